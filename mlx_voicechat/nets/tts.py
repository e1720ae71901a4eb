"""EAR-TTS (``tts_model.tts_model.*``): text ids and previous codes in, one frame of codes out.

A Gemma-3 backbone over injected embeddings (no sqrt(hidden) scaling, no embedding or head)
reads the gated fusion of the previous frame's code embedding and the current subword's
character-aware embedding, in a batch of two for classifier-free guidance (row 0 conditioned
on the text, row 1 on ``null_emb``). A mixture-of-Gaussians head then fills the 31 codebooks
in a few iterations of the mask schedule, each a Gumbel-max component pick, a slightly noised
latent and a nearest-neighbour residual refinement against the RVQ codebooks.

Per session: ``cache = tts.make_cache()``; ``prev, cache = tts.warmup(latent, init_codes, cache)``;
then per frame ``codes, cache = tts.step(text_id, prev, cache, noise, silence_codes)`` and
``prev = codes``.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import gemma3_text
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.gemma3_text import clip_residual
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ..config import MoGHeadConfig, TTSConfig
from ..noise import NoiseSource
from .char_encoder import CharAwareSubwordEncoder, OffsetRMSNorm
from .compiled import FrozenCompile
from .layout import keep_row_major, on_cpu

TextId = Union[int, np.integer, mx.array]


# --- backbone -------------------------------------------------------------------------------


def _gemma_args(cfg: TTSConfig) -> gemma3_text.ModelArgs:
    return gemma3_text.ModelArgs(
        model_type="gemma3_text",
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        vocab_size=1,
        rope_theta=cfg.rope_global_base_freq,
        rope_local_base_freq=cfg.rope_local_base_freq,
        query_pre_attn_scalar=cfg.query_pre_attn_scalar,
        sliding_window=cfg.sliding_window,
        sliding_window_pattern=cfg.sliding_window_pattern,
    )


class BackboneBlock(gemma3_text.TransformerBlock):
    def __init__(self, args: gemma3_text.ModelArgs, layer_idx: int):
        super().__init__(args, layer_idx)
        # transformers' Gemma3RMSNorm adds 1 to the float32 weight; mlx-lm rounds it in bf16.
        H, hd, eps = args.hidden_size, args.head_dim, args.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(H, eps)
        self.post_attention_layernorm = OffsetRMSNorm(H, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(H, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(H, eps)
        self.self_attn.q_norm = OffsetRMSNorm(hd, eps)
        self.self_attn.k_norm = OffsetRMSNorm(hd, eps)


class Backbone(nn.Module):
    """Gemma-3 layers + final norm on injected embeddings (``backbone.*``)."""

    def __init__(self, cfg: TTSConfig):
        super().__init__()
        self.cfg = cfg
        args = _gemma_args(cfg)
        self.layers = [BackboneBlock(args, i) for i in range(cfg.num_hidden_layers)]
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        object.__setattr__(self, "_segments", FrozenCompile(self._build_segments, lambda: [self]))

    def make_cache(self) -> list:
        cfg = self.cfg
        return [
            KVCache() if cfg.is_global_layer(i) else RotatingKVCache(max_size=cfg.sliding_window)
            for i in range(cfg.num_hidden_layers)
        ]

    #: Run one position on caches through :meth:`step` (``False``: layer by layer).
    use_step = True

    def __call__(self, h: mx.array, cache: Optional[list] = None) -> mx.array:
        cfg = self.cfg
        if self.use_step and h.shape[1] == 1 and cache is not None and None not in cache:
            return self.step(h, cache)
        if cache is None:
            cache = [None] * len(self.layers)
        # Masks come from the caches before any layer advances them. mlx-lm's sliding mask
        # lets query i see keys i - window < j <= i, as transformers' Gemma-3 does.
        masks = {}
        for i, c in enumerate(cache):
            is_global = cfg.is_global_layer(i)
            if is_global not in masks:
                window = None if is_global else cfg.sliding_window
                masks[is_global] = create_attention_mask(h, c, window_size=window)
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            h = layer(h, masks[cfg.is_global_layer(i)], c)
        return self.norm(h)

    # --- one position -------------------------------------------------------------------

    def step(self, h: mx.array, cache: list) -> mx.array:
        """One position ``[B, 1, H]`` on filled caches; the same bits as the layers one by one.

        Everything between two layers' key / value caches runs as one compiled function (see
        :mod:`.compiled`): the end of layer ``i`` (output projection, norms, residuals, MLP)
        and the start of layer ``i + 1`` (norm, projections, q / k norms, RoPE at the cache's
        offset, given as an array so one trace serves every position). The cache updates and
        the attention over a cache that grows every frame stay outside. A single position
        needs no mask (mlx-lm's, and a sliding cache holds only the window)."""
        segments = self._segments.get()  # the compiled pieces for the current weights
        offsets = {}

        def offset(c):
            if c.offset not in offsets:
                offsets[c.offset] = mx.array(c.offset, dtype=mx.int32)
            return offsets[c.offset]

        q, k, v = segments[0](h, offset(cache[0]))
        n = len(self.layers)
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            attn = layer.self_attn
            keys, values = c.update_and_fetch(k, v)
            o = scaled_dot_product_attention(q, keys, values, cache=c, scale=attn.scale, mask=None)
            if i + 1 < n:
                h, q, k, v = segments[i + 1](h, o, offset(cache[i + 1]))
            else:
                h = segments[n](h, o)
        return h

    def _build_segments(self) -> List[Callable]:
        layers = self.layers

        def start(layer, h, offset):
            attn = layer.self_attn
            B, L, _ = h.shape
            x = layer.input_layernorm(h)
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            q = attn.q_norm(q.reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3))
            k = attn.k_norm(k.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3))
            v = v.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
            return attn.rope(q, offset=offset), attn.rope(k, offset=offset), v

        def end(layer, h, o):
            B, L, _ = h.shape
            r = layer.self_attn.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))
            h = clip_residual(h, layer.post_attention_layernorm(r))
            r = layer.mlp(layer.pre_feedforward_layernorm(h))
            return clip_residual(h, layer.post_feedforward_layernorm(r))

        def first(h, offset):
            return start(layers[0], h, offset)

        def between(i):
            def run(h, o, offset):
                h = end(layers[i], h, o)
                return (h, *start(layers[i + 1], h, offset))

            return run

        def last(h, o):
            return self.norm(end(layers[-1], h, o))

        return [mx.compile(first)] + [mx.compile(between(i)) for i in range(len(layers) - 1)] + [
            mx.compile(last)
        ]


# --- fusion and the MoG head --------------------------------------------------------------


class GatedFusion(nn.Module):
    """``gated_fusion_audio_text``: a learned per-channel mix of the code and text streams."""

    def __init__(self, hidden_size: int, num_codebooks: int, eps: float):
        super().__init__()
        self.num_codebooks = num_codebooks
        self.audio_proj = nn.Linear(hidden_size, hidden_size)
        self.text_proj = nn.Linear(hidden_size, hidden_size)
        self.gate = mx.zeros((hidden_size,))
        self.residual_scale = mx.array(0.0)
        self.final_norm = OffsetRMSNorm(hidden_size, eps)

    def __call__(self, audio: mx.array, text: mx.array) -> mx.array:
        a = self.audio_proj(audio / self.num_codebooks)
        t = self.text_proj(text)
        # NeMo keeps the gate parameters in float32 and casts the sigmoids to the model dtype.
        gate = mx.sigmoid(self.gate.astype(mx.float32)).astype(a.dtype)
        res = mx.sigmoid(self.residual_scale.astype(mx.float32)).astype(a.dtype)
        return self.final_norm(res * (gate * a + (1 - gate) * t))


class MLPLayer(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, eps: float):
        super().__init__()
        self.pre_norm = OffsetRMSNorm(hidden_size, eps)
        self.mlp = gemma3_text.MLP(hidden_size, intermediate_size)
        self.post_norm = OffsetRMSNorm(hidden_size, eps)

    def __call__(self, x: mx.array) -> mx.array:
        return x + self.post_norm(self.mlp(self.pre_norm(x)))


def top_p_filter(logits: mx.array, top_p: float) -> mx.array:
    """transformers' ``TopPLogitsWarper``: drop the smallest tokens whose cumulative
    probability (ascending order) is <= 1 - top_p; the largest one always stays."""
    order = mx.argsort(logits, axis=-1)
    sorted_logits = mx.take_along_axis(logits, order, axis=-1)
    cum = mx.cumsum(mx.softmax(sorted_logits, axis=-1), axis=-1)
    n = logits.shape[-1]
    drop_sorted = (cum <= (1 - top_p)) & (mx.arange(n) < n - 1)
    drop = mx.take_along_axis(drop_sorted, mx.argsort(order, axis=-1), axis=-1)
    return mx.where(drop, -mx.inf, logits)


class MoGHead(nn.Module):
    """``mog_head``: mixture weights, a low-rank mean per component and one shared log-std."""

    def __init__(self, hidden_size: int, out_size: int, cfg: MoGHeadConfig):
        super().__init__()
        n, r = cfg.num_predictions, cfg.low_rank
        self.num_predictions, self.low_rank, self.out_size = n, r, out_size
        self.min_log_std = cfg.min_log_std
        self.mlp_stack = [
            MLPLayer(hidden_size, cfg.intermediate_size, cfg.eps) for _ in range(cfg.num_layers)
        ] + [OffsetRMSNorm(hidden_size, cfg.eps)]
        self.proj_logits = nn.Linear(hidden_size, n, bias=False)
        # Read directly (one component's rows are gathered per draw): keep it row-major.
        self.proj_mus = keep_row_major(nn.Linear(hidden_size, n * (r or out_size), bias=False))
        self.proj_logs = nn.Linear(hidden_size, 1, bias=False)
        if r:
            self.proj_else = nn.Linear(hidden_size, out_size, bias=False)
            self.low_mat = mx.zeros((n, out_size, r))

    def features(self, x: mx.array) -> mx.array:
        for layer in self.mlp_stack:
            x = layer(x)
        return x

    def guided(self, feats: mx.array, guidance_scale: float) -> mx.array:
        """Classifier-free guidance on the MLP features: rows [cond; uncond] -> cond rows."""
        if guidance_scale <= 0:
            return feats
        b = feats.shape[0] // 2
        cond, uncond = feats[:b], feats[b:]
        return cond + guidance_scale * (cond - uncond)

    def infer(
        self, x: mx.array, guidance_scale: float, top_p: Optional[float], noise: NoiseSource
    ) -> Tuple[mx.array, mx.array]:
        """One component drawn per row; returns its mean ``[b, t, out]``, log-std ``[b, t, 1]``."""
        x = self.guided(self.features(x), guidance_scale)
        logits = self.proj_logits(x).astype(mx.float32)
        if top_p is not None:
            logits = top_p_filter(logits, top_p)
        scores = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        c = mx.argmax(scores + noise.gumbel(logits.shape), axis=-1)  # [b, t]
        # Gather only the drawn component's slice: proj_mus holds all of them.
        d = self.low_rank or self.out_size
        w = self.proj_mus.weight.reshape(self.num_predictions, d, -1)[c]  # [b, t, d, H]
        mu = (w @ x[..., None])[..., 0]
        if self.low_rank:
            mu = (self.low_mat[c] @ mu[..., None])[..., 0]
        logs = mx.maximum(self.proj_logs(x), self.min_log_std)
        mu = mu * mx.exp(logs)
        if self.low_rank:
            mu = mu + self.proj_else(x)
        return mu, logs


_MOG_INFER = MoGHead.infer  # what the compiled sampling inlines


class _DrawnNoise:
    """A :class:`NoiseSource` over draws taken beforehand, ``[gumbel, normal] * calls``: hands
    them out in that order, each reshaped to the request (same values: 2-D rows ask for
    ``[1, n]`` where the draw was ``[1, 1, n]``), and checks kinds and sizes at trace time."""

    def __init__(self, draws: Sequence[mx.array]):
        self._draws = list(draws)
        self._next = 0

    def _draw(self, kind: str, shape: Sequence[int]) -> mx.array:
        j = self._next
        expected = "gumbel" if j % 2 == 0 else "normal"
        if j >= len(self._draws) or kind != expected:
            raise RuntimeError(f"sampling draw {j} asked for {kind}; drawn: {len(self._draws)}")
        a = self._draws[j]
        if a.size != math.prod(shape):
            raise ValueError(f"{kind} draw {j} has shape {tuple(a.shape)}, not {tuple(shape)}")
        self._next = j + 1
        return a.reshape(tuple(shape))

    def gumbel(self, shape: Sequence[int]) -> mx.array:
        return self._draw("gumbel", shape)

    def normal(self, shape: Sequence[int]) -> mx.array:
        return self._draw("normal", shape)


# --- the model --------------------------------------------------------------------------------


class EarTTS(nn.Module):
    def __init__(
        self, tts_cfg: TTSConfig, vocab_size: int, text_eos_id: int = 2, text_pad_id: int = 12
    ):
        super().__init__()
        cfg = self.cfg = tts_cfg
        H = cfg.hidden_size
        self.text_eos_id, self.text_pad_id = text_eos_id, text_pad_id
        self.backbone = Backbone(cfg)
        self.embed_code = nn.Linear(cfg.latent_size, H, bias=False)
        self.embed_subword = CharAwareSubwordEncoder(
            cfg.character_encoder,
            H,
            vocab_size,
            use_subword_flag_emb=cfg.use_subword_flag_emb,
            use_bos_eos_emb=cfg.use_bos_eos_emb,
        )
        if cfg.use_gated_fusion_for_text_audio:
            self.gated_fusion_audio_text = GatedFusion(H, cfg.num_quantizers, cfg.rms_norm_eps)
        self.mog_head = MoGHead(H, cfg.latent_size, cfg.mog_head)
        self.rvq_embs = mx.zeros((cfg.num_quantizers, cfg.codebook_size, cfg.latent_size))
        self.bos_emb = mx.zeros((H,))
        self.null_emb = mx.zeros((H,))
        self._table_src = None
        self._table = self._sq_norms = None
        object.__setattr__(self, "_books_src", None)  # the RVQ table self._books is from
        object.__setattr__(self, "_books", None)
        object.__setattr__(self, "_compiled", FrozenCompile(self._build_sampler, lambda: [self]))

    def make_cache(self) -> list:
        return self.backbone.make_cache()

    def set_vocabulary(self, tokenizer) -> None:
        self.embed_subword.set_vocabulary(tokenizer)

    # -- code embeddings -------------------------------------------------------------------

    def _rvq_tables(self) -> Tuple[mx.array, mx.array]:
        # Built once per loaded rvq_embs: the padded table (a zero row at codebook_size, the
        # mask index) flattened over codebooks, and each code's squared norm.
        if self._table_src is not self.rvq_embs:
            e = self.rvq_embs.astype(mx.float32)
            Q, V, D = e.shape
            padded = mx.concatenate([e, mx.zeros((Q, 1, D))], axis=1).reshape(Q * (V + 1), D)
            self._table, self._sq_norms = padded, (e * e).sum(-1)
            self._table_src = self.rvq_embs
        return self._table, self._sq_norms

    def depthsum(self, codes: mx.array) -> mx.array:
        """``sum_q rvq_embs[q][codes[..., q]]`` in float32; the mask index adds nothing."""
        table, _ = self._rvq_tables()
        Q, V = self.cfg.num_quantizers, self.cfg.codebook_size
        flat = codes.astype(mx.int32) + mx.arange(Q, dtype=mx.int32) * (V + 1)
        return table[flat].sum(axis=-2)

    def embed_codes(self, codes: mx.array) -> mx.array:
        return self.embed_code(self.depthsum(codes).astype(self.embed_code.weight.dtype))

    # -- inputs ----------------------------------------------------------------------------

    def condition(self, text: mx.array) -> mx.array:
        """Text embeddings ``[1, T, H]`` -> guidance batch ``[2, T, H]`` (row 1 = ``null_emb``)."""
        null = mx.broadcast_to(self.null_emb.astype(text.dtype), text.shape)
        return mx.concatenate([text, null], axis=0)

    def fuse(self, code_embeds: mx.array, cond: mx.array) -> mx.array:
        code_embeds = mx.broadcast_to(code_embeds, cond.shape)
        if "gated_fusion_audio_text" in self:
            return self.gated_fusion_audio_text(code_embeds, cond)
        return code_embeds + cond

    @staticmethod
    def prepare_init_codes(codec_codes: mx.array, mask_id: int) -> mx.array:
        """Warm-up codes from the codec codes of ``T + 1`` frames of zero audio ``[1, T + 1, Q]``:
        the last frame dropped, frames 0 and ``T - 1`` set to the mask index (errata 4)."""
        codes = codec_codes[:, :-1].astype(mx.int32)
        T = codes.shape[1]
        edge = (mx.arange(T) == 0) | (mx.arange(T) == T - 1)
        return mx.where(edge[None, :, None], mask_id, codes)

    def warmup_inputs(self, prompt_latent: mx.array, init_codes: mx.array) -> mx.array:
        """Backbone input ``[2, T, H]`` of the voice-prompt warm-up (errata 4).

        Subwords ``[pad] * (T - 1) + [eos]`` with only the last two spelled; the prompt latent
        stands in for every frame before the BOS frame (the last), which gets the embedding of
        the shifted codes plus ``bos_emb``.
        """
        T = init_codes.shape[1]
        pos = mx.arange(T)
        shifted = mx.concatenate([mx.zeros_like(init_codes[:, :1]), init_codes[:, :-1]], axis=1)
        code_embed = self.embed_codes(shifted)
        is_bos = (pos == T - 1)[None, :, None]
        code_embed = mx.where(is_bos, code_embed, prompt_latent.astype(code_embed.dtype))
        bos = is_bos.astype(code_embed.dtype) * self.bos_emb.astype(code_embed.dtype)
        code_embed = code_embed + bos
        ids = mx.where(pos == T - 1, self.text_eos_id, self.text_pad_id)[None]
        text = self.embed_subword(ids, (pos >= T - 2)[None])
        return self.fuse(code_embed, self.condition(text.astype(code_embed.dtype)))

    def warmup(
        self, prompt_latent: mx.array, init_codes: mx.array, cache: list
    ) -> Tuple[mx.array, list]:
        """Fill ``cache`` with the voice prompt; returns the first previous code ``[1, Q]``."""
        self.backbone(self.warmup_inputs(prompt_latent, init_codes), cache)
        return init_codes[:, -1].astype(mx.int32), cache

    def step_inputs(
        self, text_id: TextId, previous_code: mx.array, silence_codes: mx.array
    ) -> mx.array:
        """Backbone input ``[2, 1, H]`` of one frame; an EOS text id swaps the previous code for
        the codec's silence codes."""
        previous_code = previous_code.reshape(1, 1, -1).astype(mx.int32)
        silence = silence_codes.reshape(1, 1, -1).astype(mx.int32)
        if isinstance(text_id, (int, np.integer)):
            text = self.embed_subword.embed_ids([int(text_id)])[None]
            if int(text_id) == self.text_eos_id:
                previous_code = silence
        else:
            ids = text_id.reshape(1, 1).astype(mx.int32)
            text = self.embed_subword(ids)
            previous_code = mx.where(ids[..., None] == self.text_eos_id, silence, previous_code)
        code_embed = self.embed_codes(previous_code)
        return self.fuse(code_embed, self.condition(text.astype(code_embed.dtype)))

    # -- sampling --------------------------------------------------------------------------

    #: Run :meth:`generate_codes` as one ``mx.compile``'d function (``False``: op by op).
    fused_sampling = True

    def generate_codes(self, hidden: mx.array, noise: NoiseSource) -> mx.array:
        """Codes ``[1, Q]`` for the last position of ``hidden`` ``[2, T, H]`` (cond, uncond).

        The sampling is several hundred small ops, each paying MLX's dispatch cost, around 31
        small matmuls that the reference BLAS runs slowly. By default it runs as one compiled
        function (fused elementwise chains, repeated transposes merged), on 2-D rows (3-D ones
        add a flatten and an unflatten to every matmul), with each codebook's tables as ready
        inputs: about 30% less time per frame at the benchmark's medium scale on a 2-core CPU
        (18 -> 13 ms). The noise is drawn first, in the order and shapes the op-by-op path takes
        it, and goes in as arrays: any :class:`NoiseSource` works and gives the same values.
        Both paths run :meth:`_sample`, and the compiled one contracts nothing (MLX builds its
        CPU kernels without FMA on x86-64), so the codes are bit-identical (tested). A MoG head
        whose ``infer`` is overridden (a subclass, or a wrapper put on to inspect its calls)
        takes the op-by-op path, so the override sees every call's real inputs.
        """
        if not self.fused_sampling or type(self.mog_head).infer is not _MOG_INFER:
            books = self._split_codebooks(*self._rvq_tables(), row_major_t=False)
            return self._sample(hidden[:, -1:], books, noise)
        return self._sampler()(hidden[:, -1], self._codebooks(), self._draw_noise(noise))

    def _sample(
        self,
        h: mx.array,
        books: Sequence[Tuple[mx.array, mx.array, mx.array]],
        noise: NoiseSource,
    ) -> mx.array:
        """The mask schedule on the last position ``h`` (``[2, H]`` or ``[2, 1, H]``): per
        iteration one MoG draw, then a greedy nearest-code refinement of the residual over
        that iteration's codebooks (``books[q]``: codes ``[V, D]``, their transpose, their
        squared norms)."""
        cfg = self.cfg
        g = cfg.guidance_scale
        dsum = mx.zeros((1, *h.shape[1:-1], cfg.latent_size), dtype=mx.float32)
        codes: List[mx.array] = []
        for count in cfg.mask_schedule():
            if count == 0:
                continue
            emb = self.embed_code(dsum.astype(self.embed_code.weight.dtype))
            x = emb + h if g > 0 else emb + h[:1]
            mu, logs = self.mog_head.infer(x, g, cfg.top_p, noise)
            mu, logs = mu.astype(mx.float32), logs.astype(mx.float32)
            r = mu + mx.exp(logs) * noise.normal(mu.shape) * cfg.noise_scale
            for e, e_t, sq_norms in books[len(codes) : len(codes) + count]:
                idx = mx.argmin(sq_norms - 2 * (r @ e_t), axis=-1)  # [1(, 1)]
                sel = e[idx]
                r = r - sel
                dsum = dsum + sel
                codes.append(idx)
        return mx.concatenate(codes, axis=-1).reshape(1, -1).astype(mx.int32)

    def _split_codebooks(
        self, table: mx.array, sq_norms: mx.array, row_major_t: bool
    ) -> List[Tuple[mx.array, mx.array, mx.array]]:
        """Per codebook: its rows of the padded RVQ table ``[V, D]``, their transpose (a view,
        or with ``row_major_t`` a row-major copy) and their squared norms ``[V]``."""
        V = self.cfg.codebook_size
        books = []
        for q in range(self.cfg.num_quantizers):
            e = table[q * (V + 1) : q * (V + 1) + V]
            books.append((e, mx.contiguous(e.T) if row_major_t else e.T, sq_norms[q]))
        return books

    def _codebooks(self) -> List[Tuple[mx.array, mx.array, mx.array]]:
        """:meth:`_split_codebooks` once per RVQ table, for the compiled sampling to take as
        inputs instead of slicing them every frame.

        On the CPU the transposes are row-major copies (the table's size again: 65 MB at full
        scale): ``r @ e.T`` is then BLAS's plain case, about a third faster, with the same sums
        in the same order (see :mod:`.layout`), so the same bits."""
        table, sq_norms = self._rvq_tables()
        if self._books_src is not table:
            object.__setattr__(self, "_books", self._split_codebooks(table, sq_norms, on_cpu()))
            object.__setattr__(self, "_books_src", table)
        return self._books

    def _draw_noise(self, noise: NoiseSource) -> List[mx.array]:
        """One call's draws in the op-by-op path's order and shapes: per MoG call the Gumbel
        noise of the component pick, then the latent's normal (errata 9)."""
        cfg = self.cfg
        gumbel_shape = (1, 1, cfg.mog_head.num_predictions)  # the conditioned row's logits
        normal_shape = (1, 1, cfg.latent_size)
        draws = []
        for count in cfg.mask_schedule():
            if count:
                draws += [noise.gumbel(gumbel_shape), noise.normal(normal_shape)]
        return draws

    def _sampler(self) -> Callable:
        """:meth:`_sample` compiled, as a function of ``(h [2, H], codebooks, draws)``; the
        weights of ``embed_code`` and ``mog_head`` are constants of the trace, and the function
        is built again when they or the sampling settings change (see :mod:`.compiled`)."""
        cfg = self.cfg
        settings = (tuple(cfg.mask_schedule()), cfg.guidance_scale, cfg.top_p, cfg.noise_scale)
        return self._compiled.get(settings)

    def _build_sampler(self) -> Callable:
        def run(h, books, draws):
            return self._sample(h, books, _DrawnNoise(draws))

        return mx.compile(run)

    def step(
        self,
        text_id: TextId,
        previous_code: mx.array,
        cache: list,
        noise: NoiseSource,
        silence_codes: mx.array,
    ) -> Tuple[mx.array, list]:
        """One 80 ms frame: codes ``[1, Q]`` for the current text id. No host sync inside."""
        hidden = self.backbone(self.step_inputs(text_id, previous_code, silence_codes), cache)
        return self.generate_codes(hidden, noise), cache

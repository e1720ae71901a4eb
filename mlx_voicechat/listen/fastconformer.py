"""NeMo's causal FastConformer on mlx-audio's blocks, chunked: with left-only attention context
and causal convolutions, running chunk by chunk on a per-layer left-context cache gives the
full pass's result at linear memory. NeMo's padding masks are added; a live stream runs it a
frame at a time (:meth:`FastConformer.step_rows`)."""

from __future__ import annotations

import math
import threading
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_audio.stt.models.nemotron_asr.attention import (
    RelPositionalEncoding,
    RelPositionMultiHeadAttention,
)
from mlx_audio.stt.models.nemotron_asr.config import ConformerArgs
from mlx_audio.stt.models.nemotron_asr.conformer import (
    CausalDwStridingSubsampling,
    ConformerBlock,
    ConformerConvolution,
)

from .. import fastpaths
from ..audio.mel import PRE_ENCODE_CONTEXT  # noqa: F401  (re-exported)
from ..caches import EncoderCache, LayerCache
from ..config import EncoderConfig
from ..derived import compiled, derived
from ..fastpaths import on_cpu
from ..fastpaths.conv_products import products
from ..fastpaths.layout import as_matrix

# Encoder frames per chunk of the chunked offline pass.
DEFAULT_CHUNK_FRAMES = 256
NEG_INF = -1e30


def _conformer_args(cfg: EncoderConfig) -> ConformerArgs:
    # ConformerArgs has no from_dict; the shared names are its fields but conv_context_size.
    given = {**vars(cfg), "conv_context_size": "causal"}
    given["att_context_size"] = [list(cfg.att_context_size)]
    return ConformerArgs(**{name: given[name] for name in ConformerArgs.__dataclass_fields__})


class Subsampling(CausalDwStridingSubsampling):
    """Causal dw-striding subsampling; lengths computed on the device (no host sync); its
    convolutions as products (marked for ``fastpaths.conv_products``)."""

    def __init__(self, args: ConformerArgs):
        super().__init__(args)
        for layer in self.conv:
            if isinstance(layer, nn.Conv2d):
                products(layer)
                if layer.weight.shape[1:3] == (1, 1):
                    as_matrix(layer)

    def stage_lengths(self, lengths) -> List:
        """Valid lengths after each stride-2 stage (ints or [B] arrays)."""
        out, pad = [], self.pad_left + self.pad_right - self.kernel_size
        for _ in range(self.sampling_num):
            lengths = (lengths + pad) // self.stride + 1
            out.append(lengths)
        return out

    def output_lengths(self, lengths):
        return self.stage_lengths(lengths)[-1]

    def __call__(self, x: mx.array, lengths: Optional[mx.array] = None, start: int = 0,
                 masked: bool = False):
        """``x`` [B, T, n_mels] from mel frame ``start`` -> (frames, output lengths); with
        ``masked``, zeros past each stage's valid length (NeMo's ``MaskedConvSequential``)."""
        stages = self.stage_lengths(lengths) if masked and lengths is not None else None
        x = x[..., None]
        if stages:
            keep = (start + mx.arange(x.shape[1]))[None, :] < lengths[:, None]
            x = x * keep[:, :, None, None].astype(x.dtype)
        stage, scale = 0, 1
        for i, layer in enumerate(self.conv):
            if i in self._strided_idx:
                pad = (self.pad_left, self.pad_right)
                x = mx.pad(x, [(0, 0), pad, pad, (0, 0)])
            x = layer(x)
            if stages and isinstance(layer, nn.ReLU):
                scale *= self.stride
                keep = (start // scale + mx.arange(x.shape[1]))[None, :] < stages[stage][:, None]
                x = x * keep[:, :, None, None].astype(x.dtype)
                stage += 1
        b, t, f, c = x.shape
        x = self.out(x.transpose(0, 1, 3, 2).reshape(b, t, c * f))
        return x, None if lengths is None else self.output_lengths(lengths)


class ContextAttention(RelPositionMultiHeadAttention):
    """Rel-pos attention whose keys / values may start with cached left-context frames (cached
    as projected: a frame's keys do not depend on its position, which enters by ``linear_pos``)."""

    def positions(self, pos_emb: mx.array) -> mx.array:
        """``linear_pos(pos_emb)`` per head, ``[B, heads, head_dim, 2 T - 1]`` contiguous,
        memoized for the last length (a full context's frames share it), per thread (lazy
        arrays belong to the thread that made them)."""
        mine = derived(self, "encoder.positions", threading.local)
        key = (pos_emb.shape, pos_emb.dtype)
        if getattr(mine, "key", None) != key:
            B, P, _ = pos_emb.shape
            p = self.linear_pos(pos_emb).reshape(B, P, self.n_head, self.head_dim)
            mine.key, mine.value = key, mx.contiguous(p.transpose(0, 2, 3, 1))
        return mine.value

    def __call__(self, x, pos, mask=None, cache_kv=None, valid=None):
        """``pos``: :meth:`positions`, projected by the caller (a compiled step's input)."""
        B, Tq, _ = x.shape
        H, d = self.n_head, self.head_dim
        q = self.linear_q(x).reshape(B, Tq, H, d)
        k = self.linear_k(x).reshape(B, Tq, H, d).transpose(0, 2, 1, 3)
        v = self.linear_v(x).reshape(B, Tq, H, d).transpose(0, 2, 1, 3)
        if cache_kv is not None:
            k = mx.concatenate([cache_kv[0], k], axis=2)
            v = mx.concatenate([cache_kv[1], v], axis=2)
        Tk = k.shape[2]
        q_u = (q + self.pos_bias_u).transpose(0, 2, 1, 3)
        q_v = (q + self.pos_bias_v).transpose(0, 2, 1, 3)
        bd = q_v @ pos
        if Tq > 1:  # the shift moves nothing for one query (it pads, then drops, one zero)
            bd = self.rel_shift(bd)
        bd = bd[..., :Tk] * self.scale
        if mask is not None:
            bd = bd + mask
        o = mx.fast.scaled_dot_product_attention(q_u, k, v, scale=self.scale, mask=bd)
        o = o.transpose(0, 2, 1, 3).reshape(B, Tq, self.n_feat)
        if valid is not None:
            # NeMo masks every key of a padded query, and a fully masked row attends to nothing.
            o = o * valid
        return self.linear_out(o), (k, v)


class CausalConvolution(ConformerConvolution):
    """Conformer convolution module whose causal left padding comes from a cache; its
    pointwise convolutions as products (marked for ``fastpaths.conv_products``)."""

    def __init__(self, args: ConformerArgs):
        super().__init__(args)
        for layer in (self.pointwise_conv1, self.pointwise_conv2):
            as_matrix(products(layer))

    def __call__(self, x, context=None, valid=None):
        x = nn.glu(self.pointwise_conv1(x), axis=-1)
        if valid is not None:
            x = x * valid  # NeMo zeroes padded frames before the depthwise conv
        if context is None:
            context = mx.zeros((x.shape[0], self.pad_left, x.shape[2]), dtype=x.dtype)
        x = mx.concatenate([context, x], axis=1)
        new_context = x[:, x.shape[1] - self.pad_left :]
        x = self.depthwise_conv(x)
        x = self.pointwise_conv2(self.activation(self.batch_norm(x)))
        return x, new_context


class ConformerLayer(ConformerBlock):
    def __init__(self, args: ConformerArgs):
        super().__init__(args)
        self.self_attn = ContextAttention(args.n_heads, args.d_model, bias=args.use_bias)
        self.conv = CausalConvolution(args)

    def __call__(self, x, pos, mask=None, cache=None, valid=None, left_context=None):
        """``pos``: this layer's projected positions (``self_attn.positions(pos_emb)``)."""
        cache = cache or LayerCache()
        x = x + 0.5 * self.feed_forward1(self.norm_feed_forward1(x))
        h = self.norm_self_att(x)
        kv = None if cache.keys is None else (cache.keys, cache.values)
        att, (k, v) = self.self_attn(h, pos, mask, cache_kv=kv, valid=valid)
        x = x + att
        conv, conv_context = self.conv(self.norm_conv(x), context=cache.conv, valid=valid)
        x = x + conv
        x = x + 0.5 * self.feed_forward2(self.norm_feed_forward2(x))
        if left_context is not None and k.shape[2] > left_context:
            k, v = k[:, :, k.shape[2] - left_context :], v[:, :, v.shape[2] - left_context :]
        return self.norm_out(x), LayerCache(k, v, conv_context)


def context_mask(q_start: int, q_len: int, k_start: int, k_len: int, left: int, right: int):
    """Additive chunked-limited mask (NeMo): a query sees keys whose chunk of ``right + 1``
    frames lies between ``left // (right + 1)`` chunks back and its own chunk."""
    size = right + 1
    q = (q_start + mx.arange(q_len)) // size
    k = (k_start + mx.arange(k_len)) // size
    diff = q[:, None] - k[None, :]
    ok = diff >= 0
    if left >= 0:
        ok = ok & (diff <= left // size)
    return mx.where(ok, 0.0, NEG_INF)


class FastConformer(nn.Module):
    """NeMo ``ConformerEncoder`` (causal dw-striding, rel-pos, chunked-limited attention) for
    both models: :meth:`step` on a cache, a compiled steady call (:meth:`steady_layers`) and
    the chunked offline pass (:meth:`encode`). The recognizer sets ``masked_input``."""

    # NeMo's masks inside the subsampling, and xscaling when the config asks (the recognizer).
    masked_input = False
    # The fast path of a steady call, and whether it is taken on the CPU only.
    steady_path, steady_cpu_only = "encoder.frame", True

    def __init__(self, cfg: EncoderConfig, chunk_size: int = DEFAULT_CHUNK_FRAMES):
        super().__init__()
        args = _conformer_args(cfg)
        self.cfg = cfg
        self.chunk_size = chunk_size
        self.pos_enc = RelPositionalEncoding(cfg.d_model, cfg.pos_emb_max_len, cfg.xscaling)
        self.pre_encode = Subsampling(args)
        self.layers = [ConformerLayer(args) for _ in range(cfg.n_layers)]

    @property
    def left_context(self) -> Optional[int]:
        """Frames of left context a layer keeps, or None when the encoder cannot be chunked."""
        left, right = self.cfg.att_context_size
        if self.cfg.att_context_style != "chunked_limited" or left < 0:
            return None
        return (left // (right + 1)) * (right + 1)

    @property
    def attention_chunk(self) -> int:
        """Frames per attention chunk (``lookahead + 1``): they become final together."""
        return self.cfg.att_context_size[1] + 1

    def make_cache(self) -> EncoderCache:
        return EncoderCache([LayerCache() for _ in self.layers])

    def output_lengths(self, mel_len: mx.array) -> mx.array:
        return self.pre_encode.output_lengths(mel_len)

    def subsample(self, mel: mx.array, start: int = 0, mel_len: Optional[mx.array] = None):
        """The subsampling of ``mel`` [B, T, n_mels] from mel frame ``start`` (a multiple of
        the factor; outputs reading before it are not valid). With ``masked_input``: zeros
        past ``mel_len`` at every stage, then NeMo's xscaling when configured."""
        sub = self.pre_encode
        x, _ = sub(mel.astype(sub.out.weight.dtype), mel_len, start, self.masked_input)
        if self.masked_input and self.cfg.xscaling:
            x = x * math.sqrt(self.cfg.d_model)
        return x

    def positions(self, keys: int, dtype) -> list:
        """Each layer's projected positions for ``keys`` keys (``ContextAttention.positions``)."""
        pos_emb = self.pos_enc.pos_emb_for(keys, dtype)
        return [layer.self_attn.positions(pos_emb) for layer in self.layers]

    def _layers(self, x, pos, mask, caches, valid=None):
        """The layer loop: ``x`` through every layer on its ``LayerCache`` -> (x, new caches)."""
        new = []
        for layer, p, c in zip(self.layers, pos, caches):
            x, c = layer(x, p, mask, c, valid, self.left_context)
            new.append(c)
        return x, new

    def step(self, x: mx.array, cache: EncoderCache, lengths: Optional[mx.array] = None):
        """The layers over subsampled frames ``x`` [B, T, D] after ``cache.offset`` -> (out,
        advanced cache). With ``lengths`` [B], frames past a row's length are masked as keys
        and zeroed where NeMo zeroes them."""
        if self.steady(x.shape[1], cache, lengths):
            y, (cache,) = self._frame(x, [cache])
            return y, cache
        left, right = self.cfg.att_context_size
        T, ctx = x.shape[1], cache.layers[0].context
        k0 = cache.offset - ctx
        mask = valid = None
        if self.cfg.att_context_style == "chunked_limited":
            mask = context_mask(cache.offset, T, k0, ctx + T, left, right)
        if lengths is not None:
            keys = (k0 + mx.arange(ctx + T))[None, :] < lengths[:, None]  # [B, K]
            mask = mx.where(keys[:, None, None, :], 0.0 if mask is None else mask, NEG_INF)
            valid = (cache.offset + mx.arange(T))[None, :, None] < lengths[:, None, None]
            valid = valid.astype(x.dtype)
        if mask is not None:
            mask = mask.astype(x.dtype)
        x, new = self._layers(x, self.positions(ctx + T, x.dtype), mask, cache.layers, valid)
        return x, EncoderCache(new, cache.offset + T)

    # --- a steady call of a stream ---------------------------------------------------------

    def steady(self, frames: int, cache: EncoderCache, lengths=None) -> bool:
        """Whether a call of ``frames`` frames can run compiled (fast path ``steady_path``):
        within one attention chunk, no padding, every left context full, so every shape and
        the mask depend only on the phase in the chunk."""
        left, size = self.left_context, self.attention_chunk
        if lengths is not None or not left or not fastpaths.enabled(self.steady_path):
            return False
        if cache.offset % size + frames > size or (self.steady_cpu_only and not on_cpu()):
            return False
        return all(c.context == left and c.conv is not None for c in cache.layers)

    def steady_layers(self, x: mx.array, arrays, phase: int):
        """:meth:`step`'s operations on a steady call at ``phase`` of the chunk: ``arrays``
        (each layer's positions, then its keys, values, conv) -> ``(out, *new cache arrays)``."""
        left, right = self.cfg.att_context_size
        ctx, n, T = self.left_context, len(self.layers), x.shape[1]
        q0 = phase + self.attention_chunk * ctx  # an offset at this phase, ctx frames in
        mask = context_mask(q0, T, q0 - ctx, ctx + T, left, right).astype(x.dtype)
        caches = [LayerCache(*arrays[n + 3 * i : n + 3 * i + 3]) for i in range(n)]
        x, new = self._layers(x, arrays[:n], mask, caches)
        return (x, *[a for c in new for a in (c.keys, c.values, c.conv)])

    def _frame(self, x: mx.array, caches: Sequence[EncoderCache]):
        """:meth:`step` on a steady call of each row (all at one phase) as one compiled
        :meth:`steady_layers`; bit-identical to each row op by op (tested)."""
        phase, T = caches[0].offset % self.attention_chunk, x.shape[1]
        fn = derived(
            self,
            ("encoder.frame", phase),
            lambda: compiled(lambda x, *a: self.steady_layers(x, a, phase)),
            fastpaths.enabled("encoder.convs"),
        )
        rows = [c.arrays() for c in caches]
        arrays = rows[0] if len(rows) == 1 else [mx.concatenate(a, axis=0) for a in zip(*rows)]
        x, *arrays = fn(x, *self.positions(self.left_context + T, x.dtype), *arrays)
        out = []
        for b, c in enumerate(caches):
            mine = arrays if len(caches) == 1 else [a[b : b + 1] for a in arrays]
            layers = [LayerCache(*mine[i : i + 3]) for i in range(0, len(mine), 3)]
            out.append(EncoderCache(layers, c.offset + T))
        return x, out

    def step_rows(
        self, x: mx.array, caches: Sequence[EncoderCache]
    ) -> Tuple[mx.array, List[EncoderCache]]:
        """One frame of each of ``B`` streams, ``x`` [B, 1, D], each on its own cache: the
        steady rows in one compiled call, the others grouped by offset."""
        phase = caches[0].offset % self.attention_chunk
        steady = [
            i for i, c in enumerate(caches)
            if self.steady(1, c) and c.offset % self.attention_chunk == phase
        ]
        outs: List[Optional[mx.array]] = [None] * len(caches)
        new: List[Optional[EncoderCache]] = [None] * len(caches)
        if steady:
            xs = x if len(steady) == len(caches) else x[mx.array(steady)]
            y, done = self._frame(xs, [caches[i] for i in steady])
            for j, i in enumerate(steady):
                outs[i], new[i] = y[j : j + 1], done[j]
        groups: dict = {}
        for i, c in enumerate(caches):
            if new[i] is None:
                groups.setdefault(c.offset, []).append(i)
        for rows in groups.values():
            if len(rows) == 1:
                i = rows[0]
                outs[i], new[i] = self.step(x[i : i + 1], caches[i])
                continue
            y, done = self.step(x[mx.array(rows)], EncoderCache.merge([caches[i] for i in rows]))
            for j, i in enumerate(rows):
                outs[i], new[i] = y[j : j + 1], done.extract(j)
        y = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
        return y, new

    # --- offline ---------------------------------------------------------------------------

    def encode(self, mel: mx.array, mel_len: mx.array, total: int, chunk_frames=None) -> mx.array:
        """``mel`` [B, T_mel, n_mels] (``mel_len`` [B] valid) -> the first ``total`` encoder
        frames [B, total, D], ``chunk_frames`` (default ``chunk_size``, whole attention
        chunks) at a time on a left-context cache."""
        factor = 2**self.pre_encode.sampling_num
        lengths = self.output_lengths(mel_len)
        size = self.attention_chunk
        chunk = total if self.left_context is None else (chunk_frames or self.chunk_size)
        chunk = max(math.ceil(chunk / size) * size, size)
        cache, outs = self.make_cache(), []
        for k0 in range(0, total, chunk):
            k1 = min(k0 + chunk, total)
            s = max(k0 - PRE_ENCODE_CONTEXT, 0)
            # Frame k reads mel frames up to factor * k (causal subsampling).
            x = self.subsample(mel[:, s * factor : (k1 - 1) * factor + 1], s * factor, mel_len)
            x, cache = self.step(x[:, k0 - s : k1 - s], cache, lengths)
            if total > chunk:
                mx.eval(x, *cache.arrays())
            outs.append(x)
        return mx.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]

    def __call__(self, mel: mx.array, mel_len: Optional[mx.array] = None, chunk_size=None):
        """``mel`` [B, T_mel, n_mels] -> (encoded [B, T', d_model] over the padded width,
        lengths [B])."""
        B, T_mel, _ = mel.shape
        if mel_len is None:
            mel_len = mx.full((B,), T_mel, dtype=mx.int32)
        mel_len = mel_len.astype(mx.int32)
        total = self.output_lengths(T_mel)
        return self.encode(mel, mel_len, total, chunk_size), self.output_lengths(mel_len)

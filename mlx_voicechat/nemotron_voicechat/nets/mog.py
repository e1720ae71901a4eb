"""EAR-TTS's speech sampling: the mixture-of-Gaussians head (``mog_head.*``) and the mask
schedule that fills the codebooks.

Per iteration one MoG draw and a greedy nearest-code refinement over that iteration's codebooks.
Rows come in guidance pairs (see :mod:`.tts_backbone`); each conversation draws from its own
noise source (:class:`~mlx_voicechat.noise.RowNoise`). The ``tts.sampling`` fast path runs the
whole schedule as one compiled function, its noise drawn first in the op-by-op path's order.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma3_text

from ... import fastpaths
from ...config import MoGHeadConfig
from ...derived import compiled, derived
from ...fastpaths import on_cpu
from ...fastpaths.layout import keep_row_major
from ...noise import NoiseSource
from .char_encoder import OffsetRMSNorm


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
        """Classifier-free guidance on the MLP features: row pairs (cond, uncond) -> cond rows."""
        if guidance_scale <= 0:
            return feats
        cond, uncond = feats[0::2], feats[1::2]
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
    ``[B, n]`` where the draw was ``[B, 1, n]``), and checks kinds and sizes at trace time."""

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


Books = List[Tuple[mx.array, mx.array, mx.array]]


class CodeSampler:
    """The mask schedule of an :class:`~.tts.EarTTS` (``tts``): ``sampler(hidden, noise)`` ->
    codes ``[B, Q]`` for the last position of ``hidden`` ``[2 B, T, H]``."""

    def __init__(self, tts):
        self.tts = tts

    def __call__(self, hidden: mx.array, noise: NoiseSource) -> mx.array:
        tts = self.tts
        if not fastpaths.enabled("tts.sampling") or type(tts.mog_head).infer is not _MOG_INFER:
            # A MoG head whose infer is overridden (a subclass, a wrapper that inspects its
            # calls) runs op by op, so the override sees every call's real inputs.
            books = self.split_codebooks(*self.tables(), row_major_t=False)
            return self.sample(hidden[:, -1:], books, noise)
        cfg = tts.cfg
        settings = (tuple(cfg.mask_schedule()), cfg.guidance_scale, cfg.top_p, cfg.noise_scale)
        fn = derived(tts, "mog.sampling", self._build, settings)
        return fn(hidden[:, -1], self.codebooks(), self.draw_noise(noise, hidden.shape[0] // 2))

    # -- tables ----------------------------------------------------------------------------

    def tables(self) -> Tuple[mx.array, mx.array]:
        """The padded RVQ table (a zero row at ``codebook_size``, the mask index) flattened over
        codebooks, and each code's squared norm; made once per weights."""

        def build():
            e = self.tts.rvq_embs.astype(mx.float32)
            Q, V, D = e.shape
            padded = mx.concatenate([e, mx.zeros((Q, 1, D))], axis=1).reshape(Q * (V + 1), D)
            return padded, (e * e).sum(-1)

        return derived(self.tts, "mog.tables", build)

    def split_codebooks(self, table: mx.array, sq_norms: mx.array, row_major_t: bool) -> Books:
        """Per codebook: its rows of the padded table ``[V, D]``, their transpose (a view, or
        with ``row_major_t`` a row-major copy) and their squared norms ``[V]``."""
        V = self.tts.cfg.codebook_size
        books = []
        for q in range(self.tts.cfg.num_quantizers):
            e = table[q * (V + 1) : q * (V + 1) + V]
            books.append((e, mx.contiguous(e.T) if row_major_t else e.T, sq_norms[q]))
        return books

    def codebooks(self) -> Books:
        """:meth:`split_codebooks` once per weights for the compiled sampling. On the CPU the
        transposes are row-major copies: ``r @ e.T`` is then BLAS's plain case, with the same
        sums in the same order (see :mod:`.layout`)."""
        cpu = on_cpu()
        build = lambda: self.split_codebooks(*self.tables(), cpu)  # noqa: E731
        return derived(self.tts, "mog.books", build, cpu)

    # -- sampling --------------------------------------------------------------------------

    def sample(self, h: mx.array, books: Books, noise: NoiseSource) -> mx.array:
        """The mask schedule on the last position ``h`` (``[2 B, H]`` or ``[2 B, 1, H]``)."""
        tts = self.tts
        cfg = tts.cfg
        g = cfg.guidance_scale
        B = h.shape[0] // 2  # guidance pairs, whether or not the guidance is used
        dsum = mx.zeros((B, *h.shape[1:-1], cfg.latent_size), dtype=mx.float32)
        codes: List[mx.array] = []
        for count in cfg.mask_schedule():
            if count == 0:
                continue
            emb = tts.embed_code(dsum.astype(tts.embed_code.weight.dtype))
            x = mx.repeat(emb, 2, axis=0) + h if g > 0 else emb + h[0::2]
            mu, logs = tts.mog_head.infer(x, g, cfg.top_p, noise)
            mu, logs = mu.astype(mx.float32), logs.astype(mx.float32)
            r = mu + mx.exp(logs) * noise.normal(mu.shape) * cfg.noise_scale
            for e, e_t, sq_norms in books[len(codes) : len(codes) + count]:
                idx = mx.argmin(sq_norms - 2 * (r @ e_t), axis=-1)  # [B(, 1)]
                sel = e[idx]
                r = r - sel
                dsum = dsum + sel
                codes.append(idx.reshape(B, 1))
        return mx.concatenate(codes, axis=1).astype(mx.int32)

    def draw_noise(self, noise: NoiseSource, rows: int) -> List[mx.array]:
        """One call's draws in the op-by-op path's order and shapes: per MoG call the Gumbel
        noise of the component pick, then the latent's normal (errata 9)."""
        cfg = self.tts.cfg
        gumbel_shape = (rows, 1, cfg.mog_head.num_predictions)
        normal_shape = (rows, 1, cfg.latent_size)
        draws = []
        for count in cfg.mask_schedule():
            if count:
                draws += [noise.gumbel(gumbel_shape), noise.normal(normal_shape)]
        return draws

    def _build(self) -> Callable:
        def run(h, books, draws):
            return self.sample(h, books, _DrawnNoise(draws))

        return compiled(run)

"""The codec's one-frame decoder step (the ``codec.step`` fast path), and its decode state.

:class:`FastStep` computes the same sums as ``AudioCodec.decode_step`` as one compiled
function (the general path dispatches some 250 small ops per frame): the codebook gathers as
one gather and a scan in the general path's order, a depthwise conv as its taps added as MLX's
convolution adds them, the k1 and transposed convs as matmuls by weights copied once into
row-major ``[in, out]`` (BLAS's plain case, same order of sums), the envelope computed once.
``tests/nemotron_voicechat/nets/test_codec_step.py`` checks it bit for bit.
"""

from __future__ import annotations

from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import _BaseCache

from ... import fastpaths
from ...derived import compiled, derived


class CodecDecodeCache(_BaseCache):
    """State of a streaming decode of ``B`` rows (see ``AudioCodec.decode_step``): each
    ConvNeXt block's last inputs, the partly overlap-added samples and their squared-window
    sum (the same for every row once a frame is decoded), and the frames decoded."""

    def __init__(self, num_blocks: int = 0):
        self.conv_tails: List[Optional[mx.array]] = [None] * num_blocks  # [B, kernel - 1, C]
        self.ola_tail: Optional[mx.array] = None  # [B, n_fft - hop]
        self.envelope_tail: Optional[mx.array] = None  # [n_fft - hop]
        self.frames = 0  # code frames decoded so far (every row alike)

    @property
    def state(self):
        return self.conv_tails, self.ola_tail, self.envelope_tail

    @state.setter
    def state(self, v):
        self.conv_tails, self.ola_tail, self.envelope_tail = v

    @property
    def meta_state(self):
        return str(self.frames)

    @meta_state.setter
    def meta_state(self, v):
        self.frames = int(v)

    def empty(self) -> bool:
        return self.ola_tail is None

    @property
    def batch_size(self) -> int:
        return 0 if self.ola_tail is None else self.ola_tail.shape[0]

    @property
    def nbytes(self) -> int:
        arrays = [*self.conv_tails, self.ola_tail, self.envelope_tail]
        return sum(a.nbytes for a in arrays if a is not None)

    def _rows(self, rows) -> "CodecDecodeCache":
        out = CodecDecodeCache(len(self.conv_tails))
        out.conv_tails = [t[rows] for t in self.conv_tails]
        out.ola_tail, out.envelope_tail, out.frames = self.ola_tail[rows], self.envelope_tail, self.frames
        return out

    def filter(self, batch_indices) -> None:
        part = self._rows(mx.array(list(batch_indices), dtype=mx.int32))
        self.conv_tails, self.ola_tail = part.conv_tails, part.ola_tail

    def take_rows(self, idx: Sequence[int]) -> "CodecDecodeCache":
        return self._rows(mx.array(list(idx), dtype=mx.int32))

    def put_rows(self, idx: Sequence[int], part: "CodecDecodeCache") -> None:
        rows = mx.array(list(idx), dtype=mx.int32)

        def put(full, a):
            full = mx.array(full)
            full[rows] = a
            return full

        self.conv_tails = [put(f, a) for f, a in zip(self.conv_tails, part.conv_tails)]
        self.ola_tail = put(self.ola_tail, part.ola_tail)
        self.envelope_tail, self.frames = part.envelope_tail, part.frames

    def extract(self, idx: int) -> "CodecDecodeCache":
        return self._rows(slice(idx, idx + 1))

    def extend(self, other: "CodecDecodeCache") -> None:
        merged = CodecDecodeCache.merge([self, other])
        self.conv_tails, self.ola_tail = merged.conv_tails, merged.ola_tail

    @classmethod
    def merge(cls, caches: Sequence["CodecDecodeCache"]) -> "CodecDecodeCache":
        """Rows of caches that have each decoded a frame (their envelopes are then the same)."""
        if any(c.empty() for c in caches):
            raise ValueError("only caches that have decoded a frame can be merged")
        out = cls(len(caches[0].conv_tails))
        out.conv_tails = [mx.concatenate(t, axis=0) for t in zip(*(c.conv_tails for c in caches))]
        out.ola_tail = mx.concatenate([c.ola_tail for c in caches], axis=0)
        out.envelope_tail = caches[0].envelope_tail
        out.frames = max(c.frames for c in caches)
        return out


def _block_step(
    block, x: mx.array, tail: mx.array, weights: Iterator[mx.array]
) -> Tuple[mx.array, mx.array]:
    """``ConvNeXtBlock.__call__(x, tail)`` on the fast step's weights, taken from ``weights``."""
    taps, taps_b, norm_w, norm_b, w1, b1, w2, b2 = (next(weights) for _ in range(8))
    padded = mx.concatenate([tail, x], axis=1)
    T = x.shape[1]
    # MLX's convolution adds the taps in float32 and rounds once (this matters for bf16).
    wide, taps = padded.astype(mx.float32), taps.astype(mx.float32)
    acc = wide[:, :T] * taps[0]
    for k in range(1, block.context + 1):
        acc = acc + wide[:, k : k + T] * taps[k]
    h = mx.fast.layer_norm(acc.astype(x.dtype) + taps_b, norm_w, norm_b, block.norm.eps)
    y = nn.gelu(h @ w1 + b1) @ w2 + b2
    return x + y, padded[:, T:]


class FastStep:
    """``AudioCodec.decode_step`` of one frame per row [B, 1, Q] on a cache that has decoded a
    frame, as one compiled function (see the module docstring)."""

    def __init__(self, codec):
        self.codec = codec
        self._fn: Optional[Callable] = None
        self._envelope: Optional[Tuple[mx.array, mx.array]] = None

    def applies(self, codes: mx.array, cache: "CodecDecodeCache") -> bool:
        """One frame per row on a cache that has decoded a frame: every shape is then fixed."""
        return (
            fastpaths.enabled("codec.step")
            and cache.ola_tail is not None
            and codes.shape[1:] == (1, self.codec.config.num_quantizers)
            and cache.ola_tail.shape[0] == codes.shape[0]
        )

    def prepare(self) -> None:
        """Make the step's weights and envelope now (a stream's first frame would, with a host
        sync of its own)."""
        if fastpaths.enabled("codec.step"):
            self.weights()
            self.envelope()

    def weights(self) -> List[mx.array]:
        """The weights the step reads, in its layouts and order: the stacked codebooks
        [Q, K, latent]; per block the depthwise taps [kernel, C] and [in, out] pointwise
        weights; per transposed conv [in, kernel * out]; the last k1 conv [in, out]. Made
        again when the weights change (see :mod:`.derived`), so the compiled step reads the
        current ones."""
        codec = self.codec

        def build():
            out = [mx.stack(list(codec.prvq.mus_list))]
            for layer in codec.decoder.layers:
                if _is_block(layer):
                    out += [layer.dwconv.weight[:, :, 0].T, layer.dwconv.bias]
                    out += [layer.norm.weight, layer.norm.bias]
                    out += [mx.contiguous(layer.pwconv1.weight[:, 0].T), layer.pwconv1.bias]
                    out += [mx.contiguous(layer.pwconv2.weight[:, 0].T), layer.pwconv2.bias]
                else:
                    w = layer.weight  # Conv1d [out, 1, in] or ConvTranspose1d [out, kernel, in]
                    out.append(mx.contiguous(w.transpose(2, 1, 0).reshape(w.shape[2], -1)))
            mx.eval(out)  # computed now, once, and readable from any thread
            return out

        return derived(codec, "codec.step_weights", build)

    def envelope(self) -> Tuple[mx.array, mx.array]:
        """The squared-window envelope of every one-frame step after the first: the part that
        divides its wave, and the tail it leaves (both what the general path computes)."""
        if self._envelope is None:
            codec = self.codec
            hop = codec.config.hop_length
            overlap = codec.config.n_fft - hop
            env = codec.window_envelope(codec.samples_per_frame // hop)
            done = env.shape[0] - overlap
            head = mx.concatenate([env[:overlap] + env[done:], env[overlap:done]])
            tail = env[done:]
            mx.eval(head, tail)
            self._envelope = (head, tail)
        return self._envelope

    def compiled(self) -> Callable:
        """``(codes, ola_tail, envelope, *conv_tails, *weights) -> (wave, ola_tail, *conv_tails)``
        for one frame per row, compiled once; every array it reads is an argument."""
        if self._fn is not None:
            return self._fn
        codec = self.codec
        overlap = codec.config.n_fft - codec.config.hop_length
        num_blocks = codec.decoder.num_blocks

        def step(codes, ola_tail, envelope, *rest):
            tails, (table, *weights) = rest[:num_blocks], rest[num_blocks:]
            B = codes.shape[0]
            sel = table[mx.arange(table.shape[0])[None], codes[:, 0]].astype(mx.float32)
            z = mx.cumsum(sel, axis=1)[:, -1:]  # (((m0 + m1) + m2) + ...), like PRVQ.decode
            x, weights = z.astype(weights[0].dtype), iter(weights)  # the decoder's dtype
            new_tails = []
            for layer in codec.decoder.layers:
                if _is_block(layer):
                    x, tail = _block_step(layer, x, tails[len(new_tails)], weights)
                    new_tails.append(tail)
                else:
                    x = (x @ next(weights)).reshape(B, -1, layer.weight.shape[0])
            num = codec.overlap_add(codec.spectrum_to_frames(x))
            num = mx.concatenate([num[:, :overlap] + ola_tail, num[:, overlap:]], axis=1)
            done = num.shape[1] - overlap
            return (num[:, :done] / envelope, num[:, done:], *new_tails)

        self._fn = compiled(step)
        return self._fn

    def __call__(self, codes: mx.array, cache: "CodecDecodeCache") -> Tuple[mx.array, "CodecDecodeCache"]:
        envelope, envelope_tail = self.envelope()
        wave, cache.ola_tail, *tails = self.compiled()(
            codes, cache.ola_tail, envelope, *cache.conv_tails, *self.weights()
        )
        cache.conv_tails = tails
        cache.envelope_tail = envelope_tail
        cache.frames += 1
        return wave, cache


def _is_block(layer) -> bool:
    """A ConvNeXt block (the decoder's other layers are plain and transposed convs)."""
    return hasattr(layer, "dwconv")



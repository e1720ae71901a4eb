"""The speech codec of NemotronLabs VoiceChat (``tts_model.audio_codec.*``, NeMo's ``RVQVAEModel``).

Waveform -> 16-point STFT -> causal ConvNeXt encoder -> one latent per 80 ms frame -> probabilistic
residual VQ (31 codebooks) -> codes, and back: codes -> sum of the selected means -> causal
ConvNeXt decoder with transposed-convolution upsampling -> magnitude/phase -> clamped iSTFT.

Every convolution is causal (left padding) and every transposed convolution has stride equal to
its kernel, so the decoder streams exactly: a ConvNeXt block needs its last ``kernel - 1`` inputs
and the overlap-add needs its last ``n_fft - hop`` samples. The one thing a code frame cannot
finish on its own is its last ``(n_fft - hop) // 2`` samples (6 at 22.05 kHz, 0.27 ms): they
overlap the first STFT frames of the next code frame. ``decode_step`` therefore emits a stream
delayed by ``stream_delay`` samples (silence before the first sample) and ``decode_flush`` emits
the final ones; ``decode`` is that same path run once over the whole sequence.

A live session decodes one code frame per call, and there every shape is fixed after the first
frame, so that call runs as one ``mx.compile``'d function (the ``codec.step`` fast path, see
:mod:`.fastpaths`) with the same arithmetic in the same order as the general path, bit for bit.
A batch of conversations decodes one row each (:class:`CodecDecodeCache` with one row per
conversation).
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_audio.dsp import hanning, stft

from mlx_lm.models.cache import _BaseCache

from ..config import CodecConfig
from . import fastpaths
from .version import Memo, Versioned

MAX_MAGNITUDE = 100.0  # NeMo's soft ceiling on the decoder's linear STFT magnitude
NORM_EPS = 1e-6  # ConvNeXt channel LayerNorm
EXPANSION = 4  # ConvNeXt pointwise expansion


class ConvNeXtBlock(Versioned, nn.Module):
    """Causal 1-D ConvNeXt block on [B, T, C]; ``tail`` holds the previous ``kernel - 1`` inputs."""

    def __init__(self, dim: int, kernel_size: int):
        super().__init__()
        self.context = kernel_size - 1
        self.dwconv = nn.Conv1d(dim, dim, kernel_size, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=NORM_EPS)
        self.pwconv1 = nn.Conv1d(dim, EXPANSION * dim, 1)
        self.pwconv2 = nn.Conv1d(EXPANSION * dim, dim, 1)

    def __call__(
        self, x: mx.array, tail: Optional[mx.array] = None
    ) -> Tuple[mx.array, mx.array]:
        if tail is None:
            padded = mx.pad(x, [(0, 0), (self.context, 0), (0, 0)])
        else:
            padded = mx.concatenate([tail, x], axis=1)
        y = self.pwconv2(nn.gelu(self.pwconv1(self.norm(self.dwconv(padded)))))
        return x + y, padded[:, padded.shape[1] - self.context :]


def _block_step(
    block: ConvNeXtBlock, x: mx.array, tail: mx.array, weights: Iterator[mx.array]
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


def _stage_widths(cfg: CodecConfig) -> List[int]:
    return [cfg.base_channels * m for m in cfg.channel_multipliers]


class CodecEncoder(Versioned, nn.Module):
    """``encoder.layers``: a k1 projection, then per stage ConvNeXt blocks and a strided conv."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        widths = _stage_widths(cfg)
        layers: list = [nn.Conv1d(cfg.stft_channels, widths[0], 1, bias=False)]
        for i, (width, rate) in enumerate(zip(widths, cfg.downsample_rates)):
            layers += [
                ConvNeXtBlock(width, cfg.block_kernel_size) for _ in range(cfg.blocks_per_stage)
            ]
            out = widths[i + 1] if i + 1 < len(widths) else cfg.latent_dim
            layers.append(nn.Conv1d(width, out, rate, stride=rate, bias=False))
        self.layers = layers

    def __call__(self, x: mx.array) -> mx.array:
        for layer in self.layers:
            x = layer(x)[0] if isinstance(layer, ConvNeXtBlock) else layer(x)
        return x


class CodecDecoder(Versioned, nn.Module):
    """``decoder.layers``: per stage (widest first) a transposed conv with stride = kernel and
    ConvNeXt blocks, then a k1 projection to the STFT channels."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        src = cfg.latent_dim
        layers: list = []
        for width, rate in zip(reversed(_stage_widths(cfg)), reversed(cfg.downsample_rates)):
            layers.append(nn.ConvTranspose1d(src, width, rate, stride=rate, bias=False))
            layers += [
                ConvNeXtBlock(width, cfg.block_kernel_size) for _ in range(cfg.blocks_per_stage)
            ]
            src = width
        layers.append(nn.Conv1d(src, cfg.stft_channels, 1, bias=False))
        self.layers = layers

    @property
    def num_blocks(self) -> int:
        return sum(isinstance(layer, ConvNeXtBlock) for layer in self.layers)

    def __call__(
        self, z: mx.array, tails: Optional[List[Optional[mx.array]]] = None
    ) -> Tuple[mx.array, List[mx.array]]:
        """[B, T, latent] -> ([B, T * samples_per_frame / hop, stft_channels], new tails)."""
        tails = tails or [None] * self.num_blocks
        new_tails = []
        x = z
        for layer in self.layers:
            if isinstance(layer, ConvNeXtBlock):
                x, tail = layer(x, tails[len(new_tails)])
                new_tails.append(tail)
            else:
                x = layer(x)
        return x, new_tails


class EMAVariance(Versioned, nn.Module):
    """``prvq.variance_list.{q}``: a training statistic, loaded so the checkpoint loads strictly."""

    def __init__(self):
        super().__init__()
        self.variance = mx.array(1.0)


class PRVQ(Versioned, nn.Module):
    """NeMo's ``PreTrainedProbabilisticVQ``: nearest-mean residual quantization, one codebook
    of ``codebook_size`` means per quantizer."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        self.mus_list = [
            mx.zeros((cfg.codebook_size, cfg.latent_dim)) for _ in range(cfg.num_quantizers)
        ]
        self.variance_list = [EMAVariance() for _ in range(cfg.num_quantizers)]

    def encode(self, z: mx.array) -> mx.array:
        """[..., latent] -> codes [..., num_quantizers] (int32)."""
        r = z.astype(mx.float32)
        codes = []
        for mus in self.mus_list:
            mus = mus.astype(mx.float32)
            # Same expression and order as NeMo's _dist_sq, so near-ties break the same way.
            dist = (r * r).sum(-1, keepdims=True) + (mus * mus).sum(-1) - 2 * (r @ mus.T)
            idx = mx.argmin(dist, axis=-1).astype(mx.int32)
            r = r - mus[idx]
            codes.append(idx)
        return mx.stack(codes, axis=-1)

    def decode(self, codes: mx.array) -> mx.array:
        """codes [..., num_quantizers] -> sum of the selected means [..., latent] (float32)."""
        z = None
        for q, mus in enumerate(self.mus_list):
            sel = mus[codes[..., q]].astype(mx.float32)
            z = sel if z is None else z + sel
        return z


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


class AudioCodec(Versioned, nn.Module):
    """``tts_model.audio_codec``: ``encode(wave) -> codes``, ``decode(codes) -> wave`` and the
    streaming ``decode_step``."""

    def __init__(self, codec_config: CodecConfig):
        super().__init__()
        cfg = codec_config
        if cfg.n_fft % cfg.hop_length:
            raise ValueError(
                f"codec n_fft {cfg.n_fft} must be a multiple of hop_length {cfg.hop_length}"
            )
        self.config = cfg
        self.encoder = CodecEncoder(cfg)
        self.prvq = PRVQ(cfg)
        self.decoder = CodecDecoder(cfg)
        self._window = hanning(cfg.n_fft, periodic=True).astype(mx.float32)
        # The fast step's compiled function, its weights in the step's layouts (prepared again
        # when the weights change) and its constant envelope; kept off the parameter tree.
        object.__setattr__(self, "_step_fn", None)
        object.__setattr__(self, "_step_weights", Memo(self))
        object.__setattr__(self, "_step_envelope", None)

    # --- constants -------------------------------------------------------------------

    @property
    def samples_per_frame(self) -> int:
        return self.config.samples_per_frame

    @property
    def stft_channels(self) -> int:
        return self.config.stft_channels

    @property
    def stream_delay(self) -> int:
        """Samples by which ``decode_step``'s output lags the code frames (6 = 0.27 ms)."""
        return (self.config.n_fft - self.config.hop_length) // 2

    # --- encoder ---------------------------------------------------------------------

    def spectrogram(self, wave: mx.array) -> mx.array:
        """[B, N] -> [B, N / hop, stft_channels]: real parts of the bins, then imaginary parts."""
        n_fft, hop = self.config.n_fft, self.config.hop_length
        left = (n_fft - hop) // 2
        rows = []
        for b in range(wave.shape[0]):
            x = mx.pad(wave[b].astype(mx.float32), [(left, n_fft - hop - left)])
            spec = stft(x, n_fft=n_fft, hop_length=hop, window=self._window, center=False)
            rows.append(mx.concatenate([spec.real, spec.imag], axis=-1))
        return mx.stack(rows)

    def encode_latents(self, wave: mx.array) -> mx.array:
        """[B, N] waveform (N a multiple of samples_per_frame) -> latents [B, N / spf, latent]."""
        if wave.ndim == 1:
            wave = wave[None]
        if wave.ndim != 2:
            raise ValueError(f"codec input must be [B, N] samples, got shape {tuple(wave.shape)}")
        if wave.shape[1] == 0 or wave.shape[1] % self.samples_per_frame:
            raise ValueError(
                f"codec input length {wave.shape[1]} is not a positive multiple of "
                f"{self.samples_per_frame} samples (one code frame); pad it first"
            )
        dtype = self.encoder.layers[0].weight.dtype
        return self.encoder(self.spectrogram(wave).astype(dtype))

    def quantize(self, z: mx.array) -> mx.array:
        return self.prvq.encode(z)

    def dequantize(self, codes: mx.array) -> mx.array:
        return self.prvq.decode(codes)

    def encode(self, wave: mx.array) -> mx.array:
        """[B, N] -> codes [B, N / samples_per_frame, num_quantizers] (int32)."""
        return self.quantize(self.encode_latents(wave))

    # --- decoder ---------------------------------------------------------------------

    def _overlap_add(self, frames: mx.array) -> mx.array:
        """[B, F, n_fft] -> [B, (F - 1) * hop + n_fft]; hop divides n_fft, so each hop-sized
        block of the output is a sum of shifted frame slices."""
        hop = self.config.hop_length
        B, F, n_fft = frames.shape
        r = n_fft // hop
        frames = frames.reshape(B, F, r, hop)
        out = sum(
            mx.pad(frames[:, :, k], [(0, 0), (k, r - 1 - k), (0, 0)]) for k in range(r)
        )
        return out.reshape(B, (F + r - 1) * hop)

    def _spectrum_to_frames(self, x: mx.array) -> mx.array:
        """Decoder output [B, F, stft_channels] -> clamped, windowed time frames [B, F, n_fft]."""
        bins = self.config.n_fft // 2 + 1
        x = x.astype(mx.float32)
        mag = MAX_MAGNITUDE * mx.exp(-nn.softplus(-x[..., :bins] + math.log(MAX_MAGNITUDE)))
        phase = x[..., bins:]
        # DC and Nyquist are real: NeMo keeps only mag * cos(phase) there.
        real_only = mx.arange(bins) % (bins - 1) == 0
        imag = mx.where(real_only, 0.0, mag * mx.sin(phase))
        frames = mx.fft.irfft(mag * mx.cos(phase) + 1j * imag, n=self.config.n_fft, axis=-1)
        w = self._window
        # errata 5: NeMo's constrain_value_range clamps each frame to the window first.
        return mx.clip(frames, -w, w) * w

    def make_decode_cache(self) -> CodecDecodeCache:
        return CodecDecodeCache(self.decoder.num_blocks)

    def decode_step(
        self, codes: mx.array, cache: CodecDecodeCache
    ) -> Tuple[mx.array, CodecDecodeCache]:
        """Decode the next code frames [B, L, Q] -> ([B, L * samples_per_frame], cache).

        The output stream lags ``decode`` by ``stream_delay`` samples: the first call starts
        with that many zeros, and ``decode_flush`` returns the last samples once the stream
        ends. So ``concat(steps)[:, delay:] ++ decode_flush == decode(all codes)``.
        ``cache`` is updated in place and returned. One frame per row on a cache that has
        decoded a frame runs as the ``codec.step`` fast path (same bits).
        """
        if self._fast_step_applies(codes, cache):
            return self._fast_step(codes, cache)
        n_fft, hop = self.config.n_fft, self.config.hop_length
        overlap = n_fft - hop
        z = self.dequantize(codes).astype(self.decoder.layers[0].weight.dtype)
        spec, cache.conv_tails = self.decoder(z, cache.conv_tails)
        frames = self._spectrum_to_frames(spec)
        num = self._overlap_add(frames)
        env = self._overlap_add(mx.broadcast_to(self._window**2, (1,) + frames.shape[1:]))[0]
        if cache.ola_tail is not None:
            num = mx.concatenate([num[:, :overlap] + cache.ola_tail, num[:, overlap:]], axis=1)
            env = mx.concatenate([env[:overlap] + cache.envelope_tail, env[overlap:]])
        done = num.shape[1] - overlap
        cache.ola_tail, cache.envelope_tail = num[:, done:], env[done:]
        wave = num[:, :done] / env[:done]
        if cache.frames == 0:
            # NeMo drops these samples; the squared window envelope is zero at the very first.
            wave = mx.concatenate(
                [mx.zeros((wave.shape[0], self.stream_delay)), wave[:, self.stream_delay :]],
                axis=1,
            )
        cache.frames += codes.shape[1]
        return wave, cache

    # --- the one-frame fast step ------------------------------------------------------
    #
    # Per frame the general path dispatches some 250 small ops, and MLX's CPU convolutions are
    # slower than matmuls that add the same products. The fast step computes the very same sums
    # as one compiled function:
    #   - the 31 codebook gathers are one gather from the stacked codebooks, and a scan adds
    #     the selected means in the general path's order;
    #   - a depthwise conv is the sum of its shifted, scaled inputs, tap by tap, as MLX's
    #     convolution adds them;
    #   - the k1 and transposed (stride = kernel) convs are matmuls by weights copied once into
    #     row-major [in, out]: on CPU about a third faster than the conv, or than a matmul by a
    #     transposed view (see nets/layout.py), and BLAS adds each output's products in the same
    #     order in all three;
    #   - the squared-window envelope is the same for every later frame: computed once.
    # test_codec_step checks that waves and caches match the general path bit for bit.

    def _fast_step_applies(self, codes: mx.array, cache: CodecDecodeCache) -> bool:
        """One frame per row on a cache that has decoded a frame: every shape is then fixed."""
        return (
            fastpaths.enabled("codec.step")
            and cache.ola_tail is not None
            and codes.shape[1:] == (1, self.config.num_quantizers)
            and cache.ola_tail.shape[0] == codes.shape[0]
        )

    def prepare_fast_step(self) -> None:
        """Make the fast step's weights and envelope now (a stream's first frame would, with
        a host sync of its own): a session calls this when it opens."""
        if fastpaths.enabled("codec.step"):
            self._step_weights.get(self._prepare_step_weights)
            self._steady_envelope()

    def _prepare_step_weights(self) -> List[mx.array]:
        """The weights the fast step reads, in its layouts and order: the stacked codebooks
        [Q, K, latent]; per block the depthwise taps [kernel, C] and [in, out] pointwise
        weights; per transposed conv [in, kernel * out]; the last k1 conv [in, out]. Made
        again when the weights change (see :mod:`.version`), so the compiled step reads the
        current ones."""
        out = [mx.stack(list(self.prvq.mus_list))]
        for layer in self.decoder.layers:
            if isinstance(layer, ConvNeXtBlock):
                out += [layer.dwconv.weight[:, :, 0].T, layer.dwconv.bias]
                out += [layer.norm.weight, layer.norm.bias]
                out += [mx.contiguous(layer.pwconv1.weight[:, 0].T), layer.pwconv1.bias]
                out += [mx.contiguous(layer.pwconv2.weight[:, 0].T), layer.pwconv2.bias]
            else:
                w = layer.weight  # Conv1d [out, 1, in] or ConvTranspose1d [out, kernel, in]
                out.append(mx.contiguous(w.transpose(2, 1, 0).reshape(w.shape[2], -1)))
        mx.eval(out)  # computed now, once, and readable from any thread
        return out

    def _steady_envelope(self) -> Tuple[mx.array, mx.array]:
        """The squared-window envelope of every one-frame step after the first: the part that
        divides its wave, and the tail it leaves (both what the general path computes)."""
        if self._step_envelope is None:
            n_fft, hop = self.config.n_fft, self.config.hop_length
            overlap = n_fft - hop
            frame = mx.broadcast_to(self._window**2, (1, self.samples_per_frame // hop, n_fft))
            env = self._overlap_add(frame)[0]
            done = env.shape[0] - overlap
            head = mx.concatenate([env[:overlap] + env[done:], env[overlap:done]])
            tail = env[done:]
            mx.eval(head, tail)
            object.__setattr__(self, "_step_envelope", (head, tail))
        return self._step_envelope

    def _compiled_step(self) -> Callable:
        """``(codes, ola_tail, envelope, *conv_tails, *weights) -> (wave, ola_tail, *conv_tails)``
        for one frame, compiled once; every array it reads is an argument."""
        if self._step_fn is not None:
            return self._step_fn
        overlap = self.config.n_fft - self.config.hop_length
        num_blocks = self.decoder.num_blocks

        def step(codes, ola_tail, envelope, *rest):
            tails, (table, *weights) = rest[:num_blocks], rest[num_blocks:]
            B = codes.shape[0]
            sel = table[mx.arange(table.shape[0])[None], codes[:, 0]].astype(mx.float32)
            z = mx.cumsum(sel, axis=1)[:, -1:]  # (((m0 + m1) + m2) + ...), like PRVQ.decode
            x, weights = z.astype(weights[0].dtype), iter(weights)  # the decoder's dtype
            new_tails = []
            for layer in self.decoder.layers:
                if isinstance(layer, ConvNeXtBlock):
                    x, tail = _block_step(layer, x, tails[len(new_tails)], weights)
                    new_tails.append(tail)
                else:
                    x = (x @ next(weights)).reshape(B, -1, layer.weight.shape[0])
            num = self._overlap_add(self._spectrum_to_frames(x))
            num = mx.concatenate([num[:, :overlap] + ola_tail, num[:, overlap:]], axis=1)
            done = num.shape[1] - overlap
            return (num[:, :done] / envelope, num[:, done:], *new_tails)

        object.__setattr__(self, "_step_fn", mx.compile(step))
        return self._step_fn

    def _fast_step(
        self, codes: mx.array, cache: CodecDecodeCache
    ) -> Tuple[mx.array, CodecDecodeCache]:
        """``decode_step`` of one frame per row [B, 1, Q] on a cache that has seen a frame."""
        envelope, envelope_tail = self._steady_envelope()
        weights = self._step_weights.get(self._prepare_step_weights)
        wave, cache.ola_tail, *tails = self._compiled_step()(
            codes, cache.ola_tail, envelope, *cache.conv_tails, *weights
        )
        cache.conv_tails = tails
        cache.envelope_tail = envelope_tail
        cache.frames += 1
        return wave, cache

    def decode_flush(self, cache: CodecDecodeCache) -> mx.array:
        """The last ``stream_delay`` samples of a stream: [B, stream_delay]."""
        if cache.ola_tail is None:
            raise ValueError("decode_flush: no code frame has been decoded with this cache")
        d = self.stream_delay
        return cache.ola_tail[:, :d] / cache.envelope_tail[:d]

    def decode(self, codes: mx.array) -> mx.array:
        """codes [B, T, Q] -> waveform [B, T * samples_per_frame] (NeMo ``RVQVAEModel.decode``)."""
        wave, cache = self.decode_step(codes, self.make_decode_cache())
        return mx.concatenate([wave[:, self.stream_delay :], self.decode_flush(cache)], axis=1)


def replace_control_codes(
    codes: mx.array, control_codes: mx.array, silence_codes: mx.array
) -> mx.array:
    """Codes [..., Q] with every value in ``control_codes`` replaced by that codebook's silence
    code (``silence_codes`` [Q]); control codes would make the codec decode garbage."""
    is_control = (codes[..., None] == control_codes.astype(codes.dtype)).any(-1)
    return mx.where(is_control, silence_codes.astype(codes.dtype), codes)

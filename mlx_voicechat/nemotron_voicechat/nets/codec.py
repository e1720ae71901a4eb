"""The speech codec of NemotronLabs VoiceChat (``tts_model.audio_codec.*``, NeMo's ``RVQVAEModel``).

Waveform -> STFT -> causal ConvNeXt encoder -> one latent per frame -> probabilistic
residual VQ -> codes, and back through a causal ConvNeXt decoder and a clamped iSTFT.
Everything is causal, so the decoder streams exactly, except the last ``(n_fft - hop) // 2``
samples of a code frame, which overlap the next one: ``decode_step`` emits a stream delayed by
``stream_delay`` samples and ``decode_flush`` the final ones; ``decode`` is that path run once.
One frame per row on a warm cache runs the ``codec.step`` fast path (:mod:`.codec_step`).
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_audio.dsp import hanning, stft

from ...config import CodecConfig
from .codec_step import CodecDecodeCache, FastStep

MAX_MAGNITUDE = 100.0  # NeMo's soft ceiling on the decoder's linear STFT magnitude
NORM_EPS = 1e-6  # ConvNeXt channel LayerNorm
EXPANSION = 4  # ConvNeXt pointwise expansion


class ConvNeXtBlock(nn.Module):
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


def _stage_widths(cfg: CodecConfig) -> List[int]:
    return [cfg.base_channels * m for m in cfg.channel_multipliers]


class CodecEncoder(nn.Module):
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


class CodecDecoder(nn.Module):
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


class EMAVariance(nn.Module):
    """``prvq.variance_list.{q}``: a training statistic, loaded so the checkpoint loads strictly."""

    def __init__(self):
        super().__init__()
        self.variance = mx.array(1.0)


class PRVQ(nn.Module):
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


class AudioCodec(nn.Module):
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
        self.fast_step = FastStep(self)

    # --- constants -------------------------------------------------------------------

    @property
    def samples_per_frame(self) -> int:
        return self.config.samples_per_frame

    @property
    def stft_channels(self) -> int:
        return self.config.stft_channels

    @property
    def stream_delay(self) -> int:
        """Samples by which ``decode_step``'s output lags the code frames."""
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

    # The decoder's streaming contract (``decode_step`` and the ``codec.step`` fast path use
    # it): frames from the spectrum, their overlap-add, the squared window's envelope.

    def overlap_add(self, frames: mx.array) -> mx.array:
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

    def window_envelope(self, frames: int) -> mx.array:
        """The overlap-added squared window of ``frames`` frames: [(frames - 1) * hop + n_fft]."""
        window = mx.broadcast_to(self._window**2, (1, frames, self.config.n_fft))
        return self.overlap_add(window)[0]

    def spectrum_to_frames(self, x: mx.array) -> mx.array:
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

        The stream lags ``decode`` by ``stream_delay`` samples (zeros first, the rest from
        ``decode_flush``): ``concat(steps)[:, delay:] ++ decode_flush == decode(all codes)``.
        ``cache`` is updated in place and returned.
        """
        if self.fast_step.applies(codes, cache):
            return self._fast_step(codes, cache)
        n_fft, hop = self.config.n_fft, self.config.hop_length
        overlap = n_fft - hop
        z = self.dequantize(codes).astype(self.decoder.layers[0].weight.dtype)
        spec, cache.conv_tails = self.decoder(z, cache.conv_tails)
        frames = self.spectrum_to_frames(spec)
        num = self.overlap_add(frames)
        env = self.window_envelope(frames.shape[1])
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

    def _fast_step(self, codes: mx.array, cache: CodecDecodeCache) -> Tuple[mx.array, CodecDecodeCache]:
        """``decode_step`` of one frame per row on a cache that has decoded a frame."""
        return self.fast_step(codes, cache)

    def prepare_fast_step(self) -> None:
        """Make the fast step's weights and envelope now (a stream's first frame would, with
        a host sync of its own): a session calls this when it opens."""
        self.fast_step.prepare()

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

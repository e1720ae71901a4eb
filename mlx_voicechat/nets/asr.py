"""Nemotron-3.5-ASR's networks: log-mel, cache-aware FastConformer, language prompt, RNNT.

The blocks are this package's (``nets.perception.FastConformer``, ``nets.rnnt.RNNTDecoder`` /
``RNNTJoint``), built on mlx-audio's ``nemotron_asr`` modules, so the parameter names are
mlx-audio's (``encoder.*``, ``prompt_kernel.*``, ``decoder.prediction.*``, ``joint.*``). What
this model adds to the VoiceChat encoder:

* a lookahead: attention sees ``lookahead`` frames to the right, chunk by chunk
  (``chunked_limited``, chunks of ``lookahead + 1`` frames), so a chunk's outputs become final
  together, once its last frame's input is in;
* lengths that mask: each clip's frames past its length are zeros at every subsampling stage
  and masked as attention keys (NeMo's ``MaskedConvSequential`` and pad mask), so a clip's
  frames never depend on its padding, in a batch or alone;
* the language prompt: a one-hot of the prompt id concatenated to every encoder frame and
  projected back (``prompt_kernel``: Linear, ReLU, Linear).

The end of a clip (``EDGES``): ``"nemo"`` is NeMo's and Transformers' (``floor(n / 160)`` mel
frames, the centred STFT's last frame is padding, stage lengths from that); ``"mlx-audio"`` is
what mlx-audio's ``generate`` computes (that last frame is real and counted, nothing masked
inside the subsampling), which differs from NeMo in the last chunk of some lengths.
"""

from __future__ import annotations

import math
from typing import Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..config import ConfigError
from ..config.asr import ASRConfig
from . import fastpaths
from .layout import on_cpu
from .version import Memo, Versioned
from .encoder import EncoderCache, FastConformer, LayerCache
from .rnnt import RNNTDecoder, RNNTJoint, start_state

EDGES = ("nemo", "mlx-audio")
# Mel bins per product of the banded filterbank (``asr.mel``).
MEL_GROUP = 8
# Mel frames per STFT block, so the framed signal of a long input is never whole (40.96 s).
MEL_BLOCK_FRAMES = 4096


def _bands(fb: np.ndarray, group: int = MEL_GROUP):
    """The filterbank ``fb`` [bins, n_mels] cut into groups of ``group`` mel bins, each with
    the span of FFT bins where its weights are nonzero: ``[(first bin, end bin, weights)]``."""
    nonzero = fb != 0
    out = []
    for m0 in range(0, fb.shape[1], group):
        cols = nonzero[:, m0 : m0 + group].any(1)
        a = int(cols.argmax()) if cols.any() else 0
        b = fb.shape[0] - int(cols[::-1].argmax()) if cols.any() else 1
        out.append((a, b, mx.array(np.ascontiguousarray(fb[a:b, m0 : m0 + group]))))
    return out


def slaney_mel_filters(sample_rate: int, n_fft: int, n_mels: int) -> np.ndarray:
    """Slaney-scale, Slaney-normalized triangular mel filters [n_fft // 2 + 1, n_mels] from
    0 Hz to Nyquist, float32 as Transformers' feature extractor holds them: the triangles in
    float64, rounded to float32, then scaled by each filter's ``2 / width`` (bit for bit its
    ``mel_filter_bank``; mlx-audio's differs in the last bits, which decide a bfloat16
    rounding now and then)."""
    log_step = math.log(6.4) / 27.0

    def to_mel(hz):
        hz = np.asarray(hz, np.float64)
        return np.where(
            hz >= 1000.0, 15.0 + np.log(np.maximum(hz, 1.0) / 1000.0) / log_step, 3.0 * hz / 200.0
        )

    def to_hz(mel):
        return np.where(mel >= 15.0, 1000.0 * np.exp(log_step * (mel - 15.0)), 200.0 * mel / 3.0)

    fft = np.linspace(0, sample_rate // 2, n_fft // 2 + 1)
    edges = to_hz(np.linspace(to_mel(0.0), to_mel(sample_rate / 2), n_mels + 2))
    width = np.diff(edges)
    slopes = edges[None, :] - fft[:, None]
    down, up = -slopes[:, :-2] / width[:-1], slopes[:, 2:] / width[1:]
    fb = np.maximum(0.0, np.minimum(down, up)).astype(np.float32)
    fb *= (2.0 / (edges[2:] - edges[:-2]))[None, :]
    return fb


def check_edge(edge: str) -> str:
    if edge not in EDGES:
        raise ConfigError(f"edge must be one of {', '.join(EDGES)}, not {edge!r}")
    return edge


class MelFrontend:
    """NeMo's log-mel (zero-padded centred STFT, power, Slaney mel, natural log, no
    normalization) on a Hann window (mlx-audio's) and filterbank (Transformers', see
    :func:`slaney_mel_filters`) computed from the config (the checkpoints carry neither),
    both rounded to ``mel_filters_dtype`` first as Transformers does."""

    def __init__(self, config: ASRConfig):
        from mlx_audio.dsp import hanning

        pre = config.preprocessor
        if str(pre.normalize).upper() not in ("NA", "NONE"):
            raise ConfigError(
                f"preprocessor.normalize {pre.normalize!r} is not supported (NA only)"
            )
        if pre.pad_to not in (0, None):
            raise ConfigError(f"preprocessor.pad_to {pre.pad_to!r} is not supported (0 only)")
        self.cfg = pre
        self.n_fft, self.hop, self.preemph = pre.n_fft, pre.hop_length, pre.preemph
        # Transformers' mel_filters_dtype: window and filterbank rounded to it, used in float32.
        low = getattr(mx, config.mel_filters_dtype)
        self.window = hanning(pre.win_length).astype(mx.float32).astype(low).astype(mx.float32)
        fb = mx.array(slaney_mel_filters(pre.sample_rate, pre.n_fft, pre.features))
        self.fb = fb.astype(low).astype(mx.float32)  # [n_fft // 2 + 1, n_mels]
        mx.eval(self.window, self.fb)
        self._bands = _bands(np.array(self.fb))
        self._banded = mx.compile(self._log_mel)

    def _log_mel(self, power: mx.array) -> mx.array:
        """``log(power @ fb + guard)`` with the product taken group by group of mel bins over
        the group's band of FFT bins: the filterbank is zero outside it, and the BLAS adds each
        output's terms in order, so the values are the whole product's bit for bit
        (``asr.mel``)."""
        mel = mx.concatenate([power[..., a:b] @ w for a, b, w in self._bands], axis=-1)
        return mx.log(mel + self.cfg.log_zero_guard_value)

    def frames(self, segment: mx.array) -> mx.array:
        """Log-mel of every full ``n_fft`` frame of a pre-emphasized, zero-padded 1-D
        ``segment`` (frame ``j`` starts at sample ``hop * j``): [F, n_mels] float32."""
        from mlx_audio.dsp import stft

        spec = stft(segment, self.n_fft, self.hop, self.n_fft, self.window, center=False)
        power = mx.square(spec.real) + mx.square(spec.imag)
        if self.cfg.mag_power != 2.0:
            power = mx.power(mx.sqrt(power), self.cfg.mag_power)
        if fastpaths.enabled("asr.mel") and on_cpu():
            return self._banded(power)
        return mx.log(power @ self.fb + self.cfg.log_zero_guard_value)

    def valid_frames(self, lengths, edge: str):
        """Mel frames that count for ``lengths`` samples: ``floor(n / hop)`` (NeMo, errata 2),
        or one more, the centred STFT's last (mlx-audio)."""
        return lengths // self.hop + (1 if edge == "mlx-audio" else 0)

    def __call__(self, wave: mx.array, lengths: mx.array, edge: str = "nemo"):
        """``wave`` [B, N] float32, ``lengths`` [B] -> (mel [B, N // hop + 1, n_mels] with the
        pad value past each row's count, mel_len [B])."""
        B, N = wave.shape
        if self.preemph:
            wave = mx.concatenate([wave[:, :1], wave[:, 1:] - self.preemph * wave[:, :-1]], axis=1)
        wave = mx.where(mx.arange(N)[None] < lengths[:, None], wave, 0.0)
        half = self.n_fft // 2
        padded = mx.pad(wave, [(0, 0), (half, half)])
        n_frames = N // self.hop + 1
        rows = []
        for b in range(B):
            blocks = []
            for f0 in range(0, n_frames, MEL_BLOCK_FRAMES):
                f1 = min(f0 + MEL_BLOCK_FRAMES, n_frames)
                blocks.append(
                    self.frames(padded[b, f0 * self.hop : (f1 - 1) * self.hop + self.n_fft])
                )
            rows.append(mx.concatenate(blocks) if len(blocks) > 1 else blocks[0])
        mel = mx.stack(rows)
        mel_len = self.valid_frames(lengths, edge)
        keep = mx.arange(n_frames)[None, :, None] < mel_len[:, None, None]
        return mx.where(keep, mel, self.cfg.pad_value), mel_len


class RecognizerEncoder(FastConformer):
    """The FastConformer as the recognizer runs it (see the module docstring): NeMo's masks
    inside the subsampling and its xscaling; a steady chunk compiled with the subsampling,
    the prompt and the joint's projection (``asr.chunk``, ``RecognizerNetwork.encode_chunk``)."""

    masked_input = True
    steady_path, steady_cpu_only = "asr.chunk", False


class RecognizerNetwork(Versioned, nn.Module):
    """The parameter tree of Nemotron-3.5-ASR (mlx-audio's key names)."""

    def __init__(self, config: ASRConfig):
        super().__init__()
        self.config = config
        self.model_type = config.model_type
        self.frontend = MelFrontend(config)  # not a parameter: computed, never loaded
        self.encoder = RecognizerEncoder(config.encoder)
        p = config.prompt
        if p.num_prompts:
            d = config.encoder.d_model
            self.prompt_kernel = [
                nn.Linear(d + p.num_prompts, p.prompt_hidden),
                nn.ReLU(),
                nn.Linear(p.prompt_hidden, d),
            ]
        self.decoder = RNNTDecoder(config.decoder)
        self.joint = RNNTJoint(config.joint)

    @property
    def has_prompt(self) -> bool:
        return bool(self.config.prompt.num_prompts)

    def apply_prompt(self, x: mx.array, prompt_ids: mx.array) -> mx.array:
        """Encoder frames [B, T, D] conditioned on each row's prompt id ([B] int)."""
        if not self.has_prompt:
            return x
        B, T, _ = x.shape
        n = self.config.prompt.num_prompts
        one_hot = (mx.arange(n)[None, :] == prompt_ids[:, None]).astype(x.dtype)
        x = mx.concatenate([x, mx.broadcast_to(one_hot[:, None, :], (B, T, n))], axis=-1)
        for layer in self.prompt_kernel:
            x = layer(x)
        return x

    def joint_frames(self, encoded: mx.array, prompt_ids: mx.array) -> mx.array:
        """Encoder frames -> the joint's encoder side (prompt, then ``joint.enc``)."""
        return self.joint.project_encoder(self.apply_prompt(encoded, prompt_ids))

    def encode_chunk(
        self, mel, start: int, frames: slice, cache: EncoderCache, prompt_ids, mel_len=None
    ):
        """Frames ``frames`` of the subsampling of ``mel`` [1, T, n_mels] (its first row mel
        frame ``start``; with ``mel_len``, masked past it) through the layers on ``cache``,
        then :meth:`joint_frames`: (joint frames, the advanced cache). A steady chunk
        (:meth:`RecognizerEncoder.steady`) is one compiled call (``asr.chunk``): the
        subsampling, the layers and the projections fused, the same values as op by op."""
        enc = self.encoder
        n = frames.stop - frames.start
        if mel_len is not None or not enc.steady(n, cache):
            x = enc.subsample(mel, start, mel_len)[:, frames]
            x, cache = enc.step(x, cache)
            return self.joint_frames(x, prompt_ids), cache
        memo = self.__dict__.get("_chunk_memo")
        if memo is None:
            memo = Memo(self)
            object.__setattr__(self, "_chunk_memo", memo)
        key = (frames.start, frames.stop)  # and the fast paths traced into it:
        fn = memo.get(lambda: self._chunk_fn(*key), (*key, fastpaths.enabled("encoder.convs")))
        pos = enc.positions(enc.left_context + n, enc.pre_encode.out.weight.dtype)
        out, *arrays = fn(mel, prompt_ids, *pos, *cache.arrays())
        layers = [LayerCache(*arrays[i : i + 3]) for i in range(0, len(arrays), 3)]
        return out, EncoderCache(layers, cache.offset + n)

    def _chunk_fn(self, first: int, last: int):
        """:meth:`encode_chunk` on a steady chunk as a function of ``(mel, prompt ids,
        *positions, *cache arrays)``, compiled (the weights are constants of the trace, rebuilt
        when they change: ``nets.version``)."""
        enc = self.encoder

        def run(mel, prompt_ids, *arrays):
            x, *caches = enc.steady_layers(enc.subsample(mel)[:, first:last], arrays, 0)
            return (self.joint_frames(x, prompt_ids), *caches)

        return mx.compile(run)

    def start(self, batch: int) -> Tuple[mx.array, Tuple[mx.array, mx.array]]:
        """The start symbol's prediction for ``batch`` rows: its blank embedded from a zero
        state, as Transformers starts its decoder (``nets.rnnt.start_state``)."""
        return start_state(self.decoder, self.joint, batch, self.config.blank_id)

    def __call__(self, *args, **kwargs):
        raise TypeError("the recognizer is driven by mlx_voicechat.runtime.asr, not called")

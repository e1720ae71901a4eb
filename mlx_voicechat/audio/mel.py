"""NeMo's log-mel front-end of both models, offline (:class:`LogMel`) and as samples arrive
(:class:`MelStream`, the offline frames bit for bit), and the stateful :class:`Resampler`.

NeMo's quirks, kept once: the STFT pads ``n_fft // 2`` zeros, not reflect (errata 1); the valid
mel length is ``floor(n / hop)``, one less than the centred STFT's frames, the rest holding the
pad value (errata 2; ``edge="mlx-audio"`` counts that frame). A mel frame is final once the
samples its window weights are in (the window zeroes the rest, so zeros stand in for them); an
encoder frame once its subsampling's last mel frame is.
"""

from __future__ import annotations

import math
from typing import Optional

import mlx.core as mx
import numpy as np

from ..config import ConfigError, PreprocessorConfig
from ..errors import SessionError
from ..fastpaths.mel_bands import BandedLog

EDGES = ("nemo", "mlx-audio")
# Encoder frames of left context fed to a chunk's subsampling: its causal receptive field
# (2 + 4 + 8 mel frames for 3 stride-2 stages) is under 2 frames, so 2 give the full pass's bits.
PRE_ENCODE_CONTEXT = 2
# Mel frames per STFT block, so the framed signal of a long input is never whole.
MEL_BLOCK_FRAMES = 4096


def check_edge(edge: str) -> str:
    if edge not in EDGES:
        raise ConfigError(f"edge must be one of {', '.join(EDGES)}, not {edge!r}")
    return edge


def check_preprocessor(cfg: PreprocessorConfig) -> PreprocessorConfig:
    if str(cfg.normalize).upper() not in ("NA", "NONE"):
        raise ConfigError(f"preprocessor.normalize {cfg.normalize!r} is not supported (NA only)")
    if cfg.pad_to not in (0, None):
        raise ConfigError(f"preprocessor.pad_to {cfg.pad_to!r} is not supported (0 only)")
    return cfg


def slaney_mel_filters(sample_rate: int, n_fft: int, n_mels: int) -> np.ndarray:
    """Slaney mel filters [n_fft // 2 + 1, n_mels], 0 Hz to Nyquist, bit for bit Transformers'
    ``mel_filter_bank`` (float64 triangles rounded to float32, then scaled by ``2 / width``;
    mlx-audio's differ in the last bits, which can flip a bfloat16 rounding)."""
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


class LogMel:
    """NeMo's log-mel on a float32 ``window`` [win_length] and filterbank ``fb``
    [n_fft // 2 + 1, n_mels]; ``banded``: the product by ``fastpaths.mel_bands`` (for a
    filterbank that never changes)."""

    def __init__(self, cfg: PreprocessorConfig, window: mx.array, fb: mx.array, banded=False):
        self.cfg = check_preprocessor(cfg)
        self.n_fft, self.hop, self.preemph = cfg.n_fft, cfg.hop_length, cfg.preemph
        self.window, self.fb = window, fb
        self._banded = BandedLog(fb, cfg.log_zero_guard_value) if banded else None

    def frames(self, segment: mx.array) -> mx.array:
        """Log-mel of every full ``n_fft`` frame of a pre-emphasized, zero-padded 1-D
        ``segment`` (frame ``j`` starts at sample ``hop * j``): [F, n_mels] float32."""
        from mlx_audio.dsp import stft  # here: the server's wire imports this module

        spec = stft(segment, self.n_fft, self.hop, self.n_fft, self.window, center=False)
        power = mx.square(spec.real) + mx.square(spec.imag)
        if self.cfg.mag_power != 2.0:
            power = mx.power(mx.sqrt(power), self.cfg.mag_power)
        if self._banded is not None and self._banded.applies():
            return self._banded(power)
        return mx.log(power @ self.fb + self.cfg.log_zero_guard_value)

    def total_frames(self, n):
        """The centred STFT's frames for ``n`` samples."""
        return (n + 2 * (self.n_fft // 2) - self.n_fft) // self.hop + 1

    def valid_frames(self, n, edge: str = "nemo"):
        """Mel frames that count for ``n`` samples: ``floor(n / hop)`` (NeMo, errata 2: one
        fewer than the centred STFT's), or all of them (mlx-audio)."""
        return self.total_frames(n) - (0 if edge == "mlx-audio" else 1)

    def __call__(self, wave: mx.array, lengths: Optional[mx.array] = None, edge: str = "nemo"):
        """``wave`` [B, N] or [N], ``lengths`` [B] (default N) -> (mel [B, T, n_mels] with
        the pad value from each row's valid count on, mel_len [B])."""
        wave = (wave[None] if wave.ndim == 1 else wave).astype(mx.float32)
        B, N = wave.shape
        lengths = mx.full((B,), N, mx.int32) if lengths is None else lengths.astype(mx.int32)
        if self.preemph:
            wave = mx.concatenate([wave[:, :1], wave[:, 1:] - self.preemph * wave[:, :-1]], axis=1)
        wave = mx.where(mx.arange(N)[None] < lengths[:, None], wave, 0.0)
        half, hop = self.n_fft // 2, self.hop
        padded = mx.pad(wave, [(0, 0), (half, half)])  # errata 1: zeros, not reflect
        n_frames = self.total_frames(N)
        rows = []
        for b in range(B):
            blocks = []
            for f0 in range(0, n_frames, MEL_BLOCK_FRAMES):
                f1 = min(f0 + MEL_BLOCK_FRAMES, n_frames)
                blocks.append(self.frames(padded[b, f0 * hop : (f1 - 1) * hop + self.n_fft]))
            rows.append(mx.concatenate(blocks) if len(blocks) > 1 else blocks[0])
        mel = mx.stack(rows)
        mel_len = self.valid_frames(lengths, edge)
        keep = mx.arange(n_frames)[None, :, None] < mel_len[:, None, None]
        return mx.where(keep, mel, self.cfg.pad_value), mel_len


def recognizer_mel(config) -> LogMel:
    """Nemotron-3.5-ASR's log-mel: a Hann window and :func:`slaney_mel_filters` from the config
    (the checkpoints carry neither), rounded to ``mel_filters_dtype`` as Transformers does."""
    from mlx_audio.dsp import hanning

    pre, low = config.preprocessor, getattr(mx, config.mel_filters_dtype)
    window = hanning(pre.win_length).astype(mx.float32).astype(low).astype(mx.float32)
    fb = mx.array(slaney_mel_filters(pre.sample_rate, pre.n_fft, pre.features))
    fb = fb.astype(low).astype(mx.float32)  # [n_fft // 2 + 1, n_mels]
    mx.eval(window, fb)
    return LogMel(pre, window, fb, banded=True)


class MelStream:
    """The log-mel of a stream as samples arrive (the offline frames bit for bit), and the mel
    frames each encoder frame's subsampling reads, for a net with a ``frontend`` and an
    ``encoder``. ``eager``: each push computes its final frames; else :meth:`compute` does."""

    def __init__(self, net, eager: bool = True):
        self.context = PRE_ENCODE_CONTEXT
        self.mel, self.encoder, self.eager = net.frontend, net.encoder, eager
        self.n_fft, self.hop, self.preemph = self.mel.n_fft, self.mel.hop, self.mel.preemph
        mx.eval(self.mel.window, self.mel.fb)  # now: any thread may feed the stream
        window = np.array(self.mel.window)
        nonzero = np.flatnonzero(window)
        # The last sample a mel frame's window weights, relative to its centre (hop * j).
        self.window_end = (self.n_fft - window.shape[0]) // 2 + int(nonzero[-1]) - self.n_fft // 2
        self.factor = 2**self.encoder.pre_encode.sampling_num
        self.reset()

    def reset(self) -> None:
        self.received = 0  # samples pushed so far
        self._y = np.zeros(0, dtype=np.float32)  # pre-emphasized samples from _y_start on
        self._y_start = 0
        self._last_raw: Optional[np.ndarray] = None  # last raw sample, for the pre-emphasis
        self._mel: Optional[mx.array] = None  # mel frames from _mel_start on, [T, n_mels]
        self._mel_start = 0
        self.mel_frames = 0  # mel frames computed
        self.frames = 0  # encoder frames handed out
        self.final = 0  # encoder frames final so far
        self.ended = False

    # -- how much input a frame needs ------------------------------------------------------

    def mel_frames_final(self, n: int) -> int:
        """Mel frames whose weighted samples all lie in the first ``n`` samples."""
        return 0 if n <= self.window_end else (n - 1 - self.window_end) // self.hop + 1

    def frames_final(self, n: int) -> int:
        """Encoder frames final once ``n`` samples have arrived."""
        m = self.mel_frames_final(n)
        return 0 if m == 0 else (m - 1) // self.factor + 1

    def samples_needed(self, k: int) -> int:
        """Samples that must have arrived for encoder frame ``k``."""
        return self.hop * self.factor * k + self.window_end + 1

    @property
    def ready(self) -> int:
        """Encoder frames final and not handed out yet."""
        return self.final - self.frames

    # -- input -----------------------------------------------------------------------------

    def push(self, samples: np.ndarray) -> None:
        """Add float32 samples at the model's rate."""
        if self.ended:
            raise SessionError("the input has ended")
        if len(samples):
            x = np.asarray(samples, dtype=np.float32)
            # On the host in float32: offline's two IEEE operations per sample, so its bits.
            y = x
            if self.preemph:
                prev = x[:1] if self._last_raw is None else self._last_raw
                y = x - np.float32(self.preemph) * np.concatenate([prev, x[:-1]])
                if self._last_raw is None:
                    y[0] = x[0]
            self._last_raw = x[-1:].copy()
            self._y = np.concatenate([self._y, y.astype(np.float32, copy=False)])
            self.received += len(x)
        if self.eager:
            self.compute()
        self.final = max(self.final, self.frames_final(self.received))

    def compute(self, j1: Optional[int] = None) -> None:
        """Mel frames up to ``j1`` (default: all final ones), in one STFT."""
        j0, j1 = self.mel_frames, self.mel_frames_final(self.received) if j1 is None else j1
        if j1 <= j0:
            return
        half, hop = self.n_fft // 2, self.hop
        a, b = hop * j0 - half, hop * (j1 - 1) + half  # pre-emphasized samples [a, b)
        seg = np.zeros(b - a, dtype=np.float32)  # zeros before the start and past the end
        lo, hi = max(a, self._y_start), min(b, self._y_start + len(self._y))
        if hi > lo:
            seg[lo - a : hi - a] = self._y[lo - self._y_start : hi - self._y_start]
        self._add(self.mel.frames(mx.array(seg)))
        drop = hop * j1 - half  # samples no later mel frame reads
        if drop > self._y_start:
            self._y = self._y[drop - self._y_start :]
            self._y_start = drop

    def _add(self, rows: mx.array) -> None:
        self._mel = rows if self._mel is None else mx.concatenate([self._mel, rows])
        self.mel_frames += rows.shape[0]

    def finish(self, edge: str = "nemo") -> int:
        """End of input: the last mel frames as offline; returns the valid length."""
        n = self.received
        valid = self.mel.valid_frames(n, edge)
        self.compute(valid)
        pad = self.mel.total_frames(n) - self.mel_frames
        if pad > 0:
            shape = (pad, self.mel.cfg.features)
            self._add(mx.full(shape, self.mel.cfg.pad_value, dtype=mx.float32))
        if valid > 0:
            self.final = max(self.final, int(self.encoder.output_lengths(valid)))
        self.ended = True
        return valid

    # -- output ----------------------------------------------------------------------------

    def take(self, k1: int):
        """Hands out encoder frames ``frames`` to ``k1``: (the mel frames [m, n_mels] their
        subsampling reads, from ``PRE_ENCODE_CONTEXT`` frames before; the first one's index
        in that window's output)."""
        k0 = self.frames
        s = max(k0 - self.context, 0)
        m0, m1 = s * self.factor, min((k1 - 1) * self.factor + 1, self.mel_frames)
        mel = self._mel[m0 - self._mel_start : m1 - self._mel_start]
        self.frames = k1
        # Keep the mel frames the next frames' subsampling context reaches back to.
        keep = max(k1 - self.context, 0) * self.factor
        if keep > self._mel_start:
            self._mel = self._mel[keep - self._mel_start :]
            self._mel_start = keep
        return mel, k0 - s

    def window(self):
        """:meth:`take` of the next encoder frame, which must be final."""
        if self.frames >= self.final:
            raise AssertionError("no encoder frame is final")
        return self.take(self.frames + 1)

    def arrays(self):
        return [] if self._mel is None else [self._mel]


class Resampler:
    """Stateful mono float32 resampling (a soxr stream, so chunk joins leave no seam);
    ``rate_in == rate_out`` passes samples through."""

    def __init__(self, rate_in: int, rate_out: int):
        self.rate_in, self.rate_out = int(rate_in), int(rate_out)
        self._stream = None
        if self.rate_in != self.rate_out:
            import soxr

            self._stream = soxr.ResampleStream(self.rate_in, self.rate_out, 1, dtype="float32")

    def __call__(self, samples: np.ndarray, last: bool = False) -> np.ndarray:
        samples = np.asarray(samples, dtype=np.float32)
        if self._stream is None:
            return samples
        return self._stream.resample_chunk(samples, last=last)

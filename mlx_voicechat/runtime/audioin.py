"""A live conversation's audio in: samples checked and resampled, the log-mel computed as the
samples arrive, and the mel window of each encoder frame as soon as it is final.

Offline, perception runs once over the whole input (``Perception.__call__``); here the same
front-end runs incrementally and gives the same frames, bit for bit:

- log-mel: mel frame ``j`` is computed once the samples under its window are all in. Its
  centred 512-sample frame is weighted by a 400-sample Hann window padded with zeros, so only
  samples up to ``hop * j + WINDOW_END`` (160 j + 198) matter; the zero-weighted rest of the
  frame is filled with zeros, which is what the weighting makes of any sample.
- encoder frame ``k`` reads mel frames up to ``8 k`` (causal subsampling), attends to 70 frames
  to the left and none to the right and its convolutions are causal, so it is final once
  ``1280 k + 199`` samples have arrived: 1081 samples (67.6 ms) before its 80 ms slot ends.
  :meth:`MelStream.window` hands out the mel frames its subsampling reads; the encoder layers
  run with the frame step (``runtime.step``), on the encoder context kept in the frame state.
- at the end of the input (:meth:`MelStream.finish`) the frames whose windows reach past the
  last sample are computed as the offline pass does: zeros past the end, NeMo's padded last
  mel frame.
"""

from __future__ import annotations

from typing import Dict, Optional

import mlx.core as mx
import numpy as np

from ..errors import SessionError
from ..nets.encoder import PRE_ENCODE_CONTEXT


def as_samples(samples, sample_rate, rate: int) -> np.ndarray:
    """Mono audio (int or float PCM) as float32, or one SessionError naming what is wrong."""
    if sample_rate is not None:
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)) or sample_rate <= 0:
            raise SessionError(f"sample_rate must be a positive integer, got {sample_rate!r}")
    return mono_float32(samples)


def mono_float32(samples, error: type = SessionError) -> np.ndarray:
    """Mono samples (int PCM scaled to [-1, 1], or float) as a 1-D float32 array; what is
    wrong with them (not numbers, not mono, not finite) is one ``error``."""
    if isinstance(samples, mx.array):
        samples = np.array(samples)
    x = np.asarray(samples)
    if x.dtype == object or not (np.issubdtype(x.dtype, np.number) or x.dtype == bool):
        raise error(f"audio samples must be numbers, got an array of {x.dtype}")
    if x.ndim == 2 and 1 in x.shape:
        x = x.reshape(-1)
    if x.ndim != 1:
        raise error(f"feed takes mono samples as a 1-D array, got shape {tuple(x.shape)}")
    if np.issubdtype(x.dtype, np.integer):
        info = np.iinfo(x.dtype)
        x = x.astype(np.float32) / float(max(abs(info.min), info.max))
    else:
        x = x.astype(np.float32)
        if x.size and not np.isfinite(x).all():
            raise error("audio samples must be finite (got NaN or infinity)")
    return x


def preemphasize(x: np.ndarray, coef: float, prev: Optional[np.ndarray]) -> np.ndarray:
    """Float32 samples ``x`` pre-emphasized (``y[i] = x[i] - coef x[i-1]``), ``prev`` the raw
    sample before them (None at the start of the stream: ``y[0] = x[0]``)."""
    # On the host in float32: the same two IEEE operations per sample as the offline pass (a
    # float32 product, then a float32 difference), so the same bits.
    if not coef:
        return x.astype(np.float32, copy=False)
    y = x - np.float32(coef) * np.concatenate([x[:1] if prev is None else prev, x[:-1]])
    if prev is None:
        y[0] = x[0]
    return y.astype(np.float32, copy=False)


def window_of(y: np.ndarray, start: int, a: int, b: int) -> np.ndarray:
    """Samples ``[a, b)`` of a stream of which ``y`` holds those from ``start`` on, with zeros
    before the stream's start and past what ``y`` holds."""
    out = np.zeros(b - a, dtype=np.float32)
    lo, hi = max(a, start), min(b, start + len(y))
    if hi > lo:
        out[lo - a : hi - a] = y[lo - start : hi - start]
    return out


class AudioIn:
    """Samples in at any rate (stateful resamplers, one per source rate), mel windows out."""

    def __init__(self, perception, rate: int):
        self.rate = rate
        self.mel = MelStream(perception)
        self._resamplers: Dict[int, object] = {}

    def reset(self) -> None:
        self.mel.reset()
        self._resamplers.clear()

    def push(self, samples, sample_rate: Optional[int] = None) -> None:
        """Check, resample and add samples (no frame is computed here)."""
        x = as_samples(samples, sample_rate, self.rate)
        if sample_rate is not None and int(sample_rate) != self.rate and x.size:
            x = self._resample(x, int(sample_rate))
        self.mel.push(x)

    def push_silence(self, samples: int) -> None:
        self.mel.push(np.zeros(samples, np.float32))

    def _resample(self, x: np.ndarray, source: int) -> np.ndarray:
        try:
            import soxr
        except ImportError:  # pragma: no cover - soxr is a dependency
            raise SessionError("resampling needs python-soxr (pip install soxr)") from None
        stream = self._resamplers.get(source)
        if stream is None:
            stream = self._resamplers[source] = soxr.ResampleStream(source, self.rate, 1, dtype="float32")
        return stream.resample_chunk(x)

    def drain_resamplers(self) -> None:
        """At the end of input: what the resamplers still hold."""
        for resampler in self._resamplers.values():
            tail = resampler.resample_chunk(np.zeros(0, np.float32), last=True)
            if tail.size:
                self.mel.push(tail)
        self._resamplers.clear()


class MelStream:
    """The log-mel of a stream as its samples arrive, and each encoder frame's mel window."""

    def __init__(self, perception):
        self.perception = perception
        pre = perception.preprocessor
        cfg = pre.cfg
        self.n_fft, self.hop, self.preemph = cfg.n_fft, cfg.hop_length, cfg.preemph
        self.pad_value = cfg.pad_value
        self.guard = cfg.log_zero_guard_value
        self.mag_power = cfg.mag_power
        window = np.array(pre.featurizer.window.astype(mx.float32))
        left = (self.n_fft - window.shape[0]) // 2
        nonzero = np.flatnonzero(window)
        # Offsets, relative to the frame's centre sample (hop * j), of the first and last
        # samples the window weights: -199 and 198 for NeMo's 400-sample Hann in 512.
        self.window_start = left + int(nonzero[0]) - self.n_fft // 2
        self.window_end = left + int(nonzero[-1]) - self.n_fft // 2
        self.encoder = perception.encoder
        self.factor = 2**self.encoder.pre_encode.sampling_num
        self.reset()

    def reset(self) -> None:
        self.received = 0  # 16 kHz samples pushed so far
        self._y = np.zeros(0, dtype=np.float32)  # pre-emphasized samples from _y_start on
        self._y_start = 0
        self._last_raw: Optional[np.ndarray] = None  # last raw sample, for the pre-emphasis
        self._mel: Optional[mx.array] = None  # mel frames from _mel_start on, [T, n_mels]
        self._mel_start = 0
        self.mel_frames = 0  # mel frames computed
        self.frames = 0  # encoder frames handed out
        self.final = 0  # encoder frames final so far
        self._total_mel: Optional[int] = None  # after finish: the mel tensor's length

    # -- how much input a frame needs ------------------------------------------------------

    def mel_frames_final(self, n: int) -> int:
        """Mel frames whose weighted samples all lie in the first ``n`` samples."""
        if n <= self.window_end:
            return 0
        return (n - 1 - self.window_end) // self.hop + 1

    def frames_final(self, n: int) -> int:
        """Encoder frames final once ``n`` samples have arrived (frame k: mel frame 8 k)."""
        m = self.mel_frames_final(n)
        return 0 if m == 0 else (m - 1) // self.factor + 1

    def samples_needed(self, k: int) -> int:
        """Samples that must have arrived for encoder frame ``k`` (1280 k + 199)."""
        return self.hop * self.factor * k + self.window_end + 1

    @property
    def ready(self) -> int:
        """Encoder frames final and not handed out yet."""
        return self.final - self.frames

    # -- input -----------------------------------------------------------------------------

    def push(self, samples: np.ndarray) -> None:
        if self._total_mel is not None:
            raise SessionError("the input has ended")
        if len(samples):
            self._append(samples)
        m = self.mel_frames_final(self.received)
        if m > self.mel_frames:
            self._add_mel(self._compute_mel(self.mel_frames, m))
        self.final = max(self.final, self.frames_final(self.received))

    def _append(self, samples: np.ndarray) -> None:
        x = np.asarray(samples, dtype=np.float32)
        y = preemphasize(x, self.preemph, self._last_raw)
        self._last_raw = x[-1:].copy()
        self._y = np.concatenate([self._y, y])
        self.received += len(x)

    def _signal(self, a: int, b: int) -> np.ndarray:
        """Pre-emphasized samples [a, b) with zeros before the start and past what arrived."""
        return window_of(self._y, self._y_start, a, b)

    def _compute_mel(self, j0: int, j1: int) -> mx.array:
        """Log-mel frames [j0, j1) exactly as ``Preprocessor.__call__`` computes them."""
        from mlx_audio.dsp import stft

        pre = self.perception.preprocessor
        half = self.n_fft // 2
        seg = mx.array(self._signal(self.hop * j0 - half, self.hop * (j1 - 1) + half))
        window = pre.featurizer.window.astype(mx.float32)
        fb = pre.featurizer.fb[0].astype(mx.float32).T
        spec = stft(seg, self.n_fft, self.hop, self.n_fft, window, center=False)
        power = mx.square(spec.real) + mx.square(spec.imag)
        if self.mag_power != 2.0:
            power = mx.power(mx.sqrt(power), self.mag_power)
        return mx.log(power @ fb + self.guard)

    def _add_mel(self, rows: mx.array) -> None:
        self._mel = rows if self._mel is None else mx.concatenate([self._mel, rows], axis=0)
        self.mel_frames += rows.shape[0]
        drop = self.hop * self.mel_frames - self.n_fft  # samples no future mel frame reads
        if drop > self._y_start:
            self._y = self._y[drop - self._y_start :]
            self._y_start = drop

    def finish(self) -> None:
        """End of input: the remaining frames as the offline pass computes them (zeros past the
        end, NeMo's last mel frame set to the pad value)."""
        n = self.received
        valid = n // self.hop  # NeMo's mel length (errata 2)
        total = int(self.encoder.output_lengths(valid)) if valid > 0 else 0
        if total > self.final:
            if valid > self.mel_frames:
                self._add_mel(self._compute_mel(self.mel_frames, valid))
            elif valid < self.mel_frames:  # cannot happen: a final mel frame is always valid
                raise AssertionError("streaming mel frames past the valid length")
            # The centred STFT has one frame more than NeMo counts; it holds the pad value.
            self._add_mel(mx.full((1, self._mel.shape[1]), self.pad_value, dtype=self._mel.dtype))
            self._total_mel = valid + 1
            self.final = total
        else:
            self._total_mel = self.mel_frames

    # -- output ----------------------------------------------------------------------------

    def window(self):
        """The mel frames ``[m, n_mels]`` the next encoder frame's subsampling reads, and that
        frame's index in the subsampled output (hands the frame out)."""
        k = self.frames
        if k >= self.final:
            raise AssertionError("no encoder frame is final")
        s = max(k - PRE_ENCODE_CONTEXT, 0)
        m0 = s * self.factor
        m1 = k * self.factor + 1  # the subsampling is causal: frame k reads mel frames <= 8 k
        mel = self._mel[m0 - self._mel_start : m1 - self._mel_start]
        self.frames = k + 1
        # Keep the mel frames the next frames' subsampling context reaches back to.
        keep = max(k + 1 - PRE_ENCODE_CONTEXT, 0) * self.factor
        if keep > self._mel_start:
            self._mel = self._mel[keep - self._mel_start :]
            self._mel_start = keep
        return mel, k - s

    def arrays(self):
        return [] if self._mel is None else [self._mel]

"""The streaming listening path: samples in, final perception frames and RNNT tokens out.

Offline, perception runs once over the whole input (``Perception.__call__``) and the RNNT over
the whole encoder output (``greedy_decode``). Here the same networks run incrementally and give
the same frames, bit for bit:

- log-mel: mel frame ``j`` is computed once the samples under its window are all in. Its
  centred 512-sample frame is weighted by a 400-sample Hann window padded with zeros, so only
  samples up to ``hop * j + WINDOW_END`` (160 j + 198) matter; the zero-weighted rest of the
  frame is filled with zeros, which is what the weighting makes of any sample.
- encoder: encoder frame ``k`` reads mel frames up to ``8 k`` (causal subsampling), attends to
  70 frames to the left and none to the right and its convolutions are causal, so it is final
  once ``1280 k + 199`` samples have arrived: 1081 samples (67.6 ms) before its 80 ms slot ends.
  Each layer keeps its keys / values of the left context (``nets.perception.LayerCache``), so a
  frame costs one frame of work in every layer.
- at the end of the input (``finish``) the frames whose windows reach past the last sample are
  computed as the offline pass does: zeros past the end, NeMo's padded last mel frame.
- RNNT: NeMo's greedy decoding as a state machine whose joint evaluations ride on the frame's
  one host read (``RNNTStream``); blank frames cost one joint row and no prediction step.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..nets.perception import PRE_ENCODE_CONTEXT


class StreamingPerception:
    """Incremental ``Perception``: ``push(samples)`` -> the projected and encoded rows of every
    encoder frame that became final (``[1, n, H]``, ``[1, n, D]``, lazily on the device)."""

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
        self.frames = 0  # encoder frames emitted
        self._cache = self.encoder.make_cache()

    def arrays(self) -> List[mx.array]:
        """The device arrays this state holds."""
        return [self._mel] + self._cache.arrays()

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

    # -- input -----------------------------------------------------------------------------

    def _append(self, samples: np.ndarray) -> None:
        # The pre-emphasis in float32 on the host: the same two IEEE operations per sample as
        # the offline pass (a float32 product, then a float32 difference), so the same bits.
        x = np.asarray(samples, dtype=np.float32)
        if self.preemph:
            prev = x[:1] if self._last_raw is None else self._last_raw
            y = x - np.float32(self.preemph) * np.concatenate([prev, x[:-1]])
            if self._last_raw is None:
                y[0] = x[0]
        else:
            y = x
        self._last_raw = x[-1:].copy()
        self._y = np.concatenate([self._y, y.astype(np.float32, copy=False)])
        self.received += len(x)

    def _signal(self, a: int, b: int) -> np.ndarray:
        """Pre-emphasized samples [a, b) with zeros before the start and past what arrived."""
        out = np.zeros(b - a, dtype=np.float32)
        lo, hi = max(a, self._y_start), min(b, self._y_start + len(self._y))
        if hi > lo:
            out[lo - a : hi - a] = self._y[lo - self._y_start : hi - self._y_start]
        return out

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

    def _encode(self, k0: int, k1: int, total_mel: Optional[int] = None):
        """Encoder frames [k0, k1): subsampling over their mel context, then the layers."""
        s = max(k0 - PRE_ENCODE_CONTEXT, 0)
        m0 = s * self.factor
        m1 = total_mel if total_mel is not None else (k1 - 1) * self.factor + 1
        mel = self._mel[m0 - self._mel_start : m1 - self._mel_start]
        dtype = self.encoder.pre_encode.out.weight.dtype
        x, _ = self.encoder.pre_encode(mel[None].astype(dtype))
        x = x[:, k0 - s : k1 - s]
        x, self._cache = self.encoder.step(x, self._cache)
        self.frames = k1
        # Keep the mel frames the next frames' subsampling context reaches back to.
        keep = max(k1 - PRE_ENCODE_CONTEXT, 0) * self.factor
        if keep > self._mel_start:
            self._mel = self._mel[keep - self._mel_start :]
            self._mel_start = keep
        drop = self.hop * self.mel_frames - self.n_fft  # samples no future frame reads
        if drop > self._y_start:
            self._y = self._y[drop - self._y_start :]
            self._y_start = drop
        return self.perception.proj(x), x

    def push(self, samples: np.ndarray):
        """Add 16 kHz samples; returns (projected [1, n, H], encoded [1, n, D]) of the ``n``
        frames that became final, or None when none did."""
        if len(samples):
            self._append(samples)
        m = self.mel_frames_final(self.received)
        if m > self.mel_frames:
            self._add_mel(self._compute_mel(self.mel_frames, m))
        k = self.frames_final(self.received)
        if k <= self.frames:
            return None
        return self._encode(self.frames, k)

    def finish(self):
        """End of input: the remaining frames as the offline pass computes them (zeros past the
        end, NeMo's last mel frame set to the pad value), or None when there are none."""
        n = self.received
        valid = n // self.hop  # NeMo's mel length (errata 2)
        total = self.encoder.output_lengths(valid) if valid > 0 else 0
        total = int(total)
        if total <= self.frames:
            return None
        if valid > self.mel_frames:
            self._add_mel(self._compute_mel(self.mel_frames, valid))
        elif valid < self.mel_frames:  # cannot happen: a final mel frame is always valid
            raise AssertionError("streaming mel frames past the valid length")
        # The centred STFT has one frame more than NeMo counts; it holds the pad value.
        pad = mx.full((1, self._mel.shape[1]), self.pad_value, dtype=self._mel.dtype)
        self._add_mel(pad)
        return self._encode(self.frames, total, total_mel=valid + 1)


class RNNTStream:
    """NeMo's greedy RNNT decoding (``nets.rnnt.greedy_decode``) over frames that arrive over
    time. The joint labels of a window of frames are queued on the device (``pending``) and
    read with the frame's one host read; ``advance(labels)`` then applies exactly the offline
    rules and queues the next window. One read settles one token, or a run of blank frames of
    any length: at under one token per frame (speech is about 0.3) the transcript keeps up, a
    burst of several tokens in one frame lags a frame per extra token and catches up at the
    next blank frames, and ``finish`` reads whatever is left."""

    def __init__(self, decoder, joint, blank_id: int, max_symbols: Optional[int], window: int = 16):
        self.decoder, self.joint = decoder, joint
        self.blank, self.max_symbols, self.window = int(blank_id), max_symbols, window
        self.reset()

    def reset(self) -> None:
        self._enc: Optional[mx.array] = None  # projected encoder rows from _enc_start on
        self._enc_start = 0
        self.available = 0  # encoder frames pushed
        self.t = 0  # next frame to look at
        self.emitted_here = 0
        self._state = None
        out, self._new_state = self.decoder(None, None)  # the start symbol
        self._pred = self.joint.project_prediction(out[0, -1])
        self.pending: Optional[mx.array] = None
        self._pending_start = 0

    def arrays(self) -> List[mx.array]:
        h_c = self._new_state if self._new_state is not None else ()
        return [self._enc, self._pred, self.pending, *h_c]

    def push(self, encoded: mx.array) -> None:
        """Encoder rows ``[1, n, D]`` of the next frames."""
        rows = self.joint.project_encoder(encoded[0])
        self._enc = rows if self._enc is None else mx.concatenate([self._enc, rows], axis=0)
        self.available += rows.shape[0]

    def queue(self, upto: Optional[int] = None) -> Optional[mx.array]:
        """Queue the joint labels of the next window (if there are frames to look at), over
        frames before ``upto`` only (None: every frame pushed)."""
        end = self.available if upto is None else min(upto, self.available)
        if self.pending is None and self.t < end:
            w = min(self.window, end - self.t)
            a = self.t - self._enc_start
            self.pending = mx.argmax(self.joint.logits(self._enc[a : a + w], self._pred), axis=-1)
            self.pending = self.pending.astype(mx.int32)
            self._pending_start = self.t
        return self.pending

    def advance(self, labels: List[int]) -> List[Tuple[int, int]]:
        """Apply the labels read for ``pending``; returns the (token, frame) emitted."""
        self.pending = None
        j = next((i for i, k in enumerate(labels) if k != self.blank), None)
        out: List[Tuple[int, int]] = []
        if j is None:
            self.t, self.emitted_here = self.t + len(labels), 0
        else:
            if j > 0:
                self.t, self.emitted_here = self.t + j, 0
            k = int(labels[j])
            out.append((k, self.t))
            self.emitted_here += 1
            self._state = self._new_state
            o, self._new_state = self.decoder(mx.array([[k]]), self._state)
            self._pred = self.joint.project_prediction(o[0, -1])
            if self.max_symbols is not None and self.emitted_here >= self.max_symbols:
                self.t, self.emitted_here = self.t + 1, 0
        if self.t > self._enc_start:
            self._enc = self._enc[self.t - self._enc_start :]
            self._enc_start = self.t
        return out

    @property
    def done(self) -> bool:
        return self.pending is None and self.t >= self.available

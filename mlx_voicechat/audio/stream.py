"""A live conversation's audio in: samples checked and resampled, then the log-mel and the mel
window of each encoder frame as soon as it is final (:class:`~mlx_voicechat.audio.mel.MelStream`,
bit for bit the offline front-end's frames)."""

from __future__ import annotations

from typing import Dict, Optional

import mlx.core as mx
import numpy as np

from ..errors import SessionError, is_int
from .mel import MelStream, Resampler


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


class AudioIn:
    """Samples in at any rate (stateful resamplers, one per source rate), mel windows out, for
    a network with a ``frontend`` and an ``encoder`` (see ``MelStream``); what is wrong with the
    samples is one ``error``."""

    def __init__(self, net, rate: int, error: type = SessionError, eager: bool = True):
        self.rate, self.error = rate, error
        self.mel = MelStream(net, eager)
        self._resamplers: Dict[int, Resampler] = {}

    def reset(self) -> None:
        self.mel.reset()
        self._resamplers.clear()

    def push(self, samples, sample_rate: Optional[int] = None) -> None:
        """Check, resample and add samples."""
        if sample_rate is not None and (not is_int(sample_rate) or sample_rate <= 0):
            raise self.error(f"sample_rate must be a positive integer, got {sample_rate!r}")
        x = mono_float32(samples, self.error)
        if sample_rate is not None and int(sample_rate) != self.rate and x.size:
            source = int(sample_rate)
            if source not in self._resamplers:
                self._resamplers[source] = Resampler(source, self.rate)
            x = self._resamplers[source](x)
        self.mel.push(x)

    def push_silence(self, samples: int) -> None:
        self.mel.push(np.zeros(samples, np.float32))

    def drain_resamplers(self) -> None:
        """At the end of input: what the resamplers still hold."""
        for resampler in self._resamplers.values():
            tail = resampler(np.zeros(0, np.float32), last=True)
            if tail.size:
                self.mel.push(tail)
        self._resamplers.clear()

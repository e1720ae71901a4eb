"""The recognizer's mel filterbank product band by band on the CPU (fast path ``asr.mel``): each
group of mel bins is multiplied over only the FFT bins where its weights are nonzero, which the
BLAS sums in the same order, so the whole product's bits (tested)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import fastpaths
from ..derived import compiled
from . import on_cpu

# Mel bins per product of the banded filterbank.
MEL_GROUP = 8


def bands(fb: np.ndarray, group: int = MEL_GROUP):
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


class BandedLog:
    """``log(power @ fb + guard)`` with the product band by band (:func:`bands`), compiled;
    for a filterbank that never changes."""

    def __init__(self, fb: mx.array, guard: float):
        self.bands, self.guard = bands(np.array(fb)), guard
        self._fn = compiled(self._log)

    def _log(self, power: mx.array) -> mx.array:
        mel = mx.concatenate([power[..., a:b] @ w for a, b, w in self.bands], axis=-1)
        return mx.log(mel + self.guard)

    def applies(self) -> bool:
        return fastpaths.enabled("asr.mel") and on_cpu()

    def __call__(self, power: mx.array) -> mx.array:
        return self._fn(power)

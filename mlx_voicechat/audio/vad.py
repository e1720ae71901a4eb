"""When the user starts and stops speaking: an energy detector with hysteresis (pure numpy, any
rate; the server runs it off the worker, so it never waits on MLX).

Levels are 10 ms windows' RMS in dBFS, under a noise floor that falls at once and rises slowly.
Speech starts after ``onset_ms`` above ``max(start_db, floor + start_margin_db)`` (dated at the
first of those windows) and stops after ``hangover_ms`` below ``max(stop_db, floor +
stop_margin_db)`` (dated at the end of the last loud one): the absolute thresholds keep quiet
noise from starting speech, the margins a steady loud one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_DB = -100.0  # the level of digital silence (a floor for log10(0))


@dataclass(frozen=True)
class SpeechEdge:
    """``kind`` "started" or "stopped" at sample ``sample`` (counted from the first sample the
    detector was given)."""

    kind: str
    sample: int


class SpeechDetector:
    """``push(samples) -> [SpeechEdge, ...]``: the onsets and ends of speech that the samples so
    far settle, in order. Chunking does not matter: any split of the same audio gives the same
    edges."""

    def __init__(
        self,
        rate: int = 16000,
        *,
        window_ms: int = 10,
        start_db: float = -40.0,
        stop_db: float = -45.0,
        start_margin_db: float = 12.0,
        stop_margin_db: float = 6.0,
        onset_ms: int = 40,
        hangover_ms: int = 500,
        floor_rise_db_per_s: float = 2.0,
    ):
        if rate <= 0 or window_ms <= 0:
            raise ValueError("rate and window_ms must be positive")
        self.rate = int(rate)
        self.window = max(1, self.rate * int(window_ms) // 1000)
        self.start_db, self.stop_db = float(start_db), float(stop_db)
        self.start_margin_db, self.stop_margin_db = float(start_margin_db), float(stop_margin_db)
        self.onset_windows = max(1, round(onset_ms / window_ms))
        self.hangover_windows = max(1, round(hangover_ms / window_ms))
        self.rise_per_window = float(floor_rise_db_per_s) * window_ms / 1000.0
        self.onset_ms, self.hangover_ms = int(onset_ms), int(hangover_ms)
        self.speaking = False
        self.floor: float | None = None
        self._held = np.zeros(0, np.float32)  # less than a window, waiting for the rest
        self._windows = 0  # windows measured so far
        self._loud = 0  # consecutive windows over the start threshold
        self._quiet = 0  # consecutive windows under the stop threshold while speaking

    @property
    def samples_seen(self) -> int:
        """Samples pushed so far (measured or held)."""
        return self._windows * self.window + self._held.size

    def push(self, samples: np.ndarray) -> list[SpeechEdge]:
        x = np.asarray(samples, dtype=np.float32).reshape(-1)
        if self._held.size:
            x = np.concatenate([self._held, x])
        n = x.size // self.window
        self._held = x[n * self.window :].copy()
        if n == 0:
            return []
        frames = x[: n * self.window].reshape(n, self.window).astype(np.float64)
        power = np.einsum("ij,ij->i", frames, frames) / self.window
        levels = 10.0 * np.log10(np.maximum(power, 10.0 ** (MIN_DB / 10.0)))
        edges: list[SpeechEdge] = []
        for level in levels.tolist():  # a few windows per push: a plain loop is cheapest
            edge = self._window(level)
            if edge is not None:
                edges.append(edge)
            self._windows += 1
        return edges

    def _window(self, level: float) -> SpeechEdge | None:
        floor = level if self.floor is None else self.floor
        floor = level if level < floor else min(level, floor + self.rise_per_window)
        self.floor = floor
        if not self.speaking:
            if level > max(self.start_db, floor + self.start_margin_db):
                self._loud += 1
            else:
                self._loud = 0
            if self._loud >= self.onset_windows:
                self.speaking, self._loud, self._quiet = True, 0, 0
                first = self._windows - self.onset_windows + 1
                return SpeechEdge("started", first * self.window)
            return None
        if level < max(self.stop_db, floor + self.stop_margin_db):
            self._quiet += 1
        else:
            self._quiet = 0
        if self._quiet >= self.hangover_windows:
            self.speaking, self._quiet = False, 0
            last_loud_end = self._windows + 1 - self.hangover_windows
            return SpeechEdge("stopped", last_loud_end * self.window)
        return None

"""Sampling noise for the speaking path: one source per session, never the global generator.

EAR-TTS draws, per MoG call, Gumbel noise for the component pick, then a standard normal for
the latent (errata 9). Sources are passed in explicitly, so sessions never share random state
and tests can replay NeMo's recorded draws.
"""

from __future__ import annotations

import math
from typing import Protocol, Sequence, Tuple, runtime_checkable

import mlx.core as mx

GUMBEL_EPS = 1e-8  # NeMo's gumbel_like: -log(-log(u + eps) + eps)


def gumbel_from_uniform(u: mx.array) -> mx.array:
    return -mx.log(-mx.log(u + GUMBEL_EPS) + GUMBEL_EPS)


@runtime_checkable
class NoiseSource(Protocol):
    def gumbel(self, shape: Sequence[int]) -> mx.array: ...

    def normal(self, shape: Sequence[int]) -> mx.array: ...


class KeyNoise:
    """Noise from a private MLX key, split once per draw.

    Drawing only builds graph nodes (no host sync); the key chain itself stays on the device.
    """

    def __init__(self, seed: int = 0):
        self.key = mx.random.key(seed)

    def _next(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub

    def uniform(self, shape: Sequence[int]) -> mx.array:
        return mx.random.uniform(shape=tuple(shape), key=self._next())

    def gumbel(self, shape: Sequence[int]) -> mx.array:
        return gumbel_from_uniform(self.uniform(shape))

    def normal(self, shape: Sequence[int]) -> mx.array:
        return mx.random.normal(shape=tuple(shape), key=self._next())


class _DrawsByKind:
    """``gumbel`` and ``normal`` through the subclass's ``_draw(kind, shape)``."""

    def gumbel(self, shape: Sequence[int]) -> mx.array:
        return self._draw("gumbel", shape)

    def normal(self, shape: Sequence[int]) -> mx.array:
        return self._draw("normal", shape)


class ReplayNoise(_DrawsByKind):
    """Replays recorded draws in order: row ``j`` of each table serves the ``j``-th draw of
    that kind. Running out, or a row that does not fit the requested shape, is an error."""

    def __init__(self, gumbel_rows, normal_rows):
        self._rows = {"gumbel": mx.array(gumbel_rows), "normal": mx.array(normal_rows)}
        self._next = {"gumbel": 0, "normal": 0}

    def _draw(self, kind: str, shape: Sequence[int]) -> mx.array:
        rows, j = self._rows[kind], self._next[kind]
        if j >= rows.shape[0]:
            raise RuntimeError(
                f"ReplayNoise: all {rows.shape[0]} recorded {kind} draws are used up"
            )
        row = rows[j]
        if row.size != math.prod(int(s) for s in shape):
            raise ValueError(
                f"ReplayNoise: recorded {kind} draw {j} has {row.size} values, "
                f"asked for shape {tuple(shape)}"
            )
        self._next[kind] = j + 1
        return row.reshape(tuple(shape)).astype(mx.float32)

    @property
    def used(self) -> Tuple[int, int]:
        """Draws consumed so far: (gumbel, normal)."""
        return self._next["gumbel"], self._next["normal"]


class RowNoise(_DrawsByKind):
    """One source per row of a batch of conversations: a draw of shape ``[B, ...]`` is each
    row's own source drawing ``[1, ...]``, stacked, so every conversation takes the draws it
    takes alone. Has mlx-lm's batch protocol (rows along the list; ``extract`` and ``filter``
    share the sources, which are the rows' own)."""

    def __init__(self, sources: Sequence[NoiseSource]):
        self.sources = list(sources)

    def _draw(self, kind: str, shape: Sequence[int]) -> mx.array:
        shape = tuple(int(s) for s in shape)
        if shape[0] != len(self.sources):
            raise ValueError(f"a draw for {shape[0]} rows from {len(self.sources)} sources")
        one = (1, *shape[1:])
        draws = [getattr(s, kind)(one) for s in self.sources]
        return draws[0] if len(draws) == 1 else mx.concatenate(draws, axis=0)

    # -- the batch protocol ------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return len(self.sources)

    @property
    def state(self):
        """Each row's key (None for a source without one, such as :class:`ReplayNoise`)."""
        return [getattr(s, "key", None) for s in self.sources]

    @state.setter
    def state(self, v):
        for s, key in zip(self.sources, v):
            if key is not None:
                s.key = key

    @property
    def meta_state(self):
        """Each row's kind of source (its class name)."""
        return [type(s).__name__ for s in self.sources]

    @meta_state.setter
    def meta_state(self, v):
        if list(v) != self.meta_state:
            raise ValueError(f"noise sources {self.meta_state} cannot take the state of {list(v)}")

    def filter(self, batch_indices) -> None:
        self.sources = [self.sources[int(i)] for i in batch_indices]

    def extend(self, other: "RowNoise") -> None:
        self.sources = self.sources + other.sources

    def extract(self, idx: int) -> "RowNoise":
        return RowNoise([self.sources[idx]])

    @classmethod
    def merge(cls, parts: Sequence["RowNoise"]) -> "RowNoise":
        return cls([s for p in parts for s in p.sources])

    def take_rows(self, idx: Sequence[int]) -> "RowNoise":
        return RowNoise([self.sources[i] for i in idx])

    def put_rows(self, idx: Sequence[int], part: "RowNoise") -> None:
        for i, s in zip(idx, part.sources):
            self.sources[i] = s

"""Batch forms of per-conversation state, with mlx-lm's cache protocol (``state``, ``filter``,
``extend``, ``extract``, ``merge``; ours add ``meta_state``, which mlx-lm 0.32 keeps in ``state``).

A batch is each conversation's cache tree with one row per conversation. Fixed-size state is
mlx-lm's :class:`ArraysCache` (rows along axis 0) or a cache of ours with the same protocol
(codec decode, noise, :class:`EncoderCache`); state that grows (attention keys / values) is
:class:`RowCaches`, one mlx-lm cache per row with attention run row by row. Not mlx-lm's
``BatchKVCache``: a wrapped sliding window sums its keys in ring-buffer order, which differs
between rows that joined at different times; per-row caches keep each row's bits its own.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import ArraysCache, _BaseCache


class RowCaches(_BaseCache):
    """One cache object per row (a list with mlx-lm's batch protocol). A single row also
    answers like the cache it holds, so mlx-lm blocks run on it (a prompt's prefill)."""

    def __init__(self, rows: Sequence[Any]):
        self.rows = list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Any:
        return self.rows[i]

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    # -- one row used as its cache ---------------------------------------------------------

    def _single(self):
        if len(self.rows) != 1:
            raise ValueError(f"a {len(self.rows)}-row cache runs attention row by row")
        return self.rows[0]

    def update_and_fetch(self, keys, values):
        return self._single().update_and_fetch(keys, values)

    def make_mask(self, *args, **kwargs):
        return self._single().make_mask(*args, **kwargs)

    @property
    def offset(self):
        return self._single().offset

    @property
    def keys(self):
        return self._single().keys

    @property
    def values(self):
        return self._single().values

    # -- the protocol ----------------------------------------------------------------------

    @property
    def state(self):
        return [c.state for c in self.rows]

    @state.setter
    def state(self, v):
        for c, s in zip(self.rows, v):
            c.state = s

    @property
    def meta_state(self):
        return [getattr(c, "meta_state", "") for c in self.rows]

    @meta_state.setter
    def meta_state(self, v):
        for c, m in zip(self.rows, v):
            if hasattr(c, "meta_state"):
                c.meta_state = m

    def filter(self, batch_indices) -> None:
        self.rows = [self.rows[int(i)] for i in batch_indices]

    def extend(self, other: "RowCaches") -> None:
        self.rows = self.rows + list(other.rows)

    def extract(self, idx: int) -> "RowCaches":
        return RowCaches([self.rows[idx]])

    @classmethod
    def merge(cls, caches: Sequence["RowCaches"]) -> "RowCaches":
        return cls([r for c in caches for r in c.rows])

    def empty(self) -> bool:
        return all(c.empty() for c in self.rows)

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """One position's attention, each conversation's rows of ``q``, ``k``, ``v`` (as many
        per conversation, in order) over that conversation's own cache, once the new keys and
        values are added to it."""
        if len(self.rows) == 1:  # one conversation: its rows are the whole batch
            parts = [(self.rows[0], q, k, v)]
        else:
            n = q.shape[0] // len(self.rows)
            rows = [slice(n * b, n * b + n) for b in range(len(self.rows))]
            parts = [(c, q[r], k[r], v[r]) for c, r in zip(self.rows, rows)]
        outs = []
        for c, q, k, v in parts:
            keys, values = c.update_and_fetch(k, v)
            o = scaled_dot_product_attention(q, keys, values, cache=c, scale=scale, mask=None)
            outs.append(o)
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)

    def size(self) -> int:
        return max((c.size() for c in self.rows), default=0)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.rows)


class NamedArrays(ArraysCache):
    """An :class:`ArraysCache` whose slots have names (``SLOTS``), each a property; batch
    operations keep the subclass."""

    SLOTS: tuple = ()

    def __init__(self, size: int = 0, left_padding=None):
        super().__init__(len(self.SLOTS), left_padding)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for i, name in enumerate(cls.SLOTS):
            setattr(cls, name, property(
                lambda self, i=i: self.cache[i],
                lambda self, v, i=i: self.cache.__setitem__(i, v),
            ))

    @classmethod
    def of(cls, *arrays: mx.array) -> "NamedArrays":
        c = cls()
        c.cache = list(arrays)
        return c

    def extract(self, idx: int) -> "NamedArrays":
        return self.of(*[a[idx : idx + 1] for a in self.cache])


def merge_rows(caches: Sequence[Any]) -> Any:
    """``type(caches[0]).merge`` of caches of any number of rows: mlx-lm's ``merge`` takes
    caches of one row each, so a cache of several rows is split by its ``extract`` first."""
    if any(c.batch_size != 1 for c in caches):
        caches = [c.extract(i) for c in caches for i in range(c.batch_size)]
    return type(caches[0]).merge(list(caches))


def take_rows(cache: Any, idx: Sequence[int]) -> Any:
    """A new cache with rows ``idx`` of ``cache`` (arrays gathered, row objects shared)."""
    if hasattr(cache, "take_rows"):
        return cache.take_rows(idx)
    if isinstance(cache, RowCaches):
        return RowCaches([cache.rows[i] for i in idx])
    if isinstance(cache, ArraysCache):
        rows = mx.array(list(idx), dtype=mx.int32)
        part = copy.copy(cache)  # of the same class (NamedArrays keep their names)
        part.cache = [None if a is None else a[rows] for a in cache.cache]
        return part
    raise TypeError(f"no rows to take from a {type(cache).__name__}")


def put_rows(cache: Any, idx: Sequence[int], part: Any) -> None:
    """Write ``part`` (what :func:`take_rows` gave, advanced) back into rows ``idx``."""
    if hasattr(cache, "put_rows"):
        cache.put_rows(idx, part)
        return
    if isinstance(cache, RowCaches):
        for i, row in zip(idx, part.rows):
            cache.rows[i] = row
        return
    if isinstance(cache, ArraysCache):
        rows = mx.array(list(idx), dtype=mx.int32)
        for k, a in enumerate(part.cache):
            if a is not None:
                full = mx.array(cache.cache[k])  # a new object: others may hold the old one
                full[rows] = a
                cache.cache[k] = full
        return
    raise TypeError(f"no rows to put into a {type(cache).__name__}")


def cache_arrays(cache: Any) -> List[mx.array]:
    """Every array of a cache's ``state`` (nested states included)."""
    try:
        state = cache.state
    except Exception:  # an mlx-lm cache that holds nothing yet has no state
        return []
    return [a for _, a in tree_flatten(state) if isinstance(a, mx.array)]


@dataclass
class LayerCache:
    keys: Optional[mx.array] = None  # [B, heads, <= left context, head_dim], projected
    values: Optional[mx.array] = None
    conv: Optional[mx.array] = None  # [B, kernel - 1, D] GLU outputs

    @property
    def context(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]


@dataclass
class EncoderCache:
    """Left context of every layer after ``offset`` encoder frames, for streams at that one
    offset (rows along axis 0). Live rows sit at different offsets while their contexts warm
    up, so a frame state keeps one per row in a :class:`RowCaches`."""

    layers: List[LayerCache]
    offset: int = 0

    def arrays(self) -> List[mx.array]:
        return [a for c in self.layers for a in (c.keys, c.values, c.conv) if a is not None]

    def _map(self, fn) -> List[LayerCache]:
        return [
            LayerCache(*(None if a is None else fn(a) for a in (c.keys, c.values, c.conv)))
            for c in self.layers
        ]

    # -- mlx-lm's batch protocol (rows of one offset) --------------------------------------

    @property
    def batch_size(self) -> int:
        arrays = self.arrays()
        return arrays[0].shape[0] if arrays else 1

    def filter(self, batch_indices) -> None:
        rows = mx.array([int(i) for i in batch_indices], dtype=mx.int32)
        self.layers = self._map(lambda a: a[rows])

    def extract(self, idx: int) -> "EncoderCache":
        return EncoderCache(self._map(lambda a: a[idx : idx + 1]), self.offset)

    def extend(self, other: "EncoderCache") -> None:
        self.layers = EncoderCache.merge([self, other]).layers

    @classmethod
    def merge(cls, caches: Sequence["EncoderCache"]) -> "EncoderCache":
        """The rows of caches at one offset (their arrays then have the same shapes)."""
        offsets = sorted({c.offset for c in caches})
        if len(offsets) > 1:
            raise ValueError(
                f"encoder caches at offsets {offsets} keep their rows apart (in a RowCaches)"
            )
        layers = [
            LayerCache(*(None if p[0] is None else mx.concatenate(p, axis=0) for p in zip(*parts)))
            for parts in zip(*([(c.keys, c.values, c.conv) for c in e.layers] for e in caches))
        ]
        return cls(layers, offsets[0])

    @property
    def state(self):
        return [(c.keys, c.values, c.conv) for c in self.layers]

    @state.setter
    def state(self, v):
        self.layers = [LayerCache(*kvc) for kvc in v]

    @property
    def meta_state(self):
        return str(self.offset)

    @meta_state.setter
    def meta_state(self, v):
        self.offset = int(v)

    def empty(self) -> bool:
        return self.offset == 0

    def size(self) -> int:
        return self.layers[0].context if self.layers else 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

"""The TTS's chain over a system prompt's positions, computed once per (speaker, seed).

At prompt positions the TTS hears only pad ids, its own codes and the seeded noise, so its
state after ``L`` positions depends on (weights, speaker, seed, L) alone. A
:class:`PromptChain` runs the chain once and keeps every position's keys and values, codes and
noise keys; opening a conversation is then a gather, not ``L - 1`` TTS steps. The gathered
caches equal the stepped ones bit for bit: each buffer's layout comes from replaying mlx-lm's
cache rules on position numbers. Positions past ``max_bytes`` are stepped, not kept.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
from typing import Iterator, List, Tuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ...caches import RowCaches
from ...noise import KeyNoise
from ...threads import note_mlx_thread

CHAIN_MAX_BYTES = 2 << 30  # default bound of one chain's keys and values
_EXTEND_ROUND = 64  # a chain grows by whole blocks of steps


def chain_max_bytes() -> int:
    """The bound of one chain's memory: ``MLX_VOICECHAT_PROMPT_CHAIN_MB`` or 2 GiB."""
    mb = os.environ.get("MLX_VOICECHAT_PROMPT_CHAIN_MB")
    return CHAIN_MAX_BYTES if not mb else int(float(mb) * (1 << 20))


@contextlib.contextmanager
def _recording(caches) -> Iterator[List[list]]:
    """For the block, each of ``caches`` notes every ``(keys, values)`` it is updated with in
    its tape (one list per cache, yielded). Undone after the block: the wrapper makes a
    reference cycle that would keep the tapes alive until the cyclic garbage collector runs."""
    tapes = [[] for _ in caches]
    for cache, tape in zip(caches, tapes):

        def update_and_fetch(keys, values, inner=cache.update_and_fetch, tape=tape):
            tape.append((keys, values))
            return inner(keys, values)

        cache.update_and_fetch = update_and_fetch
    try:
        yield tapes
    finally:
        for cache in caches:
            cache.__dict__.pop("update_and_fetch", None)


def _layout(template, sizes: List[int]) -> Tuple[object, mx.array]:
    """The cache ``template`` (a fresh mlx-lm cache) after updates of ``sizes`` positions: its
    bookkeeping, and per buffer slot 1 + the position it holds (0: an empty slot). This
    replays mlx-lm's ``KVCache`` / ``RotatingKVCache`` update rules on position numbers in
    Python (:func:`_layout_mlx` runs the classes themselves; a test holds the two equal)."""
    c = copy.copy(template)
    if isinstance(template, RotatingKVCache):
        slots, c.offset, c._idx = _rotating(sizes, template.max_size, template.keep)
    elif type(template) is KVCache:
        n = sum(sizes)
        size = -(-n // KVCache.step) * KVCache.step if n else 0
        slots, c.offset = list(range(1, n + 1)) + [0] * (size - n), n
    else:
        return _layout_mlx(template, sizes)
    return c, mx.array(slots, dtype=mx.int32)


def _rotating(sizes: List[int], max_size: int, keep: int) -> Tuple[List[int], int, int]:
    """mlx-lm's ``RotatingKVCache`` bookkeeping over position numbers: (slots, offset, _idx)."""
    buf, offset, idx = None, 0, 0
    for s in sizes:
        block = list(range(offset + 1, offset + s + 1))
        if s > 1:  # _update_concat
            if buf is None:
                buf = block
            else:
                if idx != len(buf):  # _temporal_order
                    buf = buf[:keep] + buf[idx:] + buf[keep:idx] if idx < offset else buf[:idx]
                idx = len(buf)
                trim = idx - max_size + 1
                buf = (buf[:keep] + buf[trim + keep :] if trim > 0 else buf) + block
            offset += s
            idx = len(buf)
            continue
        prev = offset  # _update_in_place
        if buf is None or (prev >= len(buf) and len(buf) < max_size):
            grow = min(RotatingKVCache.step, max_size - prev)
            buf = (buf or []) + [0] * grow
            idx = prev
        trim = len(buf) - max_size
        if trim > 0:
            buf = buf[:keep] + buf[trim + keep :]
            idx = max_size
        if idx == max_size:
            idx = keep
        buf[idx] = block[0]
        offset += 1
        idx += 1
    return buf or [], offset, idx


def _layout_mlx(template, sizes: List[int]) -> Tuple[object, mx.array]:
    """:func:`_layout` by running the cache class itself on position numbers (slow: a few
    array operations per position)."""
    sim = copy.deepcopy(template)
    start = 1
    for s in sizes:
        block = mx.arange(start, start + s, dtype=mx.int32).reshape(1, 1, s, 1)
        sim.update_and_fetch(block, block)
        start += s
    slots = sim.keys.reshape(-1)
    mx.eval(slots)
    return sim, slots


class PromptChain:
    """The TTS chain over prompt positions of one (speaker, seed); see the module docstring.
    Thread-safe: a lock covers growing it."""

    def __init__(self, tts, latent, init_codes, silence, pad: int, seed: int, max_bytes=None):
        note_mlx_thread()
        self.tts, self.silence, self.pad, self.seed = tts, silence, pad, seed
        self.max_bytes = chain_max_bytes() if max_bytes is None else int(max_bytes)
        self._lock = threading.Lock()
        self._templates = [rc.rows[0] for rc in tts.make_cache()]
        taped = copy.deepcopy(self._templates)
        with _recording(taped) as tapes:
            previous, _ = tts.warmup(latent, init_codes, [RowCaches([c]) for c in taped])
        self.warmup_positions = int(tapes[0][0][0].shape[2])
        self._keys = [mx.concatenate([k for k, _ in t], axis=2) for t in tapes]
        self._values = [mx.concatenate([v for _, v in t], axis=2) for t in tapes]
        self._previous = previous  # [1 + steps, Q]
        self._noise_keys = KeyNoise(seed).key[None]  # [1 + steps, 2]
        mx.eval(self._keys, self._values, self._previous, self._noise_keys)
        self.steps = 0  # TTS steps run over prompt positions

    # -- size ------------------------------------------------------------------------------

    def bytes_per_position(self) -> int:
        pairs = zip(self._keys, self._values)
        return sum(k[:, :, :1].nbytes + v[:, :, :1].nbytes for k, v in pairs)

    @property
    def nbytes(self) -> int:
        arrays = self._keys + self._values + [self._previous, self._noise_keys]
        return sum(a.nbytes for a in arrays)

    @property
    def max_steps(self) -> int:
        """The most steps the chain keeps within ``max_bytes`` (the warm-up's positions are
        always kept)."""
        per = self.bytes_per_position()
        return max(self.max_bytes // per - self.warmup_positions, 0)

    # -- one conversation's state ------------------------------------------------------------

    def state(self, steps: int, progress=None) -> Tuple[mx.array, list, KeyNoise]:
        """The TTS's previous code ``[1, Q]``, caches and noise source after the warm-up and
        ``steps`` prompt steps: those of running the steps, bit for bit. The chain grows to
        ``steps`` first if it is shorter (``progress(done, total)`` after each new step) and
        within its bound; past it, the rest is stepped here. ``progress`` is called at least
        once, with ``(steps, steps)`` at the end."""
        note_mlx_thread()
        kept = min(steps, self.max_steps)
        with self._lock:
            if kept > self.steps:
                target = min(-(-kept // _EXTEND_ROUND) * _EXTEND_ROUND, self.max_steps)
                self._grow(max(target, kept), progress, steps)
            previous, cache, noise = self._rebuild(kept)
        for i in range(kept, steps):
            previous, cache = self.tts.step(self.pad, previous, cache, noise, self.silence)
            mx.async_eval(previous)
            if progress is not None:
                progress(i + 1, steps)
        if progress is not None and steps and kept == steps:
            progress(steps, steps)  # (again, or at once when the chain was long enough)
        return previous, cache, noise

    def grow(self, steps: int, most: int) -> None:
        """Run up to ``most`` more steps of the chain toward ``steps`` (within its bound)."""
        note_mlx_thread()
        target = min(steps, self.max_steps, self.steps + max(int(most), 1))
        with self._lock:
            if target > self.steps:
                self._grow(target, None, target)

    def _rebuild(self, steps: int):
        sizes = [self.warmup_positions] + [1] * steps
        layouts = {}
        rows = []
        for i, template in enumerate(self._templates):
            kind = (type(template), getattr(template, "max_size", None))
            if kind not in layouts:
                layouts[kind] = _layout(template, sizes)
            sim, slots = layouts[kind]
            c = copy.copy(sim)
            c.keys = self._gather(self._keys[i], slots)
            c.values = self._gather(self._values[i], slots)
            rows.append(RowCaches([c]))
        noise = KeyNoise(self.seed)
        noise.key = self._noise_keys[steps]
        previous = self._previous[steps : steps + 1]
        mx.eval([(c.rows[0].keys, c.rows[0].values) for c in rows], previous, noise.key)
        return previous, rows, noise

    @staticmethod
    def _gather(chain: mx.array, slots: mx.array) -> mx.array:
        n = slots.shape[0]
        used = (slots > 0).reshape(1, 1, n, 1)
        taken = mx.take(chain, mx.maximum(slots - 1, 0), axis=2)
        return mx.where(used, taken, mx.zeros((), chain.dtype))

    def _grow(self, target: int, progress, total: int) -> None:
        previous, cache, noise = self._rebuild(self.steps)
        codes, keys = [], []
        with _recording([c.rows[0] for c in cache]) as tapes:
            for i in range(self.steps, target):
                previous, cache = self.tts.step(self.pad, previous, cache, noise, self.silence)
                codes.append(previous)
                keys.append(noise.key[None])
                mx.async_eval(previous, noise.key)
                if progress is not None and i < total:
                    progress(i + 1, total)
        self._keys = [
            mx.concatenate([k] + [a for a, _ in t], axis=2) for k, t in zip(self._keys, tapes)
        ]
        self._values = [
            mx.concatenate([v] + [b for _, b in t], axis=2) for v, t in zip(self._values, tapes)
        ]
        self._previous = mx.concatenate([self._previous] + codes, axis=0)
        self._noise_keys = mx.concatenate([self._noise_keys] + keys, axis=0)
        mx.eval(self._keys, self._values, self._previous, self._noise_keys)
        self.steps = target

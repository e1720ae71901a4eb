"""What conversations carry from one 80 ms frame to the next: the frame state.

A :class:`FrameState` is a tree of caches with one row per conversation, each with mlx-lm's
cache protocol (``state``, ``meta_state``, ``filter``, ``extend``, ``extract``, ``merge``; see
:mod:`mlx_voicechat.nets.caches`): the LLM's (mlx-lm's own: Mamba states stacked, attention
rows side by side), the TTS backbone's, the previous ids and code frame, the barge-in and
forced-id flags, the noise sources, and for a live conversation the encoder's context, the
RNNT's prediction state and the codec's decode state. :func:`open_state` makes one
conversation's (a single row); :meth:`FrameState.merge` stacks several into a batch, which
:meth:`FrameState.extract` / :meth:`FrameState.filter` split again, bit for bit.

The one step that advances it is :func:`mlx_voicechat.runtime.step.step`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from ..nets.caches import RowCaches, arrays_cache, cache_arrays, put_rows, take_rows
from ..nets.version import Memo
from ..noise import KeyNoise, NoiseSource, RowNoise
from .request import Request
from .threads import note_mlx_thread

NO_ID = -1  # a forced-id flag that forces nothing
_SNAPSHOTS_MAX = 4
_snapshot_lock = threading.Lock()


@dataclass
class FrameState:
    """The state of ``B`` conversations (rows) between frames.

    ``ids``: the last frame's ``[text, function]`` ids ``[B, 2]``, its text id ``[B]`` and the
    TTS's previous code frame ``[B, Q]``. ``flags``: barge-in ``[B]`` (the text channel is fed
    silence until the model gives BOS), and the ids forced on the next frame ``[B]`` twice
    (:data:`NO_ID`: the head's). ``position``: each row's next timeline position. ``prefix``:
    a fresh conversation's prompt rows ``[1, P, H]``, prefilled with its first frame."""

    llm: List[Any]
    tts: List[RowCaches]
    ids: ArraysCache
    flags: ArraysCache
    noise: RowNoise
    position: List[int]
    prefix: Optional[mx.array] = None
    encoder: Optional[RowCaches] = None
    rnnt: Optional[ArraysCache] = None
    codec: Optional[Any] = None
    frames: List[int] = field(default_factory=list)  # audio frames each row has run

    @property
    def rows(self) -> int:
        return len(self.position)

    # -- the tree ----------------------------------------------------------------------------

    def caches(self) -> List[Any]:
        """Every cache of the tree, in a fixed order."""
        out = list(self.llm) + list(self.tts) + [self.ids, self.flags, self.noise]
        return out + [c for c in (self.encoder, self.rnnt, self.codec) if c is not None]

    @property
    def state(self) -> list:
        return [c.state for c in self.caches()] + [self.prefix]

    @property
    def meta_state(self) -> tuple:
        return tuple(self.position), tuple(self.frames)

    def arrays(self) -> List[mx.array]:
        """Every array the state holds (what the next call reads)."""
        out = [a for c in self.caches() for a in cache_arrays(c)]
        if self.prefix is not None:
            out.append(self.prefix)
        return out

    def settle(self) -> None:
        """Schedule every array the next call will read: an array left lazy belongs to the
        streams of the thread that made it, and the next call may come from another thread."""
        arrays = [a for a in self.arrays() if isinstance(a, mx.array)]
        if arrays:
            mx.async_eval(*arrays)

    # -- rows --------------------------------------------------------------------------------

    def _parts(self) -> List[str]:
        return [n for n in ("ids", "flags", "noise", "encoder", "rnnt", "codec") if getattr(self, n) is not None]

    def take(self, idx: Sequence[int]) -> "FrameState":
        """A state of rows ``idx`` (arrays gathered; row caches and sources shared). After a
        step on it, :meth:`put` writes it back."""
        idx = list(idx)
        if idx == list(range(self.rows)):
            return self
        part = FrameState(
            llm=[take_rows(c, idx) for c in self.llm],
            tts=[take_rows(c, idx) for c in self.tts],
            ids=take_rows(self.ids, idx),
            flags=take_rows(self.flags, idx),
            noise=take_rows(self.noise, idx),
            position=[self.position[i] for i in idx],
            frames=[self.frames[i] for i in idx],
        )
        for name in ("encoder", "rnnt", "codec"):
            c = getattr(self, name)
            if c is not None:
                setattr(part, name, take_rows(c, idx))
        return part

    def put(self, idx: Sequence[int], part: "FrameState") -> None:
        idx = list(idx)
        if part is self:
            return
        for full, p in zip(self.llm, part.llm):
            put_rows(full, idx, p)
        for full, p in zip(self.tts, part.tts):
            put_rows(full, idx, p)
        for name in self._parts():
            put_rows(getattr(self, name), idx, getattr(part, name))
        for j, i in enumerate(idx):
            self.position[i] = part.position[j]
            self.frames[i] = part.frames[j]

    def filter(self, keep: Sequence[int]) -> None:
        """Keep rows ``keep`` only (a conversation leaves)."""
        keep = [int(i) for i in keep]
        for c in self.llm + self.tts:
            c.filter(keep)
        for name in self._parts():
            getattr(self, name).filter(keep)
        self.position = [self.position[i] for i in keep]
        self.frames = [self.frames[i] for i in keep]

    def extract(self, i: int) -> "FrameState":
        """Row ``i`` as a state of its own (arrays sliced, row caches shared)."""
        return _shallow(self) if self.rows == 1 else self.take([i])

    def extend(self, other: "FrameState") -> None:
        """Append ``other``'s rows (a conversation joins after its first frame)."""
        merged = FrameState.merge([self, other])
        for name in ("llm", "tts", "ids", "flags", "noise", "encoder", "rnnt", "codec", "position", "frames"):
            setattr(self, name, getattr(merged, name))

    @classmethod
    def merge(cls, states: Sequence["FrameState"]) -> "FrameState":
        """The rows of ``states`` as one batch; each must have run its first frame."""
        if any(s.prefix is not None or 0 in s.position for s in states):
            raise ValueError("a conversation joins a batch after its first frame")
        first = states[0]

        def merged(pick):
            caches = [pick(s) for s in states]
            return type(caches[0]).merge(caches) if caches[0] is not None else None

        llm = [
            RowCaches.merge(parts) if isinstance(parts[0], RowCaches) else _merge_arrays(parts)
            for parts in ([s.llm[j] for s in states] for j in range(len(first.llm)))
        ]
        tts = [RowCaches.merge([s.tts[j] for s in states]) for j in range(len(first.tts))]
        return cls(
            llm=llm,
            tts=tts,
            ids=_merge_arrays([s.ids for s in states]),
            flags=_merge_arrays([s.flags for s in states]),
            noise=RowNoise.merge([s.noise for s in states]),
            position=[p for s in states for p in s.position],
            frames=[f for s in states for f in s.frames],
            encoder=merged(lambda s: s.encoder),
            rnnt=None if first.rnnt is None else _merge_arrays([s.rnnt for s in states]),
            codec=merged(lambda s: s.codec),
        )


def _shallow(state: FrameState) -> FrameState:
    return FrameState(
        llm=list(state.llm), tts=list(state.tts), ids=state.ids, flags=state.flags,
        noise=state.noise, position=list(state.position), prefix=state.prefix,
        encoder=state.encoder, rnnt=state.rnnt, codec=state.codec, frames=list(state.frames),
    )


def _merge_arrays(caches: Sequence[ArraysCache]) -> ArraysCache:
    """Rows of :class:`ArraysCache` s of any number of rows, stacked (mlx-lm's
    ``ArraysCache.merge`` takes caches of one row each)."""
    return arrays_cache(*[mx.concatenate(parts, axis=0) for parts in zip(*(c.cache for c in caches))])


# --- one conversation's state -------------------------------------------------------------


def warmup_codes(model) -> mx.array:
    """The TTS warm-up code frames ``[1, T, Q]``: the codec codes of ``T + 1`` frames of silence,
    prepared per errata 4. They depend only on the weights, so they are made once."""

    def build():
        speech = model.tts_model
        codec = speech.audio_codec
        latent = speech.audio_prompt_latents[model.config.speaker]
        T = latent.shape[1]
        codes = codec.encode(mx.zeros((1, (T + 1) * codec.samples_per_frame)))
        init = speech.tts_model.prepare_init_codes(codes, model.config.tts_config.codebook_size)
        mx.eval(init)
        return init

    return _memo(model, "_warmup").get(build)


def _memo(model, name: str) -> Memo:
    memo = model.__dict__.get(name)
    if memo is None:
        memo = Memo(model)
        object.__setattr__(model, name, memo)
    return memo


def _embed(model, ids) -> mx.array:
    return model.stt_model.embed_tokens(mx.array(ids, dtype=mx.int32).reshape(1, -1))


def start_state(model, request: Request, noise: NoiseSource, progress=None) -> FrameState:
    """A conversation's state after the TTS warm-up and its steps over the prompt positions
    (``progress(done, total)`` after each of those steps), before any audio."""
    note_mlx_thread()
    cfg = model.config
    pad, prompt = cfg.pad_token_id, request.prompt_ids
    speech = model.tts_model
    tts = speech.tts_model
    latent = speech.audio_prompt_latents[cfg.speaker]
    previous, tts_cache = tts.warmup(latent, warmup_codes(model), tts.make_cache())
    prefix = None
    if prompt:
        w = cfg.function_channel_weight
        pad_row = _embed(model, [pad])
        # Prompt ids enter on the audio channel; the text and function channels hold pad.
        prefix = _embed(model, prompt) + pad_row + w * pad_row
        silence = speech.codec_silence_tokens
        for i in range(1, len(prompt)):  # position 0 is never spoken
            previous, tts_cache = tts.step(pad, previous, tts_cache, noise, silence)
            mx.async_eval(previous)
            if progress is not None:
                progress(i, len(prompt) - 1)
    return FrameState(
        llm=model.stt_model.llm.make_cache(),
        tts=tts_cache,
        ids=arrays_cache(
            mx.array([[pad, pad]], dtype=mx.int32), mx.array([pad], dtype=mx.int32), previous
        ),
        flags=arrays_cache(
            mx.zeros((1,), dtype=mx.bool_), mx.full((1,), NO_ID, mx.int32), mx.full((1,), NO_ID, mx.int32)
        ),
        noise=RowNoise([noise]),
        position=[len(prompt)],
        prefix=prefix,
        frames=[0],
    )


def _copy_tts(rows: List[RowCaches]) -> List[RowCaches]:
    """New cache objects over the same (immutable) arrays: mlx-lm caches update their arrays
    by slice assignment, which rebinds the array object it is called on, so each copy gets
    array objects of its own and a snapshot is never written through."""
    out = []
    for rc in rows:
        copies = []
        for c in rc.rows:
            new = c.__class__.__new__(c.__class__)
            new.__dict__.update(c.__dict__)
            for name in ("keys", "values"):
                a = getattr(c, name, None)
                if isinstance(a, mx.array):
                    setattr(new, name, mx.array(a))
            copies.append(new)
        out.append(RowCaches(copies))
    return out


def open_state(model, request: Request, progress=None) -> FrameState:
    """A conversation's state after its prompt. With the default (seeded) noise it depends
    only on (weights, prompt, seed): it is kept, and later conversations start from a copy."""
    if request.noise is not None:
        return start_state(model, request, request.noise, progress)
    memo = _memo(model, "_snapshots").get(OrderedDict)
    key = (tuple(request.prompt_ids), request.seed)
    with _snapshot_lock:
        snap = memo.get(key)
        if snap is not None:
            memo.move_to_end(key)
    if snap is None:
        snap = start_state(model, request, KeyNoise(request.seed), progress)
        mx.eval(snap.arrays())
        with _snapshot_lock:
            memo[key] = snap
            while len(memo) > _SNAPSHOTS_MAX:
                memo.popitem(last=False)
    noise = KeyNoise.__new__(KeyNoise)
    noise.key = snap.noise.sources[0].key
    return FrameState(
        llm=model.stt_model.llm.make_cache(),
        tts=_copy_tts(snap.tts),
        ids=arrays_cache(*snap.ids.cache),
        flags=arrays_cache(*snap.flags.cache),
        noise=RowNoise([noise]),
        position=list(snap.position),
        prefix=snap.prefix,
        frames=[0],
    )


def open_live(model, state: FrameState) -> FrameState:
    """Add what a live conversation also carries: the encoder's context, the RNNT's
    prediction state (before its first token) and the codec's decode state."""
    stt = model.stt_model
    state.encoder = RowCaches([stt.perception.encoder.make_cache()])
    h, c, pred = model.rnnt_frames.start()
    state.rnnt = arrays_cache(h.swapaxes(0, 1), c.swapaxes(0, 1), pred)
    state.codec = model.tts_model.audio_codec.make_decode_cache()
    return state



"""What conversations carry from one frame to the next: the :class:`FrameState`.

A tree of caches with one row per conversation (LLM, TTS, last ids, flags, noise; live: the
encoder's context, the RNNT's state, the codec's), each with mlx-lm's cache protocol (see
:mod:`mlx_voicechat.caches`), so merge / extract / filter / extend walk the tree bit for bit.
:func:`open_state` makes one conversation's state; only :func:`.step.step` advances it.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, List, Optional, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from ...caches import NamedArrays, RowCaches, cache_arrays, merge_rows, put_rows, take_rows
from ...derived import derived
from ...noise import NoiseSource, RowNoise
from ...threads import note_mlx_thread
from .promptchain import PromptChain
from .request import Request
from .step import NO_ID, speak

_SNAPSHOTS_MAX = 4
_CHAINS_MAX = 2  # prompt chains kept (seeds)
_snapshot_lock = threading.Lock()
PROMPT_STATES = {"hit": 0, "miss": 0}  # opens that found their post-prompt state kept, or not


def _cache():
    """A field of the tree of caches (a cache, a list of caches, or None where absent)."""
    return field(default=None, metadata={"cache": True})


class LastIds(NamedArrays):
    """The last frame's ``[text, function]`` ids ``[B, 2]`` and the TTS's code frame ``[B, Q]``."""

    SLOTS = ("ids", "code")


class Flags(NamedArrays):
    """The barge-in ``[B]`` bool (the text channel is fed silence until the model gives BOS),
    and the text and function ids forced on the next frame ``[B]`` (:data:`NO_ID`: the head's)."""

    SLOTS = ("quiet", "force_text", "force_function")

    @classmethod
    def start(cls) -> "Flags":
        none = mx.full((1,), NO_ID, mx.int32)
        return cls.of(mx.zeros((1,), dtype=mx.bool_), none, none)


class RNNTState(NamedArrays):
    """The RNNT prediction network's state after each row's last token: ``h`` and ``c``
    ``[layers, B, H]``, as its step takes them (rows along axis 1), and its projection
    ``pred`` ``[B, J]``."""

    SLOTS = ("h", "c", "pred")

    @property
    def batch_size(self) -> int:
        return self.pred.shape[0]

    def filter(self, keep) -> None:
        self.cache = self.take_rows(keep).cache

    def extend(self, other: "RNNTState") -> None:
        self.cache = self.merge([self, other]).cache

    def extract(self, idx: int) -> "RNNTState":
        return self.of(self.h[:, idx : idx + 1], self.c[:, idx : idx + 1], self.pred[idx : idx + 1])

    @classmethod
    def merge(cls, caches) -> "RNNTState":
        rows = [[c.h for c in caches], [c.c for c in caches], [c.pred for c in caches]]
        return cls.of(*[mx.concatenate(r, axis=1 if k < 2 else 0) for k, r in enumerate(rows)])

    def take_rows(self, idx) -> "RNNTState":
        rows = mx.array(list(idx), dtype=mx.int32)
        return self.of(self.h[:, rows], self.c[:, rows], self.pred[rows])

    def put_rows(self, idx, part: "RNNTState") -> None:
        rows = mx.array(list(idx), dtype=mx.int32)
        h, c, pred = mx.array(self.h), mx.array(self.c), mx.array(self.pred)  # new objects
        h[:, rows], c[:, rows], pred[rows] = part.h, part.c, part.pred
        self.cache = [h, c, pred]


@dataclass
class FrameState:
    """The state of ``B`` conversations (rows) between frames: the parts a stage of the step
    reads (no ``llm``: transcription only; no ``encoder``: frames heard already; no ``codec``:
    codes left undecoded). ``position``: each row's next timeline position. ``prefix``: a
    fresh conversation's prompt rows ``[1, P, H]``, prefilled with its first frame."""

    llm: Optional[List[Any]] = _cache()
    tts: Optional[List[RowCaches]] = _cache()
    last: Optional[LastIds] = _cache()
    flags: Optional[Flags] = _cache()
    noise: Optional[RowNoise] = _cache()
    position: List[int] = field(default_factory=lambda: [0])
    prefix: Optional[mx.array] = None
    encoder: Optional[RowCaches] = _cache()
    rnnt: Optional[RNNTState] = _cache()
    codec: Optional[Any] = _cache()
    frames: List[int] = field(default_factory=list)  # audio frames each row has run

    @property
    def rows(self) -> int:
        return len(self.position)

    # -- the tree ----------------------------------------------------------------------------

    def tree(self) -> Dict[str, Any]:
        """The caches by field: a cache, a list of them (the LLM's and the TTS's layers), or
        None (what a conversation that is not live lacks)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("cache")}

    def caches(self) -> List[Any]:
        """Every cache of the tree, in a fixed order."""
        return [c for _, c in tree_flatten(self.tree()) if c is not None]

    def _map(self, fn: Callable, *others: "FrameState") -> Dict[str, Any]:
        """``fn`` of each cache (and the caches at the same place in ``others``), by field."""

        def each(c, *o):
            return None if c is None else fn(c, *o)

        return tree_map(each, self.tree(), *(s.tree() for s in others))

    @property
    def state(self) -> list:
        return [c.state for c in self.caches()] + [self.prefix]

    @property
    def meta_state(self) -> tuple:
        return tuple(self.position), tuple(self.frames)

    def _meta(self, idx: Sequence[int]) -> Dict[str, List[int]]:
        """The host's per-row lists (``position``, ``frames``) of rows ``idx``."""
        return {k: [getattr(self, k)[i] for i in idx] for k in ("position", "frames")}

    def arrays(self) -> List[mx.array]:
        """Every array the state holds (what the next call reads)."""
        out = [a for c in self.caches() for a in cache_arrays(c)]
        if self.prefix is not None:
            out.append(self.prefix)
        return out

    def copy(self) -> "FrameState":
        """A state of its own over the same data, by ``copy.deepcopy`` as mlx-lm's prompt cache
        copies its snapshots: its caches update arrays by slice assignment, so a copy sharing
        the array objects would write through."""
        return copy.deepcopy(self)

    # -- rows: mlx-lm's batch protocol, cache by cache ---------------------------------------

    def _check_started(self) -> None:
        if self.prefix is not None or 0 in self.position:
            raise ValueError("a conversation joins a batch after its first frame")

    def filter(self, keep: Sequence[int]) -> None:
        """Keep rows ``keep`` only (a conversation leaves)."""
        keep = [int(i) for i in keep]
        for c in self.caches():
            c.filter(keep)
        vars(self).update(self._meta(keep))

    def extract(self, i: int) -> "FrameState":
        """Row ``i`` as a state of its own, from each cache's ``extract`` (arrays sliced; the
        row caches of growing state, the noise source, shared). After the first frame."""
        self._check_started()
        return FrameState(**self._map(lambda c: c.extract(i)), **self._meta([i]))

    def extend(self, other: "FrameState") -> None:
        """Append ``other``'s rows, each cache with its own ``extend`` (a conversation joins
        after its first frame)."""
        self._check_started()
        other._check_started()
        self._map(lambda c, o: c.extend(o), other)
        self.position = self.position + other.position
        self.frames = self.frames + other.frames

    @classmethod
    def merge(cls, states: Sequence["FrameState"]) -> "FrameState":
        """The rows of ``states`` as one batch, each cache from its kind's ``merge``; each
        state must have run its first frame."""
        for s in states:
            s._check_started()
        first, rest = states[0], states[1:]
        return cls(
            **first._map(lambda *cs: merge_rows(cs), *rest),
            position=[p for s in states for p in s.position],
            frames=[f for s in states for f in s.frames],
        )

    # -- rounds in which only some rows have a frame -----------------------------------------

    def take(self, idx: Sequence[int]) -> "FrameState":
        """A state of rows ``idx`` (arrays gathered; row caches and sources shared). After a
        step on it, :meth:`put` writes it back."""
        idx = list(idx)
        if idx == list(range(self.rows)):
            return self
        return FrameState(**self._map(lambda c: take_rows(c, idx)), **self._meta(idx))

    def put(self, idx: Sequence[int], part: "FrameState") -> None:
        """Write ``part`` (what :meth:`take` gave, advanced) back into rows ``idx``."""
        idx = list(idx)
        if part is self:
            return
        self._map(lambda c, p: put_rows(c, idx, p), part)
        for j, i in enumerate(idx):
            self.position[i] = part.position[j]
            self.frames[i] = part.frames[j]


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

    return derived(model, "warmup_codes", build)


def _embed(model, ids) -> mx.array:
    return model.stt_model.embed_tokens(mx.array(ids, dtype=mx.int32).reshape(1, -1))


def prompt_chain(model, seed: int) -> PromptChain:
    """The model's TTS chain over prompt positions for ``seed`` and its speaker (made on
    first use, kept for the last few seeds)."""
    note_mlx_thread()
    cfg = model.config
    memo = derived(model, "prompt_chains", OrderedDict)
    key = (cfg.speaker, seed)
    with _snapshot_lock:
        chain = memo.get(key)
        if chain is not None:
            memo.move_to_end(key)
            return chain
    speech = model.tts_model
    chain = PromptChain(
        speech.tts_model, speech.audio_prompt_latents[cfg.speaker], warmup_codes(model),
        speech.codec_silence_tokens, cfg.pad_token_id, seed,
    )
    with _snapshot_lock:
        chain = memo.setdefault(key, chain)
        while len(memo) > _CHAINS_MAX:
            memo.popitem(last=False)
    return chain


def _prefix(model, prompt: Sequence[int]) -> Optional[mx.array]:
    """The prompt's LLM rows ``[1, P, H]``: prompt ids on the audio channel, pad on the text
    and function channels."""
    if not prompt:
        return None
    cfg = model.config
    pad_row = _embed(model, [cfg.pad_token_id])
    return _embed(model, prompt) + pad_row + cfg.function_channel_weight * pad_row


def start_state(model, request: Request, noise: NoiseSource, progress=None) -> FrameState:
    """A conversation's state after the TTS warm-up and its steps over the prompt positions
    (``progress(done, total)`` after each of those steps), before any audio: the steps run
    here, one after the other, drawing from ``noise`` (a caller's own source)."""
    note_mlx_thread()
    cfg = model.config
    pad, prompt = cfg.pad_token_id, request.prompt_ids
    speech = model.tts_model
    tts = speech.tts_model
    latent = speech.audio_prompt_latents[cfg.speaker]
    previous, tts_cache = tts.warmup(latent, warmup_codes(model), tts.make_cache())
    state = _state(model, request, previous, tts_cache, noise)
    for i in range(1, len(prompt)):  # position 0 is never spoken
        mx.async_eval(speak(model, state, pad))
        if progress is not None:
            progress(i, len(prompt) - 1)
    return state


def chain_state(model, request: Request, progress=None) -> FrameState:
    """:func:`start_state` for the seeded noise, its TTS part taken from the seed's
    :class:`~.promptchain.PromptChain` (the same bits, without a step per prompt position)."""
    previous, tts_cache, noise = prompt_chain(model, request.seed).state(
        _chain_steps(request), progress
    )
    return _state(model, request, previous, tts_cache, noise)


def _state(model, request: Request, previous, tts_cache, noise) -> FrameState:
    pad = model.config.pad_token_id
    return FrameState(
        llm=model.stt_model.llm.make_cache(),
        tts=tts_cache,
        last=LastIds.of(mx.array([[pad, pad]], dtype=mx.int32), previous),
        flags=Flags.start(),
        noise=RowNoise([noise]),
        position=[len(request.prompt_ids)],
        prefix=_prefix(model, request.prompt_ids),
        frames=[0],
    )


def _chain_steps(request: Request) -> int:
    return max(len(request.prompt_ids) - 1, 0)  # position 0 is never spoken


def state_ready(model, request: Request) -> bool:
    """Whether :func:`open_state` makes ``request``'s state without stepping the speech model
    over prompt positions (its state is kept, or the seed's chain is long enough, or as long
    as its memory bound lets it be). A caller's own noise source always steps."""
    if request.noise is not None:
        return False
    memo = derived(model, "snapshots", OrderedDict)
    if (tuple(request.prompt_ids), request.seed) in memo:
        return True
    chain = prompt_chain(model, request.seed)
    return chain.steps >= min(_chain_steps(request), chain.max_steps)


def grow_chain(model, request: Request, steps: int) -> None:
    """Grow the seed's prompt chain by up to ``steps`` steps toward ``request``'s prompt."""
    prompt_chain(model, request.seed).grow(_chain_steps(request), steps)


def open_state(model, request: Request, progress=None) -> FrameState:
    """A conversation's state after its prompt. With the default (seeded) noise it depends
    only on (weights, prompt, seed): it is kept, and later conversations start from a copy;
    a prompt not seen before takes its TTS state from the seed's prompt chain. A caller's own
    noise source steps the TTS over the prompt (its draws are not the seed's)."""
    if request.noise is not None:
        return start_state(model, request, request.noise, progress)
    memo = derived(model, "snapshots", OrderedDict)
    key = (tuple(request.prompt_ids), request.seed)
    with _snapshot_lock:
        snap = memo.get(key)
        if snap is not None:
            memo.move_to_end(key)
        PROMPT_STATES["hit" if snap is not None else "miss"] += 1
    if snap is None:
        snap = chain_state(model, request, progress)
        mx.eval(snap.arrays())
        with _snapshot_lock:
            memo[key] = snap
            while len(memo) > _SNAPSHOTS_MAX:
                memo.popitem(last=False)
    return snap.copy()


def open_live(model, state: FrameState, *, listen: bool = True, decode: bool = True) -> FrameState:
    """Add what a live conversation also carries: with ``listen``, the encoder's context and
    the RNNT's prediction state (before its first token); with ``decode``, the codec's decode
    state."""
    if listen:
        state.encoder = RowCaches([model.stt_model.perception.encoder.make_cache()])
        state.rnnt = RNNTState.of(*model.rnnt_frames.start())
    if decode:
        state.codec = model.tts_model.audio_codec.make_decode_cache()
    return state

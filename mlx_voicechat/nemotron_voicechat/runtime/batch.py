"""Batched live sessions: every conversation of a model advanced by one forward per frame.

``s = batch.open(...)`` opens a conversation (a :class:`~.handle.SessionHandle`),
``s.push(samples)`` buffers audio, ``batch.step()`` runs every ready frame in batched rounds and
returns each conversation's events. As in mlx-lm's ``BatchGenerator``, a conversation's first
frame runs alone, then its rows are merged in; it leaves by ``filter``. One host read per
round, and each conversation's events equal ``model.session()``'s bit for bit (see ``caches``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ...caches import cache_arrays
from ...errors import SessionError, is_int
from ...threads import note_mlx_thread
from .events import FrameEvent, Queued
from .framestate import NO_ID, FrameState
from .handle import SessionHandle
from .request import Request, resolve
from .step import ReadLayout, prefill, read, step

#: A conversation's options (``SessionBatch.open``, ``Session``, ``model.session``).
SESSION_OPTIONS = ("seed", "noise", "prompt", "tools", "max_seconds")


class SessionBatch:
    """Live conversations of one model, stepped together (see the module docstring)."""

    def __init__(self, model, max_sessions: int = 8, join_rows: Optional[int] = None):
        if not is_int(max_sessions) or max_sessions < 1:
            raise SessionError(f"max_sessions must be an integer >= 1, got {max_sessions!r}")
        self.model = model
        self.max_sessions = int(max_sessions)
        # None: a conversation's whole prompt is prefilled with its first frame (one call);
        # a number: the first frame takes at most that many prompt rows along, and the rest
        # go first through prefill() in slices (a server runs them between rounds).
        self.join_rows = join_rows
        self.layout = ReadLayout(model)
        self._handles: List[SessionHandle] = []
        self._state: Optional[FrameState] = None  # the joined conversations' rows
        self._rows: List[SessionHandle] = []  # who each row is
        self.last_rounds = 0  # rounds the last step ran

    def __len__(self) -> int:
        return len(self._handles)

    @property
    def sessions(self) -> List[SessionHandle]:
        return list(self._handles)

    def open(self, system_prompt: Optional[str] = None, **options) -> SessionHandle:
        """A new conversation; it joins at its first frame. A SessionError past ``max_sessions``.
        ``options``: ``seed`` (0), ``noise``, ``prompt`` (ids instead of ``system_prompt``),
        ``tools``, ``max_seconds`` (see ``nemotron_voicechat.runtime.request.resolve``)."""
        return SessionHandle(self, system_prompt, **options)

    def request(self, system_prompt: Optional[str] = None, **options) -> Request:
        """A new conversation's options, checked, if the batch has room for it."""
        if len(self._handles) >= self.max_sessions:
            raise SessionError(f"the batch holds its {self.max_sessions} sessions; close one first")
        unknown = sorted(set(options) - set(SESSION_OPTIONS))
        if unknown:
            raise SessionError(f"a session has no option {', '.join(map(repr, unknown))}: it "
                               f"takes {', '.join(SESSION_OPTIONS)}")
        note_mlx_thread()
        request = resolve(self.model, system_prompt, **options)
        codec = self.model.tts_model.audio_codec
        codec.prepare_fast_step()  # so that no frame makes its own host sync for it
        return request

    def admit(self, handle: SessionHandle) -> None:
        """Take ``handle`` (made on :meth:`request`'s options) into the batch."""
        self._handles.append(handle)
        self._settle()

    def feed(self, chunks: Dict[SessionHandle, Any], sample_rate: Optional[int] = None):
        """``push`` each conversation's samples, then :meth:`step`."""
        for handle, samples in chunks.items():
            handle.push(samples, sample_rate)
        return self.step()

    # -- rows ------------------------------------------------------------------------------

    def _join(self, handle: SessionHandle) -> None:
        if self._state is None:
            self._state = handle.state
        else:
            self._state.extend(handle.state)
        self._rows.append(handle)
        handle.state = None

    def leave(self, handle: SessionHandle, close: bool = False) -> None:
        """Take ``handle``'s rows out of the batch's frame state (and the handle out of the
        batch, with ``close``)."""
        if close:
            self._handles.remove(handle)
        if handle in self._rows:
            keep = [i for i, h in enumerate(self._rows) if h is not handle]
            self._rows = [self._rows[i] for i in keep]
            if keep:
                self._state.filter(keep)
            else:
                self._state = None

    def set_quiet(self, handle: SessionHandle) -> None:
        """Start a barge-in on ``handle``'s row from its next frame."""
        if handle.joined:
            state, i = self._state, self._rows.index(handle)
        else:
            state, i = handle.state, 0
        quiet = mx.array(state.flags.quiet)
        quiet[i] = True
        state.flags.quiet = quiet

    # -- prompts in slices -------------------------------------------------------------------

    @property
    def prefilling(self) -> Optional[SessionHandle]:
        """The conversation whose prompt :meth:`prefill` runs next (the first opened), if any
        has more prompt rows left than its first frame takes along (``join_rows``)."""
        return next((h for h in self._handles if h.prefilling), None)

    def prefill(self, rows: int, steps: Optional[int] = None) -> int:
        """Run ``rows`` more prompt rows of :attr:`prefilling`'s conversation through the LLM,
        and wait for them; returns its rows left (0 with none prefilling). While the seed's
        prompt chain is shorter than its prompt, this grows the chain by ``steps`` (default
        ``rows``) speech steps instead (and makes its state when it is long enough)."""
        note_mlx_thread()
        h = self.prefilling
        if h is None:
            return 0
        if h.opening:
            h.open_some(rows if steps is None else steps)
            return h.prefill_rows
        rows = max(1, min(int(rows), h.prefill_rows - self.join_rows))
        prefill(self.model, h.state, rows)
        mx.eval([a for c in h.state.llm for a in cache_arrays(c)])
        return h.prefill_rows

    @property
    def pending(self) -> bool:
        """Whether a frame is ready or a prompt waits for its slices."""
        return any(h.ready or h.prefilling for h in self._handles)

    # -- frames ----------------------------------------------------------------------------

    def step(self, max_rounds: Optional[int] = None) -> Dict[SessionHandle, List[FrameEvent]]:
        """Run every ready frame, round by round (at most ``max_rounds`` rounds: a server leaves
        the rest for its next step); each conversation's events in order."""
        note_mlx_thread()
        events: Dict[SessionHandle, List[FrameEvent]] = {h: [] for h in self._handles}
        held = None  # the round queued last, not read yet
        self.last_rounds = 0
        while max_rounds is None or self.last_rounds < max_rounds:
            ready = [h for h in self._handles if h.ready]
            if not ready:
                break
            self.last_rounds += 1
            queued = self._queue_round(ready)
            if held is not None:
                self._hand_out(held, events)
            held = queued
        if held is not None:
            self._hand_out(held, events)
        for h in list(self._handles):
            if h.remainder_due:
                events[h].append(self._remainder(h))
            if h.finished is not None:
                self.leave(h)
        self._settle()
        return events

    def _settle(self) -> None:
        """Schedule every array the next call reads: an array left lazy belongs to the streams
        of the thread that made it, and the next call may come from another thread."""
        arrays = [] if self._state is None else self._state.arrays()
        for h in self._handles:
            arrays += h.audio.mel.arrays() + ([] if h.state is None else h.state.arrays())
        if arrays:
            mx.async_eval(*arrays)

    def _queue_round(self, ready: List[SessionHandle]):
        """Queue one frame of each ready conversation: the joined ones in one batched frame,
        a joining one alone (its first frame), then merged into the batch."""
        # In row order: when every row has a frame, the batch's state is stepped as it is.
        joined = [h for h in self._rows if h in ready]
        fresh = [h for h in ready if not h.joined]
        packed, entries = [], []
        if joined:
            idx = [self._rows.index(h) for h in joined]
            part = self._state.take(idx)
            self._set_forced(part, joined, entries)
            windows = [h.audio.mel.window() for h in joined]
            packed.append(self._frame(part, windows))
            self._state.put(idx, part)
        for h in fresh:
            self._set_forced(h.state, [h], entries)
            packed.append(self._frame(h.state, [h.audio.mel.window()]))
            self._join(h)
        words = packed[0] if len(packed) == 1 else mx.concatenate(packed, axis=0)
        return words, entries

    def _frame(self, state: FrameState, windows) -> mx.array:
        """The frame step on ``state``'s rows; its words, not read yet."""
        return step(self.model, state, windows, layout=self.layout, split_head=True).words

    def _set_forced(self, state: FrameState, handles: Sequence[SessionHandle], entries) -> None:
        texts, functions = [], []
        for h in handles:
            text, function, forced, injected = h.book.next_forced()
            texts.append(NO_ID if text is None else int(text))
            functions.append(NO_ID if function is None else int(function))
            h.queued += 1
            ends = h.queued >= h.max_frames
            if ends:
                h.end("max_seconds")
            tail = ends or (h.input_ended and h.audio.mel.ready == 1)  # its window is next
            entries.append((h, Queued(h.queued - 1, forced, injected, ends, tail)))
        if any(t != NO_ID for t in texts) or any(f != NO_ID for f in functions):
            state.flags.force_text = mx.array(texts, dtype=mx.int32)
            state.flags.force_function = mx.array(functions, dtype=mx.int32)

    def _hand_out(self, held, events) -> None:
        words, entries = held
        rows = read(words)  # the round's one host read
        for (h, q), row in zip(entries, rows):
            if h.closed:
                continue
            events.setdefault(h, []).append(h.book.event(q, self.layout.unpack(row)))
            h.frames += 1
            if q.tail and h.finished is None:
                h.end("finished")

    def _remainder(self, h: SessionHandle) -> FrameEvent:
        h.remainder_due = False
        h.end("finished")
        codec = self._state.codec.extract(self._rows.index(h)) if h.joined else h.state.codec
        tail = self.model.tts_model.audio_codec.decode_flush(codec)[0].astype(mx.float32)
        return h.book.remainder(h.frames - 1, read(mx.view(tail, mx.int32)).view(np.float32))

"""Batched live sessions: every conversation of a model advanced by one forward per frame.

``batch = model.session_batch(max_sessions=8)``; ``s = batch.open(...)`` opens a conversation
(a :class:`SessionHandle`); ``s.push(samples)`` buffers audio; ``batch.step()`` runs every frame
that is ready, the conversations that have one in one batched frame per round, until none has
a complete frame, and returns each conversation's events. ``model.session()`` is a batch of
one (:class:`~.session.Session`): the same code for one conversation or many.

A conversation joins the way mlx-lm's ``BatchGenerator`` adds a request: its first frame (the
prompt's prefill, or position 0's silence) runs alone from the cached post-prompt state, then
its rows are merged into the batch's frame state; it leaves by ``filter``. A round in which
only some conversations have a frame runs those rows (gathered, then written back). Each round
is queued before the previous one is read, and read once: one host read per batched frame.
Every row computes what it computes alone, so each conversation's events equal the same
conversation run through ``model.session()`` (bit for bit with MLX's CPU BLAS; see
``nets.caches``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..errors import SessionError, is_int
from ..nets.caches import cache_arrays
from .audioin import AudioIn
from .events import EventBook, FrameEvent, Queued
from .framestate import NO_ID, FrameState, grow_chain, open_live, open_state, state_ready
from .request import Request, check_extra_seconds, resolve
from .step import ReadLayout, prefill, read, step
from .threads import note_mlx_thread
from .tools import ToolError, tool_result_ids

#: A conversation's options (``SessionBatch.open``, ``Session``, ``model.session``).
SESSION_OPTIONS = ("seed", "noise", "prompt", "tools", "max_seconds")


class SessionHandle:
    """One conversation of a :class:`SessionBatch`: the input side of a session. Use it (and
    its batch) from one thread at a time, any thread."""

    def __init__(self, batch: "SessionBatch", system_prompt: Optional[str] = None, **options):
        self.batch = batch
        model = batch.model
        cfg = model.config
        self.request = request = batch.request(system_prompt, **options)
        self.prompt_ids = request.prompt_ids
        self.tools = request.tools
        self.seed = request.seed
        self.max_frames = request.max_frames
        self.input_sample_rate = cfg.input_sample_rate
        self.output_sample_rate = cfg.output_sample_rate
        self.samples_per_frame = model.tts_model.audio_codec.samples_per_frame
        self.input_samples_per_frame = cfg.input_samples_per_frame
        self.audio = AudioIn(model.stt_model.perception, cfg.input_sample_rate)
        self.book = EventBook(model, request.parser)
        self._closed = False
        self._start()
        batch.admit(self)

    def _start(self) -> None:
        model = self.batch.model
        # A batch that takes prompts in slices does not grow the seed's prompt chain inside
        # open: the conversation waits (prefilling) while prefill() grows it in slices.
        self._opening = self.batch.join_rows is not None and not state_ready(model, self.request)
        self._quiet = False  # a cancel while opening, for the state once it is made
        self.state: Optional[FrameState] = None
        if not self._opening:
            self.state = open_live(model, open_state(model, self.request))
        self.audio.reset()
        self.book.reset()
        self.frames = 0  # frames handed out
        self.queued = 0  # frames queued on the device
        self._finished: Optional[str] = None  # why the conversation stopped taking input
        self.input_ended = False  # finish() was called (its frames may not have run yet)
        self.remainder_due = False  # finish() made no frame: hand out the stream's end alone

    # -- state -----------------------------------------------------------------------------

    @property
    def joined(self) -> bool:
        return self.state is None and not self._opening

    @property
    def opening(self) -> bool:
        """Whether the conversation waits for the seed's prompt chain to grow to its prompt
        (see ``_start``); :meth:`SessionBatch.prefill` grows it."""
        return self._opening

    def open_some(self, steps: int) -> None:
        """Grow the seed's prompt chain by up to ``steps`` steps toward this prompt's length;
        once it is long enough, make the state."""
        model = self.batch.model
        grow_chain(model, self.request, steps)
        if state_ready(model, self.request):
            self.state = open_live(model, open_state(model, self.request))
            self._opening = False
            if self._quiet:
                self.state.flags.quiet = mx.array([True])

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def finished(self) -> Optional[str]:
        return self._finished

    def end(self, reason: str) -> None:
        """Stop taking input; :attr:`finished` says ``reason`` ("finished", "max_seconds")."""
        self._finished = reason

    @property
    def speaking(self) -> bool:
        return self.book.speaking

    @property
    def tool_frames(self) -> int:
        return self.book.tool_frames

    @property
    def transcript_tokens(self) -> List[int]:
        return self.book.transcript_tokens

    @property
    def pending_samples(self) -> int:
        """16 kHz samples received that are not yet part of an emitted frame."""
        return max(self.audio.mel.received - self.frames * self.input_samples_per_frame, 0)

    def samples_needed(self, k: int) -> int:
        """16 kHz samples that must have arrived for frame ``k`` to be computed (1280 k + 199)."""
        return self.audio.mel.samples_needed(k)

    @property
    def ready_before_slot_end(self) -> int:
        """How many samples before the end of its 80 ms slot a frame is computed (1081)."""
        return self.input_samples_per_frame - self.audio.mel.samples_needed(0)

    def memory_per_minute(self) -> dict:
        """Bytes the conversation's caches grow by per minute (see the README)."""
        return self.batch.model.memory_per_minute()

    @property
    def prefill_rows(self) -> int:
        """Prompt rows not yet run through the LLM (they enter before or with the first
        frame)."""
        state = self.state
        return 0 if state is None or state.prefix is None else int(state.prefix.shape[1])

    @property
    def prefilling(self) -> bool:
        """Whether the prompt has more rows left than its first frame takes along (the batch's
        ``join_rows``): :meth:`SessionBatch.prefill` runs them first."""
        most = self.batch.join_rows
        return most is not None and not self._closed and (self._opening or self.prefill_rows > most)

    @property
    def ready(self) -> bool:
        """Whether a frame is ready to run."""
        return (
            not self._closed
            and self._finished is None
            and self.audio.mel.ready > 0
            and not self.prefilling
        )

    def _check_open(self) -> None:
        if self._closed:
            raise SessionError("the session is closed")

    def _check_input(self) -> None:
        self._check_open()
        if self._finished is not None:
            raise SessionError(
                f"the session has ended ({self._finished}); call reset() to start a new conversation"
            )
        if self.input_ended:
            raise SessionError("the input has ended (finish() was called); call reset() to start again")

    # -- input -----------------------------------------------------------------------------

    def push(self, samples, sample_rate: Optional[int] = None) -> None:
        """Add mono audio (int or float PCM, at 16 kHz or ``sample_rate``); computes nothing."""
        self._check_input()
        self.audio.push(samples, sample_rate)

    def silence(self, frames: int) -> None:
        """Advance the clock by ``frames`` 80 ms frames of silent input."""
        if not is_int(frames) or frames < 0:
            raise SessionError(f"silence takes a number of frames >= 0, got {frames!r}")
        self._check_input()
        self.audio.push_silence(int(frames) * self.input_samples_per_frame)

    def finish(self, extra_decoding_seconds: float = 3.0) -> None:
        """End of the user's input: ``extra_decoding_seconds`` of trailing silence so the reply
        can finish, then the frames that the end of input makes final; the last carries the
        codec's tail. The frames run with the next ``step``."""
        self._check_input()
        extra = check_extra_seconds(extra_decoding_seconds)
        rate = self.input_sample_rate
        room = (self.max_frames - self.queued + 1) * self.input_samples_per_frame
        pad = min(int(round(extra * rate)), max(room, 0))
        self.audio.drain_resamplers()
        self.audio.push_silence(pad)
        self.audio.mel.finish()
        self.input_ended = True
        if self.audio.mel.ready == 0 and self.frames and self.queued == self.frames:
            self.remainder_due = True

    # -- control -----------------------------------------------------------------------------

    def cancel(self) -> None:
        """Barge-in: from the next frame the text channel is fed the silence id (so nothing is
        spoken) until the model starts a new turn (its text head gives BOS)."""
        self._check_open()
        if self._opening:
            self._quiet = True  # for the state once it is made
        else:
            self.batch.set_quiet(self)

    def force(self, text_id: Optional[int] = None, function_id: Optional[int] = None) -> None:
        """Queue ids to feed back on the next frame instead of the heads' (None: the head's)."""
        self._check_open()
        vocab = self.batch.model.config.text_args.vocab_size
        for v in (text_id, function_id):
            ok = is_int(v) and 0 <= int(v) < vocab
            if v is not None and not ok:
                raise SessionError(f"forced ids must be ints in [0, {vocab}), got {v!r}")
        self.book.forced.append((text_id, function_id))

    def add_tool_result(self, call_id: str, output: Any) -> int:
        """Queue a tool's result for the call ``call_id``; from the next frame on it is fed to
        the model one token per frame on the function channel (the text channel gets pad, so
        nothing is spoken meanwhile). Returns how many frames it takes."""
        self._check_open()
        if self.book.parser is None:
            raise ToolError("this session has no tools; open it with model.session(..., tools=[...])")
        ids = tool_result_ids(self.batch.model.tokenizer, output)
        self.book.add_tool_result(call_id, ids)
        return len(ids)

    def reset(self) -> None:
        """Back to the state right after the system prompt (a new conversation)."""
        self._check_open()
        self.batch.leave(self)
        self._start()

    def close(self) -> None:
        if not self._closed:
            self.batch.leave(self, close=True)
        self._closed = True
        self.state = None


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
        ``tools``, ``max_seconds`` (see ``runtime.request.resolve``)."""
        return SessionHandle(self, system_prompt, **options)

    def request(self, system_prompt: Optional[str] = None, **options) -> Request:
        """A new conversation's options, checked, if the batch has room for it."""
        if len(self._handles) >= self.max_sessions:
            raise SessionError(f"the batch holds its {self.max_sessions} sessions; close one first")
        for name in set(options) - set(SESSION_OPTIONS):
            raise SessionError(f"a session has no option {name!r}: {', '.join(SESSION_OPTIONS)}")
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
        state, i = (handle.state, 0) if not handle.joined else (self._state, self._rows.index(handle))
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
        """Schedule every array the next call reads (see ``FrameState.settle``)."""
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

    def _set_forced(self, state: FrameState, handles: Sequence[SessionHandle], entries: list) -> None:
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

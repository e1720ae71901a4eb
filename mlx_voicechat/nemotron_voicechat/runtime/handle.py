"""One conversation of a :class:`~.batch.SessionBatch`: its input side (audio, tool results,
barge-in, forced ids) and its place in the batch (opening, prefilling, joined). The batch and
its handles talk through public methods (``batch.request`` / ``admit`` / ``leave`` /
``set_quiet``; ``handle.end``, ``open_some``, ``input_ended``, ``remainder_due``).
"""

from __future__ import annotations

from typing import Any, List, Optional

import mlx.core as mx

from ...audio.stream import AudioIn
from ...errors import SessionError, is_int
from .events import EventBook
from .framestate import FrameState, grow_chain, open_live, open_state, state_ready
from .request import check_extra_seconds
from .tools import ToolError, tool_result_ids


class SessionHandle:
    """One conversation of a :class:`SessionBatch`: the input side of a session. Use it (and
    its batch) from one thread at a time, any thread."""

    def __init__(self, batch, system_prompt: Optional[str] = None, **options):
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
        """16 kHz samples that must have arrived for frame ``k`` to be computed."""
        return self.audio.mel.samples_needed(k)

    @property
    def ready_before_slot_end(self) -> int:
        """How many samples before the end of its 80 ms slot a frame is computed."""
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
        live = not self._closed and self._finished is None
        return live and self.audio.mel.ready > 0 and not self.prefilling

    def _check_open(self) -> None:
        if self._closed:
            raise SessionError("the session is closed")

    def _check_input(self) -> None:
        self._check_open()
        if self._finished is not None:
            why = f"the session has ended ({self._finished})"
            raise SessionError(f"{why}; call reset() to start a new conversation")
        if self.input_ended:
            raise SessionError(
                "the input has ended (finish() was called); call reset() to start again"
            )

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
            raise ToolError(
                "this session has no tools; open it with model.session(..., tools=[...])"
            )
        ids = tool_result_ids(self.batch.model.tokenizer, output)
        self.book.results.add(call_id, ids)
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

"""The streaming session: talk to the model as audio arrives, one 80 ms frame at a time.

``Session.feed`` turns whatever audio has arrived into the frames that are now final and runs
the one frame step (``runtime.step``) on each, returning one :class:`FrameEvent` per frame:
the ids, the deltas of the assistant's text, the function channel and the user's words, the
turn marks and 1764 samples of speech. For any chunking of the input the events equal
:func:`generate.generate` on the same samples (ids, codes and transcript identical; audio
equal after the codec's fixed 6-sample delay).

A session is a batch of one conversation (``runtime.batch``): the code that steps many
conversations together steps this one.

Latency: frame ``k`` is computed by the ``feed`` that completes sample ``1280 k + 198`` (see
``audioin``); its RNNT tokens come out with it (the frame's greedy symbols run on the device,
up to ``max_symbols``), and its audio lags the offline waveform by the codec's 6 samples.

Host reads: one per frame. The TTS reads the frame's text id on the device, so a frame's
listening, LLM, speech and codec are queued as one graph, and its read carries the two ids,
the RNNT's tokens, its codes and its audio. When a ``feed`` completes several frames, each
frame is queued before the previous one is read; a barge-in is therefore a device flag carried
from frame to frame, so that frames queued before the host has read the one that ends it
follow it exactly.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

from ..errors import SessionError  # noqa: F401  (the public name: session.SessionError)
from ..noise import NoiseSource
from .batch import SessionBatch
from .events import FrameEvent


class Session:
    """One conversation: see the module docstring. Use it from one thread at a time (any
    thread); two sessions of one model may run in two threads."""

    def __init__(
        self,
        model,
        system_prompt: Optional[str] = None,
        *,
        seed: int = 0,
        noise: Optional[NoiseSource] = None,
        prompt: Optional[Sequence[int]] = None,
        max_seconds: Optional[float] = None,
        tools: Optional[Sequence[Any]] = None,
    ):
        self.model = model
        self.config = model.config
        self._batch = SessionBatch(model, max_sessions=1)
        self._handle = self._batch.open(
            system_prompt, seed=seed, noise=noise, prompt=prompt, max_seconds=max_seconds, tools=tools
        )
        h = self._handle
        self.prompt_ids, self.tools, self.seed, self.max_frames = h.prompt_ids, h.tools, h.seed, h.max_frames
        self.input_sample_rate, self.output_sample_rate = h.input_sample_rate, h.output_sample_rate
        self.samples_per_frame = h.samples_per_frame
        self.input_samples_per_frame = h.input_samples_per_frame

    def _events(self) -> List[FrameEvent]:
        return self._batch.step().get(self._handle, [])

    # -- input -----------------------------------------------------------------------------

    def feed(self, samples, sample_rate: Optional[int] = None) -> List[FrameEvent]:
        """Add mono audio (int or float PCM, at 16 kHz or ``sample_rate``); returns the events of
        every frame that became final with it."""
        self._handle.push(samples, sample_rate)
        return self._events()

    def silence(self, frames: int) -> List[FrameEvent]:
        """Advance the clock by ``frames`` 80 ms frames of silent input."""
        self._handle.silence(frames)
        return self._events()

    def finish(self, extra_decoding_seconds: float = 3.0) -> List[FrameEvent]:
        """End of the user's input: ``extra_decoding_seconds`` of trailing silence so the reply
        can finish, the frames that the end of input makes final, and the codec's tail."""
        self._handle.finish(extra_decoding_seconds)
        return self._events()

    # -- control ---------------------------------------------------------------------------

    def cancel(self) -> None:
        """Barge-in: from the next frame the text channel is fed the silence id (so nothing is
        spoken) until the model starts a new turn (its text head gives BOS)."""
        self._handle.cancel()

    def force(self, text_id: Optional[int] = None, function_id: Optional[int] = None) -> None:
        """Queue ids to feed back on the next frame instead of the heads' (None: the head's)."""
        self._handle.force(text_id, function_id)

    def add_tool_result(self, call_id: str, output: Any) -> int:
        """Queue a tool's result for the call ``call_id`` (see ``SessionHandle``); returns
        how many frames it takes."""
        return self._handle.add_tool_result(call_id, output)

    def reset(self) -> None:
        """Back to the state right after the system prompt (a new conversation)."""
        self._handle.reset()

    def close(self) -> None:
        self._handle.close()

    # -- facts -----------------------------------------------------------------------------

    @property
    def frames(self) -> int:
        """Frames handed out."""
        return self._handle.frames

    @property
    def speaking(self) -> bool:
        return self._handle.speaking

    @property
    def tool_frames(self) -> int:
        return self._handle.tool_frames

    @property
    def transcript_tokens(self) -> List[int]:
        return self._handle.transcript_tokens

    @property
    def finished(self) -> Optional[str]:
        return self._handle.finished

    @property
    def pending_samples(self) -> int:
        """16 kHz samples received that are not yet part of an emitted frame."""
        return self._handle.pending_samples

    def samples_needed(self, k: int) -> int:
        """16 kHz samples that must have arrived for frame ``k`` to be computed (1280 k + 199)."""
        return self._handle.samples_needed(k)

    @property
    def ready_before_slot_end(self) -> int:
        """How many samples before the end of its 80 ms slot a frame is computed (1081)."""
        return self._handle.ready_before_slot_end

    def memory_per_minute(self) -> dict:
        """Bytes a session's caches grow by per minute of conversation (see the README)."""
        return self._handle.memory_per_minute()

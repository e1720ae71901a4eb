"""What a live conversation hands out per frame (:class:`FrameEvent`), and the host bookkeeping
that makes it from the frame's read (:class:`EventBook`: text deltas, turns, tool calls and
results, forced ids, the end of the stream).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import numpy as np

from ...listen.textstream import TextStream, TranscriptStream
from .tools import ToolResultQueue


@dataclass
class FrameEvent:
    index: int
    text_id: int
    function_id: int
    codes: np.ndarray  # [Q] int32, after control-code replacement
    audio: np.ndarray  # float32: one frame of speech (+ the codec's tail on the last)
    text: str = ""
    function_text: str = ""
    transcript: str = ""
    turn: Optional[str] = None  # "start" / "end" of an assistant turn at this frame
    speaking: bool = False
    tool_calls: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    end: Optional[str] = None  # why the session ended at this frame ("max_seconds")
    forced: bool = False  # the ids fed back at this frame were forced (cancel / tool result)
    # True on the event finish() adds when the end of input makes no new frame: it carries what
    # the stream still held (the codec's last samples, the last transcript tokens and text) and
    # repeats the last frame's index and ids; its codes are empty (no new frame).
    remainder: bool = False


@dataclass
class Queued:
    """What the host knows of a frame when it queues it."""

    index: int
    forced: bool  # ids were forced by the caller (force, a tool result)
    injected: bool  # the function id is a tool result's token (not the model's)
    ends: bool  # the frame reaches the conversation's max_seconds
    tail: bool  # the last frame of the stream: it carries the codec's last samples


class EventBook:
    """One conversation's text, turn and tool bookkeeping."""

    def __init__(self, model, parser=None):
        self.model = model
        self.config = model.config
        self.parser = parser
        self.reset()

    def reset(self) -> None:
        cfg = self.config
        self.text = TextStream(self.model, cfg)
        self.function = TextStream(self.model, cfg)
        self.transcript = TranscriptStream(self.model.rnnt_vocabulary)
        self.transcript_tokens: List[int] = []
        self.speaking = False
        self.forced: List[Tuple[Optional[int], Optional[int]]] = []  # (text, function) per frame
        self.results = ToolResultQueue()
        self.tool_frames = 0  # frames whose function id was a tool result's token
        self.last_ids: Tuple[int, int] = (cfg.pad_token_id, cfg.pad_token_id)
        if self.parser is not None:
            self.parser.reset()

    def next_forced(self) -> Tuple[Optional[int], Optional[int], bool, bool]:
        """(text, function, forced by the caller, a tool result's token) for the next frame;
        None: the head's id."""
        if self.forced:
            text, function = self.forced.pop(0)
            return text, function, True, False
        token = self.results.next_forced()
        if token is not None:
            self.tool_frames += 1
            return self.config.pad_token_id, token, True, True
        return None, None, False, False

    def event(self, q: Queued, read) -> FrameEvent:
        """The event of a frame from its read (``step.FrameRead``)."""
        cfg = self.config
        text_id, function_id = read.text_id, read.function_id
        audio = np.concatenate([read.audio, read.tail]) if q.tail else read.audio
        event = FrameEvent(q.index, text_id, function_id, read.codes, audio)
        event.forced = q.forced or read.quiet
        for token in read.labels:
            self.transcript_tokens.append(token)
            event.transcript += self.transcript.add(token)
        # A barge-in holds after this frame unless the id fed back ended it (BOS).
        quiet = read.quiet and text_id != cfg.bos_token_id
        event.text = self.text.add(text_id)
        event.function_text = self.function.add(function_id)
        idle = (cfg.pad_token_id, cfg.silence_token_id, cfg.eos_token_id)
        if not self.speaking and text_id not in idle:
            self.speaking, event.turn = True, "start"
        elif self.speaking and (text_id == cfg.eos_token_id or quiet):
            self.speaking, event.turn = False, "end"
        event.speaking = self.speaking or event.turn == "end"
        if self.parser is not None and not q.injected:
            event.tool_calls, event.errors = self.parser.feed(function_id)
            for call in event.tool_calls:
                self.results.expect(call.call_id)
        if q.ends:
            event.end = "max_seconds"
        self.last_ids = (text_id, function_id)
        if q.tail:
            self.end_of_stream(event)
        return event

    def end_of_stream(self, event: FrameEvent) -> None:
        """What the streams still hold goes on the last event: a held-back character, an
        unfinished tool call."""
        event.text += self.text.flush()
        event.function_text += self.function.flush()
        if self.parser is not None:
            unfinished = self.parser.close()
            if unfinished:
                event.errors.append(unfinished)

    def remainder(self, index: int, tail: np.ndarray) -> FrameEvent:
        """The end of the stream when no frame is left to carry it (see FrameEvent.remainder)."""
        text_id, function_id = self.last_ids
        event = FrameEvent(index, text_id, function_id, np.zeros(0, np.int32), tail, remainder=True)
        event.speaking = self.speaking
        self.end_of_stream(event)
        return event

"""What a session hands out per frame, and the one host read that fills it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import mlx.core as mx
import numpy as np


@dataclass
class FrameEvent:
    index: int
    text_id: int
    function_id: int
    codes: np.ndarray  # [Q] int32, after control-code replacement
    audio: np.ndarray  # float32 at 22.05 kHz: 1764 samples (+ the codec's tail on the last)
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


def _output_parts(codes: mx.array, audio: mx.array) -> List[mx.array]:
    """A frame's codes and audio as int32 parts of one host read (the audio's float32 bits
    viewed as int32, so nothing is converted)."""
    return [codes.reshape(-1).astype(mx.int32), mx.view(audio.reshape(-1), mx.int32)]


def _read(words: mx.array) -> np.ndarray:
    """One host read of int32 words (``tolist``: the read the sync counters see)."""
    return np.array(words.tolist(), dtype=np.int32)


def _fill(event: "FrameEvent", read: np.ndarray, q: int) -> "FrameEvent":
    """Set ``event.codes`` / ``event.audio`` from the int32 words of ``_output_parts``."""
    event.codes = read[:q].astype(np.int32)
    event.audio = read[q:].view(np.float32)
    return event

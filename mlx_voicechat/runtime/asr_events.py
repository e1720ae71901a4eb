"""What a live transcription session hands out: per-frame :class:`TranscriptEvent` s built
from decoded (token, frame) pairs, the language once known, and the input checks; shared by
the recognizer's session (:mod:`.asr_session`) and a VoiceChat RNNT head's
(:mod:`.rnnt_transcription`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

from ..errors import VoiceChatError
from ..nets.rnnt import LANGUAGE_TAG
from .audioin import mono_float32
from .textstream import TranscriptStream


class TranscriptionError(VoiceChatError, ValueError):
    """A call a transcription session cannot take (bad audio, a finished session)."""


@dataclass
class TranscriptEvent:
    """One encoder frame (80 ms) whose decoding is complete: the tokens emitted on it and the
    text they add; ``language`` is the detected (or forced) language once known."""

    index: int
    tokens: List[int] = field(default_factory=list)
    text: str = ""
    language: Optional[str] = None
    final: bool = False  # the last event of the stream (from finish)
    remainder: bool = False  # (VoiceChat's FrameEvent field: always a frame of its own here)


def _mono_float32(samples) -> np.ndarray:
    return mono_float32(samples, TranscriptionError)


class TranscriptEvents:
    """Per-frame events from decoded (token, frame) pairs: a frame's event goes out once the
    decoder has passed it, with its text delta and the language once known (the first
    ``<xx-XX>`` tag emitted, else the forced language)."""

    def __init__(self, vocabulary, language: Optional[str] = None):
        self.vocabulary = vocabulary
        self.language = language
        self._stream = TranscriptStream(vocabulary)
        self._held = {}  # tokens of frames not complete yet
        self._done = 0  # frames handed out
        self._tagged = False

    def complete(self, tokens, frames, upto: int) -> List[TranscriptEvent]:
        """Events of frames ``[done, upto)``, given the tokens decoded since the last call."""
        by_frame = self._held
        for t, f in zip(tokens, frames):
            by_frame.setdefault(f, []).append(int(t))
        self._held = {f: ts for f, ts in by_frame.items() if f >= upto}
        events = []
        for f in range(self._done, upto):
            ev = TranscriptEvent(f, by_frame.get(f, []))
            for t in ev.tokens:
                ev.text += self._stream.add(t)
                piece = self.vocabulary[t] if 0 <= t < len(self.vocabulary) else ""
                if not self._tagged and LANGUAGE_TAG.match(piece):
                    # The first tag is the detected language; it wins over a forced one.
                    self.language, self._tagged = piece[1:-1], True
            ev.language = self.language
            events.append(ev)
        self._done = max(self._done, upto)
        return events


def close_events(events: List[TranscriptEvent], total: int, language) -> List[TranscriptEvent]:
    """Mark the stream's last event final (one is added when no frame is left to carry it)."""
    if not events:
        events = [TranscriptEvent(max(total - 1, 0), language=language)]
    events[-1].final = True
    return events

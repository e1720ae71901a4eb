"""What a live transcription session hands out: per-frame :class:`TranscriptEvent` s from
decoded (token, frame) pairs, for the recognizer's session and a VoiceChat RNNT head's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from ..errors import VoiceChatError
from .rnnt import WORD_BOUNDARY, read_piece
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


class PieceText:
    """The recognizer's text, one id at a time, as Transformers decodes it (its tokenizer's
    Metaspace decoder, SentencePiece's rule): special pieces and ``<xx-XX>`` tags dropped,
    ``▁`` a space, and one ``▁`` taken off the front of the first piece kept; nothing else is
    stripped (a trailing ``▁`` stays a space). The deltas add up to :func:`piece_text`."""

    def __init__(self, vocabulary: Sequence[str]):
        self.vocabulary = vocabulary
        self._started = False

    def add(self, token_id: int) -> str:
        piece, _ = read_piece(self.vocabulary, token_id)
        if piece is None:
            return ""
        if not self._started:
            self._started = True
            if piece.startswith(WORD_BOUNDARY):
                piece = piece[1:]
        return piece.replace(WORD_BOUNDARY, " ")


def piece_text(ids: Sequence[int], vocabulary: Sequence[str]) -> str:
    """The text of recognizer ids (see :class:`PieceText`)."""
    return "".join(map(PieceText(vocabulary).add, ids))


class TranscriptEvents:
    """Per-frame events from decoded (token, frame) pairs: a frame's event goes out once the
    decoder has passed it, with its text delta and the language once known (the first
    ``<xx-XX>`` tag emitted, else the forced language)."""

    def __init__(self, vocabulary, language: Optional[str] = None, pieces: bool = False):
        """``pieces``: the recognizer's text (:class:`PieceText`, Transformers' decoding);
        otherwise the RNNT head's words (:class:`~.textstream.TranscriptStream`)."""
        self.vocabulary = vocabulary
        self.language = language
        self._stream = PieceText(vocabulary) if pieces else TranscriptStream(vocabulary)
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
                _, tag = read_piece(self.vocabulary, t)
                if tag and not self._tagged:
                    # The first tag is the detected language; it wins over a forced one.
                    self.language, self._tagged = tag, True
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

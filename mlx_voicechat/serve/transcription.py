"""OpenAI Realtime *transcription* sessions (``session.type: "transcription"``, GA names), as a
socket-free state machine like :mod:`.protocol`: appends stream transcript deltas of the
current item, a commit completes it (with the detected language). Served by a Nemotron-3.5-ASR
recognizer or a VoiceChat checkpoint's RNNT head; no server VAD (the client commits).
"""

from __future__ import annotations

import json
from typing import List, Optional

import numpy as np

from .wire import (
    COMMIT_EMPTY,
    INPUT_RATES,
    MAX_EVENT_BYTES,
    MODEL_INPUT_RATE,
    Append,
    ClientProtocol,
    Command,
    Commit,
    Event,
    ProtocolError,
    Resampler,
    Start,
    _new_id,
    format_rate,
    invalid,
    session_of,
)

TRANSCRIPTION = "transcription"


def is_transcription_update(raw) -> bool:
    """Whether a client message is a ``session.update`` (or beta ``transcription_session
    .update``) asking for a transcription session."""
    if not isinstance(raw, str) or len(raw) > MAX_EVENT_BYTES:
        return False
    try:
        event = json.loads(raw)
    except (ValueError, RecursionError):
        return False
    kind = event.get("type") if isinstance(event, dict) else None
    session = event.get("session") if kind == "session.update" else None
    return kind == "transcription_session.update" or (
        isinstance(session, dict) and session.get("type") == TRANSCRIPTION
    )


class TranscriptionRealtime(ClientProtocol):
    """One transcription connection's protocol state; the transport owns it.

    ``receive(raw)`` -> ``(events, commands)``; ``transcript(events)`` -> delta events;
    ``completed(...)`` -> the item's end."""

    def __init__(self, model_id: str, *, language: Optional[str] = None):
        super().__init__(model_id)  # (once audio arrived, the rate and language are fixed)
        self.language = language
        self.transcription_model = model_id
        self.item: Optional[str] = None  # the item the audio goes to
        self.previous: Optional[str] = None
        self.text = ""  # the current item's transcript so far

    def session_object(self) -> dict:
        return {
            "type": TRANSCRIPTION,
            "object": "realtime.transcription_session",
            "id": self.session_id,
            "audio": {
                "input": {
                    "format": {"type": "audio/pcm", "rate": self.input_rate},
                    "transcription": {
                        "model": self.transcription_model,
                        "language": self.language,
                        "prompt": None,
                    },
                    "turn_detection": None,
                    "noise_reduction": None,
                }
            },
            "include": [],
        }

    def unhandled(self, type_: str) -> ProtocolError:
        return ProtocolError(
            "unsupported_event",
            f"{type_[:100]!r} is not served in a transcription session (it takes "
            "session.update, input_audio_buffer.append / commit / clear)",
            "type",
        )

    def _session_update(self, event: dict):
        beta = event["type"] == "transcription_session.update"
        session, a_in, _ = session_of(event)
        if not beta and session.get("type", TRANSCRIPTION) != TRANSCRIPTION:
            raise invalid(
                f"this connection is a transcription session; session.type {session.get('type')!r}"
                ' cannot be served on it (open a new connection for "realtime")',
                "session.type",
            )
        new = {}
        rate = format_rate(
            a_in.get("format"), session.get("input_audio_format"), INPUT_RATES, "input"
        )
        if rate is not None:
            new["input_rate"] = rate
        t = a_in.get("transcription", session.get("input_audio_transcription"))
        if t is not None:
            if not isinstance(t, dict):
                raise invalid("`transcription` must be an object", "session.audio.input")
            if t.get("language") is not None and not isinstance(t["language"], str):
                raise invalid("`language` must be a string", "language")
            new["language"] = t.get("language") or None
            if isinstance(t.get("model"), str):
                new["transcription_model"] = t["model"]
        td = a_in.get("turn_detection", session.get("turn_detection"))
        if td is not None:
            raise invalid(
                "turn_detection is not served: set it to null and end each item with "
                "input_audio_buffer.commit",
                "session.audio.input.turn_detection",
            )
        if self.started:
            changed = [
                k for k in ("input_rate", "language") if k in new and new[k] != getattr(self, k)
            ]
            if changed:
                raise ProtocolError(
                    "session_immutable",
                    f"audio has arrived; {', '.join(changed)} cannot change any more",
                    "session",
                )
        for k, v in new.items():
            setattr(self, k, v)
        name = "transcription_session.updated" if beta else "session.updated"
        return [self._event(name, session=self.session_object())], []

    def start(self) -> Start:
        self.started = True
        return Start(self.language)

    def _audio_begins(self) -> List[Command]:
        commands = super()._audio_begins()
        if self.item is None:
            self.item, self.text = _new_id("item"), ""
        return commands

    def _commit(self, event: dict):
        if self.item is None:
            raise ProtocolError(*COMMIT_EMPTY)
        committed = self._event(
            "input_audio_buffer.committed", item_id=self.item, previous_item_id=self.previous
        )
        # The resampler's last samples end this item; the next item starts a fresh one.
        tail = self._input(_EMPTY, last=True)
        self._input = Resampler(self.input_rate, MODEL_INPUT_RATE)
        commands: List[Command] = [Append(tail)] if tail.size else []
        return [committed], commands + [Commit()]

    HANDLERS = {
        "session.update": _session_update,
        "transcription_session.update": _session_update,
        "input_audio_buffer.append": ClientProtocol._append,
        "input_audio_buffer.commit": _commit,
        "input_audio_buffer.clear": ClientProtocol._clear,
    }

    # -- worker results --

    def transcript(self, events) -> List[Event]:
        """Delta events for the session's per-frame events (those with text)."""
        out = []
        for e in events:
            if e.text and self.item is not None:
                self.text += e.text
                out.append(self.transcript_delta(self.item, e.text))
        return out

    def completed(self, events, seconds: float, language: Optional[str]) -> List[Event]:
        """The committed item's last deltas and its ``completed`` event; the next audio opens
        a new item."""
        out = self.transcript(events)
        more = {"languages": [{"code": language}]} if language else {}
        out.append(self.transcript_completed(self.item, self.text, round(seconds, 3), **more))
        self.previous, self.item, self.text = self.item, None, ""
        return out


_EMPTY = np.zeros(0, np.float32)

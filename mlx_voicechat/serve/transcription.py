"""OpenAI Realtime *transcription* sessions (``session.type: "transcription"``, GA names), as a
socket-free state machine like :mod:`.protocol`: appends stream transcript deltas of the
current item, a commit completes it (with the detected language). Served by a Nemotron-3.5-ASR
recognizer or a VoiceChat checkpoint's RNNT head; no server VAD (the client commits).
"""

from __future__ import annotations

import json
import logging
from typing import List, Optional, Tuple

import numpy as np

from .wire import (
    DEFAULT_RATE,
    INPUT_RATES,
    MAX_EVENT_BYTES,
    MODEL_INPUT_RATE,
    Append,
    Clear,
    Command,
    Commit,
    Event,
    EventSource,
    ProtocolError,
    Resampler,
    Start,
    _new_id,
    decode_pcm16,
)

TRANSCRIPTION = "transcription"
log = logging.getLogger("mlx_voicechat.serve")


def is_transcription_update(raw) -> bool:
    """Whether a client message is a ``session.update`` (or beta ``transcription_session
    .update``) asking for a transcription session."""
    if not isinstance(raw, str) or len(raw) > MAX_EVENT_BYTES:
        return False
    try:
        event = json.loads(raw)
    except (ValueError, RecursionError):
        return False
    if not isinstance(event, dict):
        return False
    if event.get("type") == "transcription_session.update":
        return True
    session = event.get("session")
    return (
        event.get("type") == "session.update"
        and isinstance(session, dict)
        and session.get("type") == TRANSCRIPTION
    )


class TranscriptionRealtime(EventSource):
    """One transcription connection's protocol state; the transport owns it.

    ``receive(raw)`` -> ``(events, commands)``; ``transcript(events)`` -> delta events;
    ``completed(...)`` -> the item's end."""

    def __init__(self, model_id: str, *, language: Optional[str] = None):
        super().__init__()
        self.model_id = model_id
        self.session_id = _new_id("sess")
        self.input_rate = DEFAULT_RATE
        self.language = language
        self.transcription_model = model_id
        self.started = False  # audio arrived: the rate and language are fixed
        self._input: Optional[Resampler] = None
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

    def open(self) -> List[Event]:
        return [self._event("session.created", session=self.session_object())]

    # -- client events --

    def receive(self, raw) -> Tuple[List[Event], List[Command]]:
        def refused(code: str, message: str):
            return [self.error(code, message)], []

        if isinstance(raw, (bytes, bytearray)):
            return refused("invalid_event", "binary messages are not events; send JSON")
        if len(raw.encode("utf-8", "surrogatepass")) > MAX_EVENT_BYTES:
            message = f"the event is larger than {MAX_EVENT_BYTES} bytes (send smaller appends)"
            return refused("event_too_large", message)
        try:
            event = json.loads(raw)
        except (ValueError, RecursionError) as e:
            return refused("invalid_json", f"the event is not valid JSON: {e}")
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            return refused("invalid_event", "an event is a JSON object with a `type`")
        client_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
        type_ = event["type"]
        handler = _HANDLERS.get(type_)
        try:
            if handler is None:
                raise ProtocolError(
                    "unsupported_event",
                    f"{type_[:100]!r} is not served in a transcription session (it takes "
                    "session.update, input_audio_buffer.append / commit / clear)",
                    "type",
                )
            return handler(self, event)
        except ProtocolError as e:
            return [self.error(e.code, e.message, e.param, client_id)], []
        except Exception as e:  # a shape no check foresaw: answered, logged, not fatal
            log.exception("unexpected client event %.200r", raw)
            message = f"the {type_[:100]!r} event could not be handled ({type(e).__name__})"
            return [self.error("invalid_event", message, None, client_id)], []

    def _session_update(self, event: dict):
        beta = event["type"] == "transcription_session.update"
        session = event.get("session")
        if not isinstance(session, dict):
            raise ProtocolError("invalid_value", "`session` must be an object", "session")
        if not beta and session.get("type", TRANSCRIPTION) != TRANSCRIPTION:
            raise ProtocolError(
                "invalid_value",
                f"this connection is a transcription session; session.type {session.get('type')!r}"
                ' cannot be served on it (open a new connection for "realtime")',
                "session.type",
            )
        audio = session.get("audio") if isinstance(session.get("audio"), dict) else {}
        a_in = audio.get("input") if isinstance(audio.get("input"), dict) else {}
        new = {}
        fmt = a_in.get("format")
        if fmt is not None or session.get("input_audio_format") is not None:
            new["input_rate"] = _rate(fmt, session.get("input_audio_format"))
        t = a_in.get("transcription", session.get("input_audio_transcription"))
        if t is not None:
            if not isinstance(t, dict):
                raise ProtocolError(
                    "invalid_value", "`transcription` must be an object", "session.audio.input"
                )
            if t.get("language") is not None and not isinstance(t["language"], str):
                raise ProtocolError("invalid_value", "`language` must be a string", "language")
            new["language"] = t.get("language") or None
            if isinstance(t.get("model"), str):
                new["transcription_model"] = t["model"]
        td = a_in.get("turn_detection", session.get("turn_detection"))
        if td is not None:
            raise ProtocolError(
                "invalid_value",
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

    def _append(self, event: dict):
        samples = decode_pcm16(event.get("audio"))
        if samples.size == 0:
            return [], []
        commands: List[Command] = []
        if not self.started:
            self.started = True
            self._input = Resampler(self.input_rate, MODEL_INPUT_RATE)
            commands.append(Start(self.language))
        if self.item is None:
            self.item, self.text = _new_id("item"), ""
        resampled = self._input(samples)
        if resampled.size:
            commands.append(Append(resampled))
        return [], commands

    def _commit(self, event: dict):
        if self.item is None:
            raise ProtocolError(
                "input_audio_buffer_commit_empty", "nothing to commit: no audio has been appended"
            )
        committed = self._event(
            "input_audio_buffer.committed", item_id=self.item, previous_item_id=self.previous
        )
        # The resampler's last samples end this item; the next item starts a fresh one.
        tail = self._input(_EMPTY, last=True)
        self._input = Resampler(self.input_rate, MODEL_INPUT_RATE)
        commands: List[Command] = [Append(tail)] if tail.size else []
        return [committed], commands + [Commit()]

    def _clear(self, event: dict):
        return [self._event("input_audio_buffer.cleared")], [Clear()]

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


def _rate(ga, beta) -> int:
    if ga is not None:
        if not isinstance(ga, dict) or ga.get("type", "audio/pcm") != "audio/pcm":
            raise ProtocolError(
                "invalid_value",
                'the audio format must be {"type": "audio/pcm", "rate": ...}',
                "session.audio.input.format",
            )
        rate = ga.get("rate", DEFAULT_RATE)
        if isinstance(rate, bool) or rate not in INPUT_RATES:
            raise ProtocolError(
                "invalid_value",
                f"input rate {rate!r} is not served; use one of {', '.join(map(str, INPUT_RATES))}",
                "session.audio.input.format",
            )
        return int(rate)
    if beta != "pcm16":
        raise ProtocolError("invalid_value", f"audio format {beta!r} is not served; use pcm16")
    return DEFAULT_RATE


_EMPTY = np.zeros(0, np.float32)

_HANDLERS = {
    "session.update": TranscriptionRealtime._session_update,
    "transcription_session.update": TranscriptionRealtime._session_update,
    "input_audio_buffer.append": TranscriptionRealtime._append,
    "input_audio_buffer.commit": TranscriptionRealtime._commit,
    "input_audio_buffer.clear": TranscriptionRealtime._clear,
}

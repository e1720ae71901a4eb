"""The OpenAI Realtime protocol (GA names) for a full-duplex model, as a socket-free state machine.

Client events go in (:meth:`Realtime.receive`, one raw WebSocket text message at a time); server
events come out as dicts, and :class:`Command` objects tell the worker what to do with the
session (start it, feed samples, commit, clear, cancel). The worker's :class:`FrameEvent` lists go
back in through :meth:`Realtime.frames`, which derives the response lifecycle from the model's
own turns: a response opens at a frame whose ``turn`` is ``"start"`` and closes at ``"end"``.

Audio is resampled here, at the edges, with stateful soxr streams (no seam at chunk joins):
client PCM16 at the input rate (24 kHz by default, 16 kHz passed through) to the model's 16 kHz,
and the model's 22.05 kHz speech to the output rate (24 kHz by default, 22.05 kHz passed through).
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import logging
import secrets
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

MODEL_INPUT_RATE = 16000  # Hz, what the session listens at
MODEL_OUTPUT_RATE = 22050  # Hz, what the session speaks at
DEFAULT_RATE = 24000  # Hz, the Realtime protocol's PCM rate
INPUT_RATES = (24000, 16000)
OUTPUT_RATES = (24000, 22050)
MAX_EVENT_BYTES = 1 << 20  # a client event larger than this is refused
PCM16_SCALE = 32768.0
VOICES = ("Aria",)

Event = Dict[str, Any]
log = logging.getLogger("mlx_voicechat.serve")


# --- commands for the worker --------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    """Something the worker does with the conversation's session, in order."""


@dataclass(frozen=True)
class Start(Command):
    """Open the session (at the first audio); the instructions are fixed from here on."""

    instructions: Optional[str]


@dataclass(frozen=True)
class Append(Command):
    """Feed float32 samples at 16 kHz (``silence``: fed by the server's clock, not the client)."""

    samples: np.ndarray
    silence: bool = False


@dataclass(frozen=True)
class Commit(Command):
    """The user finished: feed trailing silence so that the reply can finish."""


@dataclass(frozen=True)
class Clear(Command):
    """Drop the client audio that has not been fed yet."""


@dataclass(frozen=True)
class Cancel(Command):
    """Barge-in: the model is made quiet from the next frame."""


class ProtocolError(Exception):
    """A client event that is answered with an ``error`` event; the session goes on."""

    def __init__(self, code: str, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


# --- audio at the edges -------------------------------------------------------------------


class Resampler:
    """Stateful mono float32 resampling; ``rate_in == rate_out`` passes samples through."""

    def __init__(self, rate_in: int, rate_out: int):
        self.rate_in, self.rate_out = int(rate_in), int(rate_out)
        self._stream = None
        if self.rate_in != self.rate_out:
            import soxr

            self._stream = soxr.ResampleStream(self.rate_in, self.rate_out, 1, dtype="float32")

    def __call__(self, samples: np.ndarray, last: bool = False) -> np.ndarray:
        samples = np.asarray(samples, dtype=np.float32)
        if self._stream is None:
            return samples
        return self._stream.resample_chunk(samples, last=last)


def decode_pcm16(audio: Any) -> np.ndarray:
    """Base64 PCM16 LE mono -> float32 in [-1, 1)."""
    if not isinstance(audio, str):
        raise ProtocolError("invalid_value", "`audio` must be a base64 string", "audio")
    try:
        raw = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError(
            "invalid_base64", "`audio` is not valid base64 (PCM16 LE mono expected)", "audio"
        ) from None
    if len(raw) % 2:
        raise ProtocolError(
            "invalid_audio",
            f"`audio` holds {len(raw)} bytes; PCM16 needs an even number",
            "audio",
        )
    return np.frombuffer(raw, dtype="<i2").astype(np.float32) / PCM16_SCALE


def encode_pcm16(samples: np.ndarray) -> str:
    """float32 -> base64 PCM16 LE mono (clipped, rounded)."""
    pcm = np.clip(np.rint(np.asarray(samples, np.float64) * 32767.0), -32768, 32767)
    return base64.b64encode(pcm.astype("<i2").tobytes()).decode("ascii")


# --- the state machine --------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


# Client event names this server acts on; other known names are answered as unsupported.
_UNSUPPORTED = {
    "conversation.item.delete": "this server keeps no editable conversation history",
    "conversation.item.retrieve": "this server keeps no conversation history to retrieve",
    "output_audio_buffer.clear": "output_audio_buffer.clear is for WebRTC / SIP connections",
    "transcription_session.update": "this server runs realtime, not transcription, sessions",
}


class Realtime:
    """One connection's protocol state. Not thread-safe; the transport owns it.

    ``receive(raw)`` -> ``(events, commands)``; ``frames(frame_events)`` -> events."""

    def __init__(self, model_id: str = "nemotron-voicechat", *, voice: str = "Aria"):
        self.model_id = model_id
        self.session_id = _new_id("sess")
        self.conversation_id = _new_id("conv")
        self._events = itertools.count(1)
        self._event_prefix = "event_" + secrets.token_hex(6)
        self.instructions: Optional[str] = None
        self.voice = voice
        self.input_rate = DEFAULT_RATE
        self.output_rate = DEFAULT_RATE
        self.transcription = True
        self.started = False  # the first audio arrived: the session is immutable from here on
        self.frames_seen = 0
        self.responses_done = 0
        self._input: Optional[Resampler] = None
        # the open assistant response
        self.response: Optional[dict] = None
        self._output: Optional[Resampler] = None
        self._last_item: Optional[str] = None
        self._assistant_items: Dict[str, int] = {}  # item id -> audio ms sent
        # the open user item (RNNT transcript of the user's words)
        self._user_item: Optional[str] = None
        self._user_text: List[str] = []
        self._user_frames = 0

    # -- helpers --

    def _event(self, type_: str, **fields) -> Event:
        return {"type": type_, "event_id": f"{self._event_prefix}_{next(self._events)}", **fields}

    def error(
        self,
        code: str,
        message: str,
        param: Optional[str] = None,
        client_event_id: Optional[str] = None,
        type_: str = "invalid_request_error",
    ) -> Event:
        return self._event(
            "error",
            error={
                "type": type_,
                "code": code,
                "message": message,
                "param": param,
                "event_id": client_event_id,
            },
        )

    def session_object(self) -> dict:
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": self.session_id,
            "model": self.model_id,
            "output_modalities": ["audio"],
            "instructions": self.instructions or "",
            "audio": {
                "input": {
                    "format": {"type": "audio/pcm", "rate": self.input_rate},
                    "transcription": {"model": "rnnt"} if self.transcription else None,
                    "turn_detection": None,  # the model takes turns itself
                    "noise_reduction": None,
                },
                "output": {
                    "format": {"type": "audio/pcm", "rate": self.output_rate},
                    "voice": self.voice,
                    "speed": 1.0,
                },
            },
            "tools": [],
            "tool_choice": "auto",
            "max_output_tokens": "inf",
        }

    def open(self) -> List[Event]:
        """The events sent when the connection opens."""
        return [self._event("session.created", session=self.session_object())]

    # -- client events --

    def receive(self, raw) -> Tuple[List[Event], List[Command]]:
        """One client WebSocket message -> (server events, worker commands)."""
        if isinstance(raw, (bytes, bytearray)):
            return [
                self.error("invalid_event", "binary messages are not events; send JSON text")
            ], []
        size = len(raw) if raw.isascii() else len(raw.encode("utf-8", "surrogatepass"))
        if size > MAX_EVENT_BYTES:
            return [
                self.error(
                    "event_too_large",
                    f"the event is {size} bytes; at most {MAX_EVENT_BYTES} are accepted "
                    "(send audio in smaller appends)",
                )
            ], []
        try:
            event = json.loads(raw)
        except (ValueError, RecursionError) as e:
            return [self.error("invalid_json", f"the event is not valid JSON: {e}")], []
        if not isinstance(event, dict):
            return [self.error("invalid_event", "an event must be a JSON object")], []
        client_id = event.get("event_id")
        if not isinstance(client_id, str):
            client_id = None
        type_ = event.get("type")
        if not isinstance(type_, str):
            return [
                self.error("invalid_event", "the event has no string `type`", "type", client_id)
            ], []
        handler = _HANDLERS.get(type_)
        try:
            if handler is not None:
                return handler(self, event)
            if type_ in _UNSUPPORTED:
                raise ProtocolError("unsupported_event", f"{type_}: {_UNSUPPORTED[type_]}", "type")
            raise ProtocolError("unknown_event", f"unknown event type {type_[:100]!r}", "type")
        except ProtocolError as e:
            return [self.error(e.code, e.message, e.param, client_id)], []
        except Exception as e:  # a shape no check above foresaw: answered, logged, not fatal
            log.exception("unexpected client event %.200r", raw)
            message = f"the {type_[:100]!r} event could not be handled ({type(e).__name__})"
            return [self.error("invalid_event", message, None, client_id)], []

    def _session_update(self, event: dict):
        session = event.get("session")
        if not isinstance(session, dict):
            raise ProtocolError("invalid_value", "`session` must be an object", "session")
        kind = session.get("type", "realtime")
        if kind != "realtime":
            raise ProtocolError(
                "invalid_value",
                f'session.type {kind!r} is not served; use "realtime"',
                "session.type",
            )
        audio = session.get("audio") if isinstance(session.get("audio"), dict) else {}
        a_in = audio.get("input") if isinstance(audio.get("input"), dict) else {}
        a_out = audio.get("output") if isinstance(audio.get("output"), dict) else {}

        new = {}
        if "instructions" in session and session["instructions"] is not None:
            if not isinstance(session["instructions"], str):
                raise ProtocolError(
                    "invalid_value", "`instructions` must be a string", "session.instructions"
                )
            new["instructions"] = session["instructions"] or None
        voice = a_out.get("voice", session.get("voice"))  # GA, then beta's flat `voice`
        if voice is not None:
            name = voice.get("id") if isinstance(voice, dict) else voice
            if name not in VOICES:
                raise ProtocolError(
                    "invalid_value",
                    f"voice {name!r} is not available; this model speaks as {', '.join(VOICES)}",
                    "session.audio.output.voice",
                )
            new["voice"] = name
        rate = _format_rate(
            a_in.get("format"), session.get("input_audio_format"), INPUT_RATES, "input"
        )
        if rate is not None:
            new["input_rate"] = rate
        rate = _format_rate(
            a_out.get("format"), session.get("output_audio_format"), OUTPUT_RATES, "output"
        )
        if rate is not None:
            new["output_rate"] = rate
        modalities = session.get("output_modalities", session.get("modalities"))
        if modalities is not None:
            if not isinstance(modalities, list) or "audio" not in modalities:
                raise ProtocolError(
                    "invalid_value",
                    "this model always answers in audio (with its transcript): output_modalities "
                    'must include "audio"',
                    "session.output_modalities",
                )
        tools = session.get("tools")
        if tools:
            raise ProtocolError(
                "tools_unsupported", "tools are not served by this server yet", "session.tools"
            )
        if "transcription" in a_in or "input_audio_transcription" in session:
            t = a_in.get("transcription", session.get("input_audio_transcription"))
            new["transcription"] = t is not None

        if self.started:
            fixed = ("instructions", "voice", "input_rate", "output_rate")
            changed = [k for k in fixed if k in new and new[k] != getattr(self, k)]
            if changed:
                names = {"input_rate": "audio.input.format", "output_rate": "audio.output.format"}
                raise ProtocolError(
                    "session_immutable",
                    "the session has started (audio arrived); "
                    + ", ".join(names.get(k, k) for k in changed)
                    + " cannot change any more",
                    "session." + names.get(changed[0], changed[0]),
                )
        for k, v in new.items():
            setattr(self, k, v)
        return [self._event("session.updated", session=self.session_object())], []

    def _append(self, event: dict):
        samples = decode_pcm16(event.get("audio"))
        if samples.size == 0:
            return [], []
        commands: List[Command] = []
        if not self.started:
            self.started = True
            self._input = Resampler(self.input_rate, MODEL_INPUT_RATE)
            commands.append(Start(self.instructions))
        resampled = self._input(samples)
        if resampled.size:
            commands.append(Append(resampled))
        return [], commands

    def _commit(self, event: dict):
        if not self.started:
            raise ProtocolError(
                "input_audio_buffer_commit_empty", "nothing to commit: no audio has been appended"
            )
        events = []
        item = self._user_item
        if item is None:
            events += self._open_user_item()
            item = self._user_item
        events.append(
            self._event(
                "input_audio_buffer.committed", item_id=item, previous_item_id=self._prev(item)
            )
        )
        return events, [Commit()]

    def _clear(self, event: dict):
        return [self._event("input_audio_buffer.cleared")], [Clear()]

    def _response_create(self, event: dict):
        open_id = self.response["id"] if self.response else None
        return [
            self._event(
                "x-voicechat.response.create",
                accepted=True,
                response_id=open_id,
                message=(
                    "this full-duplex model decides itself when to speak: a response opens when it "
                    "starts a turn; response.create does not start one"
                ),
            )
        ], []

    def _response_cancel(self, event: dict):
        if self.response is None:
            raise ProtocolError(
                "response_cancel_not_active", "there is no response in progress to cancel"
            )
        wanted = event.get("response_id")
        if wanted is not None and wanted != self.response["id"]:
            raise ProtocolError(
                "invalid_value",
                f"response {wanted!r} is not the response in progress",
                "response_id",
            )
        return self._close_response("cancelled"), [Cancel()]

    def _item_create(self, event: dict):
        item = event.get("item")
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "function_call_output":
            raise ProtocolError(
                "tools_unsupported", "tool results are not served by this server yet", "item.type"
            )
        raise ProtocolError(
            "unsupported_event",
            "this model only hears audio: send input_audio_buffer.append instead of "
            f"conversation.item.create ({kind!r} items)",
            "item.type",
        )

    def _item_truncate(self, event: dict):
        item_id = event.get("item_id")
        if not isinstance(item_id, str) or item_id not in self._assistant_items:
            raise ProtocolError("invalid_value", f"no assistant item {item_id!r}", "item_id")
        end_ms = event.get("audio_end_ms")
        if not isinstance(end_ms, int) or isinstance(end_ms, bool) or end_ms < 0:
            raise ProtocolError(
                "invalid_value", "`audio_end_ms` must be an integer >= 0", "audio_end_ms"
            )
        if end_ms > self._assistant_items[item_id]:
            raise ProtocolError(
                "invalid_value",
                f"audio_end_ms {end_ms} is past the {self._assistant_items[item_id]} ms sent",
                "audio_end_ms",
            )
        # The model already heard itself say it; the client's playback position is recorded only.
        return [
            self._event(
                "conversation.item.truncated", item_id=item_id, content_index=0, audio_end_ms=end_ms
            )
        ], []

    # -- items --

    def _prev(self, item_id: str) -> Optional[str]:
        return None if self._last_item == item_id else self._last_item

    def _add_item(self, item: dict) -> Event:
        event = self._event("conversation.item.added", previous_item_id=self._last_item, item=item)
        self._last_item = item["id"]
        return event

    def _open_user_item(self) -> List[Event]:
        self._user_item = _new_id("item")
        self._user_text = []
        self._user_frames = 0
        item = {
            "id": self._user_item,
            "object": "realtime.item",
            "type": "message",
            "role": "user",
            "status": "in_progress",
            "content": [{"type": "input_audio", "transcript": None}],
        }
        return [self._add_item(item)]

    def close_user_item(self) -> List[Event]:
        """Complete the user's item (a turn of the model, or the end of a commit's trailing
        silence): its transcript so far becomes final."""
        if self._user_item is None:
            return []
        item_id, text = self._user_item, "".join(self._user_text)
        self._user_item = None
        item = {
            "id": item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "user",
            "status": "completed",
            "content": [{"type": "input_audio", "transcript": text}],
        }
        seconds = round(self._user_frames * 0.08, 2)
        events = []
        if self.transcription:
            events.append(
                self._event(
                    "conversation.item.input_audio_transcription.completed",
                    item_id=item_id,
                    content_index=0,
                    transcript=text,
                    usage={"type": "duration", "seconds": seconds},
                )
            )
        events.append(self._event("conversation.item.done", previous_item_id=None, item=item))
        return events

    # -- the model's frames --

    def frames(self, frame_events: Sequence[Any]) -> List[Event]:
        """Server events for frames the session emitted (:class:`FrameEvent` objects)."""
        out: List[Event] = []
        for f in frame_events:
            self.frames_seen += 1
            if self._user_item is not None:
                self._user_frames += 1
            if f.transcript and self.transcription:
                if self._user_item is None:
                    out += self._open_user_item()
                self._user_text.append(f.transcript)
                out.append(
                    self._event(
                        "conversation.item.input_audio_transcription.delta",
                        item_id=self._user_item,
                        content_index=0,
                        delta=f.transcript,
                    )
                )
            if f.turn == "start":
                if self.response is not None:  # a start without an end: close the old one
                    out += self._close_response("completed")
                out += self.close_user_item()
                out += self._open_response()
            if self.response is not None:
                out += self._speak(f)
                if f.turn == "end":
                    out += self._close_response("completed")
        return out

    def _open_response(self) -> List[Event]:
        response_id, item_id = _new_id("resp"), _new_id("item")
        self._output = Resampler(MODEL_OUTPUT_RATE, self.output_rate)
        self.response = {
            "id": response_id,
            "item_id": item_id,
            "transcript": [],
            "samples": 0,
        }
        item = {
            "id": item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        self._assistant_items[item_id] = 0
        ref = dict(response_id=response_id, item_id=item_id, output_index=0, content_index=0)
        return [
            self._event("response.created", response=self._response_object("in_progress", [])),
            self._event(
                "response.output_item.added", response_id=response_id, output_index=0, item=item
            ),
            self._add_item(item),
            self._event(
                "response.content_part.added", part={"type": "audio", "transcript": ""}, **ref
            ),
        ]

    def _ref(self) -> dict:
        r = self.response
        return dict(response_id=r["id"], item_id=r["item_id"], output_index=0, content_index=0)

    def _speak(self, f) -> List[Event]:
        r = self.response
        out = []
        audio = self._output(f.audio, last=f.turn == "end")
        r["samples"] += audio.size
        self._assistant_items[r["item_id"]] = int(r["samples"] * 1000 // self.output_rate)
        out.append(
            self._event("response.output_audio.delta", delta=encode_pcm16(audio), **self._ref())
        )
        if f.text:
            r["transcript"].append(f.text)
            out.append(
                self._event("response.output_audio_transcript.delta", delta=f.text, **self._ref())
            )
        return out

    def _response_object(self, status: str, output: list, details: Optional[dict] = None) -> dict:
        r = self.response
        return {
            "id": r["id"],
            "object": "realtime.response",
            "status": status,
            "status_details": details,
            "conversation_id": self.conversation_id,
            "output": output,
            "output_modalities": ["audio"],
            "audio": {
                "output": {
                    "format": {"type": "audio/pcm", "rate": self.output_rate},
                    "voice": self.voice,
                }
            },
            "max_output_tokens": "inf",
            "metadata": None,
            "usage": None,
        }

    def _close_response(self, status: str) -> List[Event]:
        r = self.response
        transcript = "".join(r["transcript"])
        ref = self._ref()
        item = {
            "id": r["item_id"],
            "object": "realtime.item",
            "type": "message",
            "role": "assistant",
            "status": "completed" if status == "completed" else "incomplete",
            "content": [{"type": "output_audio", "transcript": transcript}],
        }
        details = None
        if status == "cancelled":
            details = {"type": "cancelled", "reason": "client_cancelled"}
        events = [
            self._event("response.output_audio.done", **ref),
            self._event("response.output_audio_transcript.done", transcript=transcript, **ref),
            self._event(
                "response.content_part.done",
                part={"type": "audio", "transcript": transcript},
                **ref,
            ),
            self._event(
                "response.output_item.done", response_id=r["id"], output_index=0, item=item
            ),
            self._event("conversation.item.done", previous_item_id=None, item=item),
            self._event("response.done", response=self._response_object(status, [item], details)),
        ]
        self.response = None
        self._output = None
        self.responses_done += 1
        return events

    # -- transport notices --

    def commit_done(self) -> List[Event]:
        """The trailing silence of a commit has been fed: the user's item is complete."""
        return self.close_user_item()

    def stats(self, **fields) -> Event:
        """A vendor event with the transport's figures (lag, frames, real-time factor)."""
        return self._event("x-voicechat.stats", frames=self.frames_seen, **fields)


def _format_rate(ga, beta, rates: Tuple[int, ...], which: str) -> Optional[int]:
    """The PCM rate of a GA ``{type, rate}`` format or a beta ``"pcm16"`` string (24 kHz)."""
    param = f"session.audio.{which}.format"
    if ga is not None:
        if not isinstance(ga, dict):
            raise ProtocolError("invalid_value", f"`{param}` must be an object", param)
        kind = ga.get("type", "audio/pcm")
        if kind != "audio/pcm":
            raise ProtocolError(
                "invalid_value", f'audio format {kind!r} is not served; use "audio/pcm"', param
            )
        rate = ga.get("rate", DEFAULT_RATE)
        if rate not in rates or isinstance(rate, bool):
            raise ProtocolError(
                "invalid_value",
                f"{which} rate {rate!r} is not served; use one of {', '.join(map(str, rates))}",
                param,
            )
        return int(rate)
    if beta is not None:
        if beta != "pcm16":
            raise ProtocolError(
                "invalid_value",
                f'audio format {beta!r} is not served; use "pcm16"',
                f"session.{which}_audio_format",
            )
        return DEFAULT_RATE
    return None


_HANDLERS = {
    "session.update": Realtime._session_update,
    "input_audio_buffer.append": Realtime._append,
    "input_audio_buffer.commit": Realtime._commit,
    "input_audio_buffer.clear": Realtime._clear,
    "response.create": Realtime._response_create,
    "response.cancel": Realtime._response_cancel,
    "conversation.item.create": Realtime._item_create,
    "conversation.item.truncate": Realtime._item_truncate,
}

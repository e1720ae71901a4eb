"""What crosses the protocol's edges: the commands the worker runs, the errors a client event
gets, PCM16 audio in and out (resampled statefully, so chunk joins leave no seam), the check
that a client's text is text, and the ids of the server's events (:class:`EventSource`)."""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import logging
import secrets
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ..audio.mel import Resampler  # noqa: F401  (re-exported: the edges resample with it)
from ..config.voicechat import VoiceChatConfig
from ..nemotron_voicechat.runtime.tools import ToolError, normalize_tools

# The session's rates and frame, as the model's config defines them
MODEL_INPUT_RATE = VoiceChatConfig.input_sample_rate  # Hz, what the session listens at
MODEL_OUTPUT_RATE = VoiceChatConfig.output_sample_rate  # Hz, what the session speaks at
FRAME_SECONDS = VoiceChatConfig.frame_duration
SAMPLES_PER_FRAME = round(FRAME_SECONDS * MODEL_INPUT_RATE)  # the session's input frame
DEFAULT_RATE = 24000  # Hz, the Realtime protocol's PCM rate
INPUT_RATES = (24000, 16000)
OUTPUT_RATES = (24000, 22050)
MAX_EVENT_BYTES = 1 << 20  # a client event larger than this is refused
COMMIT_EMPTY = ("input_audio_buffer_commit_empty", "nothing to commit: no audio has been appended")
PCM16_SCALE = 32768.0

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
    tools: tuple = ()


@dataclass(frozen=True)
class ToolResult(Command):
    """A client's ``function_call_output``: inject it into the model's function channel."""

    call_id: str
    output: str


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


def invalid(message: str, param: Optional[str] = None) -> ProtocolError:
    """The error of a client event that holds a value the server cannot take."""
    return ProtocolError("invalid_value", message, param)


# --- audio at the edges -------------------------------------------------------------------


def decode_pcm16(audio: Any) -> np.ndarray:
    """Base64 PCM16 LE mono -> float32 in [-1, 1)."""
    if not isinstance(audio, str):
        raise invalid("`audio` must be a base64 string", "audio")
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
    """float32 -> base64 PCM16 LE mono: ``x * 32767`` rounded to the nearest integer (halves
    to even), then clipped to [-32768, 32767].

    NaN and infinite samples raise ``ValueError``, as ``save_wav`` refuses them: the model's
    speech is always finite, so one that is not is a bug to report (a live connection ends with
    ``server_error``), not audio to send as silence or a full-scale click."""
    x = np.asarray(samples, np.float64)
    finite = np.isfinite(x)
    if not finite.all():
        bad = int(x.size - np.count_nonzero(finite))
        raise ValueError(f"audio to encode as PCM16 has {bad} NaN or infinite samples of {x.size}")
    pcm = np.clip(np.rint(x * 32767.0), -32768, 32767)
    return base64.b64encode(pcm.astype("<i2").tobytes()).decode("ascii")


def modalities_of(session: dict) -> None:
    """Refuses ``output_modalities`` without audio: this model always speaks."""
    modalities = session.get("output_modalities", session.get("modalities"))
    if modalities is not None and (not isinstance(modalities, list) or "audio" not in modalities):
        raise invalid(
            "this model always answers in audio (with its transcript): output_modalities "
            'must include "audio"',
            "session.output_modalities",
        )


def tools_of(session: dict) -> Optional[List[dict]]:
    """``session.tools`` checked (:func:`~..runtime.tools.normalize_tools`), or None."""
    if session.get("tools") is None:
        return None
    try:
        return normalize_tools(session["tools"])
    except ToolError as e:
        raise invalid(str(e), "session.tools") from None


def _object(value) -> dict:
    return value if isinstance(value, dict) else {}


def session_of(event: dict) -> Tuple[dict, dict, dict]:
    """A ``session.update``'s ``session`` and its ``audio.input`` / ``audio.output`` ({} if
    absent)."""
    session = event.get("session")
    if not isinstance(session, dict):
        raise invalid("`session` must be an object", "session")
    audio = _object(session.get("audio"))
    return session, _object(audio.get("input")), _object(audio.get("output"))


def format_rate(ga, beta, rates: Tuple[int, ...], which: str) -> Optional[int]:
    """The PCM rate of a GA ``{type, rate}`` format or a beta ``"pcm16"`` string (24 kHz)."""
    param = f"session.audio.{which}.format"
    if ga is not None:
        if not isinstance(ga, dict):
            raise invalid(f"`{param}` must be an object", param)
        kind = ga.get("type", "audio/pcm")
        if kind != "audio/pcm":
            raise invalid(f'audio format {kind!r} is not served; use "audio/pcm"', param)
        rate = ga.get("rate", DEFAULT_RATE)
        if rate not in rates or isinstance(rate, bool):
            raise invalid(
                f"{which} rate {rate!r} is not served; use one of {', '.join(map(str, rates))}",
                param,
            )
        return int(rate)
    if beta is not None:
        if beta != "pcm16":
            raise invalid(
                f'audio format {beta!r} is not served; use "pcm16"', f"session.{which}_audio_format"
            )
        return DEFAULT_RATE
    return None


# --- text ----------------------------------------------------------------------------------


def utf8(s: str) -> bool:
    """Whether ``s`` can be UTF-8 (JSON lets an escape make a lone surrogate)."""
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def not_utf8(event) -> Optional[str]:
    """The path (``session.tools[0].name``) of the first key or string of ``event`` that
    cannot be UTF-8 (JSON lets an escape make a lone surrogate), or None."""
    stack = [("", event)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not utf8(value):
                return path[:200] or "(the event)"
        elif isinstance(value, dict):
            for k, v in reversed(list(value.items())):
                if not utf8(k):
                    return f"{path}.(a key)" if path else "(a key)"
                stack.append((f"{path}.{k}" if path else k, v))
        elif isinstance(value, list):
            stack += [(f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value)))]
    return None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


class EventSource:
    """The server events of one connection's protocol (duplex or transcription): each gets an
    ``event_id`` of its own (a random prefix per connection, then a count)."""

    def __init__(self):
        self._events = itertools.count(1)
        self._event_prefix = "event_" + secrets.token_hex(6)
        self.peer = ""  # the client's address, for the log (set by the transport)

    def _event(self, type_: str, **fields) -> Event:
        return {"type": type_, "event_id": f"{self._event_prefix}_{next(self._events)}", **fields}

    def transcript_delta(self, item_id: str, delta: str) -> Event:
        """Words of the user's item ``item_id``, as the recognizer has them."""
        return self._event(
            "conversation.item.input_audio_transcription.delta",
            item_id=item_id,
            content_index=0,
            delta=delta,
        )

    def transcript_completed(self, item_id: str, text: str, seconds: float, **more) -> Event:
        """The whole transcript of the user's item ``item_id`` (``seconds`` of audio)."""
        return self._event(
            "conversation.item.input_audio_transcription.completed",
            item_id=item_id,
            content_index=0,
            transcript=text,
            usage={"type": "duration", "seconds": seconds},
            **more,
        )

    def error(
        self,
        code: str,
        message: str,
        param: Optional[str] = None,
        client_event_id: Optional[str] = None,
        type_: str = "invalid_request_error",
    ) -> Event:
        """An ``error`` event, logged (once, here, where every error event is made) with the
        connection and the reason, so that an operator sees why a client failed."""
        log.warning(
            "%s%s: error event %s%s: %s",
            getattr(self, "session_id", self._event_prefix),
            f" ({self.peer})" if self.peer else "",
            code,
            f" ({param})" if param else "",
            message[:300],
        )
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


class ClientProtocol(EventSource):
    """What both kinds of session (duplex :class:`.protocol.Realtime`, :class:`.transcription
    .TranscriptionRealtime`) do with a client's events: ``receive(raw)`` -> ``(events,
    commands)`` through the subclass's ``HANDLERS``, and the input audio buffer's append (PCM16
    resampled to the model's rate; the first audio opens the model's session through the
    subclass's ``start()``) and clear. A subclass also gives its ``session_object()``."""

    HANDLERS: Dict[str, Callable] = {}  # event type -> handler(self, event)

    def __init__(self, model_id: str):
        super().__init__()
        self.model_id = model_id
        self.session_id = _new_id("sess")
        self.input_rate = DEFAULT_RATE
        self.started = False  # the first audio arrived
        self._input: Optional[Resampler] = None

    def open(self, vendor: Optional[dict] = None) -> List[Event]:
        """The events sent when the connection opens; ``vendor`` fields go in ``x-voicechat``."""
        created = self._event("session.created", session=self.session_object())
        if vendor:
            created["x-voicechat"] = dict(vendor)
        return [created]

    def unhandled(self, type_: str) -> ProtocolError:
        """The error for an event type that has no handler here."""
        return ProtocolError("unknown_event", f"unknown event type {type_[:100]!r}", "type")

    def receive(self, raw) -> Tuple[List[Event], List[Command]]:
        """One client WebSocket message -> (server events, worker commands)."""
        client_id = None

        def refused(code: str, message: str, param: Optional[str] = None):
            return [self.error(code, message, param, client_id)], []

        if isinstance(raw, (bytes, bytearray)):
            return refused("invalid_event", "binary messages are not events; send JSON text")
        size = len(raw) if raw.isascii() else len(raw.encode("utf-8", "surrogatepass"))
        if size > MAX_EVENT_BYTES:
            message = f"the event is {size} bytes; at most {MAX_EVENT_BYTES} are accepted"
            return refused("event_too_large", message + " (send audio in smaller appends)")
        try:
            event = json.loads(raw)
        except (ValueError, RecursionError) as e:
            return refused("invalid_json", f"the event is not valid JSON: {e}")
        if not isinstance(event, dict):
            return refused("invalid_event", "an event must be a JSON object")
        client_id = event.get("event_id")
        if not isinstance(client_id, str) or not utf8(client_id):
            client_id = None
        where = not_utf8(event) if "\\u" in raw or not raw.isascii() else None
        if where is not None:
            message = (
                f"`{where}` holds a lone surrogate (a \\ud800-\\udfff escape that is not half of "
                "a pair): it is not text"
            )
            return refused("invalid_value", message, where)
        type_ = event.get("type")
        if not isinstance(type_, str):
            return refused("invalid_event", "the event has no string `type`", "type")
        handler = self.HANDLERS.get(type_)
        try:
            if handler is None:
                raise self.unhandled(type_)
            return handler(self, event)
        except ProtocolError as e:
            return refused(e.code, e.message, e.param)
        except Exception as e:  # a shape no check above foresaw: answered, logged, not fatal
            shown = "(not shown: it has headers)" if '"headers"' in raw else raw  # secrets
            log.exception("unexpected client event %.200r", shown)
            message = f"the {type_[:100]!r} event could not be handled ({type(e).__name__})"
            return refused("invalid_event", message)

    def _audio_begins(self) -> List[Command]:
        """The commands before a client's audio: the first opens the model's session."""
        if self.started:
            return []
        self._input = Resampler(self.input_rate, MODEL_INPUT_RATE)
        return [self.start()]

    def _append(self, event: dict):
        samples = decode_pcm16(event.get("audio"))
        if samples.size == 0:
            return [], []
        commands = self._audio_begins()
        resampled = self._input(samples)
        if resampled.size:
            commands.append(Append(resampled))
        return [], commands

    def _clear(self, event: dict):
        return [self._event("input_audio_buffer.cleared")], [Clear()]

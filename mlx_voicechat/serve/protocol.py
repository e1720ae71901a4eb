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

import json
import logging
from typing import Dict, List, Optional, Tuple

from ..runtime.request import resolve_system_prompt
from ..runtime.tools import ToolError, normalize_tools
from .responses import Responses
from .wire import (  # noqa: F401  (re-exported: the transport and the tests import them here)
    DEFAULT_RATE,
    INPUT_RATES,
    MAX_EVENT_BYTES,
    MODEL_INPUT_RATE,
    MODEL_OUTPUT_RATE,
    OUTPUT_RATES,
    PCM16_SCALE,
    VOICES,
    Append,
    Cancel,
    Clear,
    Command,
    Commit,
    Event,
    EventSource,
    ProtocolError,
    Resampler,
    Start,
    ToolResult,
    _new_id,
    decode_pcm16,
    encode_pcm16,
    not_utf8,
    utf8,
)

log = logging.getLogger("mlx_voicechat.serve")

# --- the state machine --------------------------------------------------------------------



# Client event names this server acts on; other known names are answered as unsupported.
_UNSUPPORTED = {
    "conversation.item.delete": "this server keeps no editable conversation history",
    "conversation.item.retrieve": "this server keeps no conversation history to retrieve",
    "output_audio_buffer.clear": "output_audio_buffer.clear is for WebRTC / SIP connections",
    "transcription_session.update": "this server runs realtime, not transcription, sessions",
}


class Realtime(Responses, EventSource):
    """One connection's protocol state. Not thread-safe; the transport owns it.

    ``receive(raw)`` -> ``(events, commands)``; ``frames(frame_events)`` -> events."""

    def __init__(
        self,
        model_id: str = "nemotron-voicechat",
        *,
        voice: str = "Aria",
        max_instructions_chars: Optional[int] = None,
    ):
        super().__init__()
        self.model_id = model_id
        self.max_instructions_chars = max_instructions_chars
        self.session_id = _new_id("sess")
        self.conversation_id = _new_id("conv")
        self.instructions: Optional[str] = None
        self.tools: List[dict] = []
        self._calls: Dict[str, dict] = {}  # call_id -> function_call item, until answered
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

    def session_object(self) -> dict:
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": self.session_id,
            "model": self.model_id,
            "output_modalities": ["audio"],
            "instructions": resolve_system_prompt(self.instructions),  # what the model hears
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
            "tools": [dict(t, type="function") for t in self.tools],
            "tool_choice": "auto",
            "max_output_tokens": "inf",
        }

    def open(self, vendor: Optional[dict] = None) -> List[Event]:
        """The events sent when the connection opens; ``vendor`` fields go in ``x-voicechat``."""
        created = self._event("session.created", session=self.session_object())
        if vendor:
            created["x-voicechat"] = dict(vendor)
        return [created]

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
        if not isinstance(client_id, str) or not utf8(client_id):
            client_id = None
        where = not_utf8(event) if "\\u" in raw or not raw.isascii() else None
        if where is not None:
            message = (
                f"`{where}` holds a lone surrogate (a \\ud800-\\udfff escape that is not half of "
                "a pair): it is not text"
            )
            return [self.error("invalid_value", message, where, client_id)], []
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
            most = self.max_instructions_chars
            if most is not None and len(session["instructions"]) > most:
                raise ProtocolError(
                    "invalid_value",
                    f"`instructions` is {len(session['instructions'])} characters; at most {most} "
                    "fit the prompt this server takes",
                    "session.instructions",
                )
            new["instructions"] = session["instructions"]  # "" is no prompt, not the default
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
        if session.get("tools") is not None:
            try:
                new["tools"] = normalize_tools(session["tools"])
            except ToolError as e:
                raise ProtocolError("invalid_value", str(e), "session.tools") from None
        if "transcription" in a_in or "input_audio_transcription" in session:
            t = a_in.get("transcription", session.get("input_audio_transcription"))
            new["transcription"] = t is not None

        if self.started:
            fixed = ("instructions", "voice", "input_rate", "output_rate", "tools")
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
            commands.append(Start(self.instructions, tuple(self.tools)))
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
            return self._tool_output(item)
        raise ProtocolError(
            "unsupported_event",
            "this model only hears audio: send input_audio_buffer.append instead of "
            f"conversation.item.create ({kind!r} items)",
            "item.type",
        )

    def _tool_output(self, item: dict):
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str) or call_id not in self._calls:
            raise ProtocolError(
                "invalid_value",
                f"call_id {call_id!r} is not a function call of this session that waits for "
                "its output",
                "item.call_id",
            )
        if not isinstance(output, str):
            raise ProtocolError("invalid_value", "`output` must be a string", "item.output")
        del self._calls[call_id]
        done = {
            "id": item.get("id") if isinstance(item.get("id"), str) else _new_id("item"),
            "object": "realtime.item",
            "type": "function_call_output",
            "call_id": call_id,
            "output": output,
            "status": "completed",
        }
        events = [
            self._add_item(done),
            self._event("conversation.item.done", previous_item_id=None, item=done),
        ]
        return events, [ToolResult(call_id, output)]

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

"""The server's side of a conversation, derived from the model's frames: the user's item (the
RNNT transcript), the assistant's responses (opened and closed by the model's own turns), their
audio and transcript deltas, and the function calls the model writes."""

from __future__ import annotations

from collections import deque
from typing import Any, Dict, List, Optional, Sequence

from ..errors import is_int
from .items import ItemRecord
from .wire import (
    FRAME_SECONDS,
    MODEL_OUTPUT_RATE,
    Event,
    Resampler,
    ToolResult,
    _new_id,
    encode_pcm16,
    invalid,
)

MAX_REQUESTS = 16  # response.create requests that may wait for the model at once
REQUEST_WAIT_FRAMES = 25  # a requested response the model leaves unused completes empty (2 s)


def _item(item_id: str, kind: str, **fields) -> dict:
    """A conversation item: ``id``, ``object``, ``type``, then ``fields`` in their order."""
    return {"id": item_id, "object": "realtime.item", "type": kind, **fields}


def _message(item_id: str, role: str, status: str, content: list) -> dict:
    return _item(item_id, "message", role=role, status=status, content=content)


class Responses:
    """One connection's conversation, owned by its :class:`.protocol.Realtime` (``session``):
    its items (:class:`~.items.ItemRecord`), the user's item, the assistant's responses and the
    function calls that wait for their output. It makes its events with the session's
    ``_event`` / ``error`` (:class:`.wire.EventSource`) and reads the session's choices
    (``transcription``, ``output_rate``, ``voice``, ``extensions``) and MCP tools (``mcp``)."""

    def __init__(self, session):
        self.s = session
        self._event, self.error = session._event, session.error
        self.conversation_id = _new_id("conv")
        self.frames_seen = 0
        self.responses_done = 0
        self.calls: Dict[str, dict] = {}  # call_id -> function_call item, until answered
        self.record = ItemRecord(session)  # the items, for conversation.item.retrieve
        self.requests: deque = deque()  # the metadata of response.create requests that wait
        # the open assistant response
        self.response: Optional[dict] = None
        self._output: Optional[Resampler] = None
        self.assistant_items: Dict[str, int] = {}  # item id -> audio ms sent
        # the open user item (RNNT transcript of the user's words)
        self.user_item: Optional[str] = None
        self._user_text: List[str] = []
        self._user_frames = 0

    # -- items --

    def open_user_item(self) -> List[Event]:
        """Open the user's item unless one is open (its ``conversation.item.added``, or
        nothing)."""
        if self.user_item is not None:
            return []
        self.user_item = _new_id("item")
        self._user_text = []
        self._user_frames = 0
        content = [{"type": "input_audio", "transcript": None}]
        return [self.record.add(_message(self.user_item, "user", "in_progress", content))]

    def close_user_item(self) -> List[Event]:
        """Complete the user's item (a turn of the model, or the end of a commit's trailing
        silence): its transcript so far becomes final."""
        if self.user_item is None:
            return []
        item_id, text = self.user_item, "".join(self._user_text)
        self.user_item = None
        item = _message(item_id, "user", "completed", [{"type": "input_audio", "transcript": text}])
        seconds = round(self._user_frames * FRAME_SECONDS, 2)
        events = []
        if self.s.transcription:
            events.append(self.s.transcript_completed(item_id, text, seconds))
        events.append(self.record.done(item))
        return events

    # -- the model's frames --

    def frames(self, frame_events: Sequence[Any]) -> List[Event]:
        """Server events for frames the session emitted (:class:`FrameEvent` objects)."""
        out: List[Event] = []
        for f in frame_events:
            self.frames_seen += 1
            if self.user_item is not None:
                self._user_frames += 1
            if f.transcript and self.s.transcription:
                out += self.open_user_item()
                self._user_text.append(f.transcript)
                out.append(self.s.transcript_delta(self.user_item, f.transcript))
            if f.turn == "start":
                if self._speaking:  # a start without an end: close the old one
                    out += self.close_response("completed")
                out += self.close_user_item()
                out += self._open_response()
            if self._speaking:
                out += self._speak(f)
            for call in getattr(f, "tool_calls", ()):
                out += self._tool_call(call)
            for message in getattr(f, "errors", ()):
                out.append(self.error("tool_call_invalid", message, type_="server_error"))
            if self._speaking and f.turn == "end":
                out += self.close_response("completed")
            elif self.response is not None and not self._speaking:
                self.response["waited"] += 1
                if self.response["waited"] >= REQUEST_WAIT_FRAMES:  # the model stayed quiet
                    out += self.close_response("completed")
        return out

    @property
    def _speaking(self) -> bool:
        """A response is open and holds the model's spoken item."""
        return self.response is not None and self.response["item_id"] is not None

    def _new_response(self, metadata=None) -> dict:
        return {
            "id": _new_id("resp"),
            "item_id": None,
            "transcript": [],
            "samples": 0,
            "calls": [],
            "metadata": metadata,
            "waited": 0,
        }

    def next_request(self) -> List[Event]:
        """Open the oldest waiting ``response.create`` request once no response is open."""
        if self.response is not None or not self.requests:
            return []
        return self._create(self.requests.popleft())

    def _create(self, metadata=None) -> List[Event]:
        """Open a response: its ``response.created``."""
        self.response = self._new_response(metadata)
        return [self._event("response.created", response=self.response_object("in_progress", []))]

    def _output_item(self, stage: str, index: int, item: dict) -> Event:
        """``response.output_item.added`` / ``.done`` of the open response."""
        return self._event(
            f"response.output_item.{stage}",
            response_id=self.response["id"],
            output_index=index,
            item=item,
        )

    def empty_response(self, metadata) -> List[Event]:
        """An out-of-band request (``conversation: "none"``): created and done, empty."""
        r = self._new_response(metadata)
        return [
            self._event("response.created", response=self.response_object("in_progress", [], r=r)),
            self._event("response.done", response=self.response_object("completed", [], r=r)),
        ]

    def _tool_call(self, call) -> List[Event]:
        """A call the model wrote on its function channel: a function_call item in the open
        response, or, when the model is not speaking, in a response of its own (a requested
        one that waits, or a new one) that completes with it."""
        if self.s.mcp.owns(call.name):  # an MCP server's tool: serve runs it (mcp_tools.py)
            return self.s.mcp.call(call)
        own = not self._speaking
        out: List[Event] = self._ensure_response()
        r = self.response
        calls = r["calls"]
        index = len(calls) + (0 if own else 1)
        item = _item(
            _new_id("item"),
            "function_call",
            status="in_progress",
            name=call.name,
            call_id=call.call_id,
            arguments="",
        )
        ref = dict(
            response_id=r["id"], item_id=item["id"], output_index=index, call_id=call.call_id
        )
        done = dict(item, status="completed", arguments=call.arguments)
        out += [
            self._output_item("added", index, item),
            self.record.add(item),
            self._event("response.function_call_arguments.delta", delta=call.arguments, **ref),
            self._event(
                "response.function_call_arguments.done",
                name=call.name,
                arguments=call.arguments,
                **ref,
            ),
            self._output_item("done", index, done),
            self.record.done(done),
        ]
        calls.append(done)
        self.calls[call.call_id] = done
        if own:
            out += self.close_response("completed")
        return out

    def _ensure_response(self) -> List[Event]:
        """Opens a response when none is open (its ``response.created``, or nothing)."""
        return [] if self.response is not None else self._create()

    def _open_response(self) -> List[Event]:
        """The model starts a turn: its spoken item, in the requested response that waits for
        it or in a new one."""
        out: List[Event] = self._ensure_response()
        self.response["item_id"] = item_id = _new_id("item")
        self._output = Resampler(MODEL_OUTPUT_RATE, self.s.output_rate)
        item = _message(item_id, "assistant", "in_progress", [])
        self.assistant_items[item_id] = 0
        part = {"type": "audio", "transcript": ""}
        return out + [
            self._output_item("added", 0, item),
            self.record.add(item),
            self._event("response.content_part.added", part=part, **self._ref()),
        ]

    def _ref(self) -> dict:
        r = self.response
        return dict(response_id=r["id"], item_id=r["item_id"], output_index=0, content_index=0)

    def _speak(self, f) -> List[Event]:
        r = self.response
        out = []
        audio = self._output(f.audio, last=f.turn == "end")
        r["samples"] += audio.size
        self.assistant_items[r["item_id"]] = -(-r["samples"] * 1000 // self.s.output_rate)  # ceil
        out.append(
            self._event("response.output_audio.delta", delta=encode_pcm16(audio), **self._ref())
        )
        if f.text:
            r["transcript"].append(f.text)
            out.append(
                self._event("response.output_audio_transcript.delta", delta=f.text, **self._ref())
            )
        return out

    def response_object(
        self, status: str, output: list, details: Optional[dict] = None, r: Optional[dict] = None
    ) -> dict:
        r = self.response if r is None else r
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
                    "format": {"type": "audio/pcm", "rate": self.s.output_rate},
                    "voice": self.s.voice,
                }
            },
            "max_output_tokens": "inf",
            "metadata": r.get("metadata"),
            "usage": None,
        }

    def close_response(self, status: str) -> List[Event]:
        """``response.done`` (after the spoken item's done events, if the model spoke), then
        the next requested response, if one waits."""
        r = self.response
        details = None
        if status == "cancelled":
            details = {"type": "cancelled", "reason": "client_cancelled"}
        events: List[Event] = []
        output = list(r["calls"])
        if r["item_id"] is not None:
            transcript = "".join(r["transcript"])
            ref = self._ref()
            item = _message(
                r["item_id"],
                "assistant",
                "completed" if status == "completed" else "incomplete",
                [{"type": "output_audio", "transcript": transcript}],
            )
            output.insert(0, item)
            events += [
                self._event("response.output_audio.done", **ref),
                self._event("response.output_audio_transcript.done", transcript=transcript, **ref),
                self._event(
                    "response.content_part.done",
                    part={"type": "audio", "transcript": transcript},
                    **ref,
                ),
                self._output_item("done", 0, item),
                self.record.done(item),
            ]
        events.append(
            self._event("response.done", response=self.response_object(status, output, details))
        )
        self.response = None
        self._output = None
        self.responses_done += 1
        return events + self.next_request()

    def restarted(self) -> List[Event]:
        """The model's session was restarted with a new prompt: the response it was speaking
        ends (incomplete), the user's item completes, and calls that waited for their output
        are void (the new session never made them)."""
        out = self.close_user_item()
        if self._speaking:
            out += self.close_response("incomplete")
        self.calls.clear()
        return out

    def tool_output(self, item: dict):
        """A client's ``function_call_output`` for a call that waits for it."""
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str) or call_id not in self.calls:
            raise invalid(
                f"call_id {call_id!r} is not a function call of this session that waits for "
                "its output",
                "item.call_id",
            )
        if not isinstance(output, str):
            raise invalid("`output` must be a string", "item.output")
        del self.calls[call_id]
        item_id = item.get("id") if isinstance(item.get("id"), str) else _new_id("item")
        done = _item(
            item_id, "function_call_output", call_id=call_id, output=output, status="completed"
        )
        events = [self.record.add(done), self.record.done(done)]
        return events, [ToolResult(call_id, output)]

    def truncate(self, event: dict):
        """``conversation.item.truncate``: the model already heard itself say it; the client's
        playback position is recorded only."""
        item_id = event.get("item_id")
        sent = self.assistant_items
        if not isinstance(item_id, str) or item_id not in sent:
            raise invalid(f"no assistant item {item_id!r}", "item_id")
        end_ms = event.get("audio_end_ms")
        if not is_int(end_ms) or end_ms < 0:
            raise invalid("`audio_end_ms` must be an integer >= 0", "audio_end_ms")
        if end_ms > sent[item_id]:
            raise invalid(
                f"audio_end_ms {end_ms} is past the {sent[item_id]} ms sent", "audio_end_ms"
            )
        return [
            self._event(
                "conversation.item.truncated", item_id=item_id, content_index=0, audio_end_ms=end_ms
            )
        ], []

    # -- transport notices --

    def tool_injection(self, call_id: str, frames: int) -> List[Event]:
        """A vendor event: the result of ``call_id`` is being fed to the model, one token per
        frame, for ``frames`` frames (nothing is spoken meanwhile). Only for a client that
        asked for ``x-voicechat`` events."""
        if not self.s.extensions:
            return []
        return [self._event("x-voicechat.tool_result.queued", call_id=call_id, frames=frames)]

    def stats(self, **fields) -> List[Event]:
        """A vendor event with the transport's figures (lag, frames, real-time factor). Only
        for a client that asked for ``x-voicechat`` events."""
        if not self.s.extensions:
            return []
        return [self._event("x-voicechat.stats", frames=self.frames_seen, **fields)]

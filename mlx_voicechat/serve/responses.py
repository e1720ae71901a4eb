"""The server's side of a conversation, derived from the model's frames: the user's item (the
RNNT transcript), the assistant's responses (opened and closed by the model's own turns), their
audio and transcript deltas, and the function calls the model writes."""

from __future__ import annotations

import json
from collections import OrderedDict, deque
from typing import Any, Dict, List, Optional, Sequence

from .wire import FRAME_SECONDS, MODEL_OUTPUT_RATE, Event, Resampler, _new_id, encode_pcm16

MAX_ITEMS = 256  # conversation items kept for conversation.item.retrieve (the oldest go first)
MAX_ITEM_CHARS = 4 << 20  # ... and at most this much of their JSON, all together
MAX_REQUESTS = 16  # response.create requests that may wait for the model at once
REQUEST_WAIT_FRAMES = 25  # a requested response the model leaves unused completes empty (2 s)


class Responses:
    """One connection's conversation, owned by its :class:`.protocol.Realtime` (``session``):
    the items kept for ``conversation.item.retrieve``, the user's item, the assistant's
    responses and the function calls that wait for their output. It makes its events with the
    session's ``_event`` / ``error`` (:class:`.wire.EventSource`) and reads the session's
    choices (``transcription``, ``output_rate``, ``voice``) and MCP tools (``mcp``)."""

    def __init__(self, session):
        self.s = session
        self._event, self.error = session._event, session.error
        self.conversation_id = _new_id("conv")
        self.frames_seen = 0
        self.responses_done = 0
        self.calls: Dict[str, dict] = {}  # call_id -> function_call item, until answered
        self.items: "OrderedDict[str, dict]" = OrderedDict()  # the conversation, for retrieve
        self.item_sizes: Dict[str, int] = {}  # item id -> characters of its JSON
        self.item_chars = 0
        self.last_item: Optional[str] = None
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

    def prev(self, item_id: str) -> Optional[str]:
        return None if self.last_item == item_id else self.last_item

    def add_item(self, item: dict) -> Event:
        event = self._event("conversation.item.added", previous_item_id=self.last_item, item=item)
        self.last_item = item["id"]
        self._keep(item)
        return event

    def item_done(self, item: dict) -> Event:
        self._keep(item)
        return self._event("conversation.item.done", previous_item_id=None, item=item)

    def _keep(self, item: dict) -> None:
        """Track the item's latest state for ``conversation.item.retrieve`` (the last
        :data:`MAX_ITEMS`, at most :data:`MAX_ITEM_CHARS` of JSON: a client's items are kept as
        sent, so their size is bounded here)."""
        old = self.items.pop(item["id"], None)
        if old is not None:
            self.item_chars -= self.item_sizes.pop(item["id"])
        size = len(json.dumps(item, ensure_ascii=False))
        self.items[item["id"]] = item
        self.item_sizes[item["id"]] = size
        self.item_chars += size
        while len(self.items) > MAX_ITEMS or (
            self.item_chars > MAX_ITEM_CHARS and len(self.items) > 1
        ):
            gone, _ = self.items.popitem(last=False)
            self.item_chars -= self.item_sizes.pop(gone)

    def forget(self, item_id: str) -> None:
        """``conversation.item.delete``: the item's record goes (the model heard what it heard)."""
        del self.items[item_id]
        self.item_chars -= self.item_sizes.pop(item_id)

    def open_user_item(self) -> List[Event]:
        self.user_item = _new_id("item")
        self._user_text = []
        self._user_frames = 0
        item = {
            "id": self.user_item,
            "object": "realtime.item",
            "type": "message",
            "role": "user",
            "status": "in_progress",
            "content": [{"type": "input_audio", "transcript": None}],
        }
        return [self.add_item(item)]

    def close_user_item(self) -> List[Event]:
        """Complete the user's item (a turn of the model, or the end of a commit's trailing
        silence): its transcript so far becomes final."""
        if self.user_item is None:
            return []
        item_id, text = self.user_item, "".join(self._user_text)
        self.user_item = None
        item = {
            "id": item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "user",
            "status": "completed",
            "content": [{"type": "input_audio", "transcript": text}],
        }
        seconds = round(self._user_frames * FRAME_SECONDS, 2)
        events = []
        if self.s.transcription:
            events.append(self.s.transcript_completed(item_id, text, seconds))
        events.append(self.item_done(item))
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
                if self.user_item is None:
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
        self.response = self._new_response(self.requests.popleft())
        return [self._event("response.created", response=self.response_object("in_progress", []))]

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
        item = {
            "id": _new_id("item"),
            "object": "realtime.item",
            "type": "function_call",
            "status": "in_progress",
            "name": call.name,
            "call_id": call.call_id,
            "arguments": "",
        }
        ref = dict(
            response_id=r["id"], item_id=item["id"], output_index=index, call_id=call.call_id
        )
        done = dict(item, status="completed", arguments=call.arguments)
        out += [
            self._event(
                "response.output_item.added", response_id=r["id"], output_index=index, item=item
            ),
            self.add_item(item),
            self._event("response.function_call_arguments.delta", delta=call.arguments, **ref),
            self._event(
                "response.function_call_arguments.done",
                name=call.name,
                arguments=call.arguments,
                **ref,
            ),
            self._event(
                "response.output_item.done", response_id=r["id"], output_index=index, item=done
            ),
            self.item_done(done),
        ]
        calls.append(done)
        self.calls[call.call_id] = done
        if own:
            out += self.close_response("completed")
        return out

    def _ensure_response(self) -> List[Event]:
        """Opens a response when none is open (its ``response.created``, or nothing)."""
        if self.response is not None:
            return []
        self.response = self._new_response()
        return [self._event("response.created", response=self.response_object("in_progress", []))]

    def _open_response(self) -> List[Event]:
        """The model starts a turn: its spoken item, in the requested response that waits for
        it or in a new one."""
        out: List[Event] = self._ensure_response()
        r = self.response
        r["item_id"] = item_id = _new_id("item")
        self._output = Resampler(MODEL_OUTPUT_RATE, self.s.output_rate)
        item = {
            "id": item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        self.assistant_items[item_id] = 0
        ref = dict(response_id=r["id"], item_id=item_id, output_index=0, content_index=0)
        return out + [
            self._event(
                "response.output_item.added", response_id=r["id"], output_index=0, item=item
            ),
            self.add_item(item),
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
            item = {
                "id": r["item_id"],
                "object": "realtime.item",
                "type": "message",
                "role": "assistant",
                "status": "completed" if status == "completed" else "incomplete",
                "content": [{"type": "output_audio", "transcript": transcript}],
            }
            output.insert(0, item)
            events += [
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
                self.item_done(item),
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

    # -- transport notices --

    def commit_done(self) -> List[Event]:
        """The trailing silence of a commit has been fed: the user's item is complete."""
        return self.close_user_item()

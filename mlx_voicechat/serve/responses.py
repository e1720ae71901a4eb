"""The server's side of a conversation, derived from the model's frames: the user's item (the
RNNT transcript), the assistant's responses (opened and closed by the model's own turns), their
audio and transcript deltas, and the function calls the model writes."""

from __future__ import annotations

import json
from typing import Any, List, Optional, Sequence

from .wire import MODEL_OUTPUT_RATE, Event, Resampler, _new_id, encode_pcm16

MAX_ITEMS = 256  # conversation items kept for conversation.item.retrieve (the oldest go first)
MAX_ITEM_CHARS = 4 << 20  # ... and at most this much of their JSON, all together
MAX_REQUESTS = 16  # response.create requests that may wait for the model at once
REQUEST_WAIT_FRAMES = 25  # a requested response the model leaves unused completes empty (2 s)


class Responses:
    """The frame-driven half of :class:`.protocol.Realtime` (a mixin: it uses the state that
    ``Realtime`` defines and the ``_event`` / ``error`` helpers of :class:`.wire.EventSource`)."""

    # -- items --

    def _prev(self, item_id: str) -> Optional[str]:
        return None if self._last_item == item_id else self._last_item

    def _add_item(self, item: dict) -> Event:
        event = self._event("conversation.item.added", previous_item_id=self._last_item, item=item)
        self._last_item = item["id"]
        self._keep(item)
        return event

    def _item_done(self, item: dict) -> Event:
        self._keep(item)
        return self._event("conversation.item.done", previous_item_id=None, item=item)

    def _keep(self, item: dict) -> None:
        """Track the item's latest state for ``conversation.item.retrieve`` (the last
        :data:`MAX_ITEMS`, at most :data:`MAX_ITEM_CHARS` of JSON: a client's items are kept as
        sent, so their size is bounded here)."""
        old = self.items.pop(item["id"], None)
        if old is not None:
            self._item_chars -= self._item_sizes.pop(item["id"])
        size = len(json.dumps(item, ensure_ascii=False))
        self.items[item["id"]] = item
        self._item_sizes[item["id"]] = size
        self._item_chars += size
        while len(self.items) > MAX_ITEMS or (
            self._item_chars > MAX_ITEM_CHARS and len(self.items) > 1
        ):
            gone, _ = self.items.popitem(last=False)
            self._item_chars -= self._item_sizes.pop(gone)

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
        events.append(self._item_done(item))
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
                if self._speaking:  # a start without an end: close the old one
                    out += self._close_response("completed")
                out += self.close_user_item()
                out += self._open_response()
            if self._speaking:
                out += self._speak(f)
            for call in getattr(f, "tool_calls", ()):
                out += self._tool_call(call)
            for message in getattr(f, "errors", ()):
                out.append(self.error("tool_call_invalid", message, type_="server_error"))
            if self._speaking and f.turn == "end":
                out += self._close_response("completed")
            elif self.response is not None and not self._speaking:
                self.response["waited"] += 1
                if self.response["waited"] >= REQUEST_WAIT_FRAMES:  # the model stayed quiet
                    out += self._close_response("completed")
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

    def _next_request(self) -> List[Event]:
        """Open the oldest waiting ``response.create`` request once no response is open."""
        if self.response is not None or not self._requests:
            return []
        self.response = self._new_response(self._requests.popleft())
        return [self._event("response.created", response=self._response_object("in_progress", []))]

    def _empty_response(self, metadata) -> List[Event]:
        """An out-of-band request (``conversation: "none"``): created and done, empty."""
        r = self._new_response(metadata)
        return [
            self._event("response.created", response=self._response_object("in_progress", [], r=r)),
            self._event("response.done", response=self._response_object("completed", [], r=r)),
        ]

    def _tool_call(self, call) -> List[Event]:
        """A call the model wrote on its function channel: a function_call item in the open
        response, or, when the model is not speaking, in a response of its own (a requested
        one that waits, or a new one) that completes with it."""
        if self.mcp.owns(call.name):  # an MCP server's tool: serve runs it (mcp_tools.py)
            return self.mcp.call(call)
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
            self._add_item(item),
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
            self._item_done(done),
        ]
        calls.append(done)
        self._calls[call.call_id] = done
        if own:
            out += self._close_response("completed")
        return out

    def _ensure_response(self) -> List[Event]:
        """Opens a response when none is open (its ``response.created``, or nothing)."""
        if self.response is not None:
            return []
        self.response = self._new_response()
        return [self._event("response.created", response=self._response_object("in_progress", []))]

    def _open_response(self) -> List[Event]:
        """The model starts a turn: its spoken item, in the requested response that waits for
        it or in a new one."""
        out: List[Event] = self._ensure_response()
        r = self.response
        r["item_id"] = item_id = _new_id("item")
        self._output = Resampler(MODEL_OUTPUT_RATE, self.output_rate)
        item = {
            "id": item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        self._assistant_items[item_id] = 0
        ref = dict(response_id=r["id"], item_id=item_id, output_index=0, content_index=0)
        return out + [
            self._event(
                "response.output_item.added", response_id=r["id"], output_index=0, item=item
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
        self._assistant_items[r["item_id"]] = -(-r["samples"] * 1000 // self.output_rate)  # ceil
        out.append(
            self._event("response.output_audio.delta", delta=encode_pcm16(audio), **self._ref())
        )
        if f.text:
            r["transcript"].append(f.text)
            out.append(
                self._event("response.output_audio_transcript.delta", delta=f.text, **self._ref())
            )
        return out

    def _response_object(
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
                    "format": {"type": "audio/pcm", "rate": self.output_rate},
                    "voice": self.voice,
                }
            },
            "max_output_tokens": "inf",
            "metadata": r.get("metadata"),
            "usage": None,
        }

    def _close_response(self, status: str) -> List[Event]:
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
                self._item_done(item),
            ]
        events.append(
            self._event("response.done", response=self._response_object(status, output, details))
        )
        self.response = None
        self._output = None
        self.responses_done += 1
        return events + self._next_request()

    def restarted(self) -> List[Event]:
        """The model's session was restarted with a new prompt: the response it was speaking
        ends (incomplete), the user's item completes, and calls that waited for their output
        are void (the new session never made them)."""
        out = self.close_user_item()
        if self._speaking:
            out += self._close_response("incomplete")
        self._calls.clear()
        return out

    # -- transport notices --

    def commit_done(self) -> List[Event]:
        """The trailing silence of a commit has been fed: the user's item is complete."""
        return self.close_user_item()

    def tool_injection(self, call_id: str, frames: int) -> List[Event]:
        """A vendor event: the result of ``call_id`` is being fed to the model, one token per
        frame, for ``frames`` frames (nothing is spoken meanwhile). Only for a client that
        asked for ``x-voicechat`` events."""
        if not self.extensions:
            return []
        return [self._event("x-voicechat.tool_result.queued", call_id=call_id, frames=frames)]

    def stats(self, **fields) -> List[Event]:
        """A vendor event with the transport's figures (lag, frames, real-time factor). Only
        for a client that asked for ``x-voicechat`` events."""
        if not self.extensions:
            return []
        return [self._event("x-voicechat.stats", frames=self.frames_seen, **fields)]

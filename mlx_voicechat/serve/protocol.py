"""The OpenAI Realtime protocol (GA names) for a full-duplex model, as a socket-free state machine.

:meth:`Realtime.receive` turns one client message into server events and worker
:class:`Command` objects; :meth:`Realtime.frames` turns the model's frames into events (a
response opens at a frame whose ``turn`` is ``"start"`` and closes at ``"end"``). Audio is
resampled here with stateful streams (no seam at chunk joins).
"""

from __future__ import annotations

from typing import List, Optional

from ..nemotron_voicechat.runtime.request import resolve_system_prompt
from .mcp_tools import McpPolicy, McpTools
from .responses import MAX_REQUESTS, Responses
from .wire import (
    COMMIT_EMPTY,
    DEFAULT_RATE,
    INPUT_RATES,
    MODEL_INPUT_RATE,
    OUTPUT_RATES,
    Cancel,
    ClientProtocol,
    Command,
    Commit,
    Event,
    ProtocolError,
    Resampler,
    Start,
    format_rate,
    invalid,
    modalities_of,
    session_of,
    tools_of,
)

# Client event names this server acts on; other known names are answered as unsupported.
_UNSUPPORTED = {
    "transcription_session.update": "this server runs realtime, not transcription, sessions",
}
NOTE_ROLES = ("system", "developer")  # text messages that join the instructions


class Realtime(ClientProtocol):
    """One connection's protocol state: the session's choices here, its conversation in
    :attr:`responses` (:class:`~.responses.Responses`). Not thread-safe; the transport owns it.

    ``receive(raw)`` -> ``(events, commands)``; ``frames(frame_events)`` -> events."""

    def __init__(
        self,
        model_id: str = "nemotron-voicechat",
        *,
        voice: str = "Aria",
        max_instructions_chars: Optional[int] = None,
        extensions: bool = False,
        mcp: Optional[McpPolicy] = None,
    ):
        super().__init__(model_id)
        self.mcp = McpTools(self, mcp)  # the session's mcp tools (serve/mcp_tools.py)
        self.extensions = extensions  # x-voicechat.* events for a client that asked for them
        self.max_instructions_chars = max_instructions_chars
        self.instructions: Optional[str] = None
        self.notes: List[str] = []  # system / developer text messages: they join the instructions
        self.tools: List[dict] = []
        self.opened_with: Optional[tuple] = None  # (prompt, tools) the model's session runs
        self.voice = voice
        self.output_rate = DEFAULT_RATE
        self.transcription = True
        self.turn_detection: Optional[dict] = None  # None: no speech events (serve/speech.py)
        self.responses = Responses(self)

    # -- the conversation (serve/responses.py), as the transport and the tests read it --

    def commit_done(self) -> List[Event]:
        """The trailing silence of a commit has been fed: the user's item is complete."""
        return self.responses.close_user_item()

    frames = property(lambda self: self.responses.frames)
    stats = property(lambda self: self.responses.stats)
    tool_injection = property(lambda self: self.responses.tool_injection)
    response = property(lambda self: self.responses.response)
    responses_done = property(lambda self: self.responses.responses_done)
    items = property(lambda self: self.responses.record.items)
    _item_chars = property(lambda self: self.responses.record.chars)

    # -- helpers --

    @property
    def session_tools(self) -> tuple:
        """The model's tools: the session's function tools, then its MCP servers' tools."""
        return tuple(self.tools) + tuple(self.mcp.functions)

    @property
    def prompt(self) -> Optional[str]:
        """The instructions the model is given: the session's, then each system or developer
        text message in the order they came (None: the model's default prompt)."""
        if not self.notes:
            return self.instructions
        return "\n\n".join(([self.instructions] if self.instructions else []) + self.notes)

    def session_object(self) -> dict:
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": self.session_id,
            "model": self.model_id,
            "output_modalities": ["audio"],
            "instructions": resolve_system_prompt(self.prompt),  # what the model hears
            "audio": {
                "input": {
                    "format": {"type": "audio/pcm", "rate": self.input_rate},
                    "transcription": {"model": "rnnt"} if self.transcription else None,
                    "turn_detection": self.turn_detection,  # the speech events, if any
                    "noise_reduction": None,
                },
                "output": {
                    "format": {"type": "audio/pcm", "rate": self.output_rate},
                    "voice": self.voice,
                    "speed": 1.0,
                },
            },
            "tools": [dict(t, type="function") for t in self.tools] + self.mcp.echo(),
            "tool_choice": "auto",
            "max_output_tokens": "inf",
        }

    def unhandled(self, type_: str) -> ProtocolError:
        if type_ in _UNSUPPORTED:
            return ProtocolError("unsupported_event", f"{type_}: {_UNSUPPORTED[type_]}", "type")
        return super().unhandled(type_)

    def _session_update(self, event: dict):
        """Each field on its own: what this model cannot honour is refused with an error that
        names it (or, for a choice it has no use for, such as a voice name or turn detection,
        ignored), and every other field is applied; ``session.updated`` then says what is in
        effect. Instructions or tools that change after the audio started restart the model's
        conversation with the new prompt (:meth:`_restart`)."""
        session, a_in, a_out = session_of(event)
        kind = session.get("type", "realtime")
        if kind != "realtime":
            raise invalid(f'session.type {kind!r} is not served; use "realtime"', "session.type")
        client_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
        new: dict = {}
        refused: List[ProtocolError] = []

        def field(name, parse, *args):
            try:
                value = parse(*args)
            except ProtocolError as e:
                refused.append(e)
                return
            if value is not None:
                new[name] = value

        field("instructions", self._instructions_of, session)
        # A voice name (GA's audio.output.voice, beta's flat `voice`) is a wish this model
        # cannot grant: it has one voice, which session.updated reports.
        for which, a, rates in (("input", a_in, INPUT_RATES), ("output", a_out, OUTPUT_RATES)):
            beta = session.get(f"{which}_audio_format")
            field(f"{which}_rate", format_rate, a.get("format"), beta, rates, which)
        field("modalities", modalities_of, session)  # (only refuses: it returns None)
        field("tools", lambda: tools_of(self.mcp.take(session)))
        if "transcription" in a_in or "input_audio_transcription" in session:
            t = a_in.get("transcription", session.get("input_audio_transcription"))
            new["transcription"] = t is not None
        x = session.get("x-voicechat")
        if isinstance(x, dict) and isinstance(x.get("events"), bool):
            self.extensions = x["events"]

        if "input_rate" in new and self._input is not None and new["input_rate"] != self.input_rate:
            self._input = Resampler(new["input_rate"], MODEL_INPUT_RATE)
        for k, v in new.items():
            setattr(self, k, v)
        events = [self.error(e.code, e.message, e.param, client_id) for e in refused]
        events.append(self._event("session.updated", session=self.session_object()))
        events += self.mcp.events()
        return events, self._restart()

    def _instructions_of(self, session: dict) -> Optional[str]:
        text = session.get("instructions")
        if text is None:
            return None
        if not isinstance(text, str):
            raise invalid("`instructions` must be a string", "session.instructions")
        self._check_length(len(text), "session.instructions")
        return text  # "" is no prompt, not the default

    def _check_length(self, chars: int, param: str) -> None:
        most = self.max_instructions_chars
        if most is not None and chars > most:
            raise invalid(
                f"`instructions` would be {chars} characters; at most {most} fit the prompt "
                "this server takes",
                param,
            )

    def _restart(self) -> List[Command]:
        """Once the model's session runs, a new prompt (instructions, system or developer
        messages, tools) restarts it: the model's prompt is fixed when its session opens. The
        driver applies it at its next job (see ``Conversation._execute``)."""
        if self.opened_with is None or self.opened_with == (self.prompt, self.session_tools):
            return []
        return [self.start()]

    def start(self) -> Start:
        """Open the model's session with the prompt and tools (function and MCP) it has now;
        every transport's first audio opens it through here."""
        self.started = True
        self.opened_with = (self.prompt, self.session_tools)
        return Start(*self.opened_with)

    def _commit(self, event: dict):
        if not self.started:
            raise ProtocolError(*COMMIT_EMPTY)
        c = self.responses
        events = c.open_user_item()
        item = c.user_item
        previous = c.record.prev(item)
        events.append(
            self._event("input_audio_buffer.committed", item_id=item, previous_item_id=previous)
        )
        return events, [Commit()]

    def _response_create(self, event: dict):
        """A request for a response. This model decides itself when to speak, so the request
        opens a response at once (``response.created``, its ``metadata`` echoed) that the
        model's next turn or function call fills; if the model stays quiet for
        :data:`~.responses.REQUEST_WAIT_FRAMES` frames, it completes empty. While the model is
        speaking, the request waits for the end of that response. Per-response instructions,
        tools and modalities are not applied (the model's prompt is the session's)."""
        r = event.get("response") if isinstance(event.get("response"), dict) else {}
        metadata = r.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise invalid("`response.metadata` must be an object", "response.metadata")
        if r.get("conversation") == "none":
            # an out-of-band response: nothing in the conversation changes, and this model
            # writes nothing outside its conversation
            return self.responses.empty_response(metadata), []
        if len(self.responses.requests) >= MAX_REQUESTS:
            raise ProtocolError(
                "conversation_already_has_active_response",
                f"{MAX_REQUESTS} requested responses already wait for the model",
            )
        self.responses.requests.append(metadata)
        return self.responses.next_request(), []

    def _response_cancel(self, event: dict):
        if self.response is None:
            raise ProtocolError(
                "response_cancel_not_active", "there is no response in progress to cancel"
            )
        wanted = event.get("response_id")
        if wanted is not None and wanted != self.response["id"]:
            raise invalid(f"response {wanted!r} is not the response in progress", "response_id")
        return self.responses.close_response("cancelled"), [Cancel()]

    def _item_create(self, event: dict):
        item = event.get("item")
        if not isinstance(item, dict):
            raise invalid("`item` must be an object", "item")
        kind = item.get("type")
        if kind == "function_call_output":
            return self.responses.tool_output(item)
        if kind == "mcp_approval_response":
            return self.mcp.approval(item)
        if kind == "message":
            return self._message(item, event.get("previous_item_id"))
        if kind == "function_call":  # a client's record of an earlier call: kept, not run
            return self.responses.record.client_item(item, "function_call"), []
        raise invalid(
            f"item type {kind!r} is not one of message, function_call, function_call_output, "
            "mcp_approval_response",
            "item.type",
        )

    def _message(self, item: dict, previous):
        """A text (or audio) message item from the client. The model only hears the audio
        stream, so: a ``system`` or ``developer`` message joins the instructions (at once
        before the first audio, by a restart after it, see :meth:`_restart`); a ``user`` or
        ``assistant`` message is kept in the conversation (``conversation.item.retrieve``
        returns it) but the model does not hear it."""
        role = item.get("role")
        if role not in ("user", "assistant") + NOTE_ROLES:
            raise invalid(
                f"message role {role!r} is not one of user, assistant, system, developer",
                "item.role",
            )
        content = item.get("content")
        if not isinstance(content, list) or not all(isinstance(c, dict) for c in content):
            raise invalid("`item.content` must be a list of objects", "item.content")
        commands: List[Command] = []
        if role in NOTE_ROLES:
            text = "".join(c["text"] for c in content if isinstance(c.get("text"), str)).strip()
            if text:
                self._check_length(len(self.prompt or "") + len(text) + 2, "item.content")
                self.notes.append(text)
                commands = self._restart()
        record = self.responses.record.client_item(item, "message", role=role, content=content)
        return record, commands

    def _output_clear(self, event: dict):
        """WebRTC's playback buffer: over a WebSocket the client plays the audio itself, so
        there is nothing here to clear; acknowledged."""
        return [self._event("output_audio_buffer.cleared", response_id=None)], []

    HANDLERS = {
        "session.update": _session_update,
        "input_audio_buffer.append": ClientProtocol._append,
        "input_audio_buffer.commit": _commit,
        "input_audio_buffer.clear": ClientProtocol._clear,
        "response.create": _response_create,
        "response.cancel": _response_cancel,
        "conversation.item.create": _item_create,
        "conversation.item.truncate": lambda p, event: p.responses.truncate(event),
        "conversation.item.retrieve": lambda p, event: p.responses.record.retrieve(event),
        "conversation.item.delete": lambda p, event: p.responses.record.delete(event),
        "output_audio_buffer.clear": _output_clear,
    }

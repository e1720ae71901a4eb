"""Realtime ``mcp`` tools: MCP servers that ``serve`` connects to and whose tools it runs.

A client's ``{"type": "mcp", ...}`` entry of ``session.tools`` names a server the operator
allowed (``--mcp-allow PREFIX``; none by default); its tools are listed (an ``mcp_list_tools``
item) and given to the model as function tools, and each call the model writes runs in a
response of its own (an ``mcp_call`` item), its result fed back as a function result. A tool
that needs approval first gets an ``mcp_approval_request`` item.

:class:`McpTools` is the protocol's side (pure: events out, jobs to ``launch``);
:class:`~.mcp_runner.McpRunner` runs the jobs. A client's headers go to its MCP server only:
never logged, never echoed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..nemotron_voicechat.runtime.mcp_config import (
    DEFAULT_TOOL_TIMEOUT,
    ERROR_CODES,
    MAX_RESPONSE_BYTES,
    MAX_RESULT_CHARS,
    function_tools,
    is_http_url,
    is_name,
    of_strings,
    shown_url,
)
from ..nemotron_voicechat.runtime.tools import MAX_TOOLS
from .wire import Event, ProtocolError, ToolResult, _new_id, invalid


@dataclass(frozen=True)
class McpPolicy:
    """What the operator allows: URL prefixes, and the bounds of a call."""

    allow: Tuple[str, ...] = ()
    timeout: float = DEFAULT_TOOL_TIMEOUT
    max_result_chars: int = MAX_RESULT_CHARS
    max_response_bytes: int = MAX_RESPONSE_BYTES

    def allows(self, url: str) -> bool:
        """``url`` starts with an allowed prefix at a path boundary (``http://h:1`` allows
        ``http://h:1/mcp``, not ``http://h:12``)."""
        for prefix in self.allow:
            if url.startswith(prefix):
                rest = url[len(prefix) :]
                if prefix.endswith("/") or not rest or rest[0] in "/?#":
                    return True
        return False


@dataclass
class _Server:
    label: str
    url: str
    headers: Dict[str, str] = field(repr=False)
    allowed: Optional[Tuple[str, ...]]
    approval: Any
    item_id: str
    status: str = "in_progress"  # -> completed / failed
    tools: List[Any] = field(default_factory=list)  # the SDK's Tool objects, once listed
    active: bool = True  # in the session's latest tools

    def same(self, other: "_Server") -> bool:
        return (self.url, self.headers, self.allowed, self.approval) == (
            other.url, other.headers, other.allowed, other.approval
        )


@dataclass
class McpJob:
    """Work for the runner: ``kind`` "list" (connect ``server``, list its tools) or "call"."""

    kind: str
    server: _Server
    call_id: str = ""
    tool: str = ""
    arguments: str = "{}"
    item_id: str = ""
    response_id: str = ""
    approval_request_id: Optional[str] = None


def _names(value, param: str) -> Optional[Tuple[str, ...]]:
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("tool_names")
        if value is None:
            return None
    if not of_strings(value, list):
        raise invalid(f"`{param}` must list tool names", param)
    return tuple(value)


class McpTools:
    """The ``mcp`` tools of one Realtime connection (used by :class:`.protocol.Realtime`)."""

    def __init__(self, protocol, policy: Optional[McpPolicy] = None):
        self.p = protocol
        self.policy = policy or McpPolicy()
        self.servers: Dict[str, _Server] = {}
        self.routes: Dict[str, Tuple[str, str]] = {}  # function name -> (label, tool)
        self.functions: List[dict] = []
        self.approvals: Dict[str, McpJob] = {}  # the approval requests that wait, by id
        self.launch: Optional[Callable[[McpJob], None]] = None  # the runner's, once connected
        self.outbox: List[McpJob] = []  # jobs while no runner is attached (socket-free tests)
        self._events: List[Event] = []

    # -- session.tools --

    def take(self, session: dict) -> dict:
        """``session`` with its ``mcp`` tools taken out (and configured); a refused entry is a
        ProtocolError naming it. Called for each ``session.update``."""
        tools = session.get("tools")
        if not isinstance(tools, list):
            return session
        rest, wanted = [], []
        for n, tool in enumerate(tools):
            if isinstance(tool, dict) and tool.get("type") == "mcp":
                wanted.append(self._parse(tool, f"session.tools[{n}]"))
            else:
                rest.append(tool)
        labels = [s.label for s in wanted]
        if len(set(labels)) != len(labels):
            raise invalid("two mcp tools have one server_label", "session.tools")
        for s in wanted:
            old = self.servers.get(s.label)
            if old is not None and not old.same(s):
                raise invalid(
                    f"server_label {s.label!r} already names another MCP server in this session; "
                    "give the new one a label of its own",
                    "session.tools",
                )
        for s in self.servers.values():
            s.active = s.label in labels
        for s in wanted:
            if s.label not in self.servers:
                self.servers[s.label] = s
                self._list(s)
        self._rename()
        return dict(session, tools=rest)

    def _parse(self, tool: dict, param: str) -> _Server:
        label = tool.get("server_label")
        if not is_name(label):
            raise invalid("server_label must be a non-empty string of letters, digits, _ and -",
                          f"{param}.server_label")
        url = tool.get("server_url")
        if not is_http_url(url):
            raise invalid("an mcp tool needs a server_url (http:// or https://); connectors and "
                          "tunnels are not served", f"{param}.server_url")
        if not self.policy.allows(url):
            allowed = ", ".join(self.policy.allow) or "none: start serve with --mcp-allow PREFIX"
            raise ProtocolError(
                "mcp_server_not_allowed",
                f"server_url {shown_url(url)!r} is not an MCP server this server may connect to "
                f"(allowed prefixes: {allowed})",
                f"{param}.server_url",
            )
        headers = tool.get("headers") or {}
        if not of_strings(headers, dict):
            raise invalid("`headers` must be an object of strings", f"{param}.headers")
        if isinstance(tool.get("authorization"), str):
            headers = dict(headers, Authorization=f"Bearer {tool['authorization']}")
        approval = tool.get("require_approval")
        if approval is None:
            approval = "always"  # OpenAI's default: ask before data goes to a server
        if not (approval in ("always", "never") or isinstance(approval, dict)):
            raise invalid('require_approval must be "always", "never" or a filter object',
                          f"{param}.require_approval")
        if isinstance(approval, dict):
            for key in ("always", "never"):
                _names(approval.get(key), f"{param}.require_approval.{key}")
        allowed = _names(tool.get("allowed_tools"), f"{param}.allowed_tools")
        return _Server(label, url, dict(headers), allowed, approval, _new_id("item"))

    def echo(self) -> List[dict]:
        """The session's mcp tools as ``session.updated`` shows them (no headers)."""
        return [{"type": "mcp", "server_label": s.label, "server_url": s.url,
                 "allowed_tools": list(s.allowed) if s.allowed is not None else None,
                 "require_approval": s.approval} for s in self.servers.values() if s.active]

    def events(self) -> List[Event]:
        """The events of the last :meth:`take` (after the session's function tools are set)."""
        self._rename()
        out, self._events = self._events, []
        return out

    def _run(self, job: McpJob) -> None:
        (self.launch or self.outbox.append)(job)

    # -- listing --

    def _list_item(self, s: _Server) -> dict:
        tools = [
            {"name": t.name, "description": t.description, "input_schema": t.input_schema,
             "annotations": t.annotations.model_dump(exclude_none=True) if t.annotations else None}
            for t in s.tools
        ]
        return {"id": s.item_id, "object": "realtime.item", "type": "mcp_list_tools",
                "server_label": s.label, "tools": tools}

    def _list(self, s: _Server) -> None:
        p = self.p
        self._events += [
            p.responses.record.add(self._list_item(s)),
            p._event("mcp_list_tools.in_progress", item_id=s.item_id),
        ]
        self._run(McpJob("list", s))

    def listed(self, label: str, tools: Optional[Sequence[Any]], error: Optional[str] = None):
        """The runner's listing of ``label``: ``(events, commands)``; the commands restart the
        model's session with the new tools if it runs already."""
        s = self.servers[label]
        p = self.p
        if error is None:
            if s.allowed is not None:
                tools = [t for t in tools if t.name in s.allowed]
            others = len(p.tools) + sum(
                len(o.tools) for o in self.servers.values() if o.active and o is not s
            )
            if others + len(tools) > MAX_TOOLS:
                error = (
                    f"the MCP server {label!r} offers {len(tools)} tools; with the session's "
                    f"{others} others that is more than the {MAX_TOOLS} the model takes: name "
                    "some in allowed_tools"
                )
        if error is not None:
            s.status = "failed"
            events = [
                p._event("mcp_list_tools.failed", item_id=s.item_id),
                p.error("mcp_list_tools_failed", error, "session.tools", type_="server_error"),
            ]
            return events, []
        s.status, s.tools = "completed", list(tools)
        self._rename()
        events = [
            p._event("mcp_list_tools.completed", item_id=s.item_id),
            p.responses.record.done(self._list_item(s)),
        ]
        return events, p._restart()

    def _rename(self) -> None:
        listed = [(s.label, s.tools) for s in self.servers.values() if s.active and s.tools]
        self.functions, self.routes = function_tools(listed, [t["name"] for t in self.p.tools])

    # -- calls --

    def owns(self, name: str) -> bool:
        return name in self.routes

    def _needs_approval(self, s: _Server, tool: str) -> bool:
        a = s.approval
        if isinstance(a, str):
            return a == "always"
        # "always" named, or not named in "never": asked, as OpenAI does
        return tool not in (_names(a.get("never"), "never") or ())

    def _own_response(self, item: dict) -> Tuple[str, List[Event]]:
        """The first events of a response of our own, ``item`` its one output."""
        p, rid = self.p, _new_id("resp")
        obj = p.responses.response_object("in_progress", [], r={"id": rid})
        return rid, [p._event("response.created", response=obj),
                     p._event("response.output_item.added", response_id=rid, output_index=0,
                              item=item),
                     p.responses.record.add(item)]

    def _end_response(self, rid: str, item: dict) -> List[Event]:
        """The last events of a response of our own, ``item`` its one output."""
        p = self.p
        p.responses.responses_done += 1
        obj = p.responses.response_object("completed", [item], r={"id": rid})
        return [p._event("response.output_item.done", response_id=rid, output_index=0, item=item),
                p.responses.record.done(item),
                p._event("response.done", response=obj)]

    def call(self, call) -> List[Event]:
        """A call the model wrote to an MCP tool: an approval request, or the call run."""
        label, tool = self.routes[call.name]
        s = self.servers[label]
        job = McpJob("call", s, call.call_id, tool, call.arguments)
        if self._needs_approval(s, tool):
            return self._ask(job)
        return self._start(job)

    def _ask(self, job: McpJob) -> List[Event]:
        item = {"id": _new_id("item"), "object": "realtime.item", "type": "mcp_approval_request",
                "server_label": job.server.label, "name": job.tool, "arguments": job.arguments}
        self.approvals[item["id"]] = job
        rid, events = self._own_response(item)
        return events + self._end_response(rid, item)

    def _item(self, job: McpJob, **fields) -> dict:
        item = {"id": job.item_id, "object": "realtime.item", "type": "mcp_call",
                "server_label": job.server.label, "name": job.tool, "arguments": job.arguments,
                "approval_request_id": job.approval_request_id, "output": None, "error": None}
        item.update(fields)
        return item

    def _start(self, job: McpJob) -> List[Event]:
        p = self.p
        job.item_id = _new_id("item")
        job.response_id, events = self._own_response(self._item(job, arguments=""))
        ref = dict(response_id=job.response_id, item_id=job.item_id, output_index=0)
        events += [
            p._event("response.mcp_call_arguments.delta", delta=job.arguments, **ref),
            p._event("response.mcp_call_arguments.done", arguments=job.arguments, **ref),
            p._event("response.mcp_call.in_progress", item_id=job.item_id, output_index=0),
        ]
        self._run(job)
        return events

    def finished(self, job: McpJob, text: str, error: Optional[str], kind: str):
        """The runner's outcome of a call: ``(events, commands)``; the command feeds the result
        (or the error) to the model."""
        p = self.p
        if error is None:
            item, done = self._item(job, output=text), "response.mcp_call.completed"
            heard = text
        else:
            if kind == "tool":
                err = {"type": "tool_execution_error", "message": error}
            else:
                err = {"type": "protocol_error", "code": ERROR_CODES.get(kind, -32603),
                       "message": error}
            item, done = self._item(job, error=err), "response.mcp_call.failed"
            heard = json.dumps({"error": error})
        events = [p._event(done, item_id=job.item_id, output_index=0),
                  *self._end_response(job.response_id, item)]
        return events, [ToolResult(job.call_id, heard)]

    def approval(self, item: dict):
        """A client's ``mcp_approval_response`` item: ``(events, commands)``."""
        p = self.p
        request = item.get("approval_request_id")
        if not isinstance(request, str) or request not in self.approvals:
            raise invalid(f"approval_request_id {request!r} is not an approval request of this "
                          "session that waits for an answer", "item.approval_request_id")
        approve = item.get("approve")
        if not isinstance(approve, bool):
            raise invalid("`approve` must be true or false", "item.approve")
        job = self.approvals.pop(request)
        done = {"id": item.get("id") if isinstance(item.get("id"), str) else _new_id("item"),
                "object": "realtime.item", "type": "mcp_approval_response",
                "approval_request_id": request, "approve": approve,
                "reason": item.get("reason") if isinstance(item.get("reason"), str) else None}
        events = [p.responses.record.add(done), p.responses.record.done(done)]
        if not approve:
            why = f": {done['reason']}" if done["reason"] else ""
            refused = json.dumps({"error": f"the user did not approve the call{why}"})
            return events, [ToolResult(job.call_id, refused)]
        job.approval_request_id = request
        return events + self._start(job), []

"""What an MCP server is to a conversation: its entry in the ``{"mcpServers": ...}`` config
(:class:`ServerSpec`), how its tools are named as OpenAI function tools, and how a call's
result reads as the text the model hears (:class:`ToolOutcome`). The client that runs them is
:mod:`.mcp`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...errors import VoiceChatError
from ...files import read_json

DEFAULT_TOOL_TIMEOUT = 30.0  # seconds a call may take (--tool-timeout)
MAX_RESULT_CHARS = 4000  # a longer result is refused: it would take minutes to inject
MAX_RESPONSE_BYTES = 4 << 20  # an HTTP server's one SSE event, read at most (the transport's bound)
ERROR_CODES = {"timeout": -32001, "closed": -32000}  # the MCP SDK's JSON-RPC error codes


class MCPError(VoiceChatError):
    """An MCP config, server or SDK that cannot be used (one line, no traceback)."""


# --- the config (chat's file; serve's session.tools entries check theirs with the same rules) --


def is_name(value) -> bool:
    """A server's name or label: letters, digits, _ and - (it may prefix its tools' names)."""
    return isinstance(value, str) and bool(value) and all(c.isalnum() or c in "_-" for c in value)


def is_http_url(value) -> bool:
    return isinstance(value, str) and value.startswith(("http://", "https://"))


def of_strings(value, kind=list) -> bool:
    """``value`` is a ``kind`` (list, or dict: its keys too) of strings."""
    items = [*value, *value.values()] if isinstance(value, dict) else value
    return isinstance(value, kind) and all(isinstance(v, str) for v in items)


def shown_url(url: str) -> str:
    """``url`` as it may be printed or logged: no user, password, query or fragment (they may
    hold secrets), at most 200 characters."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        u = urlsplit(url)
        netloc = (u.hostname or "") + (f":{u.port}" if u.port else "")
    except ValueError:
        return "(not a URL)"
    return urlunsplit((u.scheme, netloc, u.path, "", ""))[:200]


@dataclass
class ServerSpec:
    """One MCP server: a command to start (stdio) or a URL (streamable HTTP)."""

    name: str
    command: Optional[str] = None
    args: Tuple[str, ...] = ()
    env: Optional[Dict[str, str]] = None
    url: Optional[str] = None
    headers: Dict[str, str] = field(default_factory=dict, repr=False)  # never printed
    allowed_tools: Optional[Tuple[str, ...]] = None

    @property
    def where(self) -> str:
        """What to show a person: the command line or the URL (never headers or env, nor a
        URL's user, password or query)."""
        if self.url is not None:
            return shown_url(self.url)
        return " ".join([self.command or "", *self.args])


def _strings(value, what: str, kind=list) -> Any:
    if not of_strings(value, kind):
        raise MCPError(f"{what} must be {'a list' if kind is list else 'an object'} of strings")
    return dict(value) if kind is dict else tuple(value)


def parse_config(data: Any, source: str = "the MCP config") -> List[ServerSpec]:
    """The servers of a ``{"mcpServers": {...}}`` object (validated, one-line errors)."""
    if not isinstance(data, dict) or not isinstance(data.get("mcpServers"), dict):
        raise MCPError(f'{source} must be an object with an "mcpServers" object')
    specs = []
    for name, entry in data["mcpServers"].items():
        where = f"{source}: server {name!r}"
        if not is_name(name):
            raise MCPError(f"{where}: a server name may hold only letters, digits, _ and -")
        if not isinstance(entry, dict):
            raise MCPError(f"{where} must be an object")
        allowed = entry.get("allowedTools")
        if allowed is not None:
            allowed = _strings(allowed, f"{where}: allowedTools")
        if ("command" in entry) == ("url" in entry):
            raise MCPError(f'{where} needs either "command" (stdio) or "url" (streamable HTTP)')
        if "command" in entry:
            if not isinstance(entry["command"], str) or not entry["command"]:
                raise MCPError(f"{where}: command must be a non-empty string")
            args = _strings(entry.get("args", []), f"{where}: args")
            env = _strings(entry["env"], f"{where}: env", dict) if "env" in entry else None
            specs.append(ServerSpec(name, entry["command"], args, env, allowed_tools=allowed))
        else:
            url = entry["url"]
            if not is_http_url(url):
                raise MCPError(f"{where}: url must be an http:// or https:// URL")
            headers = _strings(entry.get("headers", {}), f"{where}: headers", dict)
            specs.append(ServerSpec(name, url=url, headers=headers, allowed_tools=allowed))
    if not specs:
        raise MCPError(f'{source} has no servers in "mcpServers"')
    return specs


def read_config(path) -> List[ServerSpec]:
    """The servers of a ``--mcp FILE.json``."""
    where = f"the MCP config {path}"
    return parse_config(read_json(path, MCPError, where), where)


# --- results ------------------------------------------------------------------------------


@dataclass
class ToolOutcome:
    """What one call did: ``output`` is the text the model hears (the result, or an error
    message when ``error`` is set)."""

    call_id: str
    name: str  # the function name the model called
    server: str
    tool: str
    arguments: str
    output: str = ""
    error: Optional[str] = None
    seconds: float = 0.0
    kind: str = "ok"  # see MCPClient.call

    @property
    def ok(self) -> bool:
        return self.error is None


def _one_line(text: str, n: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n] + "..."


def result_text(result) -> str:
    """The text of a ``CallToolResult``: its text blocks joined, other blocks named; its
    structured content as JSON when it has no text."""
    parts = []
    for block in getattr(result, "content", None) or []:
        kind = getattr(block, "type", None)
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource" and hasattr(block.resource, "text"):
            parts.append(block.resource.text)
        else:
            parts.append(f"[{kind} content]")
    if not parts and getattr(result, "structured_content", None) is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


# --- tools as function tools -------------------------------------------------------------


def function_tools(listed: Sequence[Tuple[str, Sequence[Any]]], taken: Sequence[str] = ()):
    """The tools of each ``(server, tools)`` as OpenAI function tools, and the routes
    ``{function name: (server, tool name)}``. A function is named by its tool, or
    ``server_tool`` where another server (or ``taken``) has the same name."""
    count: Dict[str, int] = {n: 1 for n in taken}
    for _, tools in listed:
        for t in tools:
            count[t.name] = count.get(t.name, 0) + 1
    functions, routes = [], {}
    for server, tools in listed:
        for t in tools:
            name = t.name if count[t.name] == 1 else f"{server}_{t.name}"
            routes[name] = (server, t.name)
            out = {"type": "function", "name": name}
            if t.description:
                out["description"] = t.description
            out["parameters"] = dict(t.input_schema or {"type": "object", "properties": {}})
            functions.append(out)
    return functions, routes

"""MCP servers (the Model Context Protocol) as a conversation's tools.

The ``mcp`` SDK is asyncio and the frame loop must keep its clock, so an :class:`MCPClient` runs
every connection and call on one thread with its own event loop; the session's thread submits
calls and takes the finished results between frames (:meth:`MCPTools.take_finished`). Every
failure becomes the text of a tool result the model hears, never an exception in the frame
loop. The config and naming rules are :mod:`.mcp_config`.
"""

from __future__ import annotations

import asyncio
import json
import queue
import tempfile
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import AsyncExitStack
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .mcp_config import (  # noqa: F401  (the config's names are importable from here too)
    DEFAULT_TOOL_TIMEOUT,
    ERROR_CODES,
    MAX_RESPONSE_BYTES,
    MAX_RESULT_CHARS,
    MCPError,
    ServerSpec,
    ToolOutcome,
    _one_line,
    function_tools,
    parse_config,
    read_config,
    result_text,
    shown_url,
)
from .tools import MAX_TOOLS

START_TIMEOUT = 30.0  # seconds a server has to start and list its tools
CLOSE_TIMEOUT = 10.0


def require_sdk():
    """The ``mcp`` package, or a one-line error that says how to install it."""
    try:
        import mcp  # noqa: F401
        from mcp.client.streamable_http import streamable_http_client  # noqa: F401
    except ImportError:
        raise MCPError(
            "MCP tools need the official MCP Python SDK: pip install 'mlx-voicechat[mcp]'"
        ) from None
    return mcp


# --- the client: one thread, one event loop -----------------------------------------------


class _Connection:
    """One server, held open by a task of the client's loop."""

    def __init__(self, spec: ServerSpec):
        self.spec = spec
        self.session = None
        self.stop = asyncio.Event()  # bound to the client's loop on its first wait
        self.task: Optional[asyncio.Task] = None
        self.gone: Optional[str] = None  # why the connection ended, once it has
        self.errlog = None

    def _stderr_tail(self) -> str:
        if self.errlog is None:
            return ""
        try:
            self.errlog.flush()
            self.errlog.seek(0)
            lines = [x for x in self.errlog.read().decode("utf-8", "replace").splitlines() if x]
        except (OSError, ValueError):
            return ""
        return f"; its last words: {_one_line(lines[-1], 200)}" if lines else ""

    async def run(self, ready: asyncio.Future, max_response_bytes: int) -> None:
        from mcp import ClientSession, StdioServerParameters, stdio_client
        from mcp.client.streamable_http import streamable_http_client
        from mcp.types import PaginatedRequestParams

        spec = self.spec
        try:
            async with AsyncExitStack() as stack:
                if spec.url is not None:
                    from mcp.shared._httpx_utils import create_mcp_http_client

                    http = create_mcp_http_client(headers=dict(spec.headers))
                    await stack.enter_async_context(http)
                    streams = streamable_http_client(
                        spec.url, http_client=http, max_sse_event_size=max_response_bytes
                    )
                else:
                    self.errlog = tempfile.TemporaryFile()  # closed in finally
                    params = StdioServerParameters(
                        command=spec.command, args=list(spec.args), env=spec.env
                    )
                    streams = stdio_client(params, errlog=self.errlog)
                read, write = await stack.enter_async_context(streams)
                session = await stack.enter_async_context(ClientSession(read, write))
                await session.initialize()
                tools, cursor = [], None
                while True:
                    params = None if cursor is None else PaginatedRequestParams(cursor=cursor)
                    listed = await session.list_tools(params=params)
                    tools += listed.tools
                    cursor = listed.next_cursor
                    if not cursor:
                        break
                self.session = session
                ready.set_result(tools)
                await self.stop.wait()
                self.gone = self.gone or "it was stopped"
        except BaseException as e:  # noqa: BLE001  (any end of a server is one message)
            message = _describe(e) + self._stderr_tail()
            self.gone = self.gone or message
            if not ready.done():
                ready.set_exception(MCPError(f"the MCP server {spec.name!r} ({spec.where}) "
                                             f"did not start: {message}"))
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
        finally:
            self.session = None
            if self.errlog is not None:
                self.errlog.close()
                self.errlog = None


def _describe(e: BaseException) -> str:
    """One line for an exception (an exception group: its first leaf). Groups are known by
    their ``exceptions`` tuple: on Python 3.10 anyio raises the ``exceptiongroup`` backport's."""
    while isinstance(getattr(e, "exceptions", None), tuple) and e.exceptions:
        e = e.exceptions[0]
    if isinstance(e, asyncio.CancelledError):
        return "its connection was cancelled"
    text = str(e) or type(e).__name__
    name = type(e).__name__
    return _one_line(text if name in ("MCPError", "McpError") else f"{name}: {text}")


class MCPClient:
    """Connections to MCP servers on a thread of their own. Thread-safe: :meth:`connect` and
    :meth:`call` return ``concurrent.futures.Future`` objects; :meth:`close` stops every server
    it started and the thread."""

    def __init__(
        self, *, timeout: float = DEFAULT_TOOL_TIMEOUT, max_result_chars: int = MAX_RESULT_CHARS,
        max_response_bytes: int = MAX_RESPONSE_BYTES, start_timeout: float = START_TIMEOUT,
    ):
        require_sdk()
        if not timeout > 0:
            raise MCPError(f"the tool timeout must be > 0 seconds, not {timeout}")
        self.timeout = float(timeout)
        self.max_result_chars = int(max_result_chars)
        self.max_response_bytes = int(max_response_bytes)
        self.start_timeout = float(start_timeout)
        self._connections: Dict[str, _Connection] = {}
        self._loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self._loop.run_forever, name="mlx-voicechat-mcp", daemon=True
        )
        self.thread.start()
        self._closed = False

    def _submit(self, coro) -> Future:
        if self._closed:
            coro.close()
            raise MCPError("the MCP client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def connect(self, spec: ServerSpec) -> Future:
        """Start (stdio) or open (HTTP) ``spec``; the future's result is its tools (the SDK's
        ``Tool`` objects); a failure is an :class:`MCPError` with one line."""
        if spec.name in self._connections:
            raise MCPError(f"two MCP servers are named {spec.name!r}")
        conn = _Connection(spec)
        self._connections[spec.name] = conn

        async def start():
            ready = self._loop.create_future()
            conn.task = self._loop.create_task(conn.run(ready, self.max_response_bytes))
            try:
                return await asyncio.wait_for(asyncio.shield(ready), self.start_timeout)
            except asyncio.TimeoutError:
                conn.stop.set()
                conn.task.cancel()
                raise MCPError(
                    f"the MCP server {spec.name!r} ({spec.where}) did not answer within "
                    f"{self.start_timeout:g} s"
                ) from None

        return self._submit(start())

    def call(self, server: str, tool: str, arguments: str) -> Future:
        """Call ``tool`` on ``server`` with ``arguments`` (a JSON object as a string, as the
        model writes it); the future's result is ``(text, error or None, kind)`` and never an
        exception: bad arguments, a closed client, a timeout, a dead server, a tool error and
        an oversized result are error texts; ``kind`` is ``"ok"``, ``"arguments"``, ``"tool"``
        (the tool said it failed), ``"timeout"``, ``"closed"`` (the server or client is gone),
        ``"too_large"`` or ``"protocol"``."""
        out: Future = Future()
        try:
            return self._submit(self._call(server, tool, dict(json.loads(arguments or "{}"))))
        except ValueError as e:
            out.set_result(("", f"the arguments are not JSON: {e}", "arguments"))
        except MCPError as e:
            out.set_result(("", str(e), "closed"))
        return out

    async def _call(self, server: str, tool: str, arguments: dict):
        conn = self._connections.get(server)
        if conn is None:
            return "", f"there is no MCP server {server!r}", "closed"
        if conn.session is None or (conn.task is not None and conn.task.done()):
            why = conn.gone or "not started"
            return "", f"the MCP server {server!r} is not running ({why})", "closed"
        call = asyncio.ensure_future(conn.session.call_tool(tool, arguments))
        # the connection's task ends when its server dies: the call is not waited for then
        done, _ = await asyncio.wait({call, conn.task}, timeout=self.timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        if call not in done:
            call.cancel()
            if conn.task in done:
                reason = conn.gone or "its connection ended"
                return "", f"the MCP server {server!r} stopped during the call ({reason})", "closed"
            return "", f"the tool {tool!r} did not answer within {self.timeout:g} s", "timeout"
        try:
            result = call.result()
        except BaseException as e:  # noqa: BLE001
            closed = getattr(getattr(e, "error", None), "code", None) == ERROR_CODES["closed"]
            if closed or (conn.task is not None and conn.task.done()):
                # the server is gone: later calls are refused at once, and its task ends
                conn.gone = conn.gone or "its connection closed" + conn._stderr_tail()
                conn.session = None
                conn.stop.set()
                message = f"the MCP server {server!r} stopped during the call ({conn.gone})"
                return "", message, "closed"
            return "", f"the tool {tool!r} failed: {_describe(e)}", "protocol"
        text = result_text(result)
        if getattr(result, "is_error", False):
            return "", f"the tool {tool!r} failed: {_one_line(text) or 'no message'}", "tool"
        if len(text) > self.max_result_chars:
            return "", (
                f"the tool {tool!r} returned {len(text)} characters; at most "
                f"{self.max_result_chars} are passed on, so the result was dropped"
            ), "too_large"
        return text, None, "ok"

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Stop every server (a stdio server's process ends) and the loop's thread."""
        if self._closed:
            return
        self._closed = True

        async def stop_all():
            for conn in self._connections.values():
                conn.stop.set()
            tasks = [c.task for c in self._connections.values() if c.task is not None]
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=timeout)
                for t in pending:
                    t.cancel()
                if pending:
                    await asyncio.wait(pending, timeout=2)
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    t.cancel()

        try:
            asyncio.run_coroutine_threadsafe(stop_all(), self._loop).result(timeout + 5)
        except (FutureTimeout, RuntimeError):
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self.thread.join(timeout)
        if not self.thread.is_alive():
            self._loop.close()

    def __enter__(self) -> "MCPClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --- a conversation's tools ---------------------------------------------------------------


class MCPTools:
    """A conversation's MCP servers: started with :meth:`start`, their tools as OpenAI
    function tools (:attr:`functions`), calls the model makes run on the client's thread
    (:meth:`submit`) and their outcomes taken on the session's thread
    (:meth:`take_finished`)."""

    def __init__(self, specs: Sequence[ServerSpec], **client_options):
        self.specs = list(specs)
        self.client = MCPClient(**client_options)
        self.functions: List[Dict[str, Any]] = []
        self.routes: Dict[str, Tuple[str, str]] = {}  # function name -> (server, tool)
        self._finished: "queue.SimpleQueue[ToolOutcome]" = queue.SimpleQueue()
        self.in_flight = 0

    def start(self, taken: Sequence[str] = ()) -> List[Dict[str, Any]]:
        """Start every server and list its tools (an :class:`MCPError` names the first that
        fails; the others are stopped by :meth:`close`). ``taken``: names already in use."""
        futures = [(s, self.client.connect(s)) for s in self.specs]
        listed = []
        for spec, future in futures:
            tools = future.result()
            if spec.allowed_tools is not None:
                missing = sorted(set(spec.allowed_tools) - {t.name for t in tools})
                if missing:
                    raise MCPError(
                        f"the MCP server {spec.name!r} has no tool {', '.join(map(repr, missing))}"
                    )
                tools = [t for t in tools if t.name in spec.allowed_tools]
            listed.append((spec.name, tools))
        functions, routes = function_tools(listed, taken)
        if len(functions) + len(taken) > MAX_TOOLS:
            raise MCPError(
                f"the MCP servers offer {len(functions)} tools "
                f"({', '.join(f['name'] for f in functions)}); the model takes at most "
                f"{MAX_TOOLS} in all: keep some with an \"allowedTools\" list per server"
            )
        self.functions, self.routes = functions, routes
        return self.functions

    def owns(self, name: str) -> bool:
        return name in self.routes

    def submit(self, call) -> Future:
        """Run the model's ``call`` (a ``ToolCall`` naming one of :attr:`functions`); its
        :class:`ToolOutcome` is queued for :meth:`take_finished` (and is the future's
        result)."""
        server, tool = self.routes[call.name]
        outcome = ToolOutcome(call.call_id, call.name, server, tool, call.arguments)
        t0 = time.monotonic()
        self.in_flight += 1
        out: Future = Future()

        def finish(f: Future):
            if f.cancelled() or f.exception() is not None:  # (the client closed under it)
                why = "cancelled" if f.cancelled() else _describe(f.exception())
                text, error, kind = "", f"the call did not run ({why})", "protocol"
            else:
                text, error, kind = f.result()
            outcome.output = text if error is None else error
            outcome.error, outcome.kind = error, kind
            outcome.seconds = time.monotonic() - t0
            self._finished.put(outcome)
            out.set_result(outcome)

        self.client.call(server, tool, call.arguments).add_done_callback(finish)
        return out

    def take_finished(self) -> List[ToolOutcome]:
        """The outcomes that arrived since the last take (call on the session's thread)."""
        out = []
        while not self._finished.empty():  # this thread is the queue's only reader
            out.append(self._finished.get_nowait())
        self.in_flight -= len(out)
        return out

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> "MCPTools":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

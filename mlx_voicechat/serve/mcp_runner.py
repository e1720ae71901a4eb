"""The connection's side of the Realtime ``mcp`` tools (:mod:`.mcp_tools`): :class:`McpRunner`
runs the protocol's jobs on a ``nemotron_voicechat.runtime.mcp.MCPClient`` (a thread and event loop
of its own, never the MLX worker) and hands the outcomes back."""

from __future__ import annotations

import asyncio
import logging
import threading

from .mcp_tools import McpJob, McpPolicy

log = logging.getLogger("mlx_voicechat.serve")


class McpRunner:
    """Runs a connection's :class:`McpJob` objects; the outcomes go to its protocol and
    driver."""

    def __init__(self, conversation, policy: McpPolicy):
        self.c = conversation
        self.policy = policy
        self.client = None
        self.tasks: set = set()
        conversation.protocol.mcp.launch = self.launch

    def launch(self, job: McpJob) -> None:
        task = asyncio.get_running_loop().create_task(self._run(job))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _client(self):
        if self.client is None:
            from ..nemotron_voicechat.runtime.mcp import MCPClient

            self.client = MCPClient(
                timeout=self.policy.timeout,
                max_result_chars=self.policy.max_result_chars,
                max_response_bytes=self.policy.max_response_bytes,
                start_timeout=self.policy.timeout,
            )
        return self.client

    async def _run(self, job: McpJob) -> None:
        from ..nemotron_voicechat.runtime.mcp import MCPError, ServerSpec

        mcp = self.c.protocol.mcp
        if job.kind == "list":
            s = job.server
            try:
                spec = ServerSpec(s.label, url=s.url, headers=s.headers)
                tools = await asyncio.wrap_future(self._client().connect(spec))
                events, commands = mcp.listed(s.label, tools)
            except MCPError as e:
                events, commands = mcp.listed(s.label, None, str(e))
        else:
            try:
                future = self._client().call(job.server.label, job.tool, job.arguments)
                text, error, kind = await asyncio.wrap_future(future)
            except MCPError as e:
                text, error, kind = "", f"the call could not run: {e}", "protocol"
            events, commands = mcp.finished(job, text, error, kind)
            log.info("%s: MCP call %s.%s %s", self.c.protocol.session_id, job.server.label,
                     job.tool, "completed" if error is None else f"failed ({kind})")
        self.c.send(events)
        for command in commands:
            self.c.command(command)

    def close(self) -> None:
        """Stop the calls in flight and the MCP client (on a thread: it waits for servers)."""
        for task in list(self.tasks):
            task.cancel()
        if self.client is not None:
            threading.Thread(target=self.client.close, name="mlx-voicechat-mcp-close").start()
            self.client = None

"""A small MCP server of the tests' own (the official SDK's MCPServer): tools that answer, hang,
fail, return 1 MB, wait for a file, or kill the server mid-call.

``python mcp_server.py stdio`` serves on stdin / stdout; ``python mcp_server.py http`` binds
127.0.0.1 on a free port, prints the port on its first line and serves streamable HTTP at
``/mcp``. ``--only NAME,NAME`` keeps only those tools (the model takes at most 5).
"""

import asyncio
import os
import socket
import sys
from pathlib import Path

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("test-tools", log_level="WARNING")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def get_weather(city: str) -> str:
    """Current weather for a city."""
    return f'{{"city": "{city}", "temp_c": 21}}'


@server.tool()
async def hang() -> str:
    """Never answers."""
    await asyncio.sleep(3600)
    return "late"


@server.tool()
def fail(reason: str = "broken") -> str:
    """Always fails."""
    raise ToolError(f"the tool failed: {reason}")


@server.tool()
def big() -> str:
    """Returns 1 MB of text."""
    return "x" * (1 << 20)


@server.tool()
async def wait_for(path: str) -> str:
    """Answers once ``path`` exists (the test creates it while frames run)."""
    while not Path(path).exists():
        await asyncio.sleep(0.01)
    return "the file is there"


@server.tool()
def pid() -> int:
    """The server's process id."""
    return os.getpid()


@server.tool()
def die() -> str:
    """Kills the server in the middle of the call."""
    os._exit(3)


def main(argv):
    if "--only" in argv:
        keep = set(argv[argv.index("--only") + 1].split(","))
        for name in [t.name for t in asyncio.run(server.list_tools())]:
            if name not in keep:
                server.remove_tool(name)
    if argv[1] == "stdio":
        server.run("stdio")
        return
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)  # connections wait in the backlog until uvicorn has started
    print(sock.getsockname()[1], flush=True)
    app = server.streamable_http_app()
    config = uvicorn.Config(app, log_level="warning")
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))


if __name__ == "__main__":
    main(sys.argv)

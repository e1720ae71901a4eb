"""The tests' own MCP server (``mcp_server.py``, next to this file) as the MCP tests start it:
over stdio (``stdio``: a config entry) and over streamable HTTP (``http_url``: a module
fixture, the server on a free 127.0.0.1 port, stopped after)."""

import subprocess
import sys
from pathlib import Path

import pytest

SERVER = str(Path(__file__).resolve().with_name("mcp_server.py"))


def stdio(only):
    return {"command": sys.executable, "args": [SERVER, "stdio", "--only", only]}


@pytest.fixture(scope="module")
def http_url():
    """The test server over streamable HTTP on a free 127.0.0.1 port (stopped after)."""
    proc = subprocess.Popen([sys.executable, SERVER, "http"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.kill()
        proc.wait(10)

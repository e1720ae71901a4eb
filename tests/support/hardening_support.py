"""What the hardening tests (tests/serve/test_server_hardening.py, test_server_limits.py) share:
a ``serve`` fixture that starts servers of the shared model with any options (all stopped at the
test's end), HTTP with headers, raw handshakes and idle sockets on 127.0.0.1."""

import contextlib
import socket
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
websockets = pytest.importorskip("websockets")

from server_support import (  # noqa: E402  (the server tests' helpers)
    serve_app,
)

from mlx_voicechat.serve.wire import encode_pcm16  # noqa: E402

TIMEOUT = 20.0  # seconds, any single wait on the server
SECRET = "query-string-secret-1234"


@pytest.fixture
def serve(model, worker):
    """Start servers of ``create_app(model, **options)``; all stop at the test's end."""
    with contextlib.ExitStack() as stack:

        def start(limits=None, log_level="warning", **options):
            options.setdefault("silence_feed", False)
            options.setdefault("warmup", False)
            return stack.enter_context(
                serve_app(model, worker, log_level=log_level, limits=limits, **options)
            )

        yield start


def http(server, path, headers=None):
    req = urllib.request.Request(server.url + path, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers


async def native_rates(c):
    await c.send(
        type="session.update",
        session={
            "audio": {
                "input": {"format": {"type": "audio/pcm", "rate": 16000}},
                "output": {"format": {"type": "audio/pcm", "rate": 22050}},
            }
        },
    )
    await c.until_type("session.updated")


def handshake(port, host, origin):
    """The status line a raw WebSocket handshake with these Host and Origin headers gets."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as s:
        s.sendall(
            (
                f"GET /v1/realtime HTTP/1.1\r\nHost: {host}\r\nOrigin: {origin}\r\n"
                "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        return s.recv(200).split(b"\r\n", 1)[0].decode()


def closed_by_server(sock) -> bool:
    try:
        return sock.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def idle_sockets(port, n):
    out = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        out.append(s)
    return out


def spoken_deltas(frames):
    """The audio deltas of the frames inside the model's turns (at 22.05 kHz, passed through)."""
    out, speaking = [], False
    for f in frames:
        speaking = speaking or f.turn == "start"
        if speaking:
            out.append(encode_pcm16(f.audio))
        if f.turn == "end":
            speaking = False
    return out

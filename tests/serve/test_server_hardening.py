"""The server against a hostile or careless client on 127.0.0.1 (issue 26): clear, the idle
bound, bad text, bad paths, connection floods, slow headers, the Origin check. Floods, sizes and
secrets are in test_server_limits.py, the serve process in test_server_process.py.

Every load here is bounded in count and time and talks only to 127.0.0.1. All MLX work of this
module runs on the process's shared worker thread.
"""

import asyncio
import json
import socket
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
websockets = pytest.importorskip("websockets")

from hardening_support import (  # noqa: E402
    closed_by_server,
    handshake,
    http,
    idle_sockets,
    native_rates,
    serve,  # noqa: E402, F401  (a fixture)
    spoken_deltas,
)
from server_support import (  # noqa: E402  (the server tests' helpers)
    connect,
    noise,
    pcm,
    run,
)

from mlx_voicechat.serve.limits import Limits  # noqa: E402

# --- section 3: clear and the idle bound ----------------------------------------------------


def test_clear_drops_the_audio_the_session_has_not_consumed(serve, model, worker):
    server = serve(stats_every_frames=1)
    x = noise(1.0, 16000, seed=11)
    first = x[: 1280 * 3 + 199 + 600]  # frames 0-3, and 600 samples no frame has read yet
    later = x[8000 : 8000 + 3260]

    def reference():  # what the session hears: the 600 samples are gone
        s = model.session()
        frames = s.feed(first[:-600] / 32768.0) + s.feed(later / 32768.0)
        s.close()
        return frames

    ref = worker.submit(reference).result()
    assert len(ref) == 6  # with the 600 samples it would be 7

    async def main():
        c = await connect(server)
        await native_rates(c)
        await c.send(type="input_audio_buffer.append", audio=pcm(first))
        await c.until(lambda e: e["type"] == "x-voicechat.stats" and e["frames"] >= 4)
        await c.send(type="input_audio_buffer.clear")
        await c.until_type("input_audio_buffer.cleared")
        await c.send(type="input_audio_buffer.append", audio=pcm(later))
        await c.until(lambda e: e["type"] == "x-voicechat.stats" and e["frames"] >= 6)
        with pytest.raises(asyncio.TimeoutError):  # and no seventh frame
            await c.until(lambda e: e["type"] == "x-voicechat.stats", timeout=0.6)
        await c.ws.close()
        return c.events

    events = run(main())
    frames = max(e["frames"] for e in events if e["type"] == "x-voicechat.stats")
    assert frames == 6
    want = spoken_deltas(ref)
    assert want, "the model should speak in these frames"
    assert [e["delta"] for e in events if e["type"] == "response.output_audio.delta"] == want


def test_idle_timeout_error_and_close_4408(serve):
    server = serve(idle_timeout=0.6)

    async def silent():
        c = await connect(server)
        t = time.monotonic()
        e = await c.until_type("error", timeout=5)
        assert e["error"]["code"] == "idle_timeout" and "0.6 s" in e["error"]["message"]
        assert await c.closed() == 4408
        return time.monotonic() - t

    assert run(silent()) >= 0.5

    async def talking():  # audio every 0.2 s for 1.2 s keeps it open, then it times out
        c = await connect(server)
        await native_rates(c)
        for i in range(6):
            await c.send(type="input_audio_buffer.append", audio=pcm(noise(0.05, 16000, i)))
            await asyncio.sleep(0.2)
        assert not [e for e in c.events if e["type"] == "error"]
        e = await c.until_type("error", timeout=5)
        assert e["error"]["code"] == "idle_timeout"
        assert await c.closed() == 4408

    run(talking())


# --- section 4: what a hostile client found ---------------------------------------------------


def test_lone_surrogates_are_invalid_values_and_the_session_goes_on(serve):
    server = serve(stats_every_frames=1)
    bad = [
        (
            '{"type": "session.update", "session": {"instructions": "\\ud800"}}',
            "session.instructions",
        ),
        (
            '{"type": "session.update", "session": {"tools": [{"type": "function", '
            '"name": "\\udfff"}]}}',
            "session.tools[0].name",
        ),
        ('{"type": "no.such.event", "event_id": "\\ud800"}', "event_id"),
    ]

    async def main():
        c = await connect(server)
        for raw, param in bad:
            await c.ws.send(raw)
            e = await c.until_type("error")
            assert e["error"]["code"] == "invalid_value" and e["error"]["param"] == param
            assert e["error"]["event_id"] is None
        await c.send(type="session.update", session={"instructions": "Hi \ud83d\ude00."})  # pair
        updated = await c.until_type("session.updated")
        assert updated["session"]["instructions"] == "Hi \U0001f600."
        await native_rates(c)
        await c.send(type="input_audio_buffer.append", audio=pcm(noise(0.3, 16000)))
        await c.until_type("x-voicechat.stats")  # the session runs
        await c.ws.close()

    run(main())


def test_bad_static_names_are_404(serve):
    server = serve()
    for path in ("/static/a%00b", "/static/" + "a" * 300, "/static/" + "b/" * 3000 + "c"):
        status, body, _ = http(server, path)
        assert status == 404, (path[:40], status, body[:200])
    assert http(server, "/static/app.js")[0] == 200


def test_open_connections_are_bounded_and_health_answers(serve):
    server = serve(limits=Limits(max_connections=100, header_timeout=30))
    socks = idle_sockets(server.port, 500)
    try:
        deadline = time.monotonic() + 10
        while sum(map(closed_by_server, socks)) < 400:
            assert time.monotonic() < deadline, "the server held more than its bound"
            time.sleep(0.05)
        for _ in range(3):
            status, body, _ = http(server, "/health")
            assert status == 200 and json.loads(body)["status"] == "ok"
    finally:
        for s in socks:
            s.close()


def test_slow_or_missing_headers_time_out_and_sessions_stay(serve):
    server = serve(limits=Limits(header_timeout=0.5))
    nothing = socket.create_connection(("127.0.0.1", server.port))
    slow = socket.create_connection(("127.0.0.1", server.port))
    slow.setblocking(False)
    try:
        t = time.monotonic()
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\n":
            if closed_by_server(slow):
                break
            slow.send(bytes([byte]))
            time.sleep(0.05)
        assert closed_by_server(slow) and time.monotonic() - t < 3
        assert closed_by_server(nothing)
    finally:
        nothing.close()
        slow.close()

    async def session():  # a WebSocket outlives the header timeout
        c = await connect(server)
        await asyncio.sleep(1.0)
        await c.send(type="session.update", session={"instructions": "Hi."})
        await c.until_type("session.updated")
        await c.ws.close()

    run(session())


def test_origin_is_judged_by_the_bound_address_not_the_host_header(serve):
    server = serve(allow_origins=("https://app.example",))
    port = server.port
    evil = f"evil.example:{port}"
    assert "403" in handshake(port, evil, f"http://{evil}")  # DNS rebinding
    assert "403" in handshake(port, f"127.0.0.1:{port}", f"http://{evil}")
    for origin in (f"http://127.0.0.1:{port}", f"http://localhost:{port}", "https://app.example"):
        assert "101" in handshake(port, evil, origin), origin

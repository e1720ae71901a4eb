"""The server against a hostile or careless client on 127.0.0.1 (issue 26): clear, the idle
bound, bad text, bad paths, connection floods, the Origin check, reply floods, huge prompts,
secrets in logs, oversized events, the lag message, the page's headers, the open-file limit.

Every load here is bounded in count and time and talks only to 127.0.0.1. All MLX work of this
module runs on the process's shared worker thread.
"""

import asyncio
import contextlib
import json
import logging
import os
import resource
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
websockets = pytest.importorskip("websockets")

from mlx_voicechat.serve.app import WS_MAX_SIZE, create_app  # noqa: E402
from mlx_voicechat.serve.connection import Conversation  # noqa: E402
from mlx_voicechat.serve.limits import Limits, raise_open_file_limit  # noqa: E402
from mlx_voicechat.serve.protocol import MAX_EVENT_BYTES, encode_pcm16  # noqa: E402
from server_support import (  # noqa: E402  (the server tests' helpers)
    connect,
    noise,
    pcm,
    run,
    serve_app,
    ws_url,
)

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 20.0  # seconds, any single wait on the server
SECRET = "query-string-secret-1234"


# --- fixtures and helpers -------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from mlx_voicechat.factory import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("hardening") / "tiny", "tiny", seed=0)


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


def test_a_reply_flood_is_paced_not_dropped(serve):
    server = serve(send_queue_size=8)

    async def main():
        c = await connect(server)
        burst = 300

        async def flood():
            for _ in range(burst):
                await c.send(type="session.update", session={"voice": "ash"})

        sender = asyncio.create_task(flood())
        await c.until(lambda e: sum(x["type"] == "session.updated" for x in c.events) == burst)
        await sender
        await c.send(type="session.update", session={"instructions": "still here"})
        await c.until_type("session.updated")
        assert not [e for e in c.events if e["type"] == "error"]
        await c.ws.close()

    run(main())


def test_huge_instructions_are_refused_by_length_off_the_worker(serve, worker, monkeypatch):
    server = serve()
    jobs = []
    real = worker.submit
    monkeypatch.setattr(worker, "submit", lambda fn, *a: jobs.append(fn) or real(fn, *a))

    async def huge():
        c = await connect(server)
        await c.send(type="session.update", session={"instructions": "a" * 1_000_000})
        e = await c.until_type("error")
        assert e["error"]["code"] == "invalid_value" and "characters" in e["error"]["message"]
        assert e["error"]["param"] == "session.instructions"
        kept = await c.until_type("session.updated")  # the rest of the update: nothing
        assert len(kept["session"]["instructions"]) < 1000
        await c.send(type="session.update", session={"instructions": "Short."})
        assert (await c.until_type("session.updated"))["session"]["instructions"] == "Short."
        await c.ws.close()

    run(huge())
    work = [fn for fn in jobs if getattr(fn, "__name__", "") != "close"]  # free() closes
    assert not work, work  # nothing reached the worker

    # Within the character bound but past the token bound: refused at the first audio, with
    # the tokens counted on another thread; the session never opens on the worker.
    few = serve(max_prompt_tokens=20)
    words = "hello world " * 20

    async def long_prompt():
        c = await connect(few)
        await c.send(type="session.update", session={"instructions": words})
        await c.until_type("session.updated")
        await c.send(type="input_audio_buffer.append", audio=pcm(noise(0.2, 24000)))
        e = await c.until_type("error")
        assert e["error"]["code"] == "invalid_value" and "at most 20" in e["error"]["message"]
        assert await c.closed() == 1008

    jobs.clear()
    run(long_prompt())
    assert not [fn for fn in jobs if getattr(fn, "__name__", "") == "_open"]


def test_a_key_in_the_query_string_is_not_logged(serve):
    server = serve(api_key="the-key", log_level="info")
    lines = []

    class Capture(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = Capture()
    loggers = [logging.getLogger(n) for n in ("uvicorn.access", "uvicorn.error")]
    for logger in loggers:
        logger.addHandler(handler)
    try:

        async def main():
            with pytest.raises(websockets.InvalidStatus):
                await websockets.connect(f"{ws_url(server)}&api_key={SECRET}", open_timeout=TIMEOUT)

        run(main())
        assert http(server, f"/health?api_key={SECRET}&x=1")[0] == 200
        assert http(server, f"/v1/models?api_key={SECRET}")[0] == 401
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    logged = "\n".join(lines)
    assert "/v1/realtime" in logged and "/health" in logged and "/v1/models" in logged
    assert SECRET not in logged and "api_key=(hidden)" in logged


def test_event_sizes_get_what_the_docs_say(serve):
    server = serve()
    docs = (ROOT / "docs" / "serving.md").read_text()
    assert f"{MAX_EVENT_BYTES >> 20} MiB" in docs and f"{WS_MAX_SIZE >> 20} MiB" in docs
    assert "1009" in docs

    async def main():
        c = await connect(server)
        await c.ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (2 << 20)}))
        assert (await c.until_type("error"))["error"]["code"] == "event_too_large"
        await c.send(type="session.update", session={"instructions": "Hi."})
        await c.until_type("session.updated")  # the session goes on
        await c.ws.send("x" * (WS_MAX_SIZE + 1))
        assert await c.closed() == 1009

    run(main())


def test_lag_exceeded_says_which_side_is_behind(serve, model):
    server = serve()

    async def main():
        c = await connect(server)
        await native_rates(c)
        await c.send(type="input_audio_buffer.append", audio=pcm(noise(10.5, 16000)))
        e = await c.until_type("error")
        assert e["error"]["code"] == "lag_exceeded"
        assert "faster than real time (10.5 s of audio in" in e["error"]["message"]
        assert await c.closed() == 1013

    run(main())
    # A client at real time and a model that falls behind it: the machine is named.
    c = Conversation(create_app(model, warmup=False).state.server, websocket=None)
    c.t0 = time.monotonic() - 20.0
    c.position, c.client_seconds = 20 * 16000, 20.0
    c.consumed = 5 * 16000
    c.check_lag()
    error = c.outbox.get_nowait()["error"]
    assert error["code"] == "lag_exceeded"
    assert "the machine is slower than real time" in error["message"]


@pytest.mark.parametrize("by", ["audio", "commit"])
def test_speech_that_is_not_finite_is_a_server_error_not_audio(serve, monkeypatch, by):
    """The model's speech is always finite; were a frame's NaN, the client gets
    ``server_error`` and close 1011 (no audio delta, no silence in its place), whether the
    frame was fed by the client's audio or by a commit's trailing silence."""
    import dataclasses

    from mlx_voicechat.serve.stepper import Stepper

    real = Stepper.feed

    async def feed(self, handle, samples):  # every frame speaks, NaN
        events, seconds = await real(self, handle, samples)
        nan = [dataclasses.replace(e, audio=np.full(1764, np.nan, np.float32)) for e in events]
        return [dataclasses.replace(e, turn="start") for e in nan], seconds

    monkeypatch.setattr(Stepper, "feed", feed)
    server = serve()

    async def main():
        c = await connect(server)
        await native_rates(c)
        if by == "audio":
            await c.send(type="input_audio_buffer.append", audio=pcm(noise(0.5, 16000)))
        else:  # less than a frame, then commit: the frames come from the trailing silence
            await c.send(type="input_audio_buffer.append", audio=pcm(noise(0.005, 16000)))
            await c.send(type="input_audio_buffer.commit")
        e = await c.until_type("error")
        return e["error"], await c.closed(), c.events

    error, code, events = run(main())
    assert error["type"] == "server_error" and error["code"] == "server_error", error
    assert error["message"] == (
        "ValueError: audio to encode as PCM16 has 1764 NaN or infinite samples of 1764"
    )
    assert code == 1011
    assert not [e for e in events if e["type"] == "response.output_audio.delta"]


def test_the_page_is_sent_with_security_headers(serve):
    server = serve()
    for path in ("/", "/static/app.js", "/health"):
        status, _, headers = http(server, path)
        assert status == 200, path
        csp = headers["Content-Security-Policy"]
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp, path
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert headers["X-Frame-Options"] == "DENY"


# --- the process: open files, 2,000 idle connections, its log -----------------------------------


@pytest.fixture
def started(monkeypatch):
    """`serve.run` with uvicorn replaced (the arguments it got are returned)."""
    from mlx_voicechat.cli import serve as cli

    calls = {}
    def serve_app(app, shutdown_timeout, **kw):  # instead of uvicorn
        calls.update(app=app, shutdown_timeout=shutdown_timeout, **kw)
        return 0

    monkeypatch.setattr(cli, "_serve_app", serve_app)
    monkeypatch.delenv(cli.KEY_ENV, raising=False)
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    yield calls
    with contextlib.suppress(ValueError, OSError):  # (a hard limit lowered for good)
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)


def parse(*argv):
    import argparse

    from mlx_voicechat.cli import serve as cli

    p = argparse.ArgumentParser(prog="mlx-voicechat")
    cli.add_parser(p.add_subparsers(dest="command"))
    return p.parse_args(["serve", "--model", "some/ckpt", *argv])


def test_the_open_file_limits_survive_loading_the_model(started, monkeypatch):
    import types

    import mlx_voicechat
    from mlx_voicechat.cli import serve as cli
    from mlx_voicechat.serve import limits

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    finite = hard != resource.RLIM_INFINITY
    imported = []

    def import_module(name):  # importing mlx_lm.utils lowers both limits (to 2048 / 4096)
        imported.append(name)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard - 1 if finite else 1 << 20))

    def load(path, tokenizer=None):  # something else in the load lowers the soft one
        now = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, now[1]))
        return "model"

    monkeypatch.setattr(limits, "importlib", types.SimpleNamespace(import_module=import_module))
    monkeypatch.setattr(mlx_voicechat, "load", load)
    assert cli.run(parse("--idle-timeout", "30", "--keep-alive-timeout", "2")) == 0
    assert imported == ["mlx_lm.utils"]
    now = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert now[1] == hard  # a process without privileges could never raise it again
    wanted = Limits().files_needed
    assert now[0] >= (min(max(soft, wanted), hard) if finite else max(soft, wanted))
    assert started["timeout_keep_alive"] == 2 and started["http"].__name__.startswith("Guarded")
    assert started["app"].state.server.idle_timeout == 30


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--idle-timeout", "-1"), "--idle-timeout"),
        (("--max-connections", "0"), "--max-connections"),
        (("--header-timeout", "0"), "--header-timeout"),
        (("--keep-alive-timeout", "0"), "--keep-alive-timeout"),
        (("--shutdown-timeout", "0"), "--shutdown-timeout"),
        (("--max-prompt-tokens", "0"), "--max-prompt-tokens"),
    ],
)
def test_bad_limits_are_one_line_errors(started, argv, message):
    from mlx_voicechat.cli import serve as cli

    with pytest.raises(cli.ServeError, match=message):
        cli.run(parse(*argv))


def test_the_cli_server_answers_under_2000_idle_connections(checkpoint, tmp_path):
    n = 2100  # past the 2048 files that importing mlx_lm.utils leaves a process
    if (raise_open_file_limit(None, n + 512) or 1 << 30) < n + 512:
        pytest.skip("this process may not open enough files for the test")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "mlx_voicechat", "serve", "--model", str(checkpoint)]
    argv += ["--port", str(port), "--api-key", "the-key"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"

    def get(path, timeout=2.0):
        try:
            with urllib.request.urlopen(url + path, timeout=timeout) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError as e:
            return repr(e)

    socks = []
    try:
        deadline = time.monotonic() + 120
        while get("/health", 0.5) != 200:
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        assert get(f"/v1/models?api_key={SECRET}") == 401
        socks = idle_sockets(port, n)
        time.sleep(0.5)
        for _ in range(5):  # /health answers throughout
            assert get("/health") == 200
            time.sleep(0.2)
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        proc.wait(30)
    text = log.read_text()
    assert "Too many open files" not in text and "out of system resource" not in text
    assert SECRET not in text and "/v1/models?api_key=(hidden)" in text
    assert len(text) < 20_000, f"the log grew to {len(text)} bytes"

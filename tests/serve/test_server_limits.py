"""The server's limits against a careless client on 127.0.0.1 (issue 26): reply floods, huge
prompts, secrets in logs, oversized events, the lag message, speech that is not finite, the
page's security headers. Bounded in count and time; MLX work on the shared worker thread.
"""

import asyncio
import json
import logging
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
websockets = pytest.importorskip("websockets")

from hardening_support import (  # noqa: E402
    SECRET,
    TIMEOUT,
    http,
    native_rates,
    serve,  # noqa: E402, F401  (a fixture)
)
from server_support import (  # noqa: E402  (the server tests' helpers)
    connect,
    noise,
    pcm,
    run,
    ws_url,
)

from mlx_voicechat.serve.app import WS_MAX_SIZE, create_app  # noqa: E402
from mlx_voicechat.serve.connection import Conversation  # noqa: E402
from mlx_voicechat.serve.wire import MAX_EVENT_BYTES  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


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

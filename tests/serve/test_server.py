"""The Realtime server through real sockets: uvicorn on 127.0.0.1 on a free port, the shared
tiny model that takes short turns (tests/support/server_support.py), the `websockets` client
and the stock `openai` SDK client: routes, streams equal to a bare session, the SDK on its
defaults, the silence feed, the key and the Origin check, bad events. Sessions, slots and
their limits are in test_server_sessions.py.
"""

import asyncio
import base64
import json
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
websockets = pytest.importorskip("websockets")

from server_support import (  # noqa: E402
    ALLOWED,
    KEY,
    TIMEOUT,
    connect,
    decode,
    drain,
    expected_responses,
    free_after_each_test,
    http,
    native_rates,
    noise,
    pcm,
    plain,  # noqa: E402, F401  (a module fixture)
    reference,
    responses,
    run,
    server_fixture,
    ws_url,
)

# --- fixtures -----------------------------------------------------------------------------

keyed = server_fixture(
    "keyed",
    "An API key and the real-time silence feed (the defaults of `serve`).",
    api_key=KEY,
    stats_every_frames=4,
    warmup=False,
)
_slots_free_after_each_test = free_after_each_test("plain", "keyed")


# --- the tests ------------------------------------------------------------------------------


def test_http_routes(plain):
    status, body = http(plain, "/health")
    health = json.loads(body)
    assert status == 200 and health["status"] == "ok" and health["max_sessions"] == 1
    status, body = http(plain, "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "nemotron-voicechat"
    status, body = http(plain, "/static/../app.py")
    assert status == 404
    status, body = http(plain, "/")
    from mlx_voicechat.serve.app import STATIC_DIR

    if (STATIC_DIR / "index.html").is_file():
        assert status == 200 and b"<" in body
    else:
        assert status == 404 and b"not installed" in body


def test_stream_equals_session_at_native_rates(plain, model, worker):
    x = noise(1.2, 16000)
    chunks = [x[i : i + 1000] for i in range(0, len(x), 1000)]
    ref = reference(worker, model, chunks)
    want = expected_responses(ref, 22050)
    assert want and any(closed for *_, closed in want), "the model should take a turn"

    async def main():
        c = await connect(plain)
        await native_rates(c)
        for chunk in chunks:
            await c.append(chunk)
        await c.until_frames(len(ref))
        await c.ws.close()
        return c.events

    events = run(main())
    got = responses(events)
    assert len(got) == len(want)
    for (rid, audio, text, status), (w_audio, w_text, closed) in zip(got, want):
        assert audio == w_audio  # one delta per spoken frame, the same PCM
        assert text == w_text
        assert status == ("completed" if closed else None)
    user = [e["delta"] for e in events if e["type"].endswith("input_audio_transcription.delta")]
    assert user == [f.transcript for f in ref if f.transcript]
    items = {e["item"]["id"] for e in events if e["type"] == "conversation.item.added"}
    assert all(
        e["item_id"] in items for e in events if e["type"].startswith("conversation.item.input")
    )


def test_stream_at_24k_within_resampler_tolerance(plain, model, worker):
    x = noise(1.0, 24000, seed=1)
    chunks = [x[i : i + 2400] for i in range(0, len(x), 2400)]
    ref = reference(worker, model, chunks, input_rate=24000)
    want = expected_responses(ref, 24000)
    assert want

    async def main():
        c = await connect(plain)
        for chunk in chunks:
            await c.send(type="input_audio_buffer.append", audio=pcm(chunk))
        await c.until_frames(len(ref))
        await c.ws.close()
        return c.events

    got = responses(run(main()))
    assert len(got) == len(want)
    for (_, audio, text, _), (w_audio, w_text, _) in zip(got, want):
        assert len(audio) == len(w_audio) and text == w_text
        a, b = (
            np.concatenate([decode(d) for d in audio]),
            np.concatenate([decode(d) for d in w_audio]),
        )
        assert a.shape == b.shape and np.max(np.abs(a - b)) <= 1


def test_openai_sdk_client_unchanged(keyed):
    openai = pytest.importorskip("openai")

    async def main():
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{keyed.port}/v1", api_key=KEY)
        got = {}
        async with client.realtime.connect(model="nemotron-voicechat") as conn:
            await conn.session.update(
                session={
                    "type": "realtime",
                    "instructions": "You are a helpful assistant.",
                    "output_modalities": ["audio"],
                    "audio": {
                        "input": {"format": {"type": "audio/pcm", "rate": 24000}},
                        "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "Aria"},
                    },
                }
            )
            async for event in conn:
                got.setdefault(event.type, event)
                if event.type == "session.updated":
                    x = noise(0.8, 24000)
                    for i in range(0, len(x), 4800):
                        await conn.input_audio_buffer.append(audio=pcm(x[i : i + 4800]))
                if event.type == "response.output_audio.delta":
                    break
            # Keep reading while the connection closes: a websockets client whose incoming
            # queue is full does not see the server's close frame (it waits 10 s).
            reader = asyncio.create_task(drain(conn))
        await asyncio.wait_for(reader, TIMEOUT)
        return got

    got = run(main())
    assert got["session.updated"].session.instructions == "You are a helpful assistant."
    delta = got["response.output_audio.delta"]
    assert delta.response_id.startswith("resp_") and len(base64.b64decode(delta.delta)) > 0
    assert "response.created" in got and "error" not in got


def test_silence_feed_keeps_the_clock(keyed):
    async def main():
        c = await connect(keyed, additional_headers={"Authorization": f"Bearer {KEY}"})
        await c.append(noise(0.32, 24000), chunk=7680)  # 4 frames of audio, then nothing
        t = time.monotonic()
        e = await c.until_frames(12)
        await c.ws.close()
        return e, time.monotonic() - t

    stats, waited = run(main())
    # the clock fed silence frames at real time (not faster)
    assert stats["frames"] >= 12 and waited >= (12 - 4) * 0.08 * 0.5
    assert "lag_seconds" in stats and "rtf" in stats


def test_auth(keyed):
    async def main():
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            with pytest.raises(websockets.InvalidStatus) as e:
                await websockets.connect(ws_url(keyed), additional_headers=headers)
            assert e.value.response.status_code == 403
        with pytest.raises(websockets.InvalidStatus):
            await websockets.connect(
                ws_url(keyed), subprotocols=["realtime", "openai-insecure-api-key.wrong"]
            )
        c = await connect(keyed, subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"])
        assert c.ws.subprotocol == "realtime"
        await c.ws.close()

    run(main())
    assert http(keyed, "/v1/models")[0] == 401
    assert http(keyed, "/v1/models", {"Authorization": f"Bearer {KEY}"})[0] == 200
    assert http(keyed, "/health")[0] == 200


def test_origin(plain):
    async def main():
        with pytest.raises(websockets.InvalidStatus) as e:
            await websockets.connect(ws_url(plain), origin="http://evil.example")
        assert e.value.response.status_code == 403
        for origin in (ALLOWED, f"http://127.0.0.1:{plain.port}"):
            c = await connect(plain, origin=origin)
            await c.ws.close()

    run(main())


def test_bad_events_get_errors_and_the_session_goes_on(plain):
    async def main():
        c = await connect(plain)
        bad = [
            ("{not json", "invalid_json"),
            (json.dumps({"type": "no.such.event"}), "unknown_event"),
            (json.dumps({"type": "input_audio_buffer.append", "audio": "%%%"}), "invalid_base64"),
            (
                json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA"}),
                "invalid_audio",
            ),
            (
                json.dumps({"type": "session.update", "session": {"output_audio_format": "x"}}),
                "invalid_value",
            ),
            (
                json.dumps({"type": "session.update", "session": {"tools": [{"type": 1}]}}),
                "invalid_value",
            ),
            (
                json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (3 << 19)}),
                "event_too_large",
            ),
        ]
        for raw, code in bad:
            await c.ws.send(raw)
            e = await c.until_type("error")
            assert e["error"]["code"] == code, (raw[:60], e)
        await c.ws.send(b"\x00\x01")
        assert (await c.until_type("error"))["error"]["code"] == "invalid_event"
        await c.send(type="session.update", session={"instructions": "Hello."})
        assert (await c.until_type("session.updated"))["session"]["instructions"] == "Hello."
        await c.ws.close()

    run(main())


def test_new_instructions_after_audio_restart_the_session(plain):
    async def main():
        c = await connect(plain)
        await native_rates(c)
        await c.append(noise(0.2, 16000))
        await c.until_frames(2)
        await c.send(type="session.update", session={"instructions": "Something else."})
        e = await c.until_type("session.updated")
        assert e["session"]["instructions"] == "Something else."
        await c.send(type="session.update", session={"audio": {"output": {"voice": "ash"}}})
        assert (await c.until_type("session.updated"))["session"]["audio"]["output"][
            "voice"
        ] == "Aria"
        await c.append(noise(0.2, 16000, seed=3))
        await c.until_frames(4)  # the session goes on, in a new session with the new prompt
        assert not [x for x in c.events if x["type"] == "error"]
        await c.ws.close()

    run(main())

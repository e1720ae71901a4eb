"""The Realtime server through real sockets: uvicorn on 127.0.0.1 on a free port, a tiny
random-weight checkpoint, the `websockets` client and the stock `openai` SDK client.

The tiny model's text head is random: left alone it starts a turn at once and almost never
says EOS. The `model` fixture scales its EOS and silence rows up (real weights, real frames),
so it takes short turns and the whole response lifecycle happens within a second of audio.
All MLX work of this module runs on one shared worker thread (MLX streams belong to threads).
"""

import asyncio
import base64
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
websockets = pytest.importorskip("websockets")

from mlx_voicechat.serve.app import ServerThread, create_app  # noqa: E402
from mlx_voicechat.serve.protocol import Resampler, encode_pcm16  # noqa: E402
from mlx_voicechat.serve.worker import Worker  # noqa: E402

KEY = "sekret-key"
ALLOWED = "http://allowed.example"
TIMEOUT = 20.0  # seconds, any single wait on the server


# --- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def worker():
    return Worker.shared()


def short_turn_model(path):
    """On the worker: the checkpoint at ``path`` with its EOS and silence rows scaled up, so
    that the tiny model takes short turns."""
    import mlx.core as mx

    import mlx_voicechat

    m = mlx_voicechat.load(path)
    cfg = m.config
    w = np.array(m.stt_model.lm_head.weight)
    w[cfg.eos_token_id] *= 3.0
    w[cfg.silence_token_id] *= 3.0
    m.stt_model.lm_head.weight = mx.array(w)
    mx.eval(m.stt_model.lm_head.weight)
    return m


@pytest.fixture(scope="module")
def model(tmp_path_factory, worker):
    def build():
        from mlx_voicechat.factory import make_checkpoint

        return short_turn_model(
            make_checkpoint(tmp_path_factory.mktemp("serve") / "tiny", "tiny", seed=0)
        )

    return worker.submit(build).result()


def _start(app):
    return ServerThread(app).__enter__()


@pytest.fixture(autouse=True)
def _slots_free_after_each_test(request):
    """After each test, its servers' sessions are closed before the next test connects (a slot
    is given back once the server has seen the client go, which can trail the client's close
    on a loaded machine)."""
    yield
    for name in ("plain", "keyed", "small_queue", "short", "two_slots", "four_slots"):
        if name in request.fixturenames:
            wait_free(request.getfixturevalue(name))


@pytest.fixture(scope="module")
def plain(model, worker):
    """No key, no silence feed, a stats event after every worker job."""
    app = create_app(
        model,
        silence_feed=False,
        stats_every_frames=1,
        allow_origins=(ALLOWED,),
        worker=worker,
    )
    s = _start(app)
    yield s
    s.__exit__(None, None, None)


@pytest.fixture(scope="module")
def keyed(model, worker):
    """An API key and the real-time silence feed (the defaults of `serve`)."""
    app = create_app(model, api_key=KEY, stats_every_frames=4, worker=worker, warmup=False)
    s = _start(app)
    yield s
    s.__exit__(None, None, None)


@pytest.fixture(scope="module")
def small_queue(model, worker):
    app = create_app(model, silence_feed=False, send_queue_size=8, worker=worker, warmup=False)
    s = _start(app)
    yield s
    s.__exit__(None, None, None)


@pytest.fixture(scope="module")
def short(model, worker):
    """Sessions that end by themselves after 0.4 s (the session's max_seconds)."""
    app = create_app(
        model,
        silence_feed=False,
        session_options={"max_seconds": 0.4},
        worker=worker,
        warmup=False,
    )
    s = _start(app)
    yield s
    s.__exit__(None, None, None)


# --- helpers ------------------------------------------------------------------------------


def run(coro, timeout=60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def ws_url(server):
    """The server's URL, asking for the x-voicechat.* events (stats after each job)."""
    return f"ws://127.0.0.1:{server.port}/v1/realtime?x-voicechat=1"


def http(server, path, headers=None):
    req = urllib.request.Request(server.url + path, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def pcm(samples) -> str:
    return base64.b64encode(np.asarray(samples, "<i2").tobytes()).decode()


def noise(seconds, rate, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(int(seconds * rate)) * 3000).astype(np.int16)


class Client:
    def __init__(self, ws):
        self.ws = ws
        self.events = []

    async def send(self, **event):
        await self.ws.send(json.dumps(event))

    async def recv(self, timeout=TIMEOUT):
        e = json.loads(await asyncio.wait_for(self.ws.recv(), timeout))
        self.events.append(e)
        return e

    async def until(self, pred, timeout=TIMEOUT):
        deadline = time.monotonic() + timeout
        while True:
            e = await self.recv(max(deadline - time.monotonic(), 0.01))
            if pred(e):
                return e

    async def until_type(self, type_, timeout=TIMEOUT):
        return await self.until(lambda e: e["type"] == type_, timeout)

    async def until_frames(self, n, timeout=TIMEOUT):
        return await self.until(
            lambda e: e["type"] == "x-voicechat.stats" and e["frames"] >= n, timeout
        )

    async def append(self, samples, chunk=1000):
        for i in range(0, len(samples), chunk):
            await self.send(type="input_audio_buffer.append", audio=pcm(samples[i : i + chunk]))

    async def closed(self, timeout=TIMEOUT):
        """Read until the server closes; returns the close code."""
        with pytest.raises(websockets.ConnectionClosed):
            while True:
                await self.recv(timeout)
        return self.ws.close_code


async def connect(server, **kw):
    # max_queue=None: a client that stops reading with a full queue only sees the server's
    # close frame after its close_timeout (10 s); these clients keep everything instead
    kw.setdefault("max_queue", None)
    ws = await websockets.connect(ws_url(server), open_timeout=TIMEOUT, **kw)
    c = Client(ws)
    assert (await c.recv())["type"] == "session.created"
    return c


async def native_rates(c):
    await c.send(
        type="session.update",
        session={
            "type": "realtime",
            "audio": {
                "input": {"format": {"type": "audio/pcm", "rate": 16000}},
                "output": {"format": {"type": "audio/pcm", "rate": 22050}},
            },
        },
    )
    assert (await c.until_type("session.updated"))["session"]["audio"]["input"]["format"][
        "rate"
    ] == 16000


RESPONSE_ORDER = [
    "response.created",
    "response.output_item.added",
    "conversation.item.added",
    "response.content_part.added",
]
RESPONSE_END = [
    "response.output_audio.done",
    "response.output_audio_transcript.done",
    "response.content_part.done",
    "response.output_item.done",
    "conversation.item.done",
    "response.done",
]


def responses(events):
    """Check the order of every response's events; returns [(response_id, [audio deltas],
    [transcript deltas], status)]."""
    ids = [e["event_id"] for e in events]
    assert all(ids) and len(set(ids)) == len(ids)
    out, current, stage = [], None, None
    for e in events:
        t = e["type"]
        if t == "response.created":
            assert current is None, "a response opened inside another"
            current = [e["response"]["id"], [], [], None]
            assert e["response"]["id"].startswith("resp_")
            stage = 1
            continue
        if current is None:
            assert not t.startswith("response."), t
            continue
        rid = current[0]
        if stage < len(RESPONSE_ORDER):
            if t == RESPONSE_ORDER[stage]:
                stage += 1
                if t == "response.output_item.added":
                    assert e["item"]["id"].startswith("item_") and e["response_id"] == rid
                continue
            assert not t.startswith("response."), (t, stage)
            continue
        if t == "response.output_audio.delta":
            assert stage == len(RESPONSE_ORDER) and e["response_id"] == rid and e["item_id"]
            current[1].append(e["delta"])
        elif t == "response.output_audio_transcript.delta":
            assert e["response_id"] == rid
            current[2].append(e["delta"])
        elif t in RESPONSE_END:
            assert t == RESPONSE_END[stage - len(RESPONSE_ORDER)], (t, stage)
            stage += 1
            if t == "response.done":
                assert e["response"]["id"] == rid
                current[3] = e["response"]["status"]
                out.append(tuple(current))
                current = None
        else:
            assert not t.startswith("response."), t
    if current is not None:
        out.append(tuple(current))
    return out


def expected_responses(frame_events, output_rate):
    """[(audio deltas, transcript deltas, closed)] derived from the session's own frames."""
    out, cur, resampler = [], None, None
    for f in frame_events:
        if f.turn == "start":
            if cur is not None:
                out.append(cur + [True])
            cur, resampler = [[], []], Resampler(22050, output_rate)
        if cur is not None:
            cur[0].append(encode_pcm16(resampler(f.audio, last=f.turn == "end")))
            if f.text:
                cur[1].append(f.text)
            if f.turn == "end":
                out.append(cur + [True])
                cur = None
    if cur is not None:
        out.append(cur + [False])
    return out


def reference(worker, model, chunks, input_rate=16000):
    """A bare Session fed the same samples, on the shared worker."""

    def job():
        s = model.session()
        resample = Resampler(input_rate, 16000)
        events = []
        for c in chunks:
            events += s.feed(resample(c.astype(np.float32) / 32768.0))
        s.close()
        return events

    return worker.submit(job).result()


def decode(delta):
    return np.frombuffer(base64.b64decode(delta), "<i2").astype(np.int32)


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


async def drain(conn):
    try:
        async for _ in conn:
            pass
    except Exception:
        pass


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


def test_busy_1013_while_another_session_computes(plain, worker):
    """The first session's frames are held behind a job on the worker (a latch) while the
    second client connects: the busy answer needs no worker and comes while the first
    session computes, whatever the machine's speed."""
    latch = threading.Event()

    async def main():
        first = await connect(plain)
        await native_rates(first)
        x = noise(1.5, 16000)
        frames = (len(x) - 199) // 1280 + 1
        held = worker.submit(latch.wait, 2 * TIMEOUT)  # the worker is busy until released
        await first.append(x, chunk=len(x))  # its frames queue behind the latch
        second = await websockets.connect(ws_url(plain), open_timeout=TIMEOUT)
        e = json.loads(await asyncio.wait_for(second.recv(), TIMEOUT))
        assert e["type"] == "error" and e["error"]["code"] == "server_busy" and e["event_id"]
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(second.recv(), TIMEOUT)
        assert second.close_code == 1013
        assert not held.done()  # answered while the first session's frames were still to run
        latch.set()
        assert held.result(TIMEOUT) is True
        await first.until_frames(frames)  # then the first session goes on
        await first.ws.close()

    try:
        run(main())
    finally:
        latch.set()  # never leave the shared worker parked


def test_cancel_keeps_the_session(plain):
    async def main():
        c = await connect(plain)
        await native_rates(c)
        x = noise(3.0, 16000, seed=5)
        sent = 0
        # one frame at a time: with no silence feed the session advances only with the audio,
        # so the response that opens stays open until the cancel
        while not any(e["type"] == "response.created" for e in c.events):
            await c.append(x[sent : sent + 1280], chunk=1280)
            sent += 1280
            await c.until(lambda e: e["type"] == "x-voicechat.stats")
        rid = next(e for e in c.events if e["type"] == "response.created")["response"]["id"]
        await c.send(type="response.cancel")
        done = await c.until_type("response.done")
        assert done["response"]["id"] == rid and done["response"]["status"] == "cancelled"
        assert done["response"]["output"][0]["status"] == "incomplete"
        n = len(c.events)
        frames = [e["frames"] for e in c.events if e["type"] == "x-voicechat.stats"][-1]
        await c.append(x[sent : sent + 12800])
        await c.until_frames(frames + 9)  # the session goes on: 9 frames more than before
        later = c.events[n:]
        assert not [e for e in later if e.get("response_id") == rid]
        # quiet from the cancel on: nothing is spoken until the model starts a new turn
        kinds = [e["type"] for e in later]
        opened = kinds.index("response.created") if "response.created" in kinds else len(kinds)
        assert "response.output_audio.delta" not in kinds[:opened]
        await c.ws.close()

    run(main())


def test_commit_lets_the_reply_finish(plain):
    async def main():
        c = await connect(plain)
        await native_rates(c)
        await c.append(noise(0.3, 16000, seed=7))
        await c.send(type="input_audio_buffer.commit")
        committed = await c.until_type("input_audio_buffer.committed")
        n = len(c.events)
        # no more client audio: the server's trailing silence lets a reply finish
        done = await c.until_type("response.done")
        assert done["response"]["status"] == "completed"
        assert any(e["type"] == "response.output_audio.delta" for e in c.events[n:])
        assert any(
            e["type"] == "conversation.item.input_audio_transcription.completed"
            and e["item_id"] == committed["item_id"]
            for e in c.events
        ) or await c.until(
            lambda e: (
                e["type"] == "conversation.item.input_audio_transcription.completed"
                and e["item_id"] == committed["item_id"]
            )
        )
        await c.ws.close()

    run(main())


def test_lag_bound_closes_1013(plain):
    async def main():
        c = await connect(plain)
        await native_rates(c)
        x = noise(10.5, 16000)  # more queued audio than the 10 s bound, in one append
        await c.send(type="input_audio_buffer.append", audio=pcm(x))
        e = await c.until_type("error")
        assert e["error"]["code"] == "lag_exceeded"
        with pytest.raises(websockets.ConnectionClosed):
            await c.recv()
        assert c.ws.close_code == 1013

    run(main())
    wait_free(plain)


def wait_free(server, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while json.loads(http(server, "/health")[1])["sessions"]:
        assert time.monotonic() < deadline, "the session was not freed"
        time.sleep(0.05)


def test_disconnect_mid_frame_frees_the_session(plain):
    async def main():
        c = await connect(plain)
        await native_rates(c)
        await c.append(noise(1.0, 16000), chunk=16000)
        await c.until_frames(1)
        c.ws.transport.abort()  # no close frame, while the worker computes

    run(main())
    wait_free(plain)

    async def again():
        c = await connect(plain)
        await native_rates(c)
        await c.append(noise(0.2, 16000))
        await c.until_frames(2)
        await c.ws.close()

    run(again())


def test_client_that_stops_reading_is_dropped(small_queue):
    async def main():
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", small_queue.port))
        ws = await websockets.connect(
            ws_url(small_queue), sock=sock, max_queue=1, open_timeout=TIMEOUT
        )
        x = noise(6.0, 24000)
        for i in range(0, len(x), 24000):
            await ws.send(
                json.dumps({"type": "input_audio_buffer.append", "audio": pcm(x[i : i + 24000])})
            )
        deadline = time.monotonic() + 40
        while json.loads(http(small_queue, "/health")[1])["sessions"]:
            assert time.monotonic() < deadline, "a client that does not read was not dropped"
            await asyncio.sleep(0.1)
        ws.transport.abort()

    run(main(), timeout=60)
    wait_free(small_queue)


def test_a_session_that_ends_by_itself_says_so_and_closes(short):
    async def main():
        c = await connect(short)
        await native_rates(c)
        await c.append(noise(1.0, 16000), chunk=16000)
        e = await c.until_type("error")
        assert e["error"]["code"] == "session_ended" and "max_seconds" in e["error"]["message"]
        with pytest.raises(websockets.ConnectionClosed):
            await c.recv()
        assert c.ws.close_code == 1000

    run(main())
    wait_free(short)


def _slots(name, n, doc):
    """A module fixture: `serve --max-sessions n` (no silence feed, stats after every job)."""

    @pytest.fixture(scope="module", name=name)
    def fixture(model, worker):
        app = create_app(
            model, silence_feed=False, max_sessions=n, stats_every_frames=1, worker=worker,
            warmup=False,
        )
        s = _start(app)
        yield s
        s.__exit__(None, None, None)

    fixture.__doc__ = doc
    return fixture


two_slots = _slots("two_slots", 2, "`serve --max-sessions 2`: two conversations at a time.")
four_slots = _slots(
    "four_slots", 4, "`serve --max-sessions 4`: the server steps its conversations in one batch."
)


def test_max_sessions_2_serves_two_at_once_and_refuses_a_third(two_slots, model, worker):
    inputs = {"a": noise(1.2, 16000, seed=11), "b": noise(1.0, 16000, seed=12)}
    chunks = {k: [x[i : i + 1000] for i in range(0, len(x), 1000)] for k, x in inputs.items()}
    refs = {k: reference(worker, model, c) for k, c in chunks.items()}
    assert [f.text_id for f in refs["a"]][:12] != [f.text_id for f in refs["b"]][:12]

    async def main():
        clients = {k: await connect(two_slots) for k in inputs}
        for c in clients.values():
            await native_rates(c)
        assert json.loads(http(two_slots, "/health")[1])["sessions"] == 2
        third = await websockets.connect(ws_url(two_slots), open_timeout=TIMEOUT)
        e = json.loads(await asyncio.wait_for(third.recv(), TIMEOUT))
        assert e["type"] == "error" and e["error"]["code"] == "server_busy"
        assert "all 2 session(s)" in e["error"]["message"]
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(third.recv(), TIMEOUT)
        assert third.close_code == 1013
        for i in range(max(len(c) for c in chunks.values())):  # both stream at once
            for k, c in clients.items():
                if i < len(chunks[k]):
                    await c.append(chunks[k][i])
        for k, c in clients.items():
            await c.until_frames(len(refs[k]))
        await clients["a"].ws.close()
        deadline = time.monotonic() + TIMEOUT
        while json.loads(http(two_slots, "/health")[1])["sessions"] != 1:
            assert time.monotonic() < deadline, "the closed session's slot was not freed"
            await asyncio.sleep(0.05)
        again = await connect(two_slots)  # a freed slot takes a new conversation
        await again.ws.close()
        await clients["b"].ws.close()
        return {k: c.events for k, c in clients.items()}

    events = run(main())
    for k in inputs:  # each conversation is its own session's, as if it were alone
        got, want = responses(events[k]), expected_responses(refs[k], 22050)
        assert want and len(got) == len(want), k
        for (_, audio, text, _), (w_audio, w_text, _) in zip(got, want):
            assert audio == w_audio and text == w_text, k
    wait_free(two_slots)


async def _sdk_conversation(server, x, start=None):
    """A stock ``openai`` realtime client: 16 kHz in / 22.05 kHz out, ``x`` in 100 ms chunks;
    returns its audio deltas and transcript deltas once every frame of the input is in (the
    server's stats events count them)."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused")
    audio, text = [], []
    frames = (len(x) - 199) // 1280 + 1
    extensions = {"x-voicechat": "1"}  # the stats events count the frames
    async with client.realtime.connect(model="nemotron-voicechat", extra_query=extensions) as conn:
        await conn.session.update(
            session={
                "type": "realtime",
                "audio": {
                    "input": {"format": {"type": "audio/pcm", "rate": 16000}},
                    "output": {"format": {"type": "audio/pcm", "rate": 22050}},
                },
            }
        )
        async for event in conn:
            if event.type == "session.updated":
                if start is not None:
                    await start.wait()  # every client streams at once
                for i in range(0, len(x), 1600):
                    await conn.input_audio_buffer.append(audio=pcm(x[i : i + 1600]))
            elif event.type == "response.output_audio.delta":
                audio.append(event.delta)
            elif event.type == "response.output_audio_transcript.delta":
                text.append(event.delta)
            elif event.type == "x-voicechat.stats" and event.model_dump()["frames"] >= frames:
                break
            assert event.type != "error", event
        reader = asyncio.create_task(drain(conn))
    await asyncio.wait_for(reader, TIMEOUT)
    return audio, text


def test_max_sessions_4_batches_four_stock_clients_each_as_alone(four_slots, worker, monkeypatch):
    """Four stock ``openai`` realtime clients at once on one server with --max-sessions 4:
    its steps are batched (more than one conversation per step), and each client gets the
    audio and text it gets alone on the same server."""
    pytest.importorskip("openai")
    from mlx_voicechat.runtime.batch import SessionBatch

    inputs = [noise(1.6, 16000, seed=40 + i) for i in range(4)]
    alone = [run(_sdk_conversation(four_slots, x)) for x in inputs]
    wait_free(four_slots)
    widths = []
    real = SessionBatch.step
    monkeypatch.setattr(
        SessionBatch,
        "step",
        lambda self, *a, **k: widths.append(sum(h.ready for h in self.sessions)) or real(self, *a, **k),
    )

    async def together():
        start = asyncio.Event()
        tasks = [asyncio.create_task(_sdk_conversation(four_slots, x, start)) for x in inputs]
        await asyncio.sleep(0.5)
        start.set()
        return await asyncio.gather(*tasks)

    got = run(together())
    for (a, t), (wa, wt) in zip(got, alone):
        assert a and a == wa and t == wt
    assert max(widths) > 1  # conversations shared a step
    wait_free(four_slots)

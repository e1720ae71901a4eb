"""What the server tests share: the process's worker thread, the tiny model that takes short
turns, a server-fixture factory (``server_fixture``, ``serve_app``) and a WebSocket client.

The tiny model's text head is random: left alone it starts a turn at once and almost never
says EOS. The ``model`` fixture scales its EOS and silence rows up (real weights, real frames),
so it takes short turns and the whole response lifecycle happens within a second of audio.
It is built once per test session; all MLX work of the server tests runs on one shared worker
thread (MLX streams belong to threads). ``tests/conftest.py`` makes ``worker`` and ``model``
available to every test folder.
"""

import asyncio
import base64
import contextlib
import json
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

KEY = "sekret-key"
ALLOWED = "http://allowed.example"
TIMEOUT = 20.0  # seconds, any single wait on the server


# --- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def worker():
    from mlx_voicechat.serve.worker import Worker

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


@pytest.fixture(scope="session")
def model(tiny_checkpoint, worker):
    return worker.submit(short_turn_model, tiny_checkpoint).result()


@contextlib.contextmanager
def serve_app(model, worker, **options):
    """``create_app(model, worker=worker, **options)`` served on 127.0.0.1 (a free port) for
    the ``with`` block; ``ServerThread`` options (``ssl_certfile``, ``log_level``, ``limits``)
    go to the thread."""
    from mlx_voicechat.serve.app import ServerThread, create_app

    thread = {k: options.pop(k) for k in ("ssl_certfile", "ssl_keyfile", "log_level", "limits")
              if k in options}
    with ServerThread(create_app(model, worker=worker, **options), **thread) as s:
        yield s


def server_fixture(name, doc, **options):
    """A module fixture named ``name``: the shared ``model`` served with ``options``."""

    @pytest.fixture(scope="module", name=name)
    def fixture(model, worker):
        with serve_app(model, worker, **options) as s:
            yield s

    fixture.__doc__ = doc
    return fixture


plain = server_fixture(
    "plain",
    "No key, no silence feed, a stats event after every worker job (a module fixture: one "
    "server per test module that imports it).",
    silence_feed=False,
    stats_every_frames=1,
    allow_origins=(ALLOWED,),
)


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
        import websockets

        with pytest.raises(websockets.ConnectionClosed):
            while True:
                await self.recv(timeout)
        return self.ws.close_code


async def connect(server, **kw):
    # max_queue=None: a client that stops reading with a full queue only sees the server's
    # close frame after its close_timeout (10 s); these clients keep everything instead
    kw.setdefault("max_queue", None)
    import websockets

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
    from mlx_voicechat.serve.wire import Resampler, encode_pcm16

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
    from mlx_voicechat.serve.wire import Resampler

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


async def drain(conn):
    try:
        async for _ in conn:
            pass
    except Exception:
        pass



def wait_free(server, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while json.loads(http(server, "/health")[1])["sessions"]:
        assert time.monotonic() < deadline, "the session was not freed"
        time.sleep(0.05)


def free_after_each_test(*names):
    """An autouse fixture: after each test, the sessions of its servers among ``names`` (module
    fixtures) are closed before the next test connects (a slot is given back once the server
    has seen the client go, which can trail the client's close on a loaded machine)."""

    @pytest.fixture(autouse=True)
    def _slots_free_after_each_test(request):
        yield
        for name in names:
            if name in request.fixturenames:
                wait_free(request.getfixturevalue(name))

    return _slots_free_after_each_test


# --- the protocol without a socket or a model --------------------------------------------


def send(p, **event):
    """One client event into the protocol ``p``: its (server events, worker commands)."""
    return p.receive(json.dumps(event))


def frame(i, turn=None, speaking=False, text="", transcript="", value=0.1):
    """A hand-made FrameEvent: frame ``i`` of a session, its audio a constant."""
    from mlx_voicechat.nemotron_voicechat.runtime.session import FrameEvent

    return FrameEvent(
        index=i,
        text_id=0,
        function_id=0,
        codes=np.zeros(8, np.int32),
        audio=np.full(1764, value * (i + 1) / 10, np.float32),
        text=text,
        transcript=transcript,
        turn=turn,
        speaking=speaking,
    )


def started(**session):
    """A Realtime protocol (no socket, no model), opened, updated with ``session`` and given
    its first audio; returns it and the worker commands of that audio."""
    from mlx_voicechat.serve.protocol import Realtime

    p = Realtime("m")
    p.open()
    if session:
        events, _ = send(p, type="session.update", session=session)
        assert events[0]["type"] == "session.updated", events
    events, commands = send(p, type="input_audio_buffer.append", audio=pcm(np.zeros(320)))
    return p, commands


def error_code(events):
    assert len(events) == 1 and events[0]["type"] == "error", events
    assert events[0]["event_id"]
    return events[0]["error"]["code"]

"""Figures for the Realtime server (`mlx-voicechat serve`), all on 127.0.0.1, in one process.

1. fuzz: 10,000 events (random bytes and text, mutated valid events, broken JSON, deep nesting,
   events over 1 MiB) over WebSocket connections; every server message must be JSON with a
   `type` and an `event_id`, and the server must answer a fresh session afterwards.
2. sessions: 100 sequential sessions (connect, update, audio, frames, close); RSS before / after.
3. overhead: per frame, the server's time beyond the session's own `feed` time (one chunk of 4
   frames in flight at a time: client send -> the job's stats event back, less the job's
   compute time measured on the worker), at 16 kHz / 22.05 kHz and at 24 kHz / 24 kHz; and the
   bare session's time per frame, fed the same chunks.
4. latency: time from the append holding a frame's last needed sample leaving the client to
   the server's event for that frame arriving (stats after the frame's audio delta), with the
   audio paced at real time (tiny; small is slower than real time on this CPU) and one frame in
   flight at a time (tiny and small).
5. join: three live conversations, each with one frame in flight (its next frame's audio goes
   when the last frame's events are in: the figures do not need a machine that keeps up with
   real time), --max-sessions 4, tiny; then a fourth opens with 1,000 tokens of instructions no
   session has seen and sends audio at real time: each live one's frame latency (append -> its
   events) before and during the join, the stall (the worst latency during the join less the
   median before) in frames of that median and of 80 ms; and the fourth's time from its
   session.update to its first audio, against its plain prefill plus 10 frames.

Run: python benchmarks/bench_server.py [--quick] [--scale small] [--join-only]
"""

import argparse
import asyncio
import base64
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_voicechat.serve.app import ServerThread, create_app  # noqa: E402
from mlx_voicechat.serve.worker import Worker  # noqa: E402

FRAME = 1280  # samples at 16 kHz


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def pcm(samples) -> str:
    return base64.b64encode(np.asarray(samples, "<i2").tobytes()).decode()


def noise(n, rng):
    return (rng.standard_normal(int(n)) * 3000).astype(np.int16)


def load(tmp, scale):
    import mlx_voicechat
    from mlx_voicechat.factory import make_checkpoint

    return (
        Worker.shared()
        .submit(lambda: mlx_voicechat.load(make_checkpoint(Path(tmp) / scale, scale, seed=0)))
        .result()
    )


async def connect(port, **kw):
    import websockets

    ws = await websockets.connect(
        f"ws://127.0.0.1:{port}/v1/realtime?x-voicechat=1", max_size=None, max_queue=None, **kw
    )
    first = json.loads(await asyncio.wait_for(ws.recv(), 30))
    assert first["type"] == "session.created", first
    return ws


NATIVE = {
    "type": "session.update",
    "session": {
        "type": "realtime",
        "audio": {
            "input": {"format": {"type": "audio/pcm", "rate": 16000}},
            "output": {"format": {"type": "audio/pcm", "rate": 22050}},
        },
    },
}


# --- 1. fuzz --------------------------------------------------------------------------------


def valid_events(rng):
    return [
        {"type": "session.update", "session": {"type": "realtime", "instructions": "Hi."}},
        {
            "type": "session.update",
            "session": {
                "audio": {
                    "input": {"format": {"type": "audio/pcm", "rate": 24000}},
                    "output": {"voice": "Aria"},
                }
            },
        },
        {"type": "session.update", "session": {"modalities": ["audio"], "voice": "Aria"}},
        {"type": "input_audio_buffer.append", "audio": pcm(noise(rng.integers(0, 400), rng))},
        {"type": "input_audio_buffer.commit"},
        {"type": "input_audio_buffer.clear"},
        {"type": "response.create", "response": {}},
        {"type": "response.cancel"},
        {
            "type": "conversation.item.create",
            "item": {"type": "function_call_output", "call_id": "c1", "output": "{}"},
        },
        {"type": "conversation.item.truncate", "item_id": "item_x", "audio_end_ms": 5},
    ]


ODD_VALUES = [
    None,
    0,
    -1,
    1e308,
    True,
    "",
    "x" * 300,
    [],
    {},
    [[[]]],
    {"a": {"b": None}},
    "é\u2028",
]


def mutate(event, rng):
    e = json.loads(json.dumps(event))
    kind = rng.integers(0, 6)
    if kind == 0:  # replace a value somewhere
        target, key = e, None
        while isinstance(target, dict) and target and rng.random() < 0.7:
            key = rng.choice(list(target))
            if isinstance(target[key], dict) and target[key]:
                target = target[key]
            else:
                break
        if isinstance(target, dict) and target:
            key = rng.choice(list(target))
            target[key] = ODD_VALUES[rng.integers(len(ODD_VALUES))]
    elif kind == 1 and len(e) > 1:  # drop a key
        e.pop(rng.choice([k for k in e if k != "type"] or ["type"]), None)
    elif kind == 2:  # a near-miss type
        e["type"] = rng.choice(
            ["response.audio.delta", e["type"].upper(), e["type"] + ".", "session", ""]
        )
    elif kind == 3:  # a bad audio payload
        e = {
            "type": "input_audio_buffer.append",
            "audio": rng.choice(["%%%", "AAA", "AAAA", "A" * 5, base64.b64encode(b"\1").decode()]),
        }
    elif kind == 4:
        e["extra"] = ODD_VALUES[rng.integers(len(ODD_VALUES))]
    return e


def fuzz_message(i, rng):
    r = rng.random()
    if i % 2500 == 1234:
        return json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (1 << 20)})
    if r < 0.05:
        return bytes(rng.integers(0, 256, rng.integers(1, 64), dtype=np.uint8))
    if r < 0.10:
        return "".join(chr(int(c)) for c in rng.integers(32, 0x2FFF, rng.integers(1, 40)))
    if r < 0.12:
        return "[" * int(rng.integers(1000, 100000))
    valid = valid_events(rng)
    event = valid[rng.integers(len(valid))]
    if r < 0.45:
        text = json.dumps(event)
        if rng.random() < 0.5:
            return text[: rng.integers(0, len(text))]
        return json.dumps(mutate(event, rng))
    return json.dumps(mutate(event, rng) if r < 0.75 else event)


async def fuzz(port, n_events, per_connection=500):
    import websockets

    rng = np.random.default_rng(0)
    codes, closes, received, bad = {}, {}, 0, 0
    sent = 0
    t0 = time.perf_counter()
    while sent < n_events:
        ws = await connect(port)

        async def reader():
            nonlocal received, bad
            try:
                async for raw in ws:
                    received += 1
                    try:
                        e = json.loads(raw)
                        assert isinstance(e, dict) and e.get("type") and e.get("event_id")
                    except Exception:
                        bad += 1
                        continue
                    if e["type"] == "error":
                        c = e["error"]["code"]
                        codes[c] = codes.get(c, 0) + 1
            except websockets.ConnectionClosed:
                pass

        task = asyncio.create_task(reader())
        try:
            for _ in range(per_connection):
                if sent >= n_events:
                    break
                await ws.send(fuzz_message(sent, rng))
                sent += 1
            await ws.close()
        except websockets.ConnectionClosed:
            pass
        await asyncio.wait_for(task, 60)
        code = ws.close_code
        closes[code] = closes.get(code, 0) + 1
    seconds = time.perf_counter() - t0
    # alive and answering
    ws = await connect(port)
    await ws.send(json.dumps(NATIVE))
    e = json.loads(await asyncio.wait_for(ws.recv(), 30))
    await ws.close()
    return {
        "events": sent,
        "seconds": seconds,
        "received": received,
        "malformed_server_messages": bad,
        "error_codes": dict(sorted(codes.items(), key=lambda kv: -kv[1])),
        "close_codes": closes,
        "alive_after": e["type"] == "session.updated",
        "abnormal_closes": sum(n for c, n in closes.items() if c not in (1000, 1013)),
    }


# --- 2. sequential sessions -------------------------------------------------------------------


async def one_session(port, rng, frames=4):
    ws = await connect(port)
    await ws.send(json.dumps(NATIVE))
    await ws.send(
        json.dumps(
            {"type": "input_audio_buffer.append", "audio": pcm(noise(frames * FRAME + 200, rng))}
        )
    )
    while True:
        e = json.loads(await asyncio.wait_for(ws.recv(), 60))
        if e["type"] == "x-voicechat.stats" and e["frames"] >= frames:
            break
    await ws.close()


def wait_free(server):
    import urllib.request

    deadline = time.monotonic() + 30
    while True:
        with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
            if json.loads(r.read())["sessions"] == 0:
                return
        if time.monotonic() > deadline:
            raise RuntimeError("a session was not freed")
        time.sleep(0.02)


def sessions(server, n):
    rng = np.random.default_rng(1)
    for _ in range(5):
        asyncio.run(one_session(server.port, rng))
    wait_free(server)
    gc.collect()
    before = rss_mb()
    t0 = time.perf_counter()
    for _ in range(n):
        asyncio.run(one_session(server.port, rng))
        wait_free(server)
    seconds = time.perf_counter() - t0
    gc.collect()
    after = rss_mb()
    return {"sessions": n, "seconds": seconds, "rss_before_mb": before, "rss_after_mb": after}


# --- 3 / 4. overhead and latency ----------------------------------------------------------------


async def ping_pong(port, chunks, rate_in, rate_out, frames_per_chunk):
    """One chunk in flight: (client round trip, the job's compute time) per chunk."""
    ws = await connect(port)
    await ws.send(
        json.dumps(
            {
                "type": "session.update",
                "session": {
                    "audio": {
                        "input": {"format": {"type": "audio/pcm", "rate": rate_in}},
                        "output": {"format": {"type": "audio/pcm", "rate": rate_out}},
                    }
                },
            }
        )
    )
    rows, done = [], 0
    for chunk in chunks:
        t = time.perf_counter()
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": pcm(chunk)}))
        while True:
            e = json.loads(await asyncio.wait_for(ws.recv(), 120))
            if e["type"] == "x-voicechat.stats":
                break
        rtt = time.perf_counter() - t
        n = e["frames"] - done
        done = e["frames"]
        rows.append((rtt, e["seconds_per_frame"] * n, n))
    await ws.close()
    return rows


async def paced(port, frames, rng):
    """Audio at real time, one frame per append: per frame, append sent -> its stats back."""
    ws = await connect(port)
    await ws.send(json.dumps(NATIVE))
    x = noise((frames + 1) * FRAME, rng)
    sent_at = {}
    latencies = []

    async def reader():
        while len(latencies) < frames - 2:
            e = json.loads(await asyncio.wait_for(ws.recv(), 60))
            if e["type"] == "x-voicechat.stats":
                now = time.perf_counter()
                for k in range(len(latencies), e["frames"]):
                    latencies.append(now - sent_at[k])

    task = asyncio.create_task(reader())
    t0 = time.perf_counter()
    for k in range(frames + 1):
        await asyncio.sleep(max(t0 + k * 0.08 - time.perf_counter(), 0))
        # frame k needs samples up to 1280 k + 198: they are in the append of slot k
        sent_at[k] = time.perf_counter()
        await ws.send(
            json.dumps(
                {"type": "input_audio_buffer.append", "audio": pcm(x[k * FRAME : (k + 1) * FRAME])}
            )
        )
    await asyncio.wait_for(task, 120)
    await ws.close()
    return latencies


def bare(model, chunks):
    def job():
        s = model.session()
        s.feed(np.zeros(4 * FRAME, np.float32))
        times, frames = [], 0
        for c in chunks:
            t = time.perf_counter()
            frames += len(s.feed(c.astype(np.float32) / 32768.0))
            times.append(time.perf_counter() - t)
        s.close()
        return sum(times) / frames

    return Worker.shared().submit(job).result()


def overhead(model, n_chunks, frames_per_chunk=4):
    rng = np.random.default_rng(2)
    app = create_app(model, silence_feed=False, stats_every_frames=1, chunk_frames=frames_per_chunk)
    out = {}
    with ServerThread(app) as server:
        for rate_in, rate_out in ((16000, 22050), (24000, 24000)):
            n = frames_per_chunk * FRAME * rate_in // 16000
            chunks = [noise(n, rng) for _ in range(n_chunks)]
            rows = asyncio.run(ping_pong(server.port, chunks, rate_in, rate_out, frames_per_chunk))
            rows = rows[2:]  # the first chunks also open the session
            per_frame = [(rtt - compute) / max(k, 1) for rtt, compute, k in rows if k]
            out[f"{rate_in}/{rate_out}"] = {
                "overhead_ms_median": 1000 * statistics.median(per_frame),
                "overhead_ms_p90": 1000 * sorted(per_frame)[int(0.9 * (len(per_frame) - 1))],
                "frame_ms_median": 1000
                * statistics.median(compute / k for _, compute, k in rows if k),
            }
        chunks = [noise(frames_per_chunk * FRAME, rng) for _ in range(n_chunks)]
        out["bare_session_frame_ms"] = 1000 * bare(model, chunks)
        one = [noise(FRAME, rng) for _ in range(max(8, n_chunks))]
        rows = asyncio.run(ping_pong(server.port, one, 16000, 22050, 1))[2:]
        out["one_frame_in_flight_latency_ms_median"] = 1000 * statistics.median(
            rtt for rtt, _, k in rows if k
        )
        out["one_frame_job_ms_median"] = 1000 * statistics.median(c for _, c, k in rows if k)
    return out


# --- 5. a join with new instructions --------------------------------------------------------


async def live_client(port, frames, rng, until):
    """A conversation with one frame in flight (the next frame's audio goes when the last
    frame's events are in, so the figures do not depend on the machine keeping up with real
    time); (send time, latency) of each frame."""
    ws = await connect(port)
    await ws.send(json.dumps(NATIVE))
    x = noise((frames + 1) * FRAME, rng)
    out = []
    for k in range(frames + 1):
        if until.is_set():
            break
        sent = time.perf_counter()
        chunk = x[k * FRAME : (k + 1) * FRAME]
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": pcm(chunk)}))
        while True:
            e = json.loads(await asyncio.wait_for(ws.recv(), 120))
            if e["type"] == "x-voicechat.stats" and e["frames"] >= k + 1:
                out.append((sent, time.perf_counter() - sent))
                break
    until.set()
    await ws.close()
    return out


async def joiner(port, instructions, rng, delay):
    """Connects after ``delay`` s with ``instructions``, sends audio at real time; returns (the
    session.update's send time, seconds from it to the first audio delta)."""
    await asyncio.sleep(delay)
    ws = await connect(port)
    update = json.loads(json.dumps(NATIVE))
    update["session"]["instructions"] = instructions
    t0 = time.perf_counter()
    await ws.send(json.dumps(update))
    x = noise(200 * FRAME, rng)
    first = None

    async def sender():
        k = 0
        while first is None and k < 200:
            await asyncio.sleep(max(t0 + k * 0.08 - time.perf_counter(), 0))
            chunk = x[k * FRAME : (k + 1) * FRAME]
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": pcm(chunk)}))
            k += 1

    task = asyncio.create_task(sender())
    while first is None:
        e = json.loads(await asyncio.wait_for(ws.recv(), 120))
        if e["type"] in ("response.output_audio.delta", "response.audio.delta"):
            first = time.perf_counter() - t0
        elif e["type"] == "error":
            raise RuntimeError(e)
    await task
    await asyncio.sleep(1.0)
    await ws.close()
    return t0, first


def new_instructions(model, tokens, seed):
    """Instructions of about ``tokens`` tokens of words no session has seen."""
    from mlx_voicechat.nemotron_voicechat.runtime.request import prompt_ids

    rng = np.random.default_rng(seed)
    words = ["alpha", "river", "orange", "seven", "table", "quiet", "north", "maple", "signal"]
    text = "Be brief."
    while len(prompt_ids(model, text)) < tokens:
        text += " " + " ".join(rng.choice(words) for _ in range(20))
    return text


def join_stall(model, tokens=1000, live=3, seconds=12.0, grown=True):
    """``grown``: the seed's prompt chain is first grown past the prompt's length by a session
    with a longer prompt of other words (the issue's setting); otherwise the join grows it."""
    from mlx_voicechat.nemotron_voicechat.runtime.request import prompt_ids

    instructions = new_instructions(model, tokens, seed=int(time.time()))
    n = len(prompt_ids(model, instructions))
    seed = 0 if grown else int(time.time()) % 1000 + 1  # a seed whose chain is not grown yet
    if grown:
        longer = [7 + i % 50 for i in range(n + 100)]
        Worker.shared().submit(lambda: model.session(prompt=longer, seed=0).close()).result()
    app = create_app(
        model, max_sessions=live + 1, silence_feed=False, stats_every_frames=1, seed=seed,
        max_lag_seconds=120,  # measured here, not enforced
    )
    stepper = app.state.server.stepper
    with ServerThread(app) as server:

        async def run_all():
            until = asyncio.Event()
            frames = int(seconds / 0.08)
            rng = np.random.default_rng
            tasks = [
                asyncio.create_task(live_client(server.port, frames, rng(i), until))
                for i in range(live)
            ]
            join = asyncio.create_task(joiner(server.port, instructions, rng(9), 5.0))
            t_join, first = await join
            await asyncio.sleep(2.0)
            until.set()
            return t_join, first, await asyncio.gather(*tasks)

        t_join, first, rows = asyncio.run(run_all())
        slices = list(stepper.slices)
    before = [lat for r in rows for sent, lat in r if sent < t_join - 0.3]
    during = [lat for r in rows for sent, lat in r if t_join - 0.1 <= sent <= t_join + first + 1.0]
    base = statistics.median(before)
    stall = max(during) - base
    return {
        "tokens": n, "before": before, "during": during, "base": base, "stall": stall,
        "first_audio": first, "prefill": plain_prefill_seconds(model, n + 1), "slices": slices,
    }


def plain_prefill_seconds(model, rows):
    """One LLM call over ``rows`` positions on a fresh cache, on the worker."""
    import mlx.core as mx

    def job():
        stt = model.stt_model
        x = stt.embed_tokens(mx.zeros((1, rows), dtype=mx.int32) + 7)
        mx.eval(x)
        cache = stt.llm.make_cache()
        t = time.perf_counter()
        mx.eval(stt.llm(x, cache))
        return time.perf_counter() - t

    return Worker.shared().submit(job).result()


def print_join(j, name="tiny", grown=True):
    base = j["base"]
    chain = "the chain grown before" if grown else "the join grows the chain"
    print(
        f"join, {name} ({chain}): 3 live conversations (one frame in flight each), a fourth "
        f"opens with {j['tokens']} "
        f"tokens of new instructions"
    )
    for kind, what in (("steps", "speech steps growing the prompt chain"), ("rows", "LLM rows")):
        sl = [u for k, u in j["slices"] if k == kind]
        if sl:
            print(f"  {len(sl)} slices of {min(sl)} to {max(sl)} {what}")
    print(f"  live frames' latency before the join: {summary(j['before'])}")
    print(f"  live frames' latency during the join: {summary(j['during'])}")
    print(
        f"  worst during {1000 * max(j['during']):.0f} ms against worst before "
        f"{1000 * max(j['before']):.0f} ms"
    )
    print(
        f"  stall (worst during less median before): {1000 * j['stall']:.0f} ms = "
        f"{j['stall'] / base:.2f} frames of the batch's latency ({1000 * base:.0f} ms) = "
        f"{j['stall'] / 0.08:.2f} frames of 80 ms"
    )
    target = j["prefill"] + 10 * base  # a frame: the batch's median append -> events
    print(
        f"  the fourth's first audio {1000 * j['first_audio']:.0f} ms after its session.update; "
        f"its prompt's plain prefill {1000 * j['prefill']:.0f} ms + 10 frames = "
        f"{1000 * target:.0f} ms: {'met' if j['first_audio'] <= target else 'NOT met'}"
    )


def summary(xs):
    xs = sorted(xs)
    p90 = xs[int(0.9 * (len(xs) - 1))]
    return (
        f"median {1000 * statistics.median(xs):.1f} ms, p90 {1000 * p90:.1f} ms, "
        f"max {1000 * xs[-1]:.1f} ms ({len(xs)} frames)"
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer events / sessions / frames")
    p.add_argument("--scale", default="small", help="factory scale for the overhead figure")
    p.add_argument("--events", type=int, default=10000)
    p.add_argument("--sessions", type=int, default=100)
    p.add_argument("--join-only", action="store_true", help="only 5. (a join's stall)")
    args = p.parse_args(argv)
    if args.quick:
        args.events, args.sessions = 1000, 10
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tmp = tempfile.mkdtemp(prefix="bench_server_")
    tiny = load(tmp, "tiny")
    print(f"bench_server: {time.strftime('%Y-%m-%d %H:%M')} UTC, {os.cpu_count()} CPUs")
    if args.join_only:
        print_join(join_stall(tiny))
        print_join(join_stall(tiny, grown=False), grown=False)
        return 0

    app = create_app(
        tiny, silence_feed=False, stats_every_frames=1, commit_seconds=0.24, max_reply_seconds=1.0
    )
    with ServerThread(app) as server:
        f = asyncio.run(fuzz(server.port, args.events))
        print(
            f"fuzz: {f['events']} events in {f['seconds']:.1f} s, {f['received']} server messages, "
            f"{f['malformed_server_messages']} malformed, {f['abnormal_closes']} connections "
            f"ended abnormally; alive after: {f['alive_after']}"
        )
        print(f"  error codes: {f['error_codes']}")
        print(f"  connection close codes: {f['close_codes']}")
        s = sessions(server, args.sessions)
        growth = 100 * (s["rss_after_mb"] / s["rss_before_mb"] - 1)
        print(
            f"sessions: {s['sessions']} sequential in {s['seconds']:.1f} s; RSS "
            f"{s['rss_before_mb']:.0f} MB -> {s['rss_after_mb']:.0f} MB ({growth:+.1f}%)"
        )
        lat = asyncio.run(paced(server.port, 25 if args.quick else 60, np.random.default_rng(3)))
        print(f"latency, tiny, audio at real time (append -> its frame's events): {summary(lat)}")

    for name, model in (("tiny", tiny), (args.scale, load(tmp, args.scale))):
        o = overhead(model, 6 if args.quick else 16)
        print(f"overhead, {name}: bare session {o['bare_session_frame_ms']:.1f} ms/frame")
        for key in ("16000/22050", "24000/24000"):
            r = o[key]
            print(
                f"  {key} Hz in/out: server overhead {r['overhead_ms_median']:.2f} ms/frame "
                f"(p90 {r['overhead_ms_p90']:.2f}) over the job's "
                f"{r['frame_ms_median']:.1f} ms/frame"
            )
        print(
            f"  one frame in flight, append -> its events: "
            f"{o['one_frame_in_flight_latency_ms_median']:.1f} ms median, of which the session's "
            f"feed of that one frame {o['one_frame_job_ms_median']:.1f} ms"
        )
    print_join(join_stall(tiny))
    print_join(join_stall(tiny, grown=False), grown=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

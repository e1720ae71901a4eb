"""Figures for the Realtime server on Ray Serve (`mlx-voicechat serve --ray`), on 127.0.0.1.

A local Ray (``--cpus``) runs a two-replica deployment of a factory checkpoint; a direct
server (the app `serve` runs, in a process of its own) serves the same checkpoint beside it.

1. overhead: one frame in flight (an append of one frame, then that frame's stats event back),
   per frame the round trip less the job's compute time, on the direct server and through Ray,
   alternating; the Ray proxy's overhead per frame is the difference of the medians.
2. last sample -> audio: audio paced at real time, one frame per append; per frame, the append
   holding its last sample leaving the client -> the frame's audio delta arriving, direct and
   through Ray.
3. load: sessions connect at a fixed rate to the Ray deployment, each streams ``--seconds`` of
   audio at real time; accepted / refused (server_busy), connect -> session.created (mean,
   p95) and last sample -> audio of the accepted ones.

Run: python benchmarks/bench_ray.py [--scale tiny] [--sessions 12] [--rate 2] [--seconds 3]
"""

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_server import FRAME, NATIVE, noise, pcm  # noqa: E402  (this folder's)

OPTIONS = {"silence_feed": False, "stats_every_frames": 1}  # the same on both servers


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def direct_server(checkpoint, port, max_sessions, ready):
    """The app `serve` runs, on its own process (as `mlx-voicechat serve` would be)."""
    from mlx_voicechat import load
    from mlx_voicechat.serve.app import ServerThread, create_app
    from mlx_voicechat.serve.worker import Worker

    model = Worker.shared().submit(load, checkpoint).result()
    with ServerThread(create_app(model, max_sessions=max_sessions, **OPTIONS), port=port):
        ready.set()
        while True:
            time.sleep(3600)


async def connect(url):
    import websockets

    t = time.perf_counter()
    ws = await websockets.connect(url, max_size=None, max_queue=None, open_timeout=60)
    first = json.loads(await asyncio.wait_for(ws.recv(), 60))
    return ws, first, time.perf_counter() - t


async def one_in_flight(url, frames, rng):
    """Per frame: round trip of a one-frame append less the job's compute time (s)."""
    ws, first, _ = await connect(url)
    assert first["type"] == "session.created", first
    await ws.send(json.dumps(NATIVE))
    out, done = [], 0
    for _ in range(frames):
        t = time.perf_counter()
        await ws.send(
            json.dumps({"type": "input_audio_buffer.append", "audio": pcm(noise(FRAME, rng))})
        )
        while True:
            e = json.loads(await asyncio.wait_for(ws.recv(), 60))
            if e["type"] == "x-voicechat.stats":
                break
        rtt = time.perf_counter() - t
        n, done = e["frames"] - done, e["frames"]
        if n:
            out.append((rtt - e["seconds_per_frame"] * n) / n)
    await ws.close()
    return out[2:]  # the first frames also open the session


async def paced(url, seconds, rng, first=None, ws=None):
    """Audio at real time, one frame per append: per frame with speech, the append holding its
    last sample leaving -> its audio delta arriving (s)."""
    if ws is None:
        ws, first, _ = await connect(url)
    await ws.send(json.dumps(NATIVE))
    frames = int(seconds / 0.08)
    x = noise((frames + 1) * FRAME, rng)
    sent_at, latencies, audio_at = {}, [], []

    async def reader():
        seen = 0
        while seen < frames - 1:
            e = json.loads(await asyncio.wait_for(ws.recv(), 60))
            now = time.perf_counter()
            if e["type"] == "response.output_audio.delta":
                audio_at.append(now)
            elif e["type"] == "x-voicechat.stats":
                # this job's frames end here; a delta of them belongs to its last frame or one
                # before, so the frame's last sample went out no later than sent_at[last]
                last = e["frames"] - 1
                if audio_at and last in sent_at:
                    latencies.append(audio_at[-1] - sent_at[last])
                audio_at.clear()
                seen = e["frames"]

    task = asyncio.create_task(reader())
    t0 = time.perf_counter()
    for k in range(frames + 1):
        await asyncio.sleep(max(t0 + k * 0.08 - time.perf_counter(), 0))
        # frame k needs samples up to 1280 k + 198: they are in the append of slot k
        sent_at[k] = time.perf_counter()
        chunk = x[k * FRAME : (k + 1) * FRAME]
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": pcm(chunk)}))
    await asyncio.wait_for(task, 120)
    await ws.close()
    return latencies


async def load_at_rate(url, sessions, rate, seconds):
    """``sessions`` connections ``1 / rate`` s apart, each streaming ``seconds`` of audio."""
    results = []

    async def one(i):
        await asyncio.sleep(i / rate)
        ws, first, created = await connect(url)
        if first["type"] != "session.created":
            results.append(("refused", first.get("error", {}).get("code"), created, []))
            await ws.close()
            return
        lat = await paced(url, seconds, np.random.default_rng(100 + i), first, ws)
        results.append(("accepted", first["x-voicechat"]["replica"], created, lat))

    await asyncio.gather(*(one(i) for i in range(sessions)))
    return results


def ms(xs, p=None):
    xs = sorted(xs)
    if not xs:
        return "n/a"
    if p is None:
        return f"{1000 * statistics.mean(xs):.1f} ms"
    return f"{1000 * xs[min(len(xs) - 1, int(p * len(xs)))]:.1f} ms"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", default="tiny", help="factory scale (default tiny)")
    p.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray (default 2)")
    p.add_argument("--max-sessions", type=int, default=2, help="sessions per replica")
    p.add_argument("--sessions", type=int, default=12, help="sessions of the load phase")
    p.add_argument("--rate", type=float, default=2.0, help="new sessions per second")
    p.add_argument("--seconds", type=float, default=3.0, help="audio per session (s)")
    p.add_argument("--frames", type=int, default=40, help="frames per overhead round")
    p.add_argument("--rounds", type=int, default=3, help="overhead rounds per server")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import ray
    from ray import serve

    from mlx_voicechat.factory import make_checkpoint
    from mlx_voicechat.serve.ray_app import realtime_app, start_serve

    started = time.monotonic()
    checkpoint = make_checkpoint(
        Path(tempfile.mkdtemp(prefix="bench_ray_")) / args.scale, args.scale, seed=0
    )
    direct_port, ray_port = free_port(), free_port()
    ready = multiprocessing.get_context("spawn").Event()
    direct = multiprocessing.get_context("spawn").Process(
        target=direct_server,
        args=(str(checkpoint), direct_port, args.max_sessions, ready),
        daemon=True,
    )
    direct.start()
    print(f"bench_ray: {time.strftime('%Y-%m-%d %H:%M')} UTC, {os.cpu_count()} CPUs, {args.scale}")
    try:
        ray.init(
            address="local", num_cpus=args.cpus, include_dashboard=False, logging_level="error"
        )
        start_serve("127.0.0.1", ray_port, "ERROR")
        t = time.monotonic()
        serve.run(
            realtime_app(
                checkpoint,
                replicas=2,
                max_sessions=args.max_sessions,
                ray_actor_options={"num_cpus": args.cpus / 2},
                **OPTIONS,
            ),
            name="bench",
            route_prefix="/",
        )
        up = time.monotonic() - t
        print(f"deployment: 2 replicas x {args.max_sessions} sessions, up in {up:.1f} s")
        assert ready.wait(120), "the direct server did not start"
        urls = {
            "direct": f"ws://127.0.0.1:{direct_port}/v1/realtime?x-voicechat=1",
            "ray": f"ws://127.0.0.1:{ray_port}/v1/realtime?x-voicechat=1",
        }

        rng = np.random.default_rng(1)
        over = {k: [] for k in urls}
        audio = {k: [] for k in urls}
        for _ in range(args.rounds):
            for name, url in urls.items():
                over[name] += asyncio.run(one_in_flight(url, args.frames, rng))
                audio[name] += asyncio.run(paced(url, args.frames * 0.08, rng))
        for name in urls:
            print(
                f"{name}: overhead per frame beyond the job {ms(over[name], 0.5)} median "
                f"(p90 {ms(over[name], 0.9)}); last sample -> audio {ms(audio[name], 0.5)} "
                f"median, p95 {ms(audio[name], 0.95)} ({len(audio[name])} frames)"
            )
        proxy = statistics.median(over["ray"]) - statistics.median(over["direct"])
        later = statistics.median(audio["ray"]) - statistics.median(audio["direct"])
        print(
            f"Ray proxy overhead per frame: {1000 * proxy:.2f} ms (one frame in flight; target "
            f"5 ms: {'met' if proxy <= 0.005 else 'not met'}); last sample -> audio, Ray - "
            f"direct: {1000 * later:.2f} ms median"
        )

        rows = asyncio.run(load_at_rate(urls["ray"], args.sessions, args.rate, args.seconds))
        accepted = [r for r in rows if r[0] == "accepted"]
        refused = [r for r in rows if r[0] == "refused"]
        print(
            f"load: {args.sessions} sessions at {args.rate:g}/s, {args.seconds:g} s of audio each: "
            f"{len(accepted)} accepted ({len({r[1] for r in accepted})} replicas), "
            f"{len(refused)} refused {sorted({r[1] for r in refused})}"
        )
        created = [r[2] for r in accepted]
        print(f"  connect -> session.created: mean {ms(created)}, p95 {ms(created, 0.95)}")
        busy = [r[2] for r in refused]
        print(f"  connect -> server_busy: mean {ms(busy)}, p95 {ms(busy, 0.95)}")
        lat = [x for r in accepted for x in r[3]]
        print(f"  last sample -> audio: mean {ms(lat)}, p95 {ms(lat, 0.95)} ({len(lat)} frames)")
    finally:
        direct.terminate()
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        print(f"total {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

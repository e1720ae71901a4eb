"""Streaming: our session against our offline ``generate`` and mlx-vlm's streaming session.

    python benchmarks/bench_stream.py [--dir DIR] [--scale medium] [--seconds 20] [--repeats 1]

Writes the random-weight checkpoint once with the factory (cached in ``--dir``, shared with
``bench_peers.py``), then runs, each configuration in its own subprocess and alternating:

- ``session``: ``model.session(PROMPT)`` fed the input in 1280-sample (80 ms) chunks;
- ``offline``: ``model.generate`` on the same input (``bench_peers``' own worker);
- ``mlx-vlm``: mlx-vlm's ``create_streaming_session(...).push_audio(...)`` in the same chunks,
  through ``bench_peers``' checkpoint shims (``_peer_view``); each push's audio is evaluated
  inside its timing, as a client playing it needs it.

Per-frame ms is the median duration of the ``feed`` / ``push_audio`` calls that returned one
frame (offline: the median time between frames, which leaves out the perception and codec
passes that offline runs once over the whole input). All-in ms / frame is the first open and
every call over the frames (offline: ``generate``'s wall time, which includes its own prompt
warm-up, over the frames). Session open ms is the first and the second ``session`` with the
same prompt in one process. Memory per minute is the session's own figure
(``memory_per_minute``) and the growth of MLX's active memory and of the process RSS from
frame ``STEADY_FRAME`` (the encoder's context full: before it, the encoder's keys, values and
position table fill up to a bound, about 2 MiB on ``medium``) to the end of the run, scaled to
a minute. The caches past that grow in mlx-lm's 256-position steps, so a short run reads
either no growth or a whole step; ``memory_per_minute`` is the long-run rate. MLX keeps freed
buffers in its cache, so over a short run RSS grows less than the active memory does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_peers  # noqa: E402  (its checkpoint shims, audio, sync counter and offline worker)
from bench_peers import PROMPT, ROOT, SyncCounter, _load_audio, _machine, _peer_view  # noqa: E402

CHUNK = 1280  # 80 ms at 16 kHz
# From this frame on the encoder's 70-frame left context is full (its compiled step): the
# session's per-frame median from here is printed too (a 12 s input has 80 such frames), and
# memory growth is measured from here.
STEADY_FRAME = 72
CONFIGS = ("session", "offline", "mlx-vlm")


def _rss() -> int:
    """Resident bytes of this process (Linux /proc; 0 where it is not there)."""
    try:
        for ln in Path("/proc/self/status").read_text().splitlines():
            if ln.startswith("VmRSS:"):
                return int(ln.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _mark(mx) -> tuple:
    """Active and resident bytes once the queued work is done (outside any timing)."""
    mx.synchronize()
    return mx.get_active_memory(), _rss()


def _memory(mx, marks, frames) -> dict:
    """Growth per minute between the STEADY_FRAME mark and the end."""
    if STEADY_FRAME not in marks or frames <= STEADY_FRAME + 1:
        return {}
    minutes = (frames - STEADY_FRAME) * 0.08 / 60.0
    (a0, r0), (a1, r1) = marks[STEADY_FRAME], _mark(mx)
    return {
        "active_mib_per_min": (a1 - a0) / 2**20 / minutes,
        "rss_mib_per_min": (r1 - r0) / 2**20 / minutes,
    }


def worker_session(args) -> dict:
    import mlx.core as mx

    sys.path.insert(0, str(ROOT))
    import mlx_voicechat

    model = mlx_voicechat.load(args.ckpt)
    audio = _load_audio(args.audio)
    opens = []
    for _ in range(2):
        t = time.perf_counter()
        session = model.session(PROMPT, seed=0)
        mx.synchronize()
        opens.append(1000 * (time.perf_counter() - t))
    counter = SyncCounter()
    per_frame, steady, syncs, marks, total = [], [], [], {}, 0.0
    for i in range(0, len(audio), CHUNK):
        block = audio[i : i + CHUNK]
        counter.active, before = True, counter.count
        t = time.perf_counter()
        events = session.feed(block)
        dt = time.perf_counter() - t
        counter.active = False
        total += dt
        if len(events) == 1:
            per_frame.append(dt)
            syncs.append(counter.count - before)
            if events[0].index >= STEADY_FRAME:
                steady.append(dt)
        if session.frames == STEADY_FRAME and STEADY_FRAME not in marks:
            marks[STEADY_FRAME] = _mark(mx)
    out = {
        "frames": session.frames,
        "frame_ms": 1000 * statistics.median(per_frame),
        "steady_frame_ms": 1000 * statistics.median(steady) if steady else None,
        "all_in_ms": (opens[0] + 1000 * total) / session.frames,
        "open_ms": opens,
        "host_reads_per_frame": statistics.mean(syncs) if syncs else None,
        "lookahead_samples": session.ready_before_slot_end,
        "lookahead_ms": 1000 * session.ready_before_slot_end / session.input_sample_rate,
        "memory_per_minute": session.memory_per_minute(),
    }
    out.update(_memory(mx, marks, session.frames))
    session.close()
    return out


def worker_mlx_vlm(args) -> dict:
    import mlx.core as mx
    from mlx_vlm import load

    view = _peer_view("mlx-vlm", Path(args.ckpt), Path(args.view))
    model, processor = load(str(view))
    parent = model.create_session(processor)
    opens = []
    for _ in range(2):
        t = time.perf_counter()
        session = parent.create_streaming_session(system_prompt=PROMPT, seed=0)
        mx.synchronize()
        opens.append(1000 * (time.perf_counter() - t))
    audio = _load_audio(args.audio)
    per_frame, marks, frames = [], {}, 0
    for i in range(0, len(audio) - CHUNK + 1, CHUNK):
        t = time.perf_counter()
        events = session.push_audio(mx.array(audio[i : i + CHUNK]))
        mx.eval([e.samples for e in events if e.samples is not None])
        per_frame.append(time.perf_counter() - t)
        frames += 1
        if frames == STEADY_FRAME:
            marks[STEADY_FRAME] = _mark(mx)
    out = {
        "frames": frames,
        "frame_ms": 1000 * statistics.median(per_frame),
        "all_in_ms": (opens[0] + 1000 * sum(per_frame)) / frames,
        "open_ms": opens,
    }
    out.update(_memory(mx, marks, frames))
    return out


def _run(config, ckpt, audio, view, timeout) -> dict:
    if config == "offline":
        return bench_peers._run_worker("ours", "", "plain", ckpt, audio, view, timeout)
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        config,
        "--ckpt",
        str(ckpt),
        "--audio",
        str(audio),
        "--view",
        str(view),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if config == "mlx-vlm":
        env["MLX_VOICECHAT_OVERRIDE"] = "0"  # mlx-vlm's own model class for its model_type
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": tail[:300]}
    return json.loads(lines[-1])


def _f(v, nd=1):
    return "—" if v is None or v != v else f"{v:.{nd}f}"


def _verdict(value, target):
    if value is None:
        return "—"
    return f"{value:.3f} (target <= {target}: {'met' if value <= target else 'NOT met'})"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--dir",
        default=str(Path.home() / ".cache" / "mlx-voicechat-bench"),
        help="checkpoint / input cache (shared with bench_peers.py)",
    )
    ap.add_argument("--scale", default="medium")
    ap.add_argument("--seconds", type=float, default=20.0, help="input audio (20 s = 250 frames)")
    ap.add_argument("--repeats", type=int, default=1, help="alternating rounds")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--timeout", type=int, default=900, help="seconds per subprocess")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--audio", help=argparse.SUPPRESS)
    ap.add_argument("--view", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        fn = {"session": worker_session, "mlx-vlm": worker_mlx_vlm}[args.worker]
        print(json.dumps(fn(args)))
        return

    sys.path.insert(0, str(ROOT))
    from mlx_voicechat.factory import make_checkpoint

    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    ckpt = d / f"{args.scale}-mlx-community"
    if not (ckpt / "config.json").exists():
        make_checkpoint(ckpt, args.scale, "mlx-community")
    audio = d / f"input-{args.seconds:g}s.npy"
    if not audio.exists():
        bench_peers._write_audio(audio, args.seconds)
    configs = [c for c in args.configs.split(",") if c]
    t_all = time.perf_counter()
    runs = {c: [] for c in configs}
    for _ in range(args.repeats):
        for c in configs:  # alternating: one run of each configuration per round
            r = _run(c, ckpt, audio, d / "views" / f"stream-{c}-{args.scale}", args.timeout)
            print(f"  {args.scale} {c}: {r}", file=sys.stderr, flush=True)
            runs[c].append(r)

    def med(c, key):
        vals = [r[key] for r in runs.get(c, []) if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    def opens(c, i):
        vals = [r["open_ms"][i] for r in runs.get(c, []) if "open_ms" in r]
        return statistics.median(vals) if vals else None

    for r in runs.get("offline", []):  # generate's wall: prompt, perception, frames and codec
        if "wall_s" in r:
            r["all_in_ms"] = 1000 * r["wall_s"] / r["frames"]
    mib = 2**20
    print(
        f"### streaming, {args.scale}: {args.seconds:g} s input in {CHUNK}-sample chunks, "
        f"system prompt, {args.repeats} round(s)\n"
    )
    print(
        "| configuration | frames | per-frame ms (median) | all-in ms / frame | first open ms "
        f"| second open ms | active MiB / min from frame {STEADY_FRAME} | RSS MiB / min |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for c in configs:
        errs = [r["error"] for r in runs[c] if "error" in r]
        if errs:
            print(f"| {c} | — | failed: {errs[0]} | | | | | |")
            continue
        print(
            f"| {c} | {runs[c][0].get('frames')} | {_f(med(c, 'frame_ms'))} "
            f"| {_f(med(c, 'all_in_ms'))} | {_f(opens(c, 0))} | {_f(opens(c, 1))} "
            f"| {_f(med(c, 'active_mib_per_min'), 2)} | {_f(med(c, 'rss_mib_per_min'), 2)} |"
        )
    print()
    s = next((r for r in runs.get("session", []) if "error" not in r), None)
    if s:
        mpm = s["memory_per_minute"]
        print(
            f"- lookahead: a frame is computed {s['lookahead_samples']} samples "
            f"({s['lookahead_ms']:.1f} ms) before its 80 ms slot ends"
        )
        print(
            "- session host reads per frame (one frame per feed): "
            f"{_f(s['host_reads_per_frame'], 2)}"
        )
        print(
            f"- memory per minute (session.memory_per_minute): LLM KV "
            f"{mpm['llm_kv'] / mib:.2f} MiB, TTS global KV {mpm['tts_global_kv'] / mib:.2f} "
            f"MiB, TTS window KV {mpm['tts_window_kv'] / mib:.2f} MiB (until the window is "
            f"full, {mpm['tts_window_minutes'] * 60:.0f} s); after the window "
            f"{mpm['total_after_window'] / mib:.2f} MiB / min"
        )
    ours, off, vlm = (med(c, "frame_ms") for c in ("session", "offline", "mlx-vlm"))
    first, second = opens("session", 0), opens("session", 1)

    def ratio(a, b):
        return a / b if a and b else None

    print(f"- streaming / offline per frame: {_verdict(ratio(ours, off), 1.15)}")
    print(f"- streaming / mlx-vlm streaming per frame: {_verdict(ratio(ours, vlm), 0.35)}")
    if med("session", "steady_frame_ms"):
        print(
            f"- session per frame from frame {STEADY_FRAME} on (the encoder's context full): "
            f"{_f(med('session', 'steady_frame_ms'))} ms"
        )
    print(f"- second open / first open: {_verdict(ratio(second, first), 0.1)}")
    print(
        f"- all-in per frame, streaming / offline: "
        f"{_f(ratio(med('session', 'all_in_ms'), med('offline', 'all_in_ms')), 3)}"
    )
    print(f"\nMachine: {_machine()}. Total benchmark time {time.perf_counter() - t_all:.0f} s.")


if __name__ == "__main__":
    main()

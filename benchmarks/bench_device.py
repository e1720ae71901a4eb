"""One device run: the oracle tests and the live frame at the real model's dimensions, against
the memory roofline, on MLX's CUDA backend (``--device gpu``) or the CPU.

    python benchmarks/bench_device.py --device gpu [--scale full] [--out FILE.json]
    python benchmarks/bench_device.py --device cpu --scale small        # a short check run

Random weights are built on the device in memory (``weights.random_model``: the model the
factory's mlx-community checkpoint would load as; LLM mixers, embedding and heads 4-bit, group
64, everything else bfloat16), no checkpoint is written. Each part runs in its own subprocess
under one time budget (``--budget``; later parts are skipped with a reason when it runs out):

1. ``bench``: the device's copy bandwidth (``y = x + 1`` over a large array, bytes read plus
   written per second); the model build; the weight bytes each stage reads per frame; a live
   session (``model.session``) fed in 80 ms chunks: per-frame p50 / p95 over all frames and from
   frame 72 on (the encoder's context full), host reads per frame, peak memory; the same frames
   with an eval barrier after each stage (encoder, RNNT, LLM + heads, TTS inputs, TTS backbone,
   MoG iterations, codec): per-stage time against its weight bytes over the bandwidth; graph
   primitives per frame (``mx.export_to_dot`` of every eval and host read); offline
   ``model.generate`` per-frame p50 / p95; batched sessions at B = 1, 4, 16 where the model has
   ``session_batch``.
2. ``oracle``: the tests against NeMo's outputs (perception, RNNT, LLM, character encoder, TTS,
   codec, offline, session) with ``MLX_VOICECHAT_TEST_DEVICE`` set, each bound's error next to
   its tolerance.
3. ``launches``: CUDA kernels and launch calls per steady frame through PyTorch's profiler
   (CUPTI), where PyTorch and a GPU are present.

The frame's roofline is the sum of the stages' weight bytes over the measured bandwidth.
Everything goes to ``--out`` (rewritten after each part) and a summary to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROMPT = "You are a helpful assistant. Answer briefly and kindly."
CHUNK = 1280  # 80 ms at 16 kHz
FRAME_S = 0.08
STEADY_FRAME = 72  # from here on the encoder's 70-frame context is full (its compiled step)
ORACLE_FILES = (
    "tests/nemotron_voicechat/nets/test_perception.py", "tests/listen/test_rnnt.py", "tests/nemotron_voicechat/nets/test_llm.py",
    "tests/nemotron_voicechat/nets/test_char_encoder.py", "tests/nemotron_voicechat/nets/test_tts.py", "tests/nemotron_voicechat/nets/test_codec.py",
    "tests/nemotron_voicechat/runtime/test_duplex.py", "tests/nemotron_voicechat/runtime/test_session.py",
)
ORACLE_SELECT = "oracle04 or not test_session"  # test_session: only its oracle 04 replays
DEFAULTS = {  # device: (scale, seconds, budget s)
    "gpu": ("full", 12.0, 540),
    "cpu": ("small", 8.0, 420),
}
GRAPH_FRAMES = 3


def _input_audio(seconds: float):
    """A speech-like test input: a few amplitude-modulated harmonics over faint noise."""
    import numpy as np

    n = int(seconds * 16000)
    t = np.arange(n) / 16000
    x = sum(np.sin(2 * np.pi * f * t) / (k + 1) for k, f in enumerate((140, 280, 420, 700)))
    noise = np.random.default_rng(0).standard_normal(n)
    return (0.1 * x * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t)) + 0.01 * noise).astype(np.float32)


# --- the bench worker -----------------------------------------------------------------------


def _use_device(name: str):
    import mlx.core as mx

    device = mx.gpu if name == "gpu" else mx.cpu
    if not mx.is_available(device):
        raise SystemExit(f"this MLX ({mx.__version__}) has no {name} backend")
    mx.set_default_device(device)
    return mx


def _build(args):
    from mlx_voicechat.nemotron_voicechat import Model
    from mlx_voicechat.nemotron_voicechat.weights.random_model import random_model

    q = None if args.quantize == 0 else args.quantize
    return random_model(args.scale, quantize=q, dtype=args.dtype, seed=0, model_class=Model)


def worker_bench(args) -> None:
    mx = _use_device(args.device)
    import device_probe as probe
    import numpy as np

    res = {"phases_s": {}, "skipped": {}}
    deadline = args.deadline

    def save():
        Path(args.partial).write_text(json.dumps(res, indent=1, default=float))

    def phase(name, t):
        res["phases_s"][name] = time.perf_counter() - t
        print(f"[bench] {name}: {res['phases_s'][name]:.1f} s", file=sys.stderr, flush=True)
        save()

    t = time.perf_counter()
    res["device_info"] = {k: str(v) for k, v in mx.device_info().items()}
    res["bandwidth"] = probe.copy_bandwidth(args.copy_mib << 20)
    bw = res["bandwidth"]["bytes_per_s"]
    phase("bandwidth", t)

    t = time.perf_counter()
    mx.reset_peak_memory()
    model = _build(args)
    mx.synchronize()
    res["model"] = {
        "scale": args.scale, "quantize": args.quantize, "dtype": args.dtype,
        "active_mib": mx.get_active_memory() / 2**20,
        "build_peak_mib": mx.get_peak_memory() / 2**20,
    }
    phase("build", t)

    stages = probe.stage_weight_bytes(model)
    res["mog_iterations"] = probe.mog_iterations(model)
    frame_bytes = sum(s["bytes"] for s in stages.values())
    res["weights"] = {"stages": stages, "frame_bytes": frame_bytes}
    res["roofline_ms"] = 1000 * frame_bytes / bw
    if args.scale != "full":  # what the real model's frame would read, from its shapes alone
        full = probe.stage_weight_bytes(probe.shape_only_model("full", args.quantize, args.dtype))
        full_bytes = sum(s["bytes"] for s in full.values())
        res["full_scale"] = {
            "stages": {k: v["bytes"] for k, v in full.items()},
            "frame_bytes": full_bytes,
            "roofline_ms": 1000 * full_bytes / bw,
        }
    save()

    audio = _input_audio(args.seconds)
    chunks = [audio[i : i + CHUNK] for i in range(0, len(audio), CHUNK)]
    hooks = probe.Hooks()

    # Warm-up: the first frames of a first session compile kernels (and, on a GPU, JIT them).
    t = time.perf_counter()
    s = model.session(PROMPT, seed=0)
    for c in chunks[: STEADY_FRAME + 8]:
        s.feed(c)
        if time.time() > deadline - 60:
            res["skipped"]["warmup"] = f"cut short at frame {s.frames} by the time budget"
            break
    mx.synchronize()
    phase("warmup", t)

    t = time.perf_counter()
    mx.reset_peak_memory()
    s = model.session(PROMPT, seed=0)
    mx.synchronize()
    every, steady, reads, cut = [], [], [], False
    for c in chunks:
        hooks.counting, before = True, hooks.reads
        t0 = time.perf_counter()
        events = s.feed(c)
        dt = time.perf_counter() - t0
        hooks.counting = False
        if len(events) == 1:
            every.append(dt)
            reads.append(hooks.reads - before)
            if events[0].index >= STEADY_FRAME:
                steady.append(dt)
        if time.time() > deadline - 30:
            cut = True
            break
    res["live"] = {
        "frames": s.frames,
        "all": probe.percentiles(every),
        "steady": probe.percentiles(steady),
        "steady_from_frame": STEADY_FRAME,
        "host_reads_per_frame": float(np.mean(reads)) if reads else None,
        "peak_mib": mx.get_peak_memory() / 2**20,
        "cut_short": cut,
    }
    if steady:
        st = res["live"]["steady"]
        res["live"]["steady_over_roofline"] = {
            "p50": st["p50_ms"] / res["roofline_ms"], "p95": st["p95_ms"] / res["roofline_ms"]
        }
    phase("live", t)

    if time.time() < deadline - 40:
        t = time.perf_counter()
        timer = probe.StageTimer()
        missing = timer.install()
        s = model.session(PROMPT, seed=0)
        barrier = []
        graph_at = len(chunks) - GRAPH_FRAMES
        for c in chunks[:graph_at]:
            t0 = time.perf_counter()
            events = s.feed(c)
            dt = time.perf_counter() - t0
            keep = len(events) == 1 and events[0].index >= STEADY_FRAME
            timer.end_frame(keep)
            if keep:
                barrier.append(dt)
            if time.time() > deadline - 25:
                break
        timer.remove()
        counter = probe.GraphCounter()
        graphs = []
        hooks.on_graph = counter
        for c in chunks[graph_at:]:
            if s.feed(c):
                graphs.append(counter.take())
        hooks.on_graph = None
        per_stage = timer.summary()
        for name, st in per_stage.items():
            st.update(stages[name])
            st["roofline_ms"] = 1000 * st["bytes"] / bw
            st["ratio"] = st["p50_ms"] / st["roofline_ms"] if st["p50_ms"] else None
        res["stages"] = {
            "per_stage": per_stage,
            "barrier_frame": probe.percentiles(barrier),
            "hooks_missing": missing,
        }
        res["graph_per_frame"] = graphs[-1] if graphs else None
        phase("stages", t)
    else:
        res["skipped"]["stages"] = "time budget"

    if time.time() < deadline - 30:
        t = time.perf_counter()
        mx.reset_peak_memory()
        stamps = []
        out = model.generate(
            audio, system_prompt=PROMPT, extra_decoding_seconds=0.0, seed=0,
            progress=lambda done, total: stamps.append(time.perf_counter()),
        )
        wall = time.perf_counter() - t
        diffs = list(np.diff(stamps))
        res["offline"] = {
            "frames": out.frames, "wall_s": wall, "per_frame": probe.percentiles(diffs[2:]),
            "all_in_ms_per_frame": 1000 * wall / max(out.frames, 1),
            "peak_mib": mx.get_peak_memory() / 2**20,
        }
        phase("offline", t)
    else:
        res["skipped"]["offline"] = "time budget"

    t = time.perf_counter()
    res["batch"] = _batched(model, chunks, args, deadline, probe, hooks)
    phase("batch", t)


def _batched(model, chunks, args, deadline, probe, hooks) -> dict:
    """Batched sessions (issue 23's API): per-step p50 / p95 and frames per second at each B."""
    import mlx.core as mx

    if not hasattr(model, "session_batch"):
        return {"skipped": "this model has no session_batch (batched sessions not merged yet)"}
    sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    out = {}
    for B in sizes:
        if time.time() > deadline - 30:
            out[str(B)] = {"skipped": "time budget"}
            continue
        mx.reset_peak_memory()
        batch = model.session_batch(max_sessions=max(sizes))
        handles = [batch.open(PROMPT, seed=i) for i in range(B)]
        steps, steady, reads, frames, t_all = [], [], [], 0, time.perf_counter()
        for c in chunks:
            for h in handles:
                h.push(c)
            hooks.counting, before = True, hooks.reads
            t0 = time.perf_counter()
            events = batch.step()
            dt = time.perf_counter() - t0
            hooks.counting = False
            n = sum(len(v) for v in events.values())
            frames += n
            if n == B:
                steps.append(dt)
                reads.append(hooks.reads - before)
                idx = min(e.index for v in events.values() for e in v)
                if idx >= STEADY_FRAME:
                    steady.append(dt)
            if time.time() > deadline - 20:
                break
        wall = time.perf_counter() - t_all
        for h in handles:
            h.close()
        out[str(B)] = {
            "step": probe.percentiles(steps), "steady_step": probe.percentiles(steady),
            "frames": frames, "frames_per_s": frames / wall,
            "host_reads_per_step": sum(reads) / len(reads) if reads else None,
            "peak_mib": mx.get_peak_memory() / 2**20,
        }
    return out


# --- the launches worker ----------------------------------------------------------------------


def worker_launches(args) -> None:
    _use_device(args.device)
    import device_probe as probe

    model = _build(args)
    audio = _input_audio((STEADY_FRAME + 4 + args.launch_frames) * FRAME_S + 0.1)
    chunks = [audio[i : i + CHUNK] for i in range(0, len(audio), CHUNK)]
    s = model.session(PROMPT, seed=0)
    for c in chunks[: STEADY_FRAME + 4]:
        s.feed(c)
    todo = chunks[STEADY_FRAME + 4 : STEADY_FRAME + 4 + args.launch_frames]
    trace = os.path.join(tempfile.mkdtemp(), "trace.json")
    res = probe.cuda_kernels(lambda: [s.feed(c) for c in todo], len(todo), trace)
    Path(args.partial).write_text(json.dumps(res, indent=1))


# --- the orchestrator --------------------------------------------------------------------------


def _subprocess(cmd, timeout, env=None) -> dict:
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join(  # the workers' helpers, the plugin, the package
        [str(HERE), str(HERE / "device"), str(ROOT)]
        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, timeout=max(timeout, 1), capture_output=True,
                           check=False,
                           text=True)
        rc, tail = p.returncode, (p.stdout + p.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        rc, tail = "timeout", (out.decode(errors="replace") if isinstance(out, bytes) else out)
        tail = f"timed out after {timeout:.0f} s\n" + tail[-3000:]
    return {"rc": rc, "seconds": time.perf_counter() - t, "tail": tail}


def _worker_cmd(args, kind, partial, deadline):
    return [
        sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--partial", partial,
        "--deadline", str(deadline), "--device", args.device, "--scale", args.scale,
        "--seconds", str(args.seconds), "--quantize", str(args.quantize), "--dtype", args.dtype,
        "--batch-sizes", args.batch_sizes, "--copy-mib", str(args.copy_mib),
        "--launch-frames", str(args.launch_frames),
    ]


def _oracle(args, timeout) -> dict:
    tmp = tempfile.mkdtemp(prefix="oracle-")
    path = os.path.join(tmp, "oracle.json")
    cmd = [sys.executable, "-m", "pytest", *ORACLE_FILES, "-k", ORACLE_SELECT, "-q",
           "-p", "oracle_plugin", "-p", "no:cacheprovider", "-o", "enable_assertion_pass_hook=true"]
    env = {
        "MLX_VOICECHAT_TEST_DEVICE": args.device,
        "MLX_VOICECHAT_ORACLE_JSON": path,
        # A fresh bytecode folder: the pass hook needs the tests' assertions rewritten anew.
        "PYTHONPYCACHEPREFIX": os.path.join(tmp, "pyc"),
    }
    run = _subprocess(cmd, timeout, env)
    res = {"command": " ".join(cmd[1:]), "rc": run["rc"], "seconds": run["seconds"]}
    if os.path.exists(path):
        data = json.loads(Path(path).read_text())
        tests = data["tests"]
        counts = {}
        for t in tests.values():
            counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
        res["counts"] = counts
        res["tests"] = tests
    else:
        res["tail"] = run["tail"]
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--scale", help="tiny / small / medium / full (default: full on the GPU, "
                    "small on the CPU)")
    ap.add_argument("--seconds", type=float, help="input length (12 s = 150 frames)")
    ap.add_argument("--budget", type=float, help="seconds for the whole run (default 540 on "
                    "the GPU, 420 on the CPU)")
    ap.add_argument("--out", help="JSON file (default benchmarks/results/device-DEVICE-SCALE.json)")
    ap.add_argument("--quantize", type=int, default=4, choices=(0, 4, 8),
                    help="LLM mixers, embedding and heads (0: none)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--copy-mib", type=int, help="bandwidth array (default 4096 GPU, 512 CPU)")
    ap.add_argument("--parts", default="bench,oracle,launches")
    ap.add_argument("--launch-frames", type=int, default=8)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--partial", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    scale, seconds, budget = DEFAULTS[args.device]
    args.scale = args.scale or scale
    args.seconds = args.seconds or seconds
    args.budget = args.budget or budget
    args.copy_mib = args.copy_mib or (4096 if args.device == "gpu" else 512)
    if args.worker:
        sys.path.insert(0, str(ROOT))
        {"bench": worker_bench, "launches": worker_launches}[args.worker](args)
        return

    from bench_report import machine, summary

    start = time.time()
    end = start + args.budget
    parts = [p for p in args.parts.split(",") if p]
    name = f"device-{args.device}-{args.scale}.json"
    out = Path(args.out or ROOT / "benchmarks" / "results" / name)
    out.parent.mkdir(parents=True, exist_ok=True)
    res = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "machine": machine(args.device),
        "device": args.device, "scale": args.scale, "seconds": args.seconds,
        "budget_s": args.budget, "parts": {},
    }

    def save():
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(res, indent=1, default=float))
        tmp.replace(out)

    # What each later part is guaranteed, taken from the earlier ones' time.
    gpu = args.device == "gpu"
    reserve = {"oracle": 150 if gpu else 120, "launches": 75 if gpu else 0}
    for i, part in enumerate(parts):
        limit = end - time.time() - sum(reserve.get(p, 0) for p in parts[i + 1 :])
        if limit < 20:
            res["parts"][part] = {"skipped": f"time budget ({limit:.0f} s left)"}
            continue
        print(f"== {part} (up to {limit:.0f} s)", file=sys.stderr, flush=True)
        if part == "oracle":
            res["parts"]["oracle"] = _oracle(args, limit)
        elif part == "launches" and args.device != "gpu":
            res["parts"]["launches"] = {"skipped": "the CPU backend launches no kernels (see "
                                        "graph_per_frame for the primitives per frame)"}
        else:
            partial = os.path.join(tempfile.mkdtemp(), f"{part}.json")
            run = _subprocess(_worker_cmd(args, part, partial, time.time() + limit), limit)
            got = json.loads(Path(partial).read_text()) if os.path.exists(partial) else {}
            got["rc"], got["seconds"] = run["rc"], run["seconds"]
            if run["rc"] != 0:
                got["tail"] = run["tail"]
            res["parts"][part] = got
        save()
    res["total_s"] = time.time() - start
    save()
    print(summary(res))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

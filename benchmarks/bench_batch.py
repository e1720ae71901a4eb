"""Batched live sessions: N conversations stepped together against the same N stepped in turn.

    python benchmarks/bench_batch.py [--scale medium] [--quantize 4] [--seconds 12]
        [--sessions 1,2,4,8] [--blas wheel,openblas] [--device cpu|gpu]

Each configuration runs in a subprocess of its own (the BLAS is chosen at interpreter start,
``MLX_VOICECHAT_BLAS``), on a random-weight model built in memory (the factory's weights for
``--scale``; ``--quantize 4`` as the mlx-community 4-bit checkpoint). Every conversation is fed
its own ``--seconds`` input in 80 ms chunks:

- ``batch``: ``model.session_batch(N)``, every conversation pushing its chunk, then one
  ``batch.step()`` per 80 ms of input (one batched forward for all N);
- ``in turn``: N ``model.session()``, each fed its chunk one after the other (what a server
  that steps its sessions one by one does), round by round in the same loop as the batch.

Printed per N: aggregate frames / s (N frames per round over the round's time, from the
second round), the batch's per-round p50 / p95, its speed against N = 1 and its time against
the same N in turn; the stall a conversation joining mid-run and one leaving cause the others
(the round's time over the median round, in frames): the first join makes the batch's first
round of N + 1 rows (its compiled steps are traced for that size, once per process), a second
join later finds them traced; memory per conversation (MLX's active memory after the run over
N).
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
ROOT = HERE.parent
CHUNK = 1280  # 80 ms at 16 kHz
PROMPT = "You are a helpful voice assistant. Answer briefly."


def _machine() -> str:
    import platform

    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def _wave(seconds: float, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(int(seconds * 16000))).astype(np.float32)


def _p(xs, q):
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * len(s)) - 1))]


def worker(args) -> dict:
    sys.path.insert(0, str(ROOT))
    import mlx.core as mx

    if args.device == "gpu":
        mx.set_default_device(mx.gpu)
    from mlx_voicechat.fastpaths.system import blas_in_effect
    from mlx_voicechat.nemotron_voicechat import Model
    from mlx_voicechat.nemotron_voicechat.weights.random_model import random_model

    dtype = "bfloat16" if args.quantize else "float32"
    model = random_model(
        args.scale, quantize=args.quantize or None, dtype=dtype, seed=0, model_class=Model
    )
    sizes = [int(n) for n in args.sessions.split(",")]
    rounds = int(args.seconds / 0.08)
    waves = [_wave(args.seconds, 10 + i) for i in range(max(sizes) + 1)]
    out = {"blas": blas_in_effect()["blas"], "rounds": rounds, "sizes": {}}
    # warm-up: compiled steps traced, the prompt's snapshot made
    s = model.session(PROMPT, seed=0)
    s.feed(waves[0][: 6 * CHUNK])
    s.close()
    for n in sizes:
        res = {}
        # The batch and the same N sessions in turn, round by round in one loop, so that
        # both see the machine as it is at that moment.
        mx.eval(model.parameters())
        memory0 = mx.get_active_memory()
        batch = model.session_batch(max_sessions=n + 1)
        handles = [batch.open(PROMPT, seed=i) for i in range(n)]
        sessions = [model.session(PROMPT, seed=i) for i in range(n)]
        # With N > 1 one more conversation joins at a third of the run and leaves at two
        # thirds (the first batch of N + 1 rows: its compiled steps are traced then), and a
        # second one joins at five sixths and leaves at eleven twelfths (N + 1 rows again).
        times, turn = [], []
        visits = [(rounds // 3, 2 * rounds // 3), (5 * rounds // 6, 11 * rounds // 12)]
        joins = {a: b for a, b in visits}
        leaves = {b for _, b in visits}
        guest, guest_at = None, 0
        for k in range(rounds):
            if n > 1 and k in joins:
                guest, guest_at = batch.open(PROMPT, seed=99 + k), k
            if guest is not None and k in leaves:
                guest.close()
                guest = None
            for i, h in enumerate(handles):
                h.push(waves[i][k * CHUNK : (k + 1) * CHUNK])
            if guest is not None:
                j = k - guest_at
                guest.push(waves[n][j * CHUNK : (j + 1) * CHUNK])
            t = time.perf_counter()
            batch.step()
            times.append(time.perf_counter() - t)
            t = time.perf_counter()
            for i, s in enumerate(sessions):
                s.feed(waves[i][k * CHUNK : (k + 1) * CHUNK])
            turn.append(time.perf_counter() - t)
        # Both sides hold N conversations of the same length.
        memory = (mx.get_active_memory() - memory0) / (2 * n)
        skip = {k for a, b in visits for k in (a, b, b + 1)}
        steady = [t for j, t in enumerate(times[1:], 1) if j not in skip]
        med = statistics.median(steady)
        res["batch_round_p50_ms"] = 1000 * med
        res["batch_round_p95_ms"] = 1000 * _p(steady, 0.95)
        res["batch_frames_per_s"] = n / med
        if n > 1:
            (j1, _), (j2, _) = visits
            res["join_stall_frames"] = (times[j1] - med) / med
            res["join_again_stall_frames"] = (times[j2] - med) / med
            res["leave_stall_frames"] = max(max(times[b], times[b + 1]) - med for _, b in visits) / med
        res["memory_mib_per_session"] = memory / 2**20
        tmed = statistics.median(turn[1:])
        res["in_turn_round_p50_ms"] = 1000 * tmed
        res["in_turn_frames_per_s"] = n / tmed
        res["batch_over_in_turn_time"] = med / tmed
        for h in handles:
            h.close()
        for s in sessions:
            s.close()
        del batch, handles, sessions
        out["sizes"][str(n)] = res
        print(f"  N={n}: {res}", file=sys.stderr, flush=True)
    return out


def _run(args, blas: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--scale", args.scale, "--seconds", str(args.seconds),
           "--sessions", args.sessions, "--device", args.device]
    if args.quantize:
        cmd += ["--quantize", str(args.quantize)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), MLX_VOICECHAT_BLAS="" if blas == "wheel" else blas)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    sys.stderr.write(p.stderr)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        return {"error": (p.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(lines[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", default="medium")
    ap.add_argument("--quantize", type=int, default=0, help="4 or 8: the LLM and heads quantized")
    ap.add_argument("--seconds", type=float, default=12.0, help="input per conversation")
    ap.add_argument("--sessions", default="1,2,4,8")
    ap.add_argument("--blas", default="wheel,openblas", help="wheel and / or openblas (or a path)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    ap.add_argument("--timeout", type=int, default=7200, help="seconds per subprocess")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    t0 = time.perf_counter()
    results = {b: _run(args, b) for b in args.blas.split(",") if b}
    q = f"{args.quantize}-bit" if args.quantize else "float32"
    print(f"### batched sessions, {args.scale} {q}, {args.seconds:g} s per conversation, "
          f"80 ms chunks, {args.device}\n")
    print("| BLAS | N | batch frames/s | vs N=1 | round p50 ms | p95 ms | in turn frames/s "
          "| batch time / in turn | join stall (first N+1) | join stall (again) | leave stall "
          "| MiB / session |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for blas, r in results.items():
        if "error" in r:
            print(f"| {blas} | — | failed: {r['error']} |")
            continue
        one = r["sizes"].get("1", {}).get("batch_frames_per_s")
        for n, s in r["sizes"].items():
            vs = s["batch_frames_per_s"] / one if one else None
            print(
                f"| {r['blas']} | {n} | {s['batch_frames_per_s']:.2f} | "
                f"{'—' if vs is None else f'{vs:.2f}x'} | {s['batch_round_p50_ms']:.0f} | "
                f"{s['batch_round_p95_ms']:.0f} | {s['in_turn_frames_per_s']:.2f} | "
                f"{s['batch_over_in_turn_time']:.2f} | "
                f"{s.get('join_stall_frames', float('nan')):.2f} | "
                f"{s.get('join_again_stall_frames', float('nan')):.2f} | "
                f"{s.get('leave_stall_frames', float('nan')):.2f} | {s['memory_mib_per_session']:.0f} |"
            )
    print("\nTargets: OpenBLAS N=4 >= 2.2x and N=8 >= 3x the N=1 frames/s; with the wheel's BLAS "
          "the batch's time <= 1.05x in turn; join / leave stall <= 1 frame.")
    print(f"Machine: {_machine()}. Total {time.perf_counter() - t0:.0f} s.")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()

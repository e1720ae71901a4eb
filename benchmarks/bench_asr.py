"""Nemotron-3.5-ASR: our runtime against mlx-audio's on the same random weights, in one run.

    python benchmarks/bench_asr.py [--dir DIR] [--scales tiny,small] [--seconds 60]
                                   [--batch-seconds 15] [--seed N] [--blas both] [--repeats 3]

Writes a random-weight recognizer per scale with the factory (mlx-audio's layout, cached in
``--dir``) and, per scale, in one subprocess (after a 1 s warm-up of each path), runs each of
these ``--repeats`` times, alternating, and keeps the best time of each (the machine may be
shared):

- offline: ours ``model.transcribe(x, edge="mlx-audio")`` against mlx-audio's
  ``model.generate(x)`` (its zero-padded STFT, errata 1), wall time each, and whether the
  tokens are equal (mlx-audio leaves the language tags out of its tokens);
- live, per 80 ms of audio: ours ``model.session()`` fed 1280-sample chunks, then ``finish``,
  against mlx-audio's ``create_streaming_session()`` fed the same chunks with ``step()`` called
  after each feed until its queue holds less than one of its encoder chunks, then ``close`` and
  ``step`` to the end; wall time over the input's 80 ms frames;
- batched: ours ``model.transcribe([...])`` on 1, 4 and 16 clips of ``--batch-seconds`` each,
  as audio seconds per wall second, and against the 1-clip run's rate.

``--blas both`` runs everything twice: on the BLAS the MLX wheel ships and, where the system
has one, with OpenBLAS preloaded (``LD_PRELOAD``, ``OPENBLAS_NUM_THREADS=1``), which speeds up
MLX's CPU matrix products a great deal without changing this package. Random models emit
nothing or ``max_symbols`` tokens per frame as often as not: by default the first seed whose
rate on this input is speech-like is taken (the rate is printed, as tokens per frame).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
CHUNK = 1280  # 80 ms at 16 kHz


def _noise(n: int, seed: int):
    import numpy as np

    # Quiet noise with a slow envelope, a stand-in for speech's loud and quiet stretches.
    rng = np.random.default_rng(seed)
    env = 0.05 + 0.1 * np.abs(np.sin(np.arange(n) / 16000.0 * 1.7))
    return (env * rng.standard_normal(n)).astype(np.float32)


def _their_live(model, x):
    s = model.create_streaming_session()
    limit = s._encoder.chunk_mel * model.preprocessor_config.hop_length
    for i in range(0, len(x), CHUNK):
        s.feed(x[i : i + CHUNK])
        while s._encoded or s._queued >= limit:
            s.step()
    s.close()
    while not s.done:
        s.step()


def worker(path: str, seconds: float, batch_seconds: float, repeats: int) -> dict:
    import mlx.core as mx
    from mlx_audio.stt.models.nemotron_asr import tokenizer
    from mlx_audio.stt.utils import load_model

    from mlx_voicechat import load

    ours = load(path)
    theirs = load_model(path)
    theirs.preprocessor_config.pad_mode = "constant"  # NeMo's zero padding (errata 1)
    x = _noise(int(seconds * 16000), 1)
    frames = len(x) // CHUNK

    def our_live(audio):
        s = ours.session()
        for i in range(0, len(audio), CHUNK):
            s.feed(audio[i : i + CHUNK])
        s.finish()
        return s

    warm = x[:16000]
    ours.transcribe(warm, edge="mlx-audio")
    theirs.generate(mx.array(warm))
    our_live(warm)
    _their_live(theirs, warm)
    runs = {
        "ours_offline_s": lambda: ours.transcribe(x, edge="mlx-audio"),
        "theirs_offline_s": lambda: theirs.generate(mx.array(x)),
        "ours_live_s": lambda: our_live(x),
        "theirs_live_s": lambda: _their_live(theirs, x),
    }
    best = {k: float("inf") for k in runs}
    last = {}
    for _ in range(repeats):  # alternating, the best of each (the machine is shared)
        for k, fn in runs.items():
            t = time.perf_counter()
            last[k] = fn()
            best[k] = min(best[k], time.perf_counter() - t)
    r, g, s = last["ours_offline_s"], last["theirs_offline_s"], last["ours_live_s"]
    out = {"frames": frames, "seconds": seconds, "path": Path(path).name, "repeats": repeats}
    out.update(best)
    out["phases_ms"] = [r.timings.mel_ms, r.timings.encoder_ms, r.timings.decode_ms]
    out["tokens"], out["steps"] = len(r.tokens), r.steps
    their_tokens = [tok.id for sent in g.sentences for tok in sent.tokens]
    kept = [k for k in r.tokens if not tokenizer.is_special_token(k, theirs.vocabulary)]
    out["tokens_equal"] = kept == their_tokens
    out["ours_live_reads"] = s.reads
    out["live_equals_offline"] = s.tokens == ours.transcribe(x).tokens

    batch = {}
    for n in (1, 4, 16):
        clips = [_noise(int(batch_seconds * 16000) - 997 * i, 10 + i) for i in range(n)]
        audio = sum(len(c) for c in clips) / 16000
        best_s = float("inf")
        for _ in range(max(1, repeats - 1)):
            t = time.perf_counter()
            ours.transcribe(clips)
            best_s = min(best_s, time.perf_counter() - t)
        batch[n] = audio / best_s
    out["batch_rate"] = batch
    return out


def _machine() -> str:
    import platform

    cpus = os.cpu_count()
    try:
        import mlx.core as mx

        device = str(mx.default_device())
    except Exception:
        device = "?"
    return f"{cpus} CPUs, {platform.machine()} {platform.system()}, MLX {device}"


def report(scale: str, blas: str, r: dict) -> None:
    f = r["frames"]
    print(
        f"\n## {scale} ({r['path']}), {blas} BLAS, best of {r['repeats']}: "
        f"{r['seconds']:.0f} s of audio ({f} frames), "
        f"{r['tokens']} tokens ({r['tokens'] / max(f, 1):.2f} per frame), {r['steps']} steps"
    )
    mel, enc, dec = r["phases_ms"]
    print(
        f"offline  ours {r['ours_offline_s']:.2f} s (last run: mel {mel:.0f} / encoder {enc:.0f}"
        f" / decode {dec:.0f} ms), mlx-audio generate {r['theirs_offline_s']:.2f} s: "
        f"{r['ours_offline_s'] / r['theirs_offline_s']:.2f}x; tokens equal: "
        f"{'yes' if r['tokens_equal'] else 'NO'}"
    )
    ours, theirs = 1000 * r["ours_live_s"] / f, 1000 * r["theirs_live_s"] / f
    print(
        f"live     ours {ours:.2f} ms per 80 ms ({r['ours_live_reads']} reads), mlx-audio "
        f"session {theirs:.2f} ms: {ours / theirs:.2f}x; live tokens = offline: "
        f"{'yes' if r['live_equals_offline'] else 'NO'}"
    )
    rates = r["batch_rate"]
    one = rates["1"]
    cells = ", ".join(
        f"{n} clips {v:.1f}x real time ({v / one:.2f}x of 1)" for n, v in rates.items()
    )
    print(f"batched  {cells}")


def _rate(path: Path, seconds: float) -> float:
    """Tokens per frame of this random model on the benchmark's input."""
    from mlx_voicechat import load

    r = load(path).transcribe(_noise(int(seconds * 16000), 1))
    return len(r.tokens) / r.encoder_frames


def _checkpoint(root: Path, scale: str, seed, make, seconds: float) -> Path:
    """The scale's checkpoint for ``seed``, or (``seed`` None) for the first seed from 0 on
    whose token rate is speech-like (0.1 to 1 per frame): random weights often emit nothing,
    or ``max_symbols`` tokens at most frames, and either would measure something else."""
    for s in [seed] if seed is not None else range(32):
        path = root / f"asr-{scale}-seed{s}"
        if not (path / "config.json").exists():
            make(path, scale, "mlx-audio", seed=s)
        if seed is not None or 0.1 <= _rate(path, seconds) <= 1.0:
            return path
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=str(Path.home() / ".cache" / "mlx-voicechat-bench"))
    ap.add_argument("--scales", default="tiny,small")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--batch-seconds", type=float, default=15.0)
    ap.add_argument("--seed", type=int, default=None, help="default: the first speech-like one")
    ap.add_argument("--blas", default="both", choices=["reference", "openblas", "both"])
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs, the best of each")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per subprocess")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.seconds, args.batch_seconds, args.repeats)))
        return 0

    from mlx_voicechat.nemotron_asr.factory import make_recognizer_checkpoint

    modes = ["reference", "openblas"] if args.blas == "both" else [args.blas]
    if "openblas" in modes and not os.path.exists(OPENBLAS):
        print(f"(no {OPENBLAS}: OpenBLAS runs skipped)")
        modes = [m for m in modes if m != "openblas"]
    print(f"# bench_asr: {_machine()}")
    for scale in args.scales.split(","):
        path = _checkpoint(
            Path(args.dir), scale, args.seed, make_recognizer_checkpoint, args.seconds
        )
        for mode in modes:
            env = dict(os.environ)
            if mode == "openblas":
                env.update(LD_PRELOAD=OPENBLAS, OPENBLAS_NUM_THREADS="1")
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                str(path),
                "--seconds",
                str(args.seconds),
                "--batch-seconds",
                str(args.batch_seconds),
                "--repeats",
                str(args.repeats),
            ]
            done = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=args.timeout
            )
            if done.returncode:
                print(f"## {scale}, {mode}: the worker failed\n{done.stderr[-2000:]}")
                continue
            report(scale, mode, json.loads(done.stdout.strip().splitlines()[-1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

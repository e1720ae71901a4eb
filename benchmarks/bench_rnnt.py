"""VoiceChat's greedy RN-T decoding offline (``listen.greedy.greedy_decode``), against another
revision's ``greedy_decode`` in the same run.

    python benchmarks/bench_rnnt.py [--dir DIR] [--scale medium] [--shifts 0,4,6]
                                    [--frames 50,250,750] [--before REV] [--repeats 5]

Writes the random-weight checkpoint once with the factory (cached in ``--dir``, shared with
``bench_stream.py``) and decodes random encoder frames with its prediction and joint networks.
Random joints emit ``max_symbols`` tokens on every frame or none at all; each ``--shifts`` value
is added to the blank's logit, so one run covers the dense case, a speech-like rate and a
blank-only clip (the tokens per frame are printed). ``--before REV``: also runs the
``greedy_decode`` of ``mlx_voicechat/nets/rnnt.py`` at that git revision of this repository
(the host loop before issue 35, e.g. ``7c70333``), alternating with today's, and checks that
the tokens and frames are the same. Each figure is the median of ``--repeats`` runs after a
warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def revision_decoder(rev: str):
    """``greedy_decode`` as written in ``nets/rnnt.py`` at ``rev``, run in that module's
    namespace as it is today (its imports)."""
    import mlx_voicechat.listen.rnnt as rnnt

    src = subprocess.run(
        ["git", "show", f"{rev}:mlx_voicechat/nets/rnnt.py"],  # where it was
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout
    if "def greedy_decode(" not in src:
        raise SystemExit(f"{rev}: nets/rnnt.py has no greedy_decode")
    body = src[src.index("def greedy_decode(") : src.index("\ndef ", src.index("def greedy_decode(") + 1)]
    ns = dict(vars(rnnt))
    ns.setdefault("LOOKAHEAD_FRAMES", 16)
    exec(compile("from __future__ import annotations\n" + body, f"{rev}:nets/rnnt.py", "exec"), ns)
    return ns["greedy_decode"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=str(Path.home() / ".cache" / "mlx-voicechat-bench"))
    ap.add_argument("--scale", default="medium")
    ap.add_argument("--shifts", default="0,4,6", help="added to the blank's logit, one run each")
    ap.add_argument("--frames", default="50,250,750", help="encoder frames (80 ms each)")
    ap.add_argument("--before", help="a git revision whose nets/rnnt.py greedy_decode to compare")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    import mlx.core as mx

    from mlx_voicechat import load
    from mlx_voicechat.derived import reset_derived
    from mlx_voicechat.factory import make_checkpoint
    from mlx_voicechat.listen.greedy import greedy_decode

    ckpt = Path(args.dir) / f"{args.scale}-mlx-community"
    if not (ckpt / "config.json").exists():
        make_checkpoint(ckpt, args.scale, "mlx-community")
    model = load(str(ckpt))
    stt = model.stt_model
    decoder, joint = stt.rnnt_decoder, stt.rnnt_joint
    cap = model.config.audio_config.max_symbols
    D = model.config.audio_config.encoder.d_model
    paths = [("now", greedy_decode)]
    if args.before:
        paths.insert(0, (args.before, revision_decoder(args.before)))
    bias = joint.joint_net[-1].bias
    head = " | ".join(f"{n} ms" for n, _ in paths)
    ratio = f" | now / {args.before}" if args.before else ""
    print(f"### greedy RN-T, {args.scale}, max_symbols {cap}\n")
    print(f"| blank shift | frames | tokens / frame | {head}{ratio} |")
    print("|---" * (3 + len(paths) + bool(args.before)) + "|")
    same = True
    for shift in [float(s) for s in args.shifts.split(",")]:
        b = mx.where(mx.arange(bias.shape[0]) == joint.blank_id, bias + shift, bias)
        joint.update({"joint_net": [{} for _ in joint.joint_net[:-1]] + [{"bias": b}]})
        reset_derived(model)
        for F in [int(f) for f in args.frames.split(",")]:
            enc = mx.random.normal((F, D), key=mx.random.key(F))
            call = lambda fn: fn(decoder, joint, enc, F, joint.blank_id, cap)  # noqa: E731
            out = {n: call(fn) for n, fn in paths}  # warm-up
            times = {n: [] for n, _ in paths}
            for _ in range(args.repeats):
                for n, fn in paths:
                    t = time.perf_counter()
                    out[n] = call(fn)
                    times[n].append(1000 * (time.perf_counter() - t))
            med = {n: statistics.median(v) for n, v in times.items()}
            same &= all(o == out["now"] for o in out.values())
            cells = " | ".join(f"{med[n]:.1f}" for n, _ in paths)
            if args.before:
                cells += f" | {med['now'] / med[args.before]:.2f}"
            rate = len(out["now"][0]) / F
            print(f"| {shift:g} | {F} | {rate:.2f} | {cells} |", flush=True)
    joint.update({"joint_net": [{} for _ in joint.joint_net[:-1]] + [{"bias": bias}]})
    if args.before:
        print(f"\nsame tokens and frames as {args.before}: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

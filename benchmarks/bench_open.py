"""What opening a conversation with a never-seen prompt costs, before and after the prompt chain.

For each scale and prompt length (100, 1,000 and 3,000 tokens of ids no session has seen):
from ``model.session(prompt=...)`` to its first frame's output (the 199 samples frame 0 needs),
in seconds and in frames of that session's own step time (the median of its next frames);
  - before: the TTS stepped over every prompt position (``noise=KeyNoise(seed)``: a caller's own
    source takes the step path, which is the code every new prompt took before the chain);
  - after: the seed's prompt chain, after a first session whose prompt was longer and of other
    words (the chain built lazily up to the longest prompt seen);
  - a plain LLM prefill of the same rows (the prompt and the first frame's row), for comparison;
and the issue's target: after <= 1.5 x prefill + 10 frames (1,000 tokens), + 20 (3,000).
Also the chain's own first build (what the first session with a long prompt pays) and its size.

Run: python benchmarks/bench_open.py [--scales tiny medium] [--lengths 100 1000 3000]
     [--before-max 3000]  (skip "before" above that many tokens: it is slow on large scales)
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_voicechat.noise import KeyNoise  # noqa: E402

FIRST = 199  # samples frame 0 needs
FRAME = 1280
SLACK = {100: 10, 1000: 10, 3000: 20}  # the frames of slack (100: the same as 1,000)


def ids(model, n, salt):
    """``n`` ids no session has seen (distinct per salt)."""
    vocab = model.config.text_args.vocab_size
    rng = np.random.default_rng(1000 + salt)
    return [int(x) for x in rng.integers(10, vocab - 10, size=n)]


def wave(frames, seed=1):
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(FIRST + frames * FRAME)).astype(np.float32)


def open_and_first_frame(model, prompt, **kw):
    """Seconds from session() to the first frame's event; then the session's frame time."""
    w = wave(12)
    t = time.perf_counter()
    s = model.session(prompt=prompt, **kw)
    ev = s.feed(w[:FIRST])
    first = time.perf_counter() - t
    assert len(ev) == 1
    times = []
    for k in range(12):
        t = time.perf_counter()
        s.feed(w[FIRST + k * FRAME : FIRST + (k + 1) * FRAME])
        times.append(time.perf_counter() - t)
    s.close()
    return first, statistics.median(times[2:])


def plain_prefill(model, rows):
    """One LLM call over ``rows`` positions on a fresh cache (the mean of three)."""
    stt = model.stt_model
    x = stt.embed_tokens(mx.array([ids(model, rows, 99)], dtype=mx.int32))
    mx.eval(x)
    out = []
    for _ in range(3):
        cache = stt.llm.make_cache()
        t = time.perf_counter()
        h = stt.llm(x, cache)
        mx.eval(h, [c.state for c in cache])
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def bench(model, name, lengths, before_max):
    from mlx_voicechat.nemotron_voicechat.runtime.framestate import prompt_chain

    longest = max(lengths)
    salt = 0
    # Warm-up (compiles, the warm-up codes), with no prompt.
    open_and_first_frame(model, [], seed=0)
    chain_first, _ = open_and_first_frame(model, ids(model, longest + 200, salt), seed=0)
    chain = prompt_chain(model, 0)
    print(
        f"{name}: first session with a {longest + 200}-token prompt (builds the seed-0 chain, "
        f"{chain.steps} steps): {chain_first:.2f} s; the chain holds "
        f"{chain.nbytes / 2**20:.1f} MiB ({chain.bytes_per_position() / 1024:.1f} KiB per position)"
    )
    for n in lengths:
        salt += 1
        prefill = plain_prefill(model, n + 1)
        after, frame = open_and_first_frame(model, ids(model, n, salt), seed=0)
        line = (
            f"  {n:>5} tokens: after {after:.3f} s = {after / frame:.1f} frames "
            f"(frame {1000 * frame:.1f} ms); plain prefill {prefill:.3f} s = "
            f"{prefill / frame:.1f} frames; target 1.5 x prefill + {SLACK.get(n, 20)} frames = "
            f"{(1.5 * prefill + SLACK.get(n, 20) * frame) / frame:.1f} frames: "
            f"{'met' if after <= 1.5 * prefill + SLACK.get(n, 20) * frame else 'NOT met'}"
        )
        if n <= before_max:
            salt += 1
            before, bframe = open_and_first_frame(model, ids(model, n, salt), noise=KeyNoise(0))
            line += f"; before {before:.2f} s = {before / bframe:.0f} frames"
        print(line, flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scales", nargs="+", default=["tiny", "medium"])
    p.add_argument("--lengths", nargs="+", type=int, default=[100, 1000, 3000])
    p.add_argument("--before-max", type=int, default=3000)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import mlx_voicechat
    from mlx_voicechat.factory import make_checkpoint

    tmp = tempfile.mkdtemp(prefix="bench_open_")
    now = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    print(f"bench_open: {now} UTC, {os.cpu_count()} CPUs")
    for scale in args.scales:
        model = mlx_voicechat.load(make_checkpoint(Path(tmp) / scale, scale, seed=0))
        bench(model, scale, args.lengths, args.before_max)
        del model
    return 0


if __name__ == "__main__":
    sys.exit(main())

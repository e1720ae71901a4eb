"""Peak memory of the chunked FastConformer encoder against the audio length (random weights).

    python benchmarks/bench_encoder_memory.py [--seconds 60 600] [--layers 24] [--d-model 1024]
                                              [--chunk-frames 256] [--dtype bfloat16] [--full]

Attention sees 70 frames to the left and none to the right, so the encoder runs chunk by chunk
with a per-layer left-context cache: memory above the weights should grow linearly with the
audio (the output and the mel), not quadratically (the T x T attention of a full pass).
``--full`` also runs the unchunked pass for comparison. Each length runs in a fresh
subprocess so peaks do not carry over. Real encoder dimensions are the defaults.
"""

import argparse
import json
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_audio.dsp import hanning, mel_filters
from mlx_voicechat.config import AudioConfig, EncoderConfig
from mlx_voicechat.nemotron_voicechat.nets.perception import Perception

a = json.loads(sys.argv[1])
enc = EncoderConfig(n_layers=a["layers"], d_model=a["d_model"], n_heads=a["heads"])
cfg = AudioConfig(encoder=enc)
model = Perception(cfg)
dtype = getattr(mx, a["dtype"])
key = mx.random.key(0)
params = []
for k, v in tree_flatten(model.parameters()):
    if k.startswith("preprocessor."):
        continue
    key, sub = mx.random.split(key)
    params.append((k, (0.02 * mx.random.normal(v.shape, key=sub)).astype(dtype)))
pre = cfg.preprocessor
fb = mel_filters(pre.sample_rate, pre.n_fft, pre.features, norm="slaney", mel_scale="slaney")
params.append(("preprocessor.featurizer.fb", fb[None]))
params.append(("preprocessor.featurizer.window", hanning(pre.win_length)))
model.load_weights(params)
mx.eval(model.parameters())
weights = mx.get_active_memory()

wave = mx.random.normal((int(a["seconds"] * pre.sample_rate),), key=mx.random.key(1)) * 0.1
mx.eval(wave)
mx.reset_peak_memory()
base = mx.get_active_memory()
t = time.perf_counter()
mel, mel_len = model.log_mel(wave)
chunk = 10**9 if a["full"] else a["chunk"]
encoded, lengths = model.encode(mel.astype(dtype), mel_len, chunk_size=chunk)
projected = model.proj(encoded)
mx.eval(projected, encoded)
dt = time.perf_counter() - t
peak = (mx.get_peak_memory() - base) / 2**20
print(json.dumps({"weights_mib": weights / 2**20, "peak_above_mib": peak,
                  "frames": int(encoded.shape[1]), "wall_s": dt}))
"""


def run(args, seconds, full):
    spec = {
        "seconds": seconds,
        "layers": args.layers,
        "d_model": args.d_model,
        "heads": args.heads,
        "chunk": args.chunk_frames,
        "dtype": args.dtype,
        "full": full,
    }
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True
    )
    if out.returncode:
        sys.exit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, nargs="+", default=[60.0, 600.0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--chunk-frames", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--full", action="store_true", help="also run the unchunked full pass")
    args = ap.parse_args()
    print(
        f"encoder: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, {args.dtype}, "
        f"chunks of {args.chunk_frames} frames (80 ms each)"
    )
    print(
        f"{'mode':8} {'audio s':>8} {'frames':>7} {'MLX peak above input MiB':>25} "
        f"{'slope MiB/min':>14} {'wall s':>8}"
    )
    start = time.perf_counter()
    for mode in ("chunked", "full") if args.full else ("chunked",):
        prev = None
        for s in sorted(args.seconds):
            r = run(args, s, mode == "full")
            # Growth per minute of audio since the previous length: flat for linear memory.
            slope = (
                ""
                if prev is None
                else f"{(r['peak_above_mib'] - prev[1]) / ((s - prev[0]) / 60):.2f}"
            )
            print(
                f"{mode:8} {s:8.0f} {r['frames']:7d} {r['peak_above_mib']:25.1f} "
                f"{slope:>14} {r['wall_s']:8.1f}",
                flush=True,
            )
            prev = (s, r["peak_above_mib"])
    print(
        f"(weights {r['weights_mib']:.0f} MiB not included; "
        f"total {time.perf_counter() - start:.0f} s)"
    )


if __name__ == "__main__":
    main()

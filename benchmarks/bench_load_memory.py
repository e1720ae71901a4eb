"""Peak memory while loading a scaled random checkpoint, as a multiple of its size on disk.

    python benchmarks/bench_load_memory.py [--scale medium] [--layout mlx-community] [--dir DIR]

Loading must not hold two copies of the weights: the ratio should stay under 1.3. Each load
runs in a fresh subprocess so the figures are not polluted by earlier work.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
import mlx.core as mx
import mlx_voicechat
from mlx_voicechat import load
import mlx_voicechat.nemotron_voicechat, mlx_lm.models.nemotron_h, transformers  # import cost out of the way
def rss_mib():
    # VmHWM (the RSS high-water mark) starts afresh at exec; ru_maxrss may carry the parent's.
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
base = rss_mib()
t = time.perf_counter()
model = load(sys.argv[1])
dt = time.perf_counter() - t
print(json.dumps({"base_mib": base, "peak_mib": rss_mib(), "mlx_peak_mib": mx.get_peak_memory() / 2**20,
                  "seconds": dt}))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", default="medium")
    ap.add_argument(
        "--layout", default="mlx-community", choices=["mlx-community", "nvidia", "mlx-audio"]
    )
    ap.add_argument("--dir", default=None, help="reuse/write the checkpoint here")
    args = ap.parse_args()
    from mlx_voicechat.factory import make_checkpoint

    folder = Path(args.dir or tempfile.mkdtemp(prefix="vc-bench-")) / f"{args.scale}-{args.layout}"
    if not (folder / "config.json").exists():
        print(f"writing a {args.scale} {args.layout} checkpoint to {folder} ...", flush=True)
        make_checkpoint(folder, args.scale, args.layout)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20
    out = subprocess.run([sys.executable, "-c", CHILD, str(folder)], capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stderr)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    grown = r["peak_mib"] - r["base_mib"]
    print(f"checkpoint         {size:9.1f} MiB  ({args.scale}, {args.layout})")
    print(f"process RSS before {r['base_mib']:9.1f} MiB")
    print(f"process RSS peak   {r['peak_mib']:9.1f} MiB  (+{grown:.1f} MiB while loading)")
    print(f"MLX peak memory    {r['mlx_peak_mib']:9.1f} MiB")
    print(f"load time          {r['seconds']:9.2f} s")
    print(
        f"ratio peak/size    {grown / size:9.2f}x RSS growth, {r['mlx_peak_mib'] / size:.2f}x MLX peak  (target < 1.3x)"
    )


if __name__ == "__main__":
    main()

"""Peak memory while converting a ~2 GB NVIDIA-layout checkpoint, against its largest tensor.

    python benchmarks/bench_convert_memory.py [--dir DIR] [--hidden 1024] [--dtype bfloat16]
                                              [--quantize 4]

The converter streams one tensor at a time, so its peak should stay under 1.5x the largest
tensor plus a fixed overhead (interpreter, MLX, the model skeleton), not near the checkpoint
size. The source is the medium factory config with a wider LLM (hidden 1024 by default, which
gives a 512 MiB float32 embedding and ~2 GB in all). The conversion runs in a fresh subprocess
whose VmHWM (RSS high-water mark) is read from /proc/self/status.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
import mlx.core as mx
from mlx_voicechat.nemotron_voicechat.weights.convert import convert
import mlx_voicechat.nemotron_voicechat, mlx_lm.models.nemotron_h, transformers, safetensors  # imports first
def hwm_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
base = hwm_mib()
src, out, dtype, quantize = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
t = time.perf_counter()
convert(src, out, dtype=dtype, quantize=int(quantize) or None, progress=False)
dt = time.perf_counter() - t
print(json.dumps({"base_mib": base, "peak_mib": hwm_mib(), "seconds": dt,
                  "mlx_peak_mib": mx.get_peak_memory() / 2**20}))
"""

OVERHEAD_MIB = 256  # interpreter + MLX + the unevaluated model skeleton + header bookkeeping


def write_source(folder: Path, hidden: int) -> None:
    """A medium factory model with an LLM ``hidden`` wide, in NVIDIA's raw layout."""
    import mlx.core as mx

    from mlx_voicechat.config import VoiceChatConfig
    from mlx_voicechat.nemotron_voicechat.model import VoiceChatModel
    from mlx_voicechat.nemotron_voicechat.weights.factory import (
        build_tokenizer,
        nemo_config,
        random_weights,
        scale_config,
    )
    from mlx_voicechat.nemotron_voicechat.weights.sanitize import (
        conv_transpose_keys,
        to_torch_layout,
    )
    from mlx_voicechat.nemotron_voicechat.weights.writer import (
        save_safetensors,
        write_json,
        write_rnnt_tokenizer,
    )

    d = scale_config("medium").to_dict()
    d["text_config"].update(hidden_size=hidden, intermediate_size=2 * hidden)
    d["audio_config"]["output_dim"] = hidden
    config = VoiceChatConfig.from_dict(d)
    tok = build_tokenizer(config.text_args.vocab_size)
    model = VoiceChatModel(config)
    weights = random_weights(model, config, tok, seed=0)
    tmp = folder.with_name(folder.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    save_safetensors(
        tmp / "model.safetensors",
        to_torch_layout(weights, conv_transpose_keys(model)),
        {"format": "pt"},
    )
    del weights
    write_json(tmp / "config.json", nemo_config(config))
    tok.save(str(tmp / "tokenizer.json"))
    write_rnnt_tokenizer(tmp, config.rnnt_vocabulary)
    tmp.rename(folder)
    mx.clear_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="reuse/write the source checkpoint here")
    ap.add_argument("--hidden", type=int, default=1024, help="LLM width of the source model")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--quantize", type=int, default=0, choices=[0, 4, 8])
    args = ap.parse_args()

    root = Path(args.dir or tempfile.mkdtemp(prefix="vc-bench-"))
    src = root / f"nvidia-medium-h{args.hidden}"
    if not (src / "config.json").exists():
        print(f"writing the source checkpoint to {src} ...", flush=True)
        write_source(src, args.hidden)
    from safetensors import safe_open

    largest = 0
    with safe_open(str(src / "model.safetensors"), framework="numpy") as f:
        for k in f.keys():
            sl = f.get_slice(k)
            n = {"F32": 4, "I64": 8, "BF16": 2, "F16": 2}[sl.get_dtype()]
            for s in sl.get_shape():
                n *= s
            largest = max(largest, n)
    size = (src / "model.safetensors").stat().st_size / 2**20
    largest /= 2**20
    out = Path(tempfile.mkdtemp(prefix="vc-conv-", dir=root)) / "out"
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(src), str(out), args.dtype, str(args.quantize)],
        capture_output=True,
        text=True,
    )
    if r.returncode:
        sys.exit(r.stderr)
    m = json.loads(r.stdout.strip().splitlines()[-1])
    grown = m["peak_mib"] - m["base_mib"]
    budget = 1.5 * largest + OVERHEAD_MIB
    print(f"source checkpoint  {size:9.1f} MiB  (float32, NVIDIA layout)")
    print(f"largest tensor     {largest:9.1f} MiB")
    print(
        f"output             {sum(p.stat().st_size for p in out.glob('*.safetensors')) / 2**20:9.1f} MiB  "
        f"({args.dtype}{f', {args.quantize}-bit' if args.quantize else ''})"
    )
    print(f"RSS before         {m['base_mib']:9.1f} MiB  (imports done)")
    print(f"RSS peak (VmHWM)   {m['peak_mib']:9.1f} MiB  (+{grown:.1f} MiB while converting)")
    print(f"MLX peak memory    {m['mlx_peak_mib']:9.1f} MiB")
    print(f"convert time       {m['seconds']:9.2f} s")
    print(
        f"growth / largest   {grown / largest:9.2f}x  (budget 1.5x + {OVERHEAD_MIB} MiB = "
        f"{budget:.0f} MiB: {'OK' if grown <= budget else 'OVER'}); growth / source "
        f"{grown / size:.2f}x"
    )


if __name__ == "__main__":
    main()

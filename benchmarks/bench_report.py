"""The machine line and the printed summary of a ``bench_device.py`` result (its JSON)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

STAGE_NAMES = {
    "encoder": "encoder (mel, FastConformer step, projection)",
    "rnnt": "RNNT (joint, prediction net per token)",
    "llm_heads": "LLM + text / function heads",
    "tts_inputs": "TTS inputs (character encoder, fusion)",
    "tts_backbone": "TTS backbone",
    "mog": "MoG iterations + RVQ",
    "codec": "codec decode step",
}


def _version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def machine(device: str) -> str:
    """CPU, cores, memory, OS, MLX (and its CUDA wheel), the GPU where ``device`` is one."""
    cpu = platform.processor() or "?"
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "?"
    try:
        mem = f"{int(Path('/proc/meminfo').read_text().split()[1]) / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    mlx = f"mlx {_version('mlx')}"
    for extra in ("mlx-cuda-13", "mlx-cuda-12", "mlx-cpu", "mlx-metal"):
        if _version(extra):
            mlx += f" + {extra} {_version(extra)}"
    line = (f"{os.cpu_count()} CPUs ({cpu}), {mem} RAM, {platform.system()} {platform.machine()}, "
            f"Python {platform.python_version()}, {mlx}")
    if device == "gpu" and shutil.which("nvidia-smi"):
        try:
            gpu = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=20, check=False,
            ).stdout.strip()
            line = f"GPU {gpu}; " + line
        except (OSError, subprocess.SubprocessError):
            pass
    return line


def _f(v, nd=1):
    return "—" if v is None else f"{v:.{nd}f}"


def _pp(p):
    return f"p50 {_f(p.get('p50_ms'))} / p95 {_f(p.get('p95_ms'))} ms over {p.get('n', 0)}"


def _bench(b, lines):
    bw = b.get("bandwidth")
    if bw:
        lines.append(f"- copy bandwidth: {bw['bytes_per_s'] / 1e9:.1f} GB/s "
                     f"(y = x + 1 over {bw['bytes'] / 2 / 2**20:.0f} MiB, read + write)")
    m = b.get("model")
    if m:
        lines.append(f"- model: scale {m['scale']}, LLM {m['quantize']}-bit (0 = none), else "
                     f"{m['dtype']}; weights resident {m['active_mib']:.0f} MiB; built in "
                     f"{b['phases_s'].get('build', 0):.1f} s")
    w = b.get("weights")
    if w:
        lines.append(f"- weights read per frame: {w['frame_bytes'] / 1e6:.1f} MB -> roofline "
                     f"{b['roofline_ms']:.3f} ms per 80 ms frame")
    fs = b.get("full_scale")
    if fs:
        lines.append(f"- at the full scale (from its shapes) a frame reads "
                     f"{fs['frame_bytes'] / 1e9:.2f} GB: roofline {fs['roofline_ms']:.1f} ms at "
                     f"this bandwidth")
    live = b.get("live")
    if live:
        st = live["steady"]
        lines.append(f"- live session, {live['frames']} frames in 80 ms chunks: all frames "
                     f"{_pp(live['all'])}; from frame {live['steady_from_frame']} "
                     f"{_pp(st)}; host reads per frame {_f(live['host_reads_per_frame'], 2)}; "
                     f"peak memory {live['peak_mib']:.0f} MiB"
                     + (" (cut short by the time budget)" if live.get("cut_short") else ""))
        if st.get("p95_ms") and b.get("roofline_ms"):
            r = b["roofline_ms"]
            lines.append(f"- **live p95 {st['p95_ms']:.2f} ms against the roofline {r:.3f} ms: "
                         f"{st['p95_ms'] / r:.1f}x** (p50 {st['p50_ms'] / r:.1f}x); real time "
                         f"needs 80 ms: p95 is {st['p95_ms'] / 80:.2f} of it")
    off = b.get("offline")
    if off:
        lines.append(f"- offline generate, {off['frames']} frames: {_pp(off['per_frame'])}; "
                     f"all-in {off['all_in_ms_per_frame']:.1f} ms per frame; peak "
                     f"{off['peak_mib']:.0f} MiB")
    batch = b.get("batch") or {}
    if "skipped" in batch:
        lines.append(f"- batched sessions: skipped ({batch['skipped']})")
    else:
        for B, r in batch.items():
            if "skipped" in r:
                lines.append(f"- batch of {B}: skipped ({r['skipped']})")
            else:
                lines.append(f"- batch of {B}: step {_pp(r['step'])}; steady "
                             f"{_pp(r['steady_step'])}; {r['frames_per_s']:.1f} frames/s; "
                             f"host reads per step {_f(r['host_reads_per_step'], 2)}; "
                             f"peak {r['peak_mib']:.0f} MiB")
    g = b.get("graph_per_frame")
    if g:
        lines.append(f"- graph primitives per steady frame: {g['primitives']} ({g['non_view']} "
                     f"not views, of which {g['fused']} fused elementwise kernels)")
    stages = b.get("stages")
    if stages:
        lines.append("")
        lines.append(f"Per stage, eval barrier after each (frames from 72 on; barrier frame "
                     f"{_pp(stages['barrier_frame'])}):")
        lines.append("")
        lines.append("| stage | p50 ms | p95 ms | weights MB | roofline ms | p50 / roofline |")
        lines.append("|---|---|---|---|---|---|")
        for k, s in stages["per_stage"].items():
            ratio = f"{s['ratio']:.1f}x" if s.get("ratio") else "—"
            lines.append(f"| {STAGE_NAMES.get(k, k)} | {_f(s['p50_ms'], 2)} | "
                         f"{_f(s['p95_ms'], 2)} | {s['bytes'] / 1e6:.1f} | "
                         f"{s['roofline_ms']:.3f} | {ratio} |")
        if stages.get("hooks_missing"):
            lines.append(f"\nnot found (stage not timed): {', '.join(stages['hooks_missing'])}")


def _oracle(o, lines):
    if "tests" not in o:
        lines.append(f"- oracle tests: no result (rc {o.get('rc')}): "
                     f"{(o.get('tail') or '').strip().splitlines()[-1:]}")
        return
    c = o["counts"]
    lines.append(f"- oracle tests on the device: {c.get('passed', 0)} passed, "
                 f"{c.get('failed', 0)} failed, {c.get('skipped', 0)} skipped "
                 f"({o['seconds']:.0f} s)")
    worst, per_file = {}, {}
    for nodeid, t in o["tests"].items():
        f = nodeid.split("::")[0]
        n = per_file.setdefault(f, [0, 0])
        n[0] += t["outcome"] == "passed"
        n[1] += 1
        for ch in t["checks"]:
            r = ch["worst"] / ch["bound"] if ch["bound"] else 0.0
            if r >= worst.get(f, (-1.0,))[0]:
                worst[f] = (r, nodeid.split("::")[-1], ch)
        if t["outcome"] == "failed":
            lines.append(f"  - FAILED {nodeid}: {t.get('message', '').splitlines()[:1]}")
    for f, (passed, total) in sorted(per_file.items()):
        line = f"  - {f}: {passed} / {total} passed"
        if f in worst:
            r, name, ch = worst[f]
            line += (f"; largest error / tolerance {r:.3f} ({name}: {ch['worst']:.3g} "
                     f"{ch.get('op', '<')} {ch['bound']:.3g})")
        else:
            line += "; exact checks only"
        lines.append(line)


def summary(res: dict) -> str:
    lines = [f"## bench_device: {res['device']}, scale {res['scale']}, {res['date']}", "",
             f"Machine: {res['machine']}", ""]
    parts = res["parts"]
    b = parts.get("bench")
    if b:
        if b.get("rc") not in (0, None):
            lines.append(f"- bench: rc {b['rc']}: {(b.get('tail') or '').strip()[-600:]}")
        _bench(b, lines)
    if parts.get("oracle"):
        lines.append("")
        if "skipped" in parts["oracle"]:
            lines.append(f"- oracle tests: skipped ({parts['oracle']['skipped']})")
        else:
            _oracle(parts["oracle"], lines)
    la = parts.get("launches")
    if la:
        if "kernels_per_frame" in la:
            lines.append(f"- CUDA kernels per steady frame: {la['kernels_per_frame']:.0f}, launch "
                         f"calls {la['launch_calls_per_frame']:.0f} "
                         f"({la['launch_calls_by_api']}), GPU busy "
                         f"{la['kernel_busy_ms_per_frame']:.2f} ms per frame ({la['source']})")
        elif "skipped" in la:
            lines.append(f"- kernel launches: {la['skipped']}")
        else:
            lines.append(f"- kernel launches: unavailable (rc {la.get('rc')}: "
                         f"{(la.get('tail') or '').strip().splitlines()[-1:]})")
    lines.append(f"\nTotal {res.get('total_s', 0):.0f} s of a {res['budget_s']:.0f} s budget.")
    return "\n".join(lines)

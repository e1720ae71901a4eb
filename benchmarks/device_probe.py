"""What ``bench_device.py`` measures a frame with: the device's copy bandwidth, the weight bytes
each stage reads per frame, per-stage timers (an eval barrier after each stage), host reads and
graph primitives per frame, and CUDA kernels per frame through PyTorch's profiler (CUPTI).

Stage hooks wrap the functions a live frame calls (``FastConformer.step_rows``, the frame
step's ``_think``, ``EarTTS.step_inputs``, ``Backbone.__call__``, ``EarTTS.generate_codes``,
``AudioCodec.decode_step``, ``FrameDecoder.__call__``); a stage whose function the session no
longer calls is reported as not seen, not guessed.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import re
import statistics
import time
from typing import Callable, Dict, List, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

# (module, class or None for a module function, attribute, stage)
STAGE_HOOKS = (
    ("mlx_voicechat.listen.fastconformer", "FastConformer", "step_rows", "encoder"),
    ("mlx_voicechat.listen.rnnt", "FrameDecoder", "__call__", "rnnt"),
    ("mlx_voicechat.nemotron_voicechat.runtime.step", None, "_think", "llm_heads"),
    ("mlx_voicechat.nemotron_voicechat.nets.tts", "EarTTS", "step_inputs", "tts_inputs"),
    ("mlx_voicechat.nemotron_voicechat.nets.tts_backbone", "Backbone", "__call__", "tts_backbone"),
    ("mlx_voicechat.nemotron_voicechat.nets.tts", "EarTTS", "generate_codes", "mog"),
    ("mlx_voicechat.nemotron_voicechat.nets.codec", "AudioCodec", "decode_step", "codec"),
)
STAGES = tuple(h[3] for h in STAGE_HOOKS)
SYNC_METHODS = ("item", "tolist", "__array__", "__int__", "__float__", "__bool__", "__index__")
# Primitives that make no kernel on MLX's GPU backends (views and bookkeeping).
VIEW_PRIMITIVES = {
    "Broadcast", "Reshape", "Squeeze", "ExpandDims", "Slice", "AsStrided", "Transpose",
    "StopGradient", "Depends", "View", "Split", "Unflatten", "Flatten", "NumberOfElements",
}


def percentiles(xs: List[float]) -> Dict[str, Optional[float]]:
    """Median and 95th percentile (nearest rank) of ``xs`` in ms, with the count."""
    if not xs:
        return {"n": 0, "p50_ms": None, "p95_ms": None}
    s = sorted(xs)
    p95 = s[min(len(s) - 1, max(0, round(0.95 * len(s)) - 1))]
    return {"n": len(s), "p50_ms": 1000 * statistics.median(s), "p95_ms": 1000 * p95}


def _arrays(obj) -> List[mx.array]:
    if isinstance(obj, mx.array):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [a for o in obj for a in _arrays(o)]
    if isinstance(obj, dict):
        return [a for o in obj.values() for a in _arrays(o)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [a for f in dataclasses.fields(obj) for a in _arrays(getattr(obj, f.name))]
    return []


# --- the device -------------------------------------------------------------------------------


def copy_bandwidth(nbytes: int, repeats: int = 10) -> dict:
    """The default device's copy bandwidth: ``y = x + 1`` over ``nbytes`` of float32, bytes read
    plus bytes written per second, best of ``repeats`` after two warm-ups."""
    n = nbytes // 4
    x = mx.random.uniform(shape=(n,), key=mx.random.key(0))
    mx.eval(x)
    times = []
    for i in range(repeats + 2):
        mx.synchronize()
        t = time.perf_counter()
        y = x + 1.0
        mx.eval(y)
        mx.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t)
        del y
    del x
    mx.clear_cache()
    best = min(times)
    return {
        "bytes": 2 * n * 4,
        "best_s": best,
        "median_s": statistics.median(times),
        "bytes_per_s": 2 * n * 4 / best,
    }


# --- weight bytes per stage ------------------------------------------------------------------


def _nbytes(module, floating_only: bool = False) -> int:
    return sum(
        v.nbytes
        for _, v in tree_flatten(module.parameters())
        if not floating_only or mx.issubdtype(v.dtype, mx.floating)
    )


def stage_weight_bytes(model) -> Dict[str, dict]:
    """Bytes of weights each stage reads per live frame, with the rule used.

    Whole matrices count once per frame; tables a frame gathers rows of count those rows
    (the LLM's embedding: two rows; the MoG head's component means: one component); the MoG
    head's layers count once per non-empty iteration, the RVQ codebooks once per frame (each
    codebook refines one iteration's residual)."""
    stt, speech = model.stt_model, model.tts_model
    tts = speech.tts_model
    vocab = model.config.text_args.vocab_size
    iterations = mog_iterations(model)
    mog = tts.mog_head
    per_iteration = (
        _nbytes(tts.embed_code)
        + sum(_nbytes(m) for m in mog.mlp_stack)
        + _nbytes(mog.proj_logits)
        + _nbytes(mog.proj_logs)
        + (_nbytes(mog.proj_else) if "proj_else" in mog else 0)
        + _nbytes(mog.proj_mus) // mog.num_predictions
        + (mog.low_mat.nbytes // mog.num_predictions if "low_mat" in mog else 0)
    )
    table, sq_norms = tts.sampler.tables()
    out = {
        "encoder": (_nbytes(stt.perception), "perception: mel filters, encoder, projection"),
        "rnnt": (
            _nbytes(stt.rnnt_decoder) + _nbytes(stt.rnnt_joint),
            "prediction network and joint, once (an upper bound: the prediction network runs "
            "only on frames that emit a token)",
        ),
        "llm_heads": (
            _nbytes(stt.llm)
            + _nbytes(stt.lm_head)
            + _nbytes(stt.function_head)
            + 2 * _nbytes(stt.embed_tokens) // vocab,
            "Nemotron-H layers, text and function heads, two embedding rows",
        ),
        "tts_inputs": (
            _nbytes(tts.embed_subword, floating_only=True)
            + (_nbytes(tts.gated_fusion_audio_text) if "gated_fusion_audio_text" in tts else 0)
            + _nbytes(tts.embed_code),
            "character encoder, gated fusion, code embedding",
        ),
        "tts_backbone": (_nbytes(tts.backbone), "Gemma-3 backbone once (guidance batch of 2)"),
        "mog": (
            iterations * per_iteration + table.nbytes + sq_norms.nbytes,
            f"MoG head x {iterations} iterations, one component's means each; RVQ codebooks once",
        ),
        "codec": (_nbytes(speech.audio_codec.decoder), "codec decoder"),
    }
    return {k: {"bytes": b, "rule": rule} for k, (b, rule) in out.items()}


def shape_only_model(scale: str, quantize, dtype: str):
    """The model at ``scale`` cast and quantized as ``random_model`` does, with nothing
    evaluated: its parameters' shapes and dtypes (so :func:`stage_weight_bytes`) without their
    memory, e.g. the ``full`` model's bytes on a machine that could not hold it."""
    from mlx.nn import quantize as nn_quantize
    from mlx.utils import tree_map

    from mlx_voicechat.nemotron_voicechat import Model
    from mlx_voicechat.nemotron_voicechat.weights.scales import scale_config
    from mlx_voicechat.nemotron_voicechat.weights.writer import listed_modules, quantization_map

    model = Model(scale_config(scale))
    target = getattr(mx, dtype)
    model.update(tree_map(
        lambda x: x.astype(target) if mx.issubdtype(x.dtype, mx.floating) else x,
        model.parameters(),
    ))
    if quantize:
        listed = set(listed_modules(quantization_map(model, quantize, 64)))
        nn_quantize(model, group_size=64, bits=quantize, class_predicate=lambda p, m: p in listed)
    return model


def mog_iterations(model) -> int:
    """The MoG iterations of a frame that fill at least one codebook."""
    return sum(1 for c in model.config.tts_config.mask_schedule() if c)


# --- hooks on eval and host reads --------------------------------------------------------------


class Hooks:
    """Patches ``mx.eval`` / ``mx.async_eval`` and the ``mx.array`` methods that read values to
    the host, once; ``reads`` counts evals and reads while ``counting``; ``on_graph`` (when set)
    sees the arrays of every eval and read before they run."""

    def __init__(self):
        self.reads = 0
        self.counting = False
        self.on_graph: Optional[Callable[[List[mx.array]], None]] = None
        self._orig_eval, self._orig_async = mx.eval, mx.async_eval
        hooks = self

        def ev(*a, **k):
            hooks._seen(a, read=True)
            return hooks._orig_eval(*a, **k)

        def aev(*a, **k):
            hooks._seen(a, read=False)
            return hooks._orig_async(*a, **k)

        mx.eval, mx.async_eval = ev, aev
        for name in SYNC_METHODS:
            self._patch(name)

    def _patch(self, name):
        orig = getattr(mx.array, name)
        hooks = self

        def f(arr, *a, **k):
            hooks._seen((arr,), read=True)
            return orig(arr, *a, **k)

        setattr(mx.array, name, f)

    def _seen(self, args, read: bool):
        if read and self.counting:
            self.reads += 1
        if self.on_graph is not None:
            self.on_graph(_arrays(list(args)))


class GraphCounter:
    """Distinct graph primitives evaluated per frame, read from ``mx.export_to_dot`` of every
    eval and host read. A compiled function shows its traced primitives, its fused elementwise
    chains as one ``Compiled...`` primitive each; primitives that are not views are about the
    kernels a GPU backend launches for the frame (nodes are told apart by address, so one freed
    and reused within a frame counts once)."""

    _NODE = re.compile(r'\{ (\d+) \[label ="([^"]+)"')

    def __init__(self):
        self.frame: Dict[str, str] = {}

    def __call__(self, arrays: List[mx.array]) -> None:
        if not arrays:
            return
        f = io.StringIO()
        mx.export_to_dot(f, *arrays)
        for node, label in self._NODE.findall(f.getvalue()):
            self.frame[node] = label

    def take(self) -> dict:
        labels = list(self.frame.values())
        self.frame = {}
        kernels = [x for x in labels if x not in VIEW_PRIMITIVES]
        return {
            "primitives": len(labels),
            "non_view": len(kernels),
            "fused": sum(1 for x in labels if x.startswith("Compiled")),
        }


# --- per-stage timing ---------------------------------------------------------------------------


class StageTimer:
    """Wraps the stage functions so that each call is evaluated (a barrier) and timed; one
    frame's calls of a stage add up. ``install`` / ``remove`` put the originals back."""

    def __init__(self):
        self._saved = []
        self.current: Dict[str, float] = {}
        self.frames: List[Dict[str, float]] = []
        self.seen = set()

    def install(self) -> List[str]:
        missing = []
        for mod_name, cls_name, attr, stage in STAGE_HOOKS:
            owner = importlib.import_module(mod_name)
            if cls_name is not None:
                owner = getattr(owner, cls_name, None)
            orig = getattr(owner, attr, None) if owner is not None else None
            if orig is None:
                missing.append(f"{mod_name}.{cls_name + '.' if cls_name else ''}{attr}")
                continue
            self._saved.append((owner, attr, orig))
            setattr(owner, attr, self._wrap(orig, stage))
        return missing

    def _wrap(self, orig, stage):
        timer = self

        def timed(*a, **k):
            t = time.perf_counter()
            out = orig(*a, **k)
            mx.eval(_arrays(out))
            timer.current[stage] = timer.current.get(stage, 0.0) + time.perf_counter() - t
            timer.seen.add(stage)
            return out

        return timed

    def end_frame(self, keep: bool) -> None:
        if keep:
            self.frames.append(self.current)
        self.current = {}

    def remove(self) -> None:
        for owner, attr, orig in reversed(self._saved):
            setattr(owner, attr, orig)
        self._saved = []

    def summary(self) -> Dict[str, dict]:
        out = {}
        for stage in STAGES:
            xs = [f.get(stage, 0.0) for f in self.frames] if stage in self.seen else []
            out[stage] = percentiles(xs)
        return out


# --- CUDA kernels through PyTorch's profiler ------------------------------------------------------


def cuda_kernels(run: Callable[[], None], frames: int, trace_path: str) -> dict:
    """Kernels the GPU ran, and the launch calls made, per frame while ``run()`` runs
    ``frames`` frames: PyTorch's profiler records every CUDA kernel of the process through
    CUPTI, whichever library launched it (MLX here). Raises if PyTorch or CUDA is missing."""
    import json

    import torch
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        raise RuntimeError("PyTorch sees no CUDA device")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        mx.synchronize()
    prof.export_chrome_trace(trace_path)
    with open(trace_path, encoding="utf-8") as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") == "kernel"]
    launches = [
        e for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "aunch" in e.get("name", "")
    ]
    by_api: Dict[str, int] = {}
    for e in launches:
        by_api[e["name"]] = by_api.get(e["name"], 0) + 1
    if not kernels:
        raise RuntimeError("the profiler recorded no kernel: CUPTI did not see MLX's launches")
    busy_us = sum(e.get("dur", 0) for e in kernels)
    return {
        "frames": frames,
        "kernels_per_frame": len(kernels) / frames,
        "launch_calls_per_frame": len(launches) / frames,
        "launch_calls_by_api": {k: v / frames for k, v in sorted(by_api.items())},
        "kernel_busy_ms_per_frame": busy_us / 1000 / frames,
        "source": f"torch {torch.__version__} profiler (CUPTI)",
    }

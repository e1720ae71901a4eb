"""``mlx-voicechat info`` for a Nemotron-3.5-ASR checkpoint: layout, the recognizer's shape
(lookahead, vocabulary, language prompts) and parameters per network, from the config and
the safetensors headers only."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

# Key prefixes of either layout (mlx-audio's names first, then Transformers').
NETWORKS = OrderedDict(
    [
        ("encoder", ("encoder.",)),
        ("prompt", ("prompt_kernel.", "prompt_projector.")),
        ("prediction", ("decoder.",)),
        ("joint", ("joint.", "encoder_projector.")),
    ]
)


def _network(key: str) -> str:
    for name, prefixes in NETWORKS.items():
        if key.startswith(prefixes):
            return name
    return "other"


def recognizer_info(folder: Path, raw: dict) -> dict:
    from safetensors import safe_open

    from ..errors import CheckpointError
    from ..weights.asr_loading import read_recognizer_config
    from ..weights.loading import weight_files

    config = read_recognizer_config(folder, raw)
    counts, dtypes, shapes = {}, {}, {}
    for f in weight_files(folder):
        try:
            with safe_open(str(f), framework="numpy") as st:
                for k in st.keys():
                    sl = st.get_slice(k)
                    shapes[k] = (tuple(sl.get_shape()), sl.get_dtype())
        except Exception as e:
            raise CheckpointError(f"{f} is not a readable safetensors file: {e}") from None
    quantized = {k[: -len(".scales")] for k in shapes if k.endswith(".scales")}
    q = config.quantization if isinstance(config.quantization, dict) else {}
    for k, (shape, dtype) in shapes.items():
        if k.endswith((".scales", ".biases")) and k.rsplit(".", 1)[0] in quantized:
            continue
        n = 1
        for s in shape:
            n *= s
        if k.rsplit(".", 1)[0] in quantized and k.endswith(".weight"):
            bits = q.get("bits", 4)
            n, dtype = n * 32 // bits, f"{dtype}/{bits}-bit"
        net = _network(k)
        counts[net] = counts.get(net, 0) + n
        dtypes.setdefault(net, set()).add(dtype)
    summary = None
    if quantized:
        summary = {
            "bits": q.get("bits"),
            "group_size": q.get("group_size"),
            "modules": len(quantized),
        }
    p = config.prompt
    return {
        "path": str(folder),
        "model": "Nemotron-3.5-ASR",
        "model_type": config.model_type,
        "layout": config.layout,
        "quantization": summary,
        "lookahead": config.lookahead,
        "lookaheads": list(config.lookaheads),
        "latency_ms": round(1000 * config.chunk_frames * config.frame_samples / config.sample_rate),
        "vocabulary": len(config.vocabulary),
        "prompts": p.num_prompts,
        "languages": sorted(k for k in p.prompt_dictionary if k != "auto"),
        "default_prompt_id": p.default_prompt_id if p.num_prompts else None,
        "networks": {
            name: {"parameters": counts[name], "dtypes": sorted(dtypes[name])}
            for name in list(NETWORKS) + ["other"]
            if counts.get(name)
        },
        "total_parameters": sum(counts.values()),
    }


def describe(info: dict) -> list:
    """The recognizer's own lines of the text report."""
    langs = info["languages"]
    lines = [
        f"model        {info['model']} ({info['model_type']})",
        f"lookahead    {info['lookahead']} frames (chunks of {info['latency_ms']} ms; "
        f"trained: {', '.join(map(str, info['lookaheads']))})",
        f"vocabulary   {info['vocabulary']} pieces + blank",
    ]
    if info["prompts"]:
        shown = ", ".join(langs[:8]) + (", ..." if len(langs) > 8 else "")
        lines.append(
            f"prompts      {info['prompts']} (default {info['default_prompt_id']}"
            f"{', auto' if info['default_prompt_id'] is not None else ''}); "
            f"{len(langs)} names: {shown}"
        )
    else:
        lines.append("prompts      none (no language prompt)")
    return lines

"""``mlx-voicechat info`` for a Nemotron-3.5-ASR checkpoint: layout, the recognizer's shape
(lookahead, vocabulary, language prompts) and parameters per network, from the config and
the safetensors headers only."""

from __future__ import annotations

from pathlib import Path

from .headers import network_report, quantized_modules, tensor_headers

# Key prefixes of either layout (mlx-audio's names first, then Transformers').
NETWORKS = {
    "encoder": ("encoder.",),
    "prompt": ("prompt_kernel.", "prompt_projector."),
    "prediction": ("decoder.",),
    "joint": ("joint.", "encoder_projector."),
}


def recognizer_info(folder: Path, raw: dict) -> dict:
    from ..nemotron_asr.loading import read_recognizer_config

    config = read_recognizer_config(folder, raw)
    shapes = tensor_headers(folder)
    quantized = quantized_modules(shapes)
    q = config.quantization if isinstance(config.quantization, dict) else {}
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
        **network_report(shapes, quantized, lambda m: q.get("bits", 4), NETWORKS),
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

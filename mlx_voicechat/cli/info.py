"""``mlx-voicechat info``: layout, dtypes, quantization and parameter counts per network,
read from the safetensors headers without loading a weight; ``--system``: MLX, its devices and
the BLAS in effect."""

from __future__ import annotations

import json

from .headers import network_report, quantized_modules, tensor_headers


def add_parser(subparsers):
    p = subparsers.add_parser("info", help="describe a checkpoint without loading its weights")
    p.add_argument("model", nargs="?", help="checkpoint folder or hub id")
    p.add_argument(
        "--system",
        action="store_true",
        help="also (or only) describe this process: MLX, its devices and the BLAS in effect",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


NETWORKS = {
    "perception": ("stt_model.perception.",),
    "rnnt": ("stt_model.rnnt_decoder.", "stt_model.rnnt_joint."),
    "llm": tuple(f"stt_model.{m}." for m in ("llm", "embed_tokens", "lm_head", "function_head")),
    "tts": (
        "tts_model.tts_model.",
        "tts_model.audio_prompt_latents.",
        "tts_model.codec_silence_tokens",
        "tts_model._control_codes",
        "tts_model.control_codes",
    ),
    "codec": ("tts_model.audio_codec.",),
}


def _infer_quantization(config, shapes, quantized) -> dict:
    """``{module: (bits, group_size)}`` from the packed shapes and the model's float widths."""
    from mlx.utils import tree_flatten

    from ..nemotron_voicechat.model import VoiceChatModel

    widths = {
        k[: -len(".weight")]: v.shape[-1]
        for k, v in tree_flatten(VoiceChatModel(config).parameters())  # never evaluated
        if k.endswith(".weight")
    }
    out = {}
    for m in quantized:
        width = widths.get(m)
        packed, scales = shapes.get(f"{m}.weight"), shapes.get(f"{m}.scales")
        if not width or packed is None or not scales[0][-1]:
            continue
        out[m] = (packed[0][-1] * 32 // width, width // scales[0][-1])
    return out


def checkpoint_info(path) -> dict:
    """Layout, dtypes, quantization and parameter counts per network, from file headers only."""
    from ..config import VoiceChatConfig
    from ..nemotron_asr.config import is_recognizer_config
    from ..nemotron_voicechat.weights.loading import read_config, resolve_path

    folder = resolve_path(path)
    raw = read_config(folder)
    if is_recognizer_config(raw):
        from .asr_info import recognizer_info

        return recognizer_info(folder, raw)
    config = VoiceChatConfig.from_dict(raw)
    shapes = tensor_headers(folder)
    quantized = quantized_modules(shapes)
    q = config.quantization if isinstance(config.quantization, dict) else {}
    inferred = _infer_quantization(config, shapes, quantized) if quantized and not q else {}

    def bits_of(module):
        per_module = q.get(module) if isinstance(q.get(module), dict) else {}
        return per_module.get("bits") or q.get("bits") or inferred.get(module, (4, 0))[0]

    summary = None
    if quantized and q:
        summary = {"bits": q.get("bits"), "group_size": q.get("group_size")}
    elif quantized:
        bits = sorted({b for b, _ in inferred.values()})
        groups = sorted({g for _, g in inferred.values()})
        summary = {
            "bits": bits[0] if len(bits) == 1 else bits,
            "group_size": groups[0] if len(groups) == 1 else groups,
            "note": "inferred from the weights: config.json has no quantization, so loading "
            "this checkpoint fails",
        }
    if summary is not None:
        summary["modules"] = len(quantized)
    return {
        "path": str(folder),
        "layout": config.layout,
        "quantization": summary,
        **network_report(shapes, quantized, bits_of, NETWORKS),
    }


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def run(args) -> int:
    if args.model is None and not args.system:
        from ..errors import VoiceChatError

        raise VoiceChatError("info needs a checkpoint (a folder or hub id), or --system")
    if args.system:
        from ..fastpaths.system import system_info

        system = system_info()
        if args.json and args.model is None:
            print(json.dumps(system, indent=2))
            return 0
        if not args.json:
            for k, v in system.items():
                if k != "blas_mapped":
                    print(f"{k:<15}{v if v is not None else '-'}")
        if args.model is None:
            return 0
    info = checkpoint_info(args.model)
    if args.system:
        info["system"] = system
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"checkpoint   {info['path']}")
    if info.get("model") == "Nemotron-3.5-ASR":
        from .asr_info import describe

        print("\n".join(describe(info)))
    print(f"layout       {info['layout']}")
    q = info["quantization"]
    print(
        "quantization "
        + (f"{q['bits']}-bit, group {q['group_size']}, {q['modules']} modules" if q else "none")
        + (f" ({q['note']})" if q and q.get("note") else "")
    )
    for name, d in info["networks"].items():
        print(f"  {name:<11}{_human(d['parameters']):>10}  {', '.join(d['dtypes'])}")
    print(f"  {'total':<11}{_human(info['total_parameters']):>10}")
    return 0

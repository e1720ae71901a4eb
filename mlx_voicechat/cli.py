"""``mlx-voicechat``: one subcommand per verb. Errors are one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from typing import List, Optional

NETWORKS = OrderedDict(
    [
        ("perception", ("stt_model.perception.",)),
        ("rnnt", ("stt_model.rnnt_decoder.", "stt_model.rnnt_joint.")),
        (
            "llm",
            (
                "stt_model.llm.",
                "stt_model.embed_tokens.",
                "stt_model.lm_head.",
                "stt_model.function_head.",
            ),
        ),
        (
            "tts",
            (
                "tts_model.tts_model.",
                "tts_model.audio_prompt_latents.",
                "tts_model.codec_silence_tokens",
                "tts_model._control_codes",
                "tts_model.control_codes",
            ),
        ),
        ("codec", ("tts_model.audio_codec.",)),
    ]
)


def _network(key: str) -> str:
    for name, prefixes in NETWORKS.items():
        if key.startswith(prefixes):
            return name
    return "other"


def checkpoint_info(path) -> dict:
    """Layout, dtypes, quantization and parameter counts per network, from file headers only."""
    from safetensors import safe_open

    from .checkpoint import read_config, resolve_path, weight_files
    from .config import VoiceChatConfig
    from .errors import CheckpointError

    folder = resolve_path(path)
    config = VoiceChatConfig.from_dict(read_config(folder))
    counts = {name: 0 for name in NETWORKS}
    dtypes = {name: set() for name in NETWORKS}
    shapes = {}
    for f in weight_files(folder):
        try:
            with safe_open(str(f), framework="numpy") as st:
                for k in st.keys():
                    sl = st.get_slice(k)
                    shapes[k] = (tuple(sl.get_shape()), sl.get_dtype())
        except Exception as e:
            raise CheckpointError(f"{f} is not a readable safetensors file: {e}") from None
    quantized = {k[: -len(".scales")] for k in shapes if k.endswith(".scales")}
    for k, (shape, dtype) in shapes.items():
        if k.endswith((".scales", ".biases")) and k.rsplit(".", 1)[0] in quantized:
            continue
        n = 1
        for s in shape:
            n *= s
        module = k.rsplit(".", 1)[0]
        if module in quantized and k.endswith(".weight"):
            bits = (config.quantization or {}).get(module, {}).get("bits") or (
                config.quantization or {}
            ).get("bits", 4)
            n = n * 32 // bits
            dtype = f"{dtype}/{bits}-bit"
        net = _network(k)
        counts.setdefault(net, 0)
        counts[net] += n
        dtypes.setdefault(net, set()).add(dtype)
    q = config.quantization or {}
    return {
        "path": str(folder),
        "layout": config.layout,
        "quantization": (
            {"bits": q.get("bits"), "group_size": q.get("group_size"), "modules": len(quantized)}
            if quantized
            else None
        ),
        "networks": {
            name: {"parameters": counts[name], "dtypes": sorted(dtypes[name])}
            for name in counts
            if counts[name]
        },
        "total_parameters": sum(counts.values()),
    }


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def cmd_info(args) -> int:
    info = checkpoint_info(args.model)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"checkpoint   {info['path']}")
    print(f"layout       {info['layout']}")
    q = info["quantization"]
    print(
        "quantization "
        + (f"{q['bits']}-bit, group {q['group_size']}, {q['modules']} modules" if q else "none")
    )
    for name, d in info["networks"].items():
        print(f"  {name:<11}{_human(d['parameters']):>10}  {', '.join(d['dtypes'])}")
    print(f"  {'total':<11}{_human(info['total_parameters']):>10}")
    return 0


def cmd_make_checkpoint(args) -> int:
    from .factory import make_checkpoint

    out = make_checkpoint(
        args.dir,
        scale=args.scale,
        layout=args.layout,
        quantize=args.quantize,
        group_size=args.group_size,
        seed=args.seed,
        dtype=args.dtype,
        with_tokenizer=not args.no_tokenizer,
    )
    print(f"wrote a {args.scale} {args.layout} checkpoint to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(
        prog="mlx-voicechat",
        description="NVIDIA NemotronLabs VoiceChat (full-duplex speech-to-speech) on MLX",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    mk = sub.add_parser("make-checkpoint", help="write a random-weight checkpoint")
    mk.add_argument("dir", help="output folder (replaced if it exists)")
    mk.add_argument("--scale", default="tiny", choices=["tiny", "small", "medium", "full"])
    mk.add_argument(
        "--layout", default="mlx-community", choices=["mlx-community", "nvidia", "mlx-audio"]
    )
    mk.add_argument("--quantize", type=int, choices=[4, 8], default=None)
    mk.add_argument("--group-size", type=int, default=64)
    mk.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--no-tokenizer", action="store_true", help="leave tokenizer.json out")
    mk.set_defaults(func=cmd_make_checkpoint)

    info = sub.add_parser("info", help="describe a checkpoint without loading its weights")
    info.add_argument("model", help="checkpoint folder or hub id")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=cmd_info)

    for register in _extra_verbs():
        register(sub)
    return p


def _extra_verbs():
    """Subcommands that live beside the code they drive."""
    from .transcribe import add_transcribe_parser, run_transcribe

    def transcribe_verb(sub):
        p = add_transcribe_parser(sub)
        p.add_argument("--tokenizer", default=None, help="tokenizer folder (NVIDIA raw layout)")
        p.set_defaults(func=lambda a: run_transcribe(a, lambda m: _load(m, a.tokenizer)))

    from .convert import add_convert_parser
    from .generate_cli import add_generate_parser

    return [transcribe_verb, add_generate_parser, add_convert_parser]


def _load(model, tokenizer=None):
    from .checkpoint import load

    return load(model, tokenizer=tokenizer)


def main(argv: Optional[List[str]] = None) -> int:
    from .errors import VoiceChatError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (VoiceChatError, FileNotFoundError, PermissionError) as e:
        print(f"mlx-voicechat {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"mlx-voicechat {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

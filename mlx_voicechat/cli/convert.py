"""``mlx-voicechat convert``: any supported layout to the mlx-community layout."""

from __future__ import annotations

import json

from .options import add_quantize_options

# weights.loading.DTYPE_NAMES, named here so that building the parser imports no mlx (importing
# mlx_lm would lower the process's open-file limits before `serve` can keep them).
DTYPE_NAMES = ("bfloat16", "float16", "float32")


def add_parser(subparsers):
    p = subparsers.add_parser(
        "convert",
        help="convert a checkpoint to the mlx-community layout (bf16, 8-bit, 4-bit)",
        description="Convert NVIDIA's raw release, an mlx-community or an mlx-audio checkpoint "
        "to the mlx-community layout, streaming one tensor at a time.",
    )
    p.add_argument("--source", required=True, help="source checkpoint folder or hub id")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="folder or hub id with tokenizer.json (NVIDIA's release has none)",
    )
    p.add_argument("--output", required=True, help="output folder (must not exist)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES)
    add_quantize_options(p, "quantize the LLM, embedding and heads to this many bits")
    p.add_argument(
        "--quantize-tts",
        type=int,
        choices=[8],
        default=None,
        help="also quantize the TTS backbone and MoG head (8 bits)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def run(args) -> int:
    from ..nemotron_voicechat import Model
    from ..nemotron_voicechat.weights.convert import SEED_AUDIO_SECONDS, convert, tts_agreement
    from ..nemotron_voicechat.weights.writer import listed_modules

    out = convert(
        args.source,
        args.output,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        quantize=args.quantize,
        group_size=args.group_size,
        quantize_tts=args.quantize_tts,
        progress=not args.quiet,
    )
    q = json.loads((out / "config.json").read_text()).get("quantization") or {}
    n = len(listed_modules(q))
    print(f"wrote {out} ({args.dtype}" + (f", {n} quantized modules" if n else "") + ")")
    if args.quantize_tts:
        same, total = tts_agreement(out, args.source, Model)
        print(
            f"8-bit TTS picks the same speech codes as the unquantized TTS for {same:.1%} of "
            f"{total} codes (fixed {SEED_AUDIO_SECONDS} s input, seed 0)"
        )
    return 0

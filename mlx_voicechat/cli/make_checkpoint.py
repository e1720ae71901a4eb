"""``mlx-voicechat make-checkpoint``: a random-weight checkpoint in any layout and scale."""

from __future__ import annotations

from .options import add_quantize_options


def add_parser(subparsers):
    mk = subparsers.add_parser("make-checkpoint", help="write a random-weight checkpoint")
    mk.add_argument("dir", help="output folder (new or empty)")
    mk.add_argument(
        "--model",
        default="voicechat",
        choices=["voicechat", "asr"],
        help="voicechat (NemotronLabs VoiceChat) or asr (Nemotron-3.5-ASR); default voicechat",
    )
    mk.add_argument("--scale", default="tiny", choices=["tiny", "small", "medium", "full"])
    mk.add_argument(
        "--layout",
        default=None,
        choices=["mlx-community", "nvidia", "mlx-audio", "transformers"],
        help="voicechat: mlx-community (default), nvidia, mlx-audio; asr: mlx-audio (default), "
        "transformers",
    )
    mk.add_argument("--no-prompt", action="store_true", help="asr: without the language prompt")
    add_quantize_options(mk, "quantize like the mlx-community checkpoints (not nvidia)")
    mk.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--no-tokenizer", action="store_true", help="leave tokenizer.json out")
    mk.add_argument(
        "--force",
        action="store_true",
        help="replace DIR if it is a checkpoint folder this command wrote (nothing else in it)",
    )
    return mk


def run(args) -> int:
    from ..errors import VoiceChatError
    from ..nemotron_voicechat.weights.factory import make_checkpoint

    options = dict(
        scale=args.scale,
        quantize=args.quantize,
        group_size=args.group_size,
        seed=args.seed,
        dtype=args.dtype,
        force=args.force,
    )
    if args.model == "asr":
        from ..nemotron_asr.factory import make_recognizer_checkpoint

        layout = args.layout or "mlx-audio"
        if args.scale == "medium" or args.no_tokenizer:
            raise VoiceChatError(
                "--model asr takes --scale tiny, small or full, and no --no-tokenizer"
            )
        out = make_recognizer_checkpoint(
            args.dir, layout=layout, prompt=not args.no_prompt, **options
        )
        print(f"wrote a {args.scale} {layout} Nemotron-3.5-ASR checkpoint to {out}")
        return 0
    args.layout = args.layout or "mlx-community"
    if args.layout == "transformers" or args.no_prompt:
        raise VoiceChatError("--layout transformers and --no-prompt are for --model asr")

    out = make_checkpoint(
        args.dir, layout=args.layout, with_tokenizer=not args.no_tokenizer, **options
    )
    print(f"wrote a {args.scale} {args.layout} checkpoint to {out}")
    return 0

"""``mlx-voicechat make-checkpoint``: a random-weight checkpoint in any layout and scale."""

from __future__ import annotations


def add_parser(subparsers):
    mk = subparsers.add_parser("make-checkpoint", help="write a random-weight checkpoint")
    mk.add_argument("dir", help="output folder (new or empty)")
    mk.add_argument("--scale", default="tiny", choices=["tiny", "small", "medium", "full"])
    mk.add_argument(
        "--layout", default="mlx-community", choices=["mlx-community", "nvidia", "mlx-audio"]
    )
    mk.add_argument("--quantize", type=int, choices=[4, 8], default=None)
    mk.add_argument("--group-size", type=int, default=64, help="32, 64 or 128 (default 64)")
    mk.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--no-tokenizer", action="store_true", help="leave tokenizer.json out")
    mk.add_argument(
        "--force",
        action="store_true",
        help="replace DIR if it is a checkpoint folder this command wrote (nothing else in it)",
    )
    mk.set_defaults(func=run)
    return mk


def run(args) -> int:
    from ..weights.factory import make_checkpoint

    out = make_checkpoint(
        args.dir,
        scale=args.scale,
        layout=args.layout,
        quantize=args.quantize,
        group_size=args.group_size,
        seed=args.seed,
        dtype=args.dtype,
        with_tokenizer=not args.no_tokenizer,
        force=args.force,
    )
    print(f"wrote a {args.scale} {args.layout} checkpoint to {out}")
    return 0

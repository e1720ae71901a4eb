"""Options every conversation verb takes (``generate``, ``stream``, ``chat``)."""

from __future__ import annotations


def add_conversation_options(p) -> None:
    """``-p`` (the system prompt), ``--seed``, ``--tools`` and ``--tokenizer``."""
    p.add_argument(
        "-p",
        "--system-prompt",
        default=None,
        help='system prompt (default: NVIDIA\'s default prompt; -p "" for none)',
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the speech (default 0)")
    p.add_argument(
        "--tools", default=None, metavar="FILE.json", help="tools the model may call (a JSON list)"
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (NVIDIA raw layout)")

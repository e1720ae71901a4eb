"""``mlx-voicechat``: one subcommand per verb. Errors are one line on stderr and exit code 2.

Each verb is a module ``mlx_voicechat.cli.<verb>`` with ``add_parser(subparsers)`` (which sets
``func`` to the verb's ``run``) and ``run(args) -> int``; a new verb is one line in ``VERBS``.
Verb modules keep their heavy imports inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

# Module names under mlx_voicechat.cli, in the order `--help` lists them.
VERBS = [
    "make_checkpoint",
    "info",
    "transcribe",
    "generate",
    "convert",
    "stream",
    "chat",
    "serve",
]


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    p = argparse.ArgumentParser(
        prog="mlx-voicechat",
        description="NVIDIA NemotronLabs VoiceChat (full-duplex speech-to-speech) on MLX",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for verb in VERBS:
        importlib.import_module(f"{__name__}.{verb}").add_parser(sub)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    from ..errors import VoiceChatError

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

"""``mlx-voicechat``: one subcommand per verb. Errors are one line on stderr and exit code 2.

Each verb is a module ``mlx_voicechat.cli.<verb>`` (a line in ``VERBS``) with
``add_parser(subparsers)`` (returning its parser) and ``run(args) -> int``. Verbs import heavy
modules inside ``run``: ``--help`` stays quick, and no ``mlx_lm.utils`` import lowers the
open-file limits before ``serve`` saves them.
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
        module = importlib.import_module(f"{__name__}.{verb}")
        module.add_parser(sub).set_defaults(func=module.run)
    return p


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: unwinds like Ctrl-C, so every writer removes its temporary
    files on the way out."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum, frame):
    raise Terminated(signum)


def _catch_termination():
    """Turn SIGTERM / SIGHUP into :class:`Terminated` (main thread only, and only where the
    signal has its default action: a handler someone set, or nohup's ignore, is kept);
    returns a function that puts the old handlers back."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    old = {}
    for name in ("SIGTERM", "SIGHUP"):
        signum = getattr(signal, name, None)
        if signum is not None and signal.getsignal(signum) == signal.SIG_DFL:
            old[signum] = signal.signal(signum, _raise_terminated)

    def restore():
        for signum, handler in old.items():
            signal.signal(signum, handler)

    return restore


def main(argv: Optional[List[str]] = None) -> int:
    command = "mlx-voicechat"
    restore = _catch_termination()
    # Everything, imports and parsing included, runs inside the handlers: Ctrl-C at any moment
    # is one line and exit code 130.
    try:
        import warnings

        from ..errors import VoiceChatError

        parser = build_parser()
        args = parser.parse_args(argv)
        command = f"mlx-voicechat {args.command}"

        def one_line(message, category, filename, lineno, file=None, line=None):
            print(f"{command}: warning: {message}", file=sys.stderr)

        with warnings.catch_warnings():
            warnings.showwarning = one_line
            try:
                return int(args.func(args) or 0)
            except (VoiceChatError, FileNotFoundError, PermissionError) as e:
                print(f"{command}: error: {e}", file=sys.stderr)
                return 2
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
    except Terminated as e:
        import signal

        print(f"{command}: terminated ({signal.Signals(e.signum).name})", file=sys.stderr)
        return 128 + e.signum
    finally:
        restore()


if __name__ == "__main__":
    sys.exit(main())

"""Options several verbs take, and the words ``serve`` and ``serve --ray`` share, written once."""

from __future__ import annotations

import sys

from ..errors import VoiceChatError

MODEL_HELP = "checkpoint folder or hub id"


def add_conversation_options(p) -> None:
    """``--model``, ``-p`` (the system prompt), ``--seed``, ``--tools`` and ``--tokenizer``:
    every conversation verb (``generate``, ``stream``, ``chat``)."""
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument(
        "-p",
        "--system-prompt",
        default=None,
        help='system prompt (default: NVIDIA\'s default prompt; -p "" for none)',
    )
    add_seed_option(p)
    p.add_argument(
        "--tools", default=None, metavar="FILE.json", help="tools the model may call (a JSON list)"
    )
    add_tokenizer_option(p)


def add_seed_option(p) -> None:
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the speech (default 0)")


def add_tokenizer_option(p) -> None:
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (NVIDIA raw layout)")


def add_file_options(p, output_required: bool, extra_help: str) -> None:
    """``--audio``, ``--output-audio``, ``--extra-decoding-seconds`` and ``--plot``: the verbs
    that run an audio file (``generate``, ``stream``)."""
    p.add_argument("--audio", required=True, help="the user's audio (any rate, mono or stereo)")
    p.add_argument(
        "--output-audio",
        required=output_required,
        default=None,
        help="reply WAV (22050 Hz mono PCM16)",
    )
    p.add_argument("--extra-decoding-seconds", type=float, default=3.0, help=extra_help)
    p.add_argument("--plot", default=None, metavar="PNG", help="timeline picture of the run")


def check_file_options(args):
    """What can refuse a run of ``add_file_options`` and ``--tools``, checked before the model
    loads (a bad output, plot or file fails before the long work): ``(samples, tools)``."""
    from ..audio.io import check_output, load_audio
    from ..nemotron_voicechat.runtime.tools import read_tools_file

    if args.output_audio is not None:
        check_output(args.output_audio, inputs=[args.audio])
    tools = read_tools_file(args.tools)
    if args.plot:
        from ..nemotron_voicechat.runtime import plot

        plot.check_available()
        check_output(args.plot, inputs=[args.audio, args.output_audio])
    return load_audio(args.audio), tools


def add_recognizer_options(p) -> None:
    """``--language`` and ``--prompt-id`` (a Nemotron-3.5-ASR checkpoint's language prompt)."""
    p.add_argument(
        "--language", default=None, help="recognizer: language prompt (en-US, auto, ...)"
    )
    p.add_argument("--prompt-id", type=int, default=None, help="recognizer: language prompt index")


def add_quantize_options(p, quantize_help: str) -> None:
    """``--quantize`` and ``--group-size`` (``make-checkpoint``, ``convert``)."""
    p.add_argument("--quantize", type=int, choices=[4, 8], default=None, help=quantize_help)
    p.add_argument("--group-size", type=int, default=64, help="32, 64 or 128 (default 64)")


class ServeError(VoiceChatError):
    """The server cannot start as asked (``--ray``'s deployment included)."""


def flag(attr: str) -> str:
    """The flag of an ``args`` attribute: ``max_sessions`` -> ``--max-sessions``."""
    return "--" + attr.replace("_", "-")


def say(text: str) -> None:
    print(f"mlx-voicechat serve: {text}", file=sys.stderr)


def urls(args, tls: bool = False) -> str:
    """Where the server answers: its Realtime WebSocket and its web page."""
    ws, http = ("wss", "https") if tls else ("ws", "http")
    where = f"{args.host}:{args.port}"
    return f"{ws}://{where}/v1/realtime (web page {http}://{where}/)"

"""``mlx-voicechat chat``: talk to the model from the terminal, microphone in, speakers out.

The loop (:func:`chat_loop`) reads 80 ms blocks from an audio source, feeds them to the
session, plays each event's speech on the sink and prints the words as they come. It knows the
devices only through ``runtime.devices``' source / sink interface, so tests drive it with
arrays. Ctrl-C ends the conversation cleanly.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

from .options import add_conversation_options
from .stream import WordPrinter


def add_parser(subparsers):
    p = subparsers.add_parser(
        "chat",
        help="talk to the model: microphone in, speakers out (needs the [mic] extra)",
        description="A live full-duplex conversation from the terminal: speak, and hear the "
        "model answer; its words and yours are printed as they come. Ctrl-C ends it.",
    )
    p.add_argument("--model", required=True, help="checkpoint folder or hub id")
    add_conversation_options(p)
    p.add_argument(
        "--input-device",
        default=None,
        help="microphone: PortAudio device index or name (default: the system's)",
    )
    p.add_argument(
        "--output-device",
        default=None,
        help="speaker: PortAudio device index or name (default: the system's)",
    )
    p.set_defaults(func=run)
    return p


def chat_loop(
    session,
    source,
    sink,
    on_events: Optional[Callable[[list], None]] = None,
    extra_decoding_seconds: float = 0.0,
) -> int:
    """Feed ``source`` to ``session`` block by block and write every event's audio to ``sink``
    until the source ends (then ``finish``) or the session reaches its cap. Returns the frames
    run. A KeyboardInterrupt passes through, between or inside frames, for the caller to end
    the conversation."""
    from ..runtime.devices import DeviceError

    if sink.sample_rate != session.output_sample_rate:
        raise DeviceError(
            f"the speaker plays at {sink.sample_rate} Hz; the model speaks at "
            f"{session.output_sample_rate} Hz"
        )
    block = max(1, round(source.sample_rate * session.config.frame_duration))

    def play(events):
        for event in events:
            sink.write(event.audio)
        if on_events is not None:
            on_events(events)

    while session.finished is None:
        samples = source.read(block)
        if samples is None:
            play(session.finish(extra_decoding_seconds))
            break
        play(session.feed(samples, sample_rate=source.sample_rate))
    return session.frames


def _device(name):
    """A device flag as PortAudio takes it: an index when it is a number, else a name."""
    if name is None:
        return None
    return int(name) if str(name).strip().lstrip("-").isdigit() else name


def run(args) -> int:
    from .. import load
    from ..runtime import devices

    mic_device, speaker_device = _device(args.input_device), _device(args.output_device)
    devices.check(mic_device, speaker_device)  # a missing device fails before the model loads
    from ..runtime.tools import read_tools_file

    tools = read_tools_file(args.tools)  # a bad file fails before the model loads
    model = load(args.model, tokenizer=args.tokenizer)
    session = model.session(args.system_prompt, seed=args.seed, tools=tools or None)
    printer = WordPrinter()
    mic = devices.open_microphone(mic_device, session.input_sample_rate)
    try:
        speaker = devices.open_speaker(speaker_device, session.output_sample_rate)
    except BaseException:
        mic.close()
        raise
    print(f"listening at {mic.sample_rate} Hz; speak, and Ctrl-C to end", file=sys.stderr)
    try:
        chat_loop(session, mic, speaker, on_events=printer)
    except KeyboardInterrupt:
        pass
    finally:
        printer.end()
        mic.close()
        speaker.close()
        session.close()
    seconds = session.frames * model.config.frame_duration
    print(f"ended after {session.frames} frames ({seconds:.1f} s)", file=sys.stderr)
    return 0

"""``mlx-voicechat chat``: talk to the model from the terminal, microphone in, speakers out.

:func:`chat_loop` knows the devices only through ``audio.devices``' source / sink interface, so
tests drive it with arrays. With ``--mcp FILE`` the servers' tools are the model's; their calls
run on the MCP client's thread and each result is queued between frames.
"""

from __future__ import annotations

import contextlib
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
    add_conversation_options(p)
    p.add_argument(
        "--mcp",
        default=None,
        metavar="FILE.json",
        help='MCP servers whose tools the model may call and chat runs: {"mcpServers": {name: '
        '{"command", "args", "env"} | {"url", "headers"}}} (needs the [mcp] extra)',
    )
    p.add_argument(
        "--tool-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="how long an MCP tool call may take before the model hears it timed out "
        "(default 30)",
    )
    for side, device in (("input", "microphone"), ("output", "speaker")):
        p.add_argument(
            f"--{side}-device",
            default=None,
            help=f"{device}: PortAudio device index or name (default: the system's)",
        )
    return p


def chat_loop(
    session,
    source,
    sink,
    on_events: Optional[Callable[[list], None]] = None,
    extra_decoding_seconds: float = 0.0,
    tools=None,
    on_outcome: Optional[Callable] = None,
) -> int:
    """Feed ``source`` to ``session`` block by block and write every event's audio to ``sink``
    until the source ends (then ``finish``) or the session reaches its cap; returns the frames
    run. A KeyboardInterrupt passes through for the caller. ``tools`` (started ``MCPTools``)
    runs the model's calls; each outcome is queued before the next block and handed to
    ``on_outcome``."""
    from ..audio.devices import DeviceError

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
        if tools is not None:
            for event in events:
                for call in event.tool_calls:
                    if tools.owns(call.name):
                        tools.submit(call)

    while session.finished is None:
        if tools is not None:
            inject_results(session, tools, on_outcome)
        samples = source.read(block)
        if samples is None:
            play(session.finish(extra_decoding_seconds))
            break
        play(session.feed(samples, sample_rate=source.sample_rate))
    return session.frames


def inject_results(session, tools, on_outcome=None) -> list:
    """Queue the outcomes of the calls that finished since the last look (an error as
    ``{"error": message}``, so the model hears it); returns them."""
    from ..nemotron_voicechat.runtime.tools import ToolError

    done = tools.take_finished()
    for outcome in done:
        output = outcome.output if outcome.ok else {"error": outcome.output}
        try:
            session.add_tool_result(outcome.call_id, output)
        except ToolError as e:  # e.g. the result has no tokens: said, and the talk goes on
            outcome.error = outcome.output = f"the result could not be injected: {e}"
        if on_outcome is not None:
            on_outcome(outcome)
    return done


def print_outcome(printer, outcome) -> None:
    """``[tool result] name -> text (0.12 s)`` or ``[tool error] name: message (30.00 s)``."""
    text = outcome.output if len(outcome.output) <= 200 else outcome.output[:200] + "..."
    if outcome.ok:
        printer.line("tool result", f"{outcome.name} -> {text} ({outcome.seconds:.2f} s)")
    else:
        printer.line("tool error", f"{outcome.name}: {text} ({outcome.seconds:.2f} s)")


def start_mcp(path, timeout: float, taken=()):
    """The started MCP servers of ``--mcp FILE`` (stopped again if one fails to start)."""
    from ..nemotron_voicechat.runtime.mcp import MCPTools, read_config

    specs = read_config(path)
    tools = MCPTools(specs, timeout=timeout)
    try:
        tools.start(taken=taken)
    except BaseException:
        tools.close()
        raise
    for spec in specs:
        names = [n for n, (server, _) in tools.routes.items() if server == spec.name]
        print(f"MCP server {spec.name} ({spec.where}): {', '.join(names) or 'no tools'}",
              file=sys.stderr)
    return tools


def _device(name):
    """A device flag as PortAudio takes it: an index when it is a number, else a name."""
    if name is None:
        return None
    return int(name) if str(name).strip().lstrip("-").isdigit() else name


def run(args) -> int:
    from .. import load
    from ..audio import devices

    mic_device, speaker_device = _device(args.input_device), _device(args.output_device)
    devices.check(mic_device, speaker_device)  # a missing device fails before the model loads
    from ..nemotron_voicechat.runtime.tools import read_tools_file

    tools = read_tools_file(args.tools)  # a bad file fails before the model loads
    if args.mcp is not None:
        from ..nemotron_voicechat.runtime.mcp import MCPError, read_config, require_sdk

        require_sdk()
        read_config(args.mcp)  # a bad file, too
        if not args.tool_timeout > 0:
            raise MCPError(f"--tool-timeout must be > 0 seconds, not {args.tool_timeout:g}")
    model = load(args.model, tokenizer=args.tokenizer)
    from ..nemotron_asr.recognizer import require_voicechat

    require_voicechat(model, "chat")  # a recognizer's session takes no prompt: one clear error
    mcp = None
    if args.mcp is not None:
        mcp = start_mcp(args.mcp, args.tool_timeout, taken=[t["name"] for t in tools])
    try:
        _converse(args, model, devices, mic_device, speaker_device, tools, mcp)
    finally:
        if mcp is not None:
            mcp.close()  # Ctrl-C too: the servers it started stop
    return 0


def _converse(args, model, devices, mic_device, speaker_device, tools, mcp) -> None:
    all_tools = list(tools) + (mcp.functions if mcp is not None else [])
    session = model.session(args.system_prompt, seed=args.seed, tools=all_tools or None)
    printer = WordPrinter()
    with contextlib.ExitStack() as stack:  # whatever was opened is closed, Ctrl-C too
        stack.callback(session.close)
        mic = stack.enter_context(devices.open_microphone(mic_device, session.input_sample_rate))
        speaker = stack.enter_context(
            devices.open_speaker(speaker_device, session.output_sample_rate)
        )
        stack.callback(printer.end)
        print(f"listening at {mic.sample_rate} Hz; speak, and Ctrl-C to end", file=sys.stderr)
        try:
            chat_loop(session, mic, speaker, on_events=printer, tools=mcp,
                      on_outcome=lambda o: print_outcome(printer, o))
        except KeyboardInterrupt:
            pass
    seconds = session.frames * model.config.frame_duration
    print(f"ended after {session.frames} frames ({seconds:.1f} s)", file=sys.stderr)

"""``mlx-voicechat stream``: an audio file fed to a streaming session in 80 ms chunks as if live
(at real time with ``--realtime``), then the trailing silence and ``finish``. Prints the words
as they come, each frame's latency (from its last needed sample fed to its event) and the
real-time factor. The reply WAV equals ``generate``'s on the same input.
"""

from __future__ import annotations

import bisect
import sys
import time
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

import numpy as np

from .options import add_conversation_options, add_file_options, add_recognizer_options

CHUNK_SAMPLES = 1280  # 80 ms at 16 kHz


def add_parser(subparsers):
    p = subparsers.add_parser(
        "stream",
        help="feed an audio file to a streaming session, as if live, and time it",
        description="Feed an audio file to a streaming session in 80 ms chunks; print the words "
        "as they come and the per-frame latency and real-time factor.",
    )
    add_conversation_options(p)
    extra = "seconds of silence fed after the file so the reply can finish (default 3)"
    add_file_options(p, output_required=False, extra_help=extra)
    p.add_argument(
        "--realtime",
        action="store_true",
        help="feed the chunks at real time (80 ms apart), as a microphone would",
    )
    add_recognizer_options(p)
    return p


# --- words as they come ------------------------------------------------------------------------


def _printable(text: str) -> str:
    """Control characters (random weights decode to them) would drive the terminal."""
    return "".join(c if unicodedata.category(c)[0] != "C" else "\ufffd" for c in text)


class WordPrinter:
    """Prints the deltas of the three channels as they arrive, one line per run of a channel:
    ``[user] ...``, ``[assistant] ...``, ``[function] ...``."""

    LABELS = (("transcript", "user"), ("text", "assistant"), ("function_text", "function"))

    def __init__(self, out=None):
        self.out = out if out is not None else sys.stdout
        self.channel: Optional[str] = None

    def __call__(self, events) -> None:
        for event in events:
            for attr, label in self.LABELS:
                delta = getattr(event, attr)
                if delta:
                    self.write(label, delta)
            for call in getattr(event, "tool_calls", ()):
                self.line("tool call", f"{call.name}({call.arguments}) id={call.call_id}")
            for message in getattr(event, "errors", ()):
                self.line("tool call error", message)

    def line(self, label: str, text: str) -> None:
        """A line of its own (a tool call), between runs of words."""
        self.end()
        self.out.write(f"[{label}] {_printable(text)}\n")
        self.out.flush()

    def write(self, label: str, delta: str) -> None:
        if label != self.channel:
            delta = delta.lstrip()
            if not delta:
                return
            if self.channel is not None:
                self.out.write("\n")
            self.out.write(f"[{label}] ")
            self.channel = label
        self.out.write(_printable(delta))
        self.out.flush()

    def end(self) -> None:
        if self.channel is not None:
            self.out.write("\n")
            self.out.flush()
        self.channel = None


# --- the timed run ---------------------------------------------------------------------------


@dataclass
class StreamRun:
    events: list
    latencies: List[float]  # seconds, one per frame
    compute_seconds: float  # time spent inside feed / finish
    audio_seconds: float  # input + trailing silence
    samples: np.ndarray  # what was fed (16 kHz), the trailing silence included
    calls: List[tuple] = field(default_factory=list)  # (start, end, events) per call

    @property
    def rtf(self) -> float:
        return self.compute_seconds / self.audio_seconds if self.audio_seconds else float("nan")

    def reply_audio(self, samples_per_frame: int) -> np.ndarray:
        """The events' audio without the codec's fixed delay: the events start with that many
        samples of nothing and the final event carries as many more, so dropping them gives
        the offline waveform."""
        audio = np.concatenate([e.audio for e in self.events] or [np.zeros(0, np.float32)])
        frames = sum(1 for e in self.events if not e.remainder)
        delay = len(audio) - frames * samples_per_frame
        return audio[delay:] if delay > 0 else audio


def stream_samples(
    session,
    samples: np.ndarray,
    extra_decoding_seconds: float = 3.0,
    realtime: bool = False,
    chunk: int = CHUNK_SAMPLES,
    on_events: Optional[Callable[[list], None]] = None,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
) -> StreamRun:
    """Feed 16 kHz ``samples`` and the trailing silence in ``chunk``-sample calls, then
    ``finish(0)``; time every frame from its last needed sample to its event."""
    rate = session.input_sample_rate
    pad = int(round(extra_decoding_seconds * rate))
    fed = np.concatenate([np.asarray(samples, np.float32), np.zeros(pad, np.float32)])
    events: list = []
    arrival: List[float] = []  # per call: when its last sample was there
    received: List[float] = []  # per call: samples in after it (finish: all that will come)
    emitted: List[int] = []  # per event: the index of the call that returned it
    calls = []
    compute = 0.0
    start = clock()

    def call(fn, *a, due=None, total=None):
        nonlocal compute
        t = clock()
        arrival.append(t if due is None else min(due, t))
        received.append(float("inf") if total is None else total)
        out = fn(*a)
        end = clock()
        compute += end - t
        calls.append((t, end, len(out)))
        emitted.extend([len(arrival) - 1] * len(out))
        events.extend(out)
        if on_events is not None:
            on_events(out)

    for i in range(0, len(fed), chunk):
        block = fed[i : i + chunk]
        due = None
        if realtime:
            due = start + (i + len(block)) / rate
            wait = due - clock()
            if wait > 0:
                sleep(wait)
        call(session.feed, block, due=due, total=i + len(block))
        if session.finished is not None:  # the session's cap (max_seconds) was reached
            break
    if session.finished is None:
        call(session.finish, 0.0)
    latencies = []
    for event, j in zip(events, emitted, strict=True):
        if event.remainder:  # no frame of its own: the end of the stream's last samples
            continue
        needed = session.samples_needed(event.index)
        first = bisect.bisect_left(received, needed)  # the call that brought its last sample
        latencies.append(calls[j][1] - arrival[first])
    return StreamRun(events, latencies, compute, len(fed) / rate, fed, calls)


def latency_line(run: StreamRun) -> str:
    lat = np.array(run.latencies) * 1000.0
    if not len(lat):
        return "latency: no frames"
    p50, p95 = np.percentile(lat, [50, 95])
    return (
        f"latency per frame (last needed sample fed -> its event with audio): "
        f"p50 {p50:.1f} ms, p95 {p95:.1f} ms, max {lat.max():.1f} ms over {len(lat)} frames"
    )


def rtf_line(run: StreamRun) -> str:
    return (
        f"RTF {run.rtf:.3f} ({run.compute_seconds:.2f} s of compute for "
        f"{run.audio_seconds:.2f} s of audio)"
    )


def _timed_run(args, session, samples, extra: float, printer) -> StreamRun:
    """:func:`stream_samples` with the words printed as they come, then the latency and RTF."""
    try:
        result = stream_samples(session, samples, extra, realtime=args.realtime, on_events=printer)
    finally:
        printer.end()
    print(latency_line(result))
    print(rtf_line(result))
    return result


def run(args) -> int:
    from .. import load
    from ..audio.io import save_wav
    from ..nemotron_voicechat.runtime import plot
    from ..nemotron_voicechat.runtime.request import check_extra_seconds
    from .options import check_file_options

    extra = check_extra_seconds(args.extra_decoding_seconds)
    samples, tools = check_file_options(args)
    model = load(args.model, tokenizer=args.tokenizer)
    if getattr(model, "resolve_prompt", None) is not None:  # Nemotron-3.5-ASR: transcription
        return run_transcription(args, model, samples)
    session = model.session(args.system_prompt, seed=args.seed, tools=tools or None)
    try:
        result = _timed_run(args, session, samples, extra, WordPrinter())
    finally:
        session.close()
    ahead = session.ready_before_slot_end
    per, first = session.input_samples_per_frame, session.samples_needed(0)
    print(
        f"lookahead: frame k is computed once {per} k + {first} samples are in, {ahead} samples "
        f"({1000 * ahead / session.input_sample_rate:.1f} ms) before its 80 ms slot ends"
    )
    reply = result.reply_audio(session.samples_per_frame)
    if args.output_audio:
        save_wav(args.output_audio, reply, session.output_sample_rate)
        print(f"wrote {args.output_audio}", file=sys.stderr)
    if args.plot:
        timeline = plot.Timeline.from_events(
            result.events,
            result.samples,
            session.input_sample_rate,
            session.output_sample_rate,
            model.config.frame_duration,
            title=f"mlx-voicechat stream {Path(args.audio).name}",
        )
        timeline.output_audio = reply
        plot.save(timeline, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


# --- a recognizer: live transcription ----------------------------------------------------


class TranscriptPrinter(WordPrinter):
    """The transcript's deltas as they arrive, on a ``[user]`` line."""

    LABELS = (("text", "user"),)


def run_transcription(args, model, samples) -> int:
    """``stream`` with a Nemotron-3.5-ASR checkpoint: a live transcription session."""
    from ..errors import VoiceChatError

    if args.output_audio or args.plot:
        raise VoiceChatError("a recognizer has no reply: leave out --output-audio and --plot")
    session = model.session(language=args.language, prompt_id=args.prompt_id)
    # The transcript needs no trailing silence (that is for a VoiceChat reply).
    _timed_run(args, session, samples, 0.0, TranscriptPrinter())
    if session.language:
        print(f"language: {session.language}")
    L, first = model.config.lookahead, session.samples_needed(0)
    print(
        f"lookahead: {L} frames; a chunk of {L + 1} frames is final once "
        f"{session.frame_samples} * ({L + 1} c + {L}) + {first - session.frame_samples * L} "
        f"samples are in (its first frame {session.latency_samples} samples after its 80 ms slot)"
    )
    return 0

"""``mlx-voicechat stream`` with a Nemotron-3.5-ASR checkpoint: the file fed to a live
transcription session in 80 ms chunks (at real time with ``--realtime``), the words printed
as they come, then the per-frame latency, the real-time factor and the detected language."""

from __future__ import annotations

from ..errors import VoiceChatError
from .stream import WordPrinter, latency_line, rtf_line, stream_samples


class TranscriptPrinter(WordPrinter):
    """The transcript's deltas as they arrive, on a ``[user]`` line."""

    LABELS = (("text", "user"),)


def run_transcription(args, model, samples) -> int:
    if getattr(args, "output_audio", None) or getattr(args, "plot", None):
        raise VoiceChatError("a recognizer has no reply: leave out --output-audio and --plot")
    session = model.session(
        language=getattr(args, "language", None), prompt_id=getattr(args, "prompt_id", None)
    )
    printer = TranscriptPrinter()
    try:
        # The transcript needs no trailing silence (that is for a VoiceChat reply).
        result = stream_samples(session, samples, 0.0, realtime=args.realtime, on_events=printer)
    finally:
        printer.end()
    print(latency_line(result))
    print(rtf_line(result))
    if session.language:
        print(f"language: {session.language}")
    L, first = model.config.lookahead, session.samples_needed(0)
    print(
        f"lookahead: {L} frames; a chunk of {L + 1} frames is final once "
        f"{session.frame_samples} * ({L + 1} c + {L}) + {first - session.frame_samples * L} "
        f"samples are in (its first frame {session.latency_samples} samples after its 80 ms slot)"
    )
    return 0

"""``mlx-voicechat generate``: a question WAV in, the reply text and WAV out."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .options import add_conversation_options, add_file_options, check_file_options

PROGRESS_MIN_FRAMES = 50  # 4 s of timeline: shorter runs print no progress bar


def add_parser(subparsers):
    p = subparsers.add_parser(
        "generate",
        help="answer a spoken question with text and speech",
        description="Run the offline duplex loop on an audio file and write the spoken reply.",
    )
    add_conversation_options(p)
    extra = "seconds of silence appended so the model can finish (default 3)"
    add_file_options(p, output_required=True, extra_help=extra)
    p.add_argument("--quiet", action="store_true", help="print no progress bar")
    return p


class _Progress:
    def __init__(self, enabled: bool):
        self.enabled, self.bars, self.start = enabled, {}, time.perf_counter()

    def _update(self, total: int, unit: str, **options):
        """The bar of ``unit``, made on first use and advanced by one (None: no bar)."""
        if not self.enabled or total < PROGRESS_MIN_FRAMES:
            return None
        if unit not in self.bars:
            from tqdm import tqdm

            self.bars[unit] = tqdm(total=total, unit=unit, leave=False, **options)
        self.bars[unit].update(1)
        return self.bars[unit]

    def prompt(self, done: int, total: int) -> None:
        """The TTS steps over the system prompt's positions, before the first audio frame."""
        bar = self._update(total, "step", desc="system prompt")
        if bar is not None and done == total:
            bar.close()

    def __call__(self, done: int, total: int) -> None:
        bar = self._update(total, "frame")
        if bar is not None:
            elapsed = time.perf_counter() - self.start
            bar.set_postfix(rtf=f"{elapsed / (done * 0.08):.2f}")

    def close(self):
        for bar in self.bars.values():
            bar.close()


def run(args) -> int:
    from .. import load
    from ..nemotron_voicechat.runtime.request import check_extra_seconds, check_seed

    # The request's own checks, under the flags' names; whether the audio and its trailing
    # silence fit in the LLM's context, generate() checks before it makes the silence.
    check_extra_seconds(args.extra_decoding_seconds, "--extra-decoding-seconds")
    check_seed(args.seed, "--seed")
    samples, tools = check_file_options(args)
    model = load(args.model, tokenizer=args.tokenizer)
    from ..nemotron_asr.recognizer import require_voicechat

    require_voicechat(model, "generate")
    progress = _Progress(not args.quiet)
    try:
        result = model.generate(
            samples,
            system_prompt=args.system_prompt,
            extra_decoding_seconds=args.extra_decoding_seconds,
            seed=args.seed,
            progress=progress,
            prompt_progress=progress.prompt,
            tools=tools or None,
        )
    finally:
        progress.close()
    out = result.save(args.output_audio)
    if args.plot:
        _plot(model, result, samples, args)
    print(f"[user] {result.user_transcript}")
    print(result.text)
    if result.function_text:
        print(f"[function] {result.function_text}")
    for call in result.tool_calls:
        print(f"[tool call] {call.name}({call.arguments}) id={call.call_id}")
    for message in result.tool_errors:
        print(f"[tool call error] {message}")
    if not args.quiet:
        seconds = len(result.audio) / result.sample_rate
        print(
            f"wrote {out} ({seconds:.2f} s, {result.sample_rate} Hz, {result.frames} frames)",
            file=sys.stderr,
        )
    return 0


def _plot(model, result, samples, args) -> None:
    import numpy as np

    from ..nemotron_voicechat.runtime import plot

    rate = model.config.input_sample_rate
    heard = np.concatenate(
        [samples, np.zeros(int(round(args.extra_decoding_seconds * rate)), np.float32)]
    )
    user = plot.transcript_by_frame(model, samples, args.extra_decoding_seconds)
    timeline = plot.Timeline.from_result(
        model, result, heard, user, title=f"mlx-voicechat generate {Path(args.audio).name}"
    )
    plot.save(timeline, args.plot)
    if not args.quiet:
        print(f"wrote {args.plot}", file=sys.stderr)

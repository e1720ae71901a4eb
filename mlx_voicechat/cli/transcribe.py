"""``mlx-voicechat transcribe``: the user's words of an audio file, via the RNNT head."""

from __future__ import annotations

WARMUP_SECONDS = 1.0  # audio run once before a benchmark, so kernel set-up is not timed


def add_parser(subparsers):
    p = subparsers.add_parser(
        "transcribe",
        help="transcribe speech with the model's RNNT head",
        description="Print the transcript of an audio file (any rate, mono or stereo; "
        "WAV, FLAC, MP3).",
    )
    p.add_argument("--model", required=True, help="checkpoint folder or hub id")
    p.add_argument("--audio", required=True, help="audio file to transcribe")
    p.add_argument(
        "--benchmark",
        action="store_true",
        help="also print mel / encoder / decode milliseconds, audio seconds and RTF",
    )
    p.add_argument(
        "--chunk-frames",
        type=int,
        default=None,
        help="encoder frames (80 ms each) per chunk of the chunked encoder",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (NVIDIA raw layout)")
    p.set_defaults(func=run)
    return p


def run(args, load_fn=None) -> int:
    """Prints the transcript (and the benchmark); returns the exit code. ``load_fn(path)``
    (default: :func:`mlx_voicechat.load` with ``--tokenizer``) returns a model whose
    ``transcribe(audio, chunk_size=...)`` returns a ``TranscriptResult``."""
    from ..runtime.audio import INPUT_SAMPLE_RATE, load_audio

    if load_fn is None:
        from .. import load

        def load_fn(path):
            return load(path, tokenizer=getattr(args, "tokenizer", None))

    samples = load_audio(args.audio)  # a bad file fails before the model loads
    model = load_fn(args.model)
    chunk = getattr(args, "chunk_frames", None)
    if args.benchmark:
        model.transcribe(samples[: int(WARMUP_SECONDS * INPUT_SAMPLE_RATE)], chunk_size=chunk)
    result = model.transcribe(samples, chunk_size=chunk)
    print(result.text)
    if result.language:
        print(f"language: {result.language}")
    if args.benchmark and result.timings is not None:
        print(result.timings.report(len(result.tokens)))
    return 0

"""``mlx-voicechat transcribe``: the words of audio files, via a VoiceChat checkpoint's RNNT head
or a Nemotron-3.5-ASR recognizer (many files in one batched run)."""

from __future__ import annotations

from .options import MODEL_HELP, add_recognizer_options, add_tokenizer_option

WARMUP_SECONDS = 1.0  # audio run once before a benchmark, so kernel set-up is not timed


def add_parser(subparsers):
    p = subparsers.add_parser(
        "transcribe",
        help="transcribe speech (a recognizer, or a VoiceChat model's RNNT head)",
        description="Print the transcript of audio files (any rate, mono or stereo; WAV, "
        "FLAC, MP3). A Nemotron-3.5-ASR checkpoint decodes several files in one batch.",
    )
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("files", nargs="*", help="audio files to transcribe")
    p.add_argument("--audio", nargs="+", default=[], help="audio files to transcribe")
    p.add_argument(
        "--benchmark",
        action="store_true",
        help="also print mel / encoder / decode milliseconds, audio seconds and RTF",
    )
    add_recognizer_options(p)
    p.add_argument(
        "--edge",
        default="nemo",
        choices=["nemo", "mlx-audio"],
        help="recognizer: the end of a clip as NeMo computes it, or as mlx-audio's generate does",
    )
    p.add_argument(
        "--chunk-frames",
        type=int,
        default=None,
        help="encoder frames (80 ms each) per chunk of the chunked encoder (VoiceChat)",
    )
    add_tokenizer_option(p)
    return p


def run(args, load_fn=None) -> int:
    """Prints the transcripts (and the benchmark); returns the exit code. ``load_fn(path)``
    (default: :func:`mlx_voicechat.load` with ``--tokenizer``) returns the model."""
    from ..audio.io import INPUT_SAMPLE_RATE, load_audio
    from ..errors import VoiceChatError

    if load_fn is None:
        from .. import load

        def load_fn(path):
            return load(path, tokenizer=args.tokenizer)

    paths = args.files + args.audio
    if not paths:
        raise VoiceChatError("no audio file given (transcribe --model M a.wav [b.wav ...])")
    clips = [load_audio(p) for p in paths]  # a bad file fails before the model loads
    model = load_fn(args.model)
    batch = getattr(model, "resolve_prompt", None) is not None  # a Nemotron-3.5-ASR recognizer
    if batch:
        kw = dict(language=args.language, prompt_id=args.prompt_id, edge=args.edge)
    elif args.language is not None or args.prompt_id is not None:
        raise VoiceChatError("--language and --prompt-id are for a Nemotron-3.5-ASR checkpoint")
    else:
        kw = dict(chunk_size=args.chunk_frames)
    if args.benchmark:
        model.transcribe(clips[0][: int(WARMUP_SECONDS * INPUT_SAMPLE_RATE)], **kw)
    results = model.transcribe(clips, **kw) if batch else [model.transcribe(c, **kw) for c in clips]
    batched = getattr(results[0].timings, "clips", 1) > 1  # one report for the batch
    for path, result in zip(paths, results):
        prefix = f"{path}: " if len(paths) > 1 else ""
        print(prefix + result.text)
        if result.language:
            print(f"{'  ' if prefix else ''}language: {result.language}")
        if args.benchmark and not batched and result.timings is not None:
            print(result.timings.report(len(result.tokens)))
    if args.benchmark and batched:
        print(results[0].timings.report())
    return 0

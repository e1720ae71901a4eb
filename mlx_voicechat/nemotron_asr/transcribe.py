"""Offline transcription with Nemotron-3.5-ASR: one clip, or many as the rows of one batch
(each row's lengths mask its padding, each has its own decoder cursor, so a clip's tokens are
those of its solo run), with phase timings (``--benchmark``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..audio.io import load_audio
from ..listen.events import piece_text
from ..listen.greedy import GreedyDecoder
from ..listen.rnnt import read_piece
from ..listen.transcribe import TranscriptResult, TranscriptTimings, _ms


@dataclass
class RecognizerTimings(TranscriptTimings):
    """Phase times of one run (for a batch: of the whole batch) and the notes' counts."""

    steps: int = 0
    tokens: int = 0
    clips: int = 1

    def report(self, tokens: Optional[int] = None) -> str:
        return super().report(self.tokens if tokens is None else tokens)

    def _counts(self, tokens: int) -> str:
        clips = f"{self.clips} clips, " if self.clips > 1 else ""
        return f"{clips}{self.encoder_frames} encoder frames, {self.steps} steps, {tokens} tokens"


@dataclass
class RecognizerResult(TranscriptResult):
    """A clip's transcript, its detected (or forced) language, and the notes' counts:
    ``encoder_frames``, ``steps`` (joint evaluations) and ``len(tokens)``."""

    encoder_frames: int = 0
    steps: int = 0
    forced_advances: int = 0  # frames left after max_symbols tokens without a step
    prompt_id: Optional[int] = None
    pieces: List[str] = field(default_factory=list)


def first_language(tokens: Sequence[int], vocabulary: Sequence[str]) -> Optional[str]:
    """The first ``<xx-XX>`` tag emitted, without brackets (the detected language)."""
    return next(filter(None, (read_piece(vocabulary, t)[1] for t in tokens)), None)


def transcribe(
    model,
    audios: Sequence,
    prompt_id: int,
    language: Optional[str] = None,
    *,
    source_rate: Optional[int] = None,
    edge: str = "nemo",
) -> List[RecognizerResult]:
    """Transcribe clips (paths or arrays at ``source_rate``, default 16 kHz) in one batch;
    ``language`` is the forced prompt's name, reported when the model emits no tag."""
    config = model.config
    rate = config.sample_rate
    clips = [load_audio(a, rate, source_rate) for a in audios]
    B = len(clips)
    N = max(len(c) for c in clips)
    wave = np.zeros((B, N), np.float32)
    for b, c in enumerate(clips):
        wave[b, : len(c)] = c
    lengths = mx.array([len(c) for c in clips], dtype=mx.int32)

    start = time.perf_counter()
    mel, mel_len = model.frontend(mx.array(wave), lengths, edge)
    mx.eval(mel, mel_len)
    mel_ms = _ms(start)

    start = time.perf_counter()
    encoder = model.encoder
    frames = [int(n) for n in encoder.output_lengths(mel_len).tolist()]
    total = max(frames)
    if total > 0:
        encoded = encoder.encode(mel, mel_len, total)
        joint_frames = model.joint_frames(encoded, mx.full((B,), prompt_id, dtype=mx.int32))
        mx.eval(joint_frames)
    encoder_ms = _ms(start)

    start = time.perf_counter()
    decoder = GreedyDecoder(model, B)
    if total > 0:
        decoder.push(joint_frames)
        decoder.run(frames)
    decode_ms = _ms(start)

    vocab = config.vocabulary
    rows = decoder.rows
    timings = RecognizerTimings(
        mel_ms,
        encoder_ms,
        decode_ms,
        sum(len(c) for c in clips) / rate,
        sum(frames),
        steps=sum(r.steps for r in rows),
        tokens=sum(len(r.tokens) for r in rows),
        clips=B,
    )
    return [
        RecognizerResult(
            piece_text(r.tokens, vocab),
            list(r.tokens),
            list(r.frames),
            first_language(r.tokens, vocab) or language,
            timings,
            encoder_frames=n,
            steps=r.steps,
            forced_advances=r.forced,
            prompt_id=prompt_id if model.has_prompt else None,
            pieces=[vocab[t] for t in r.tokens if 0 <= t < len(vocab)],
        )
        for n, r in zip(frames, rows)
    ]

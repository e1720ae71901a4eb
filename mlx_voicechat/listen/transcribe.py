"""Transcription of an utterance: audio -> log-mel -> FastConformer -> greedy RNNT -> text, with
phase timings (``mlx-voicechat transcribe --benchmark``, :meth:`TranscriptTimings.report`).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import mlx.core as mx

from ..audio.io import load_audio
from .greedy import greedy_decode
from .rnnt import decode_pieces


@dataclass
class TranscriptTimings:
    mel_ms: float
    encoder_ms: float
    decode_ms: float
    audio_seconds: float
    encoder_frames: int

    @property
    def total_ms(self) -> float:
        return self.mel_ms + self.encoder_ms + self.decode_ms

    @property
    def rtf(self) -> float:
        """Real-time factor: processing time / audio time (below 1 is faster than real time)."""
        return self.total_ms / 1000.0 / self.audio_seconds if self.audio_seconds else float("nan")

    def report(self, tokens: int) -> str:
        return "\n".join(
            [
                f"audio:    {self.audio_seconds:.2f} s ({self._counts(tokens)})",
                f"mel:      {self.mel_ms:.1f} ms",
                f"encoder:  {self.encoder_ms:.1f} ms",
                f"decode:   {self.decode_ms:.1f} ms",
                f"total:    {self.total_ms:.1f} ms",
                f"RTF:      {self.rtf:.4f}",
            ]
        )

    def _counts(self, tokens: int) -> str:
        return f"{self.encoder_frames} encoder frames, {tokens} tokens"


@dataclass
class TranscriptResult:
    text: str
    tokens: List[int] = field(default_factory=list)
    frames: List[int] = field(default_factory=list)  # encoder frame (80 ms each) of every token
    language: Optional[str] = None  # the last <xx-XX> tag emitted, without brackets
    timings: Optional[TranscriptTimings] = None


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


def transcribe(
    perception,
    rnnt_decoder,
    rnnt_joint,
    vocabulary: Sequence[str],
    blank_id: Optional[int],
    max_symbols: Optional[int],
    audio,
    *,
    source_rate: Optional[int] = None,
    chunk_size: Optional[int] = None,
) -> TranscriptResult:
    """Transcribe ``audio`` (a path, or an array at ``source_rate``, default 16 kHz).

    ``blank_id`` is checked against the joint's last output, which wins (errata 15)."""
    blank = rnnt_joint.blank_id
    if blank_id is not None and int(blank_id) != blank:
        warnings.warn(
            f"config rnnt blank id {blank_id} disagrees with the joint's last output {blank}; "
            f"using {blank}",
            stacklevel=2,
        )
    sample_rate = perception.sample_rate
    samples = load_audio(audio, sample_rate, source_rate)

    start = time.perf_counter()
    mel, mel_len = perception.log_mel(mx.array(samples))
    mx.eval(mel, mel_len)
    mel_ms = _ms(start)

    start = time.perf_counter()
    encoded, lengths = perception.encode(mel, mel_len, chunk_size)
    mx.eval(encoded, lengths)
    encoder_ms = _ms(start)

    start = time.perf_counter()
    length = int(lengths[0].item())
    tokens, frames = greedy_decode(rnnt_decoder, rnnt_joint, encoded, length, blank, max_symbols)
    text, language = decode_pieces(tokens, vocabulary)
    decode_ms = _ms(start)

    timings = TranscriptTimings(mel_ms, encoder_ms, decode_ms, len(samples) / sample_rate, length)
    return TranscriptResult(text, tokens, frames, language, timings)

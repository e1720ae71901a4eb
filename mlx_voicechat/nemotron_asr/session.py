"""Live transcription with Nemotron-3.5-ASR: samples in as they arrive, transcript out.

``feed`` runs every step whose input is complete on the same networks and frames as offline
(``nemotron_asr.transcribe``), so any chunking gives the offline tokens, frames and text. The
encoder's frames become final a chunk of ``lookahead + 1`` at a time (a steady chunk is one
compiled call, ``encode_chunk``); decoding reads at most once per encoder frame's worth of
samples fed, and ``finish`` reads what is left.
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx
import numpy as np

from ..audio.stream import AudioIn
from ..listen.events import (  # noqa: F401  (TranscriptEvent, TranscriptionError: re-exported)
    TranscriptEvent,
    TranscriptEvents,
    TranscriptionError,
    close_events,
)
from ..listen.greedy import GreedyDecoder


class TranscriptionSession:
    """One live transcription (see the module docstring); one thread at a time."""

    def __init__(self, model, prompt_id: int, language: Optional[str] = None, edge: str = "nemo"):
        self.model = model
        cfg = self.config = model.config
        self.prompt_id, self.forced_language, self.edge = prompt_id, language, edge
        self.sample_rate = cfg.sample_rate
        # The mel frames are computed when a chunk is (one STFT for the chunk's frames).
        self._audio = AudioIn(model, cfg.sample_rate, TranscriptionError, eager=False)
        self._mel = self._audio.mel
        self.chunk = cfg.chunk_frames
        self.frame_samples = cfg.frame_samples
        self._decoder = GreedyDecoder(model, 1)
        self.reset()

    def reset(self) -> None:
        self._audio.reset()
        self._cache = self.model.encoder.make_cache()
        self._decoder.reset()
        self._prompt = mx.array([self.prompt_id], dtype=mx.int32)
        self._events = TranscriptEvents(self.config.vocabulary, self.forced_language, pieces=True)
        self.language = self.forced_language
        self.reads = 0
        self._finished = False

    @property
    def input_sample_rate(self) -> int:
        return self.sample_rate

    @property
    def received(self) -> int:
        return self._mel.received

    @property
    def frames(self) -> int:
        """Encoder frames computed."""
        return self._mel.frames

    # -- how much input a frame needs -------------------------------------------------------

    def samples_needed(self, k: int) -> int:
        """Samples that must have arrived for encoder frame ``k`` (its chunk's last frame's)."""
        return self._mel.samples_needed((k // self.chunk) * self.chunk + self.chunk - 1)

    @property
    def latency_samples(self) -> int:
        """The most a frame waits after its own slot ends (first frame of a chunk)."""
        return self.samples_needed(0) - self.frame_samples

    # -- input -----------------------------------------------------------------------------------

    def _encode(self, k1: int, mel_len: Optional[int] = None) -> None:
        """Encoder frames ``[frames, k1)`` (whole chunks, or the last ones at the end)."""
        k0 = self._mel.frames
        mel, j = self._mel.take(k1)
        lengths = None if mel_len is None else mx.array([mel_len], dtype=mx.int32)
        start = (k0 - j) * self._mel.factor  # the mel frame the window starts at
        frames, self._cache = self.model.encode_chunk(
            mel[None], start, slice(j, j + k1 - k0), self._cache, self._prompt, lengths
        )
        self._decoder.push(frames)

    def feed(self, samples, sample_rate: Optional[int] = None) -> List[TranscriptEvent]:
        """Add mono audio (int or float PCM, at 16 kHz or ``sample_rate``); returns an event
        for every frame whose decoding completed with it."""
        if self._finished:
            raise TranscriptionError("the session has finished; call reset() to start again")
        self._audio.push(samples, sample_rate)
        # Encoder frame k reads mel frames up to 8 k; its chunk is final with its last frame.
        whole = self._mel.final // self.chunk * self.chunk
        if whole > self.frames:
            self._mel.compute()
            self._encode(whole)
        return self._decode(budget=self.received // self.frame_samples)

    @property
    def finished(self) -> Optional[str]:
        """``"finished"`` once :meth:`finish` ran (as VoiceChat's sessions say), else None."""
        return "finished" if self._finished else None

    def finish(self, extra_decoding_seconds: float = 0.0) -> List[TranscriptEvent]:
        """End of input (after ``extra_decoding_seconds`` of silence, default none): the last
        frames as the offline pass computes them and every token left."""
        if self._finished:
            raise TranscriptionError("the session has already finished")
        if extra_decoding_seconds:
            self.feed(np.zeros(int(round(extra_decoding_seconds * self.sample_rate)), np.float32))
        self._audio.drain_resamplers()
        n = self.received
        mel_len = self._mel.finish(self.edge)
        total = int(self.model.encoder.output_lengths(mel_len)) if n else 0
        if total > self.frames:
            self._encode(total, mel_len)
        events = self._decode(budget=None, total=total)
        self._finished = True
        return close_events(events, total, self.language)

    # -- decoding ----------------------------------------------------------------------------------

    def _decode(self, budget: Optional[int], total: Optional[int] = None) -> List[TranscriptEvent]:
        """Rounds over the frames computed while ``budget`` (reads so far, at most) allows; at
        the end (``total``) every frame left, in at most two reads more than one per frame."""
        dec, row = self._decoder, self._decoder.rows[0]
        end = dec.available if total is None else total
        n0 = len(row.tokens)
        allowed = budget if budget is not None else self.received // self.frame_samples + 2
        while dec.pending([end]) and (budget is None or self.reads < budget):
            dec.round([end], reads_left=allowed - self.reads)
            self.reads += 1
        upto = row.frame if total is None else end  # frames whose decoding is complete
        self.language = self._events.language
        return self._events.complete(row.tokens[n0:], row.frames[n0:], upto)

    # -- what the session has ------------------------------------------------------------------

    @property
    def tokens(self) -> List[int]:
        return list(self._decoder.rows[0].tokens)

    @property
    def token_frames(self) -> List[int]:
        return list(self._decoder.rows[0].frames)

    @property
    def steps(self) -> int:
        return self._decoder.rows[0].steps


def open_transcription(model, *, language=None, prompt_id=None, edge: str = "nemo"):
    """A live transcription session on a recognizer (``model.session``) or on a VoiceChat
    checkpoint's RNNT head (``RNNTTranscription``, which has no language prompt)."""
    if getattr(model, "resolve_prompt", None) is not None:
        return model.session(language=language, prompt_id=prompt_id, edge=edge)
    if language not in (None, "auto") or prompt_id is not None:
        raise TranscriptionError(
            "a VoiceChat checkpoint transcribes with its RNNT head, which has no language prompt"
        )
    from ..nemotron_voicechat.runtime.rnnt_transcription import RNNTTranscription

    return RNNTTranscription(model)

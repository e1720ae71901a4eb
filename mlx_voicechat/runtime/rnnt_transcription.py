"""Live transcription on a VoiceChat checkpoint: its listening path and RNNT head alone.

The same interface as :class:`~mlx_voicechat.runtime.asr_session.TranscriptionSession`
(``feed`` / ``finish`` -> per-frame :class:`TranscriptEvent` s), so a server offers
transcription sessions on either kind of checkpoint. It drives the streaming perception and
RNNT of :mod:`mlx_voicechat.runtime.frontend` (frame ``k`` is final with sample ``1280 k +
199``; one read per frame settles a token or a run of blank frames), without the LLM or the
speech: the tokens equal ``model.transcribe`` on the same samples.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np

from .asr_events import (
    TranscriptEvent,
    TranscriptEvents,
    TranscriptionError,
    _mono_float32,
    close_events,
)
from .frontend import RNNTStream, StreamingPerception


class RNNTTranscription:
    """Transcription with a VoiceChat model's RNNT head; one thread at a time."""

    def __init__(self, model):
        self.model = model
        stt = model.stt_model
        cfg = model.config
        self.sample_rate = cfg.input_sample_rate
        self.frame_samples = cfg.input_samples_per_frame
        self.forced_language = None
        self._front = StreamingPerception(stt.perception)
        self._rnnt = RNNTStream(
            stt.rnnt_decoder, stt.rnnt_joint, stt.rnnt_joint.blank_id, cfg.audio_config.max_symbols
        )
        self.reset()

    def reset(self) -> None:
        self._front.reset()
        self._rnnt.reset()
        self._events = TranscriptEvents(self.model.rnnt_vocabulary)
        self.language = None
        self.tokens: List[int] = []
        self.token_frames: List[int] = []
        self.reads = 0
        self._finished = False
        self._resampler = None

    def samples_needed(self, k: int) -> int:
        return self._front.samples_needed(k)

    @property
    def latency_samples(self) -> int:
        return self.samples_needed(0) - self.frame_samples

    @property
    def received(self) -> int:
        return self._front.received

    def _decode(self, budget: Optional[int]) -> List[TranscriptEvent]:
        rnnt, n0 = self._rnnt, len(self.tokens)
        while budget is None or self.reads < budget:
            labels = rnnt.queue()
            if labels is None:
                break
            for token, frame in rnnt.advance(labels.tolist()):  # the round's one read
                self.tokens.append(token)
                self.token_frames.append(frame)
            self.reads += 1
        events = self._events.complete(self.tokens[n0:], self.token_frames[n0:], rnnt.t)
        self.language = self._events.language
        return events

    def feed(self, samples, sample_rate: Optional[int] = None) -> List[TranscriptEvent]:
        if self._finished:
            raise TranscriptionError("the session has finished; call reset() to start again")
        x = _mono_float32(samples)
        if sample_rate is not None and int(sample_rate) != self.sample_rate and x.size:
            import soxr

            if self._resampler is None:
                self._resampler = soxr.ResampleStream(
                    int(sample_rate), self.sample_rate, 1, dtype="float32"
                )
            x = self._resampler.resample_chunk(x)
        out = self._front.push(x)
        if out is not None:
            self._rnnt.push(out[1])
        return self._decode(budget=self._front.received // self.frame_samples)

    def finish(self) -> List[TranscriptEvent]:
        if self._finished:
            raise TranscriptionError("the session has already finished")
        if self._resampler is not None:
            tail = self._resampler.resample_chunk(np.zeros(0, np.float32), last=True)
            if tail.size:
                self._front.push(tail)
        out = self._front.finish()
        if out is not None:
            self._rnnt.push(out[1])
        events = self._decode(budget=None)
        self._finished = True
        return close_events(events, self._rnnt.available, self.language)

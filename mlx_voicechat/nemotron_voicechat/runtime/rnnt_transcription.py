"""Live transcription on a VoiceChat checkpoint: its listening path and RNNT head alone.

The interface of :class:`~mlx_voicechat.nemotron_asr.session.TranscriptionSession`, so a
server offers transcription on either kind of checkpoint. Each frame is the frame step on a
state without the LLM or the speech, one read per frame; the tokens equal ``model.transcribe``.
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx

from ...audio.stream import AudioIn
from ...listen.events import TranscriptEvent, TranscriptEvents, TranscriptionError, close_events
from .framestate import FrameState, open_live
from .step import ReadLayout, read, step


class RNNTTranscription:
    """Transcription with a VoiceChat model's RNNT head; one thread at a time."""

    def __init__(self, model):
        self.model = model
        cfg = model.config
        self.sample_rate = cfg.input_sample_rate
        self.frame_samples = cfg.input_samples_per_frame
        self.forced_language = None
        self._audio = AudioIn(model.stt_model.perception, self.sample_rate, TranscriptionError)
        self._mel = self._audio.mel
        self._layout = ReadLayout(model, think=False, speak=False)
        self.reset()

    def reset(self) -> None:
        self._audio.reset()
        self._state = open_live(self.model, FrameState(frames=[0]), decode=False)
        self._events = TranscriptEvents(self.model.rnnt_vocabulary)
        self.language = None
        self.tokens: List[int] = []
        self.token_frames: List[int] = []
        self.reads = 0
        self._finished = False

    def samples_needed(self, k: int) -> int:
        return self._mel.samples_needed(k)

    @property
    def latency_samples(self) -> int:
        return self.samples_needed(0) - self.frame_samples

    @property
    def received(self) -> int:
        return self._mel.received

    def _decode(self) -> List[TranscriptEvent]:
        """Every frame that is final: the step without thinking or speaking, one read each."""
        n0 = len(self.tokens)
        while self._mel.ready:
            k = self._mel.frames
            words = step(self.model, self._state, [self._mel.window()], layout=self._layout).words
            labels = self._layout.unpack(read(words)[0]).labels  # the frame's one read
            self.tokens += labels
            self.token_frames += [k] * len(labels)
            self.reads += 1
        mx.async_eval(*self._state.arrays(), *self._mel.arrays())
        events = self._events.complete(self.tokens[n0:], self.token_frames[n0:], self._mel.frames)
        self.language = self._events.language
        return events

    def feed(self, samples, sample_rate: Optional[int] = None) -> List[TranscriptEvent]:
        if self._finished:
            raise TranscriptionError("the session has finished; call reset() to start again")
        self._audio.push(samples, sample_rate)
        return self._decode()

    def finish(self) -> List[TranscriptEvent]:
        if self._finished:
            raise TranscriptionError("the session has already finished")
        self._audio.drain_resamplers()
        self._mel.finish()
        events = self._decode()
        self._finished = True
        return close_events(events, self._mel.frames, self.language)

"""Live transcription with Nemotron-3.5-ASR: samples in as they arrive, transcript out.

``TranscriptionSession.feed`` runs every step whose input is complete, the same networks as
offline (``runtime.asr``) on the same frames, so for any chunking of the input the tokens, their
frames and the text equal the offline run (the encoder's left-context cache makes each chunk
cost one chunk of work, whatever the stream's length):

- log-mel: mel frame ``j`` is final once the samples under its window are in (sample
  ``160 j + 198``), computed with the same pre-emphasis and STFT as offline when the chunk
  that reads it is;
- encoder: the attention looks ``lookahead`` frames ahead within chunks of ``lookahead + 1``
  frames, so the frames of chunk ``c`` (``(L+1) c .. (L+1) c + L``) are final together, once
  mel frame ``8 ((L+1) c + L)`` is: the ``feed`` that completes sample
  ``1280 ((L+1) c + L) + 199``. With the real model's lookahead 13 that is 1.12 s chunks: the
  first frame of a chunk comes out 15559 samples (972 ms) after its own 80 ms slot ends, the
  last one 1081 samples before; with lookahead 0 every frame comes out 1081 samples before its
  slot ends, as VoiceChat's do;
- encoding: a steady chunk's subsampling, layers and joint projection are one compiled call
  (``RecognizerNetwork.encode_chunk``);
- decoding: rounds of the greedy loop over the chunk's frames, one read each
  (``runtime.asr_greedy``): the joint's labels over the frames left, so a chunk takes one read
  and one more per token in it. A session reads at most once per 1280 samples it has been fed
  (one read per 80 ms frame); on its last read a round runs several calls, and a burst of
  tokens beyond that waits for the next frames' reads (``finish`` reads what is left).
- the end of input (``finish``): the last frames as the offline pass computes them.
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx
import numpy as np

from ..nets.encoder import PRE_ENCODE_CONTEXT
from .asr_events import (  # noqa: F401  (TranscriptEvent, TranscriptionError: re-exported)
    TranscriptEvent,
    TranscriptEvents,
    TranscriptionError,
    _mono_float32,
    close_events,
)
from .asr_greedy import GreedyDecoder
from .audioin import preemphasize, window_of


class TranscriptionSession:
    """One live transcription (see the module docstring); one thread at a time."""

    def __init__(self, model, prompt_id: int, language: Optional[str] = None, edge: str = "nemo"):
        self.model = model
        cfg = model.config
        self.config = cfg
        self.prompt_id, self.forced_language, self.edge = prompt_id, language, edge
        self.sample_rate = cfg.sample_rate
        front = model.frontend
        self.hop, self.n_fft, self.preemph = front.hop, front.n_fft, front.preemph
        window = np.array(front.window)
        nonzero = np.flatnonzero(window)
        left = (self.n_fft - window.shape[0]) // 2
        # The last sample a mel frame's window weights, relative to its centre (198).
        self.window_end = left + int(nonzero[-1]) - self.n_fft // 2
        self.factor = 2**model.encoder.pre_encode.sampling_num
        self.chunk = cfg.chunk_frames
        self.frame_samples = cfg.frame_samples
        self._decoder = GreedyDecoder(model, 1)
        self._resampler = None
        self._resampler_rate = None
        self.reset()

    def reset(self) -> None:
        self.received = 0
        self._y = np.zeros(0, np.float32)  # pre-emphasized samples from _y_start on
        self._y_start = 0
        self._last_raw: Optional[np.ndarray] = None
        self._mel: Optional[mx.array] = None  # mel frames from _mel_start on
        self._mel_start = 0
        self.mel_frames = 0
        self.frames = 0  # encoder frames computed
        self._cache = self.model.encoder.make_cache()
        self._decoder.reset()
        self._prompt = mx.array([self.prompt_id], dtype=mx.int32)
        self._events = TranscriptEvents(self.config.vocabulary, self.forced_language, pieces=True)
        self.language = self.forced_language
        self.reads = 0
        self._finished = False
        self._resampler = None

    # -- how much input a frame needs -------------------------------------------------------

    def samples_needed(self, k: int) -> int:
        """Samples that must have arrived for encoder frame ``k`` to be computed (its chunk's
        last frame's mel: ``1280 ((L+1) c + L) + 199``)."""
        last = (k // self.chunk) * self.chunk + self.chunk - 1
        return self.hop * self.factor * last + self.window_end + 1

    @property
    def latency_samples(self) -> int:
        """The most a frame waits after its own slot ends (first frame of a chunk)."""
        return self.samples_needed(0) - self.frame_samples

    def _mel_final(self, n: int) -> int:
        return 0 if n <= self.window_end else (n - 1 - self.window_end) // self.hop + 1

    # -- input -----------------------------------------------------------------------------------

    def _append(self, x: np.ndarray) -> None:
        self._y = np.concatenate([self._y, preemphasize(x, self.preemph, self._last_raw)])
        self._last_raw = x[-1:].copy()
        self.received += len(x)

    def _signal(self, a: int, b: int) -> np.ndarray:
        return window_of(self._y, self._y_start, a, b)

    def _add_mel(self, j1: int) -> None:
        j0 = self.mel_frames
        if j1 <= j0:
            return
        half = self.n_fft // 2
        rows = self.model.frontend.frames(
            mx.array(self._signal(self.hop * j0 - half, self.hop * (j1 - 1) + half))
        )
        self._mel = rows if self._mel is None else mx.concatenate([self._mel, rows])
        self.mel_frames = j1
        drop = self.hop * j1 - half  # samples no later mel frame reads
        if drop > self._y_start:
            self._y = self._y[drop - self._y_start :]
            self._y_start = drop

    def _encode(self, k1: int, mel_len: Optional[int] = None) -> None:
        """Encoder frames ``[frames, k1)`` (whole chunks, or the last ones at the end)."""
        model, k0 = self.model, self.frames
        s = max(k0 - PRE_ENCODE_CONTEXT, 0)
        m0, m1 = s * self.factor, min((k1 - 1) * self.factor + 1, self.mel_frames)
        mel = self._mel[m0 - self._mel_start : m1 - self._mel_start][None]
        lengths = None if mel_len is None else mx.array([mel_len], dtype=mx.int32)
        frames, self._cache = model.encode_chunk(
            mel, m0, slice(k0 - s, k1 - s), self._cache, self._prompt, lengths
        )
        self._decoder.push(frames)
        self.frames = k1
        keep = max(k1 - PRE_ENCODE_CONTEXT, 0) * self.factor
        if keep > self._mel_start:
            self._mel = self._mel[keep - self._mel_start :]
            self._mel_start = keep

    def _samples(self, samples, sample_rate) -> np.ndarray:
        x = _mono_float32(samples)
        if sample_rate is None or int(sample_rate) == self.sample_rate or not x.size:
            return x
        if isinstance(sample_rate, bool) or int(sample_rate) <= 0:
            raise TranscriptionError(f"sample_rate must be a positive integer, got {sample_rate!r}")
        import soxr

        if self._resampler is None or self._resampler_rate != int(sample_rate):
            self._resampler = soxr.ResampleStream(
                int(sample_rate), self.sample_rate, 1, dtype="float32"
            )
            self._resampler_rate = int(sample_rate)
        return self._resampler.resample_chunk(x)

    def feed(self, samples, sample_rate: Optional[int] = None) -> List[TranscriptEvent]:
        """Add mono audio (int or float PCM, at 16 kHz or ``sample_rate``); returns an event
        for every frame whose decoding completed with it."""
        if self._finished:
            raise TranscriptionError("the session has finished; call reset() to start again")
        x = self._samples(samples, sample_rate)
        if x.size:
            self._append(x)
        # Encoder frame k reads mel frames up to 8 k; its chunk is final with its last frame.
        # The mel frames are computed when a chunk is (one STFT for the chunk's frames).
        m = self._mel_final(self.received)
        k = (m - 1) // self.factor + 1 if m else 0
        whole = k // self.chunk * self.chunk
        if whole > self.frames:
            self._add_mel(m)
            self._encode(whole)
        return self._decode(budget=self.received // self.frame_samples)

    @property
    def input_sample_rate(self) -> int:
        return self.sample_rate

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
        if self._resampler is not None:
            tail = self._resampler.resample_chunk(np.zeros(0, np.float32), last=True)
            if tail.size:
                self._append(tail)
        n = self.received
        mel_len = self.model.frontend.valid_frames(n, self.edge)
        total = int(self.model.encoder.output_lengths(mel_len)) if n else 0
        # At least one mel frame: under 160 samples NeMo still makes a (masked) encoder frame.
        self._add_mel(max(min(mel_len, n // self.hop + 1), 1))
        # (NeMo's padded last mel frame is a zero the length mask makes anyway.)
        if total > self.frames:
            self._encode(total, mel_len)
        events = self._decode(budget=None, total=total)
        self._finished = True
        return close_events(events, total, self.language)

    # -- decoding ----------------------------------------------------------------------------------

    def _decode(self, budget: Optional[int], total: Optional[int] = None) -> List[TranscriptEvent]:
        """Rounds over the frames computed while ``budget`` (reads so far, at most) allows; at
        the end (``total``) every frame left, sized to take at most two reads beyond one per
        1280 samples fed."""
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
    checkpoint's RNNT head (:class:`~mlx_voicechat.runtime.rnnt_transcription.RNNTTranscription`,
    which has no language prompt)."""
    if getattr(model, "resolve_prompt", None) is not None:
        return model.session(language=language, prompt_id=prompt_id, edge=edge)
    if language not in (None, "auto") or prompt_id is not None:
        raise TranscriptionError(
            "a VoiceChat checkpoint transcribes with its RNNT head, which has no language prompt"
        )
    from .rnnt_transcription import RNNTTranscription

    return RNNTTranscription(model)

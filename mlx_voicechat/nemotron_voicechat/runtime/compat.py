"""mlx-audio 0.6.2's NemotronVoiceChat API, over ours (``mlx_audio.sts.load_model`` returns our
model once this package is installed).

``model.create_session()`` is a :class:`VoiceChatSession` (``generate``: our offline generation
with mlx-audio's defaults); its ``create_streaming_session`` and ``model.create_duplex_session``
give a :class:`VoiceChatStreamingSession`, a view of one of our streaming sessions
(``.session``) that turns each frame's event into mlx-audio's events. Where we differ on
purpose (resampling, int16 scaling, the default prompt, the codec's tail kept in ``tail``, the
session's own randomness): docs/compat.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import mlx.core as mx
import numpy as np

from ...errors import GenerationError, SessionError
from ...listen.textstream import dropped_ids
from .events import FrameEvent
from .generate import GenerationResult

#: The ``kind`` values of :class:`VoiceChatEvent`, as in mlx-audio.
EVENT_KINDS = (
    "assistant_text_delta",
    "function_delta",
    "user_transcript_delta",
    "audio",
    "done",
    "cancelled",
)

#: mlx-audio's name for the offline result: ours answers to its field names too
#: (``text_tokens``, ``audio_tokens``, ``function_tokens``, ``audio_codes``).
VoiceChatOutput = GenerationResult


class VoiceChatContextLimitError(SessionError, RuntimeError):
    """Audio pushed after the session reached ``max_streaming_seconds``."""


class VoiceChatClosedError(SessionError, RuntimeError):
    """Audio pushed after ``flush()`` or ``cancel()``."""


@dataclass
class VoiceChatEvent:
    """One of mlx-audio's streaming events (same fields, same types)."""

    kind: str
    frame_index: Optional[int] = None
    token_id: Optional[int] = None
    delta: Optional[str] = None
    text: Optional[str] = None
    samples: Optional[mx.array] = None  # float32 at sample_rate
    sample_rate: Optional[int] = None
    audio_codes: Optional[mx.array] = None  # [Q] int32, after control-code replacement


def _flag(name: str, value: Any, error=SessionError) -> bool:
    if not isinstance(value, bool):
        raise error(f"{name} must be True or False, got {value!r}")
    return value


class VoiceChatSession:
    """What mlx-audio's ``model.create_session()`` returns: offline ``generate`` and
    ``create_streaming_session``."""

    def __init__(self, model):
        self.model = model
        self.tokenizer = model.tokenizer

    def generate(self, audio, *, extra_decoding_seconds: float = 0.0, **options):
        """``Model.generate`` with mlx-audio's session default of no trailing silence; its other
        keywords (``system_prompt``, ``max_frames``, ``seed``, ``use_language_cache``: that one
        changes nothing, our LLM always keeps its cache) pass on. A :class:`GenerationResult`."""
        return self.model.generate(audio, extra_decoding_seconds=extra_decoding_seconds, **options)

    def create_streaming_session(self, **options) -> "VoiceChatStreamingSession":
        """A :class:`VoiceChatStreamingSession` with ``options`` (its keyword arguments)."""
        return VoiceChatStreamingSession(self, **options)


class VoiceChatStreamingSession:
    """mlx-audio's streaming session over our :class:`Session` (``self.session``)."""

    def __init__(
        self,
        parent: VoiceChatSession,
        *,
        system_prompt: Optional[str] = None,
        seed: int = 0,
        max_streaming_seconds: Optional[float] = None,
        use_language_cache: bool = True,
        use_perception_cache: bool = True,
        **options,
    ):
        # Both caches are always on in ours (the results are the same either way in theirs).
        _flag("use_language_cache", use_language_cache)
        _flag("use_perception_cache", use_perception_cache)
        unknown = sorted(set(options) - {"noise", "prompt", "tools"})
        if unknown:
            raise SessionError(
                f"create_streaming_session() got an option it does not know: {unknown[0]}; it "
                "takes system_prompt, seed, max_streaming_seconds, use_language_cache, "
                "use_perception_cache, noise, prompt and tools"
            )
        self.parent = parent
        self.model = parent.model
        self.tokenizer = parent.tokenizer
        self.config = self.model.config
        self.session = self.model.session(
            system_prompt, seed=seed, max_seconds=max_streaming_seconds, **options
        )
        s = self.session
        self.input_sample_rate = s.input_sample_rate
        self.output_sample_rate = s.output_sample_rate
        self.frame_samples = s.input_samples_per_frame
        self.max_frames = None if max_streaming_seconds is None else s.max_frames
        self._special = dropped_ids(self.config)
        self._text = self._function = self._transcript = ""
        self._tail = np.zeros(0, np.float32)
        self._closed: Optional[str] = None  # "flush", "cancel" or "max_streaming_seconds"

    @property
    def closed(self) -> bool:
        return self._closed is not None

    @property
    def tail(self) -> mx.array:
        """The codec's last samples (float32 at ``output_sample_rate``), which no ``audio``
        event carries: empty until ``flush`` (or the ``max_streaming_seconds`` end) makes
        them, 6 samples after it. The audio events joined, then ``tail``, are the session's
        whole waveform; mlx-audio's own session drops these samples."""
        return mx.array(self._tail)

    @property
    def frame_index(self) -> int:
        """Frames emitted so far (the index of the next one)."""
        return self.session.frames

    def _convert(self, frames: List[FrameEvent]) -> List[VoiceChatEvent]:
        out: List[VoiceChatEvent] = []
        rate = self.output_sample_rate
        for e in frames:
            if e.transcript:
                self._transcript += e.transcript
                out.append(VoiceChatEvent(
                    "user_transcript_delta", e.index, delta=e.transcript, text=self._transcript
                ))
            # A remainder event repeats the last frame's ids: only what it adds is an event.
            if e.text_id not in self._special and (e.text or not e.remainder):
                self._text += e.text
                out.append(VoiceChatEvent(
                    "assistant_text_delta", e.index, e.text_id, e.text, self._text
                ))
            if e.function_id not in self._special and (e.function_text or not e.remainder):
                self._function += e.function_text
                out.append(VoiceChatEvent(
                    "function_delta", e.index, e.function_id, e.function_text, self._function
                ))
            # mlx-audio's contract: one frame of samples per audio event, one event per frame
            # (a remainder is no new frame); what the codec adds at the end goes to `tail`.
            spf = self.session.samples_per_frame
            extra = e.audio if e.remainder else e.audio[spf:]
            if extra.size:
                self._tail = np.concatenate([self._tail, extra])
            if not e.remainder:
                out.append(VoiceChatEvent(
                    "audio", e.index, samples=mx.array(e.audio[:spf]), sample_rate=rate,
                    audio_codes=mx.array(e.codes),
                ))
            if e.end is not None:  # the session reached max_streaming_seconds
                self._closed = "max_streaming_seconds"
                self.session.close()
                out.append(VoiceChatEvent("done", self.frame_index))
        return out

    def _check_open(self) -> None:
        if self._closed == "max_streaming_seconds":
            raise VoiceChatContextLimitError(
                f"the stream reached its max_streaming_seconds ({self.max_frames} frames); "
                "open a new session"
            )
        if self._closed is not None:
            raise VoiceChatClosedError(f"the streaming session is closed (by {self._closed}())")

    def push_audio(self, samples, *, sample_rate: Optional[int] = None) -> List[VoiceChatEvent]:
        """Mono PCM (float, or int scaled to [-1, 1)) at ``sample_rate`` (default 16 kHz; other
        rates are resampled): the events of every frame that became final with it."""
        self._check_open()
        return self._convert(self.session.feed(samples, sample_rate=sample_rate))

    def flush(
        self, *, pad_partial: bool = True, extra_decoding_seconds: float = 0.0
    ) -> List[VoiceChatEvent]:
        """End of input: the frames the end makes final (the partial frame is padded with
        silence, as offline), optionally ``extra_decoding_seconds`` of silence, then ``done``;
        the session is closed."""
        if self._closed is not None:
            return []
        if not _flag("pad_partial", pad_partial):
            raise SessionError(
                "pad_partial=False is not supported: the samples pushed are already part of "
                "the frames (as in offline generate); flush() pads the partial frame"
            )
        out = self._convert(self.session.finish(extra_decoding_seconds))
        if self._closed is None:
            self._closed = "flush"
            self.session.close()
            out.append(VoiceChatEvent("done", self.frame_index))
        return out

    def cancel(self) -> List[VoiceChatEvent]:
        """Stop and close the session (mlx-audio's meaning). For a barge-in that keeps the
        conversation going, call ``self.session.cancel()`` instead."""
        if self._closed is not None:
            return []
        self._closed = "cancel"
        self.session.close()
        return [VoiceChatEvent("cancelled", self.frame_index)]


def check_generate_compat(verbose, use_language_cache) -> None:
    """``Model.generate``'s mlx-audio flags: both must be booleans."""
    _flag("verbose", verbose, GenerationError)
    _flag("use_language_cache", use_language_cache, GenerationError)

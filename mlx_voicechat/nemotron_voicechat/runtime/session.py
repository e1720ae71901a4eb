"""The streaming session: talk to the model as audio arrives, one 80 ms frame at a time.

``Session.feed`` turns whatever audio has arrived into the frames that are now final and runs
the one frame step (``nemotron_voicechat.runtime.step``) on each, returning one :class:`FrameEvent`
per frame: the ids, the deltas of the assistant's text, the function channel and the user's words,
the turn marks and 1764 samples of speech. For any chunking of the input the events equal
:func:`generate.generate` on the same samples (ids, codes and transcript identical; audio
equal after the codec's fixed 6-sample delay).

A session is the one conversation of a batch of its own (``nemotron_voicechat.runtime.batch``): a
:class:`~.handle.SessionHandle` whose ``feed`` steps that batch, so the code that steps many
conversations together steps this one.

Latency: frame ``k`` is computed by the ``feed`` that completes sample ``1280 k + 198`` (see
``audioin``); its RNNT tokens come out with it (the frame's greedy symbols run on the device,
up to ``max_symbols``), and its audio lags the offline waveform by the codec's 6 samples.

Host reads: one per frame. The TTS reads the frame's text id on the device, so a frame's
listening, LLM, speech and codec are queued as one graph, and its read carries the two ids,
the RNNT's tokens, its codes and its audio. When a ``feed`` completes several frames, each
frame is queued before the previous one is read; a barge-in is therefore a device flag carried
from frame to frame, so that frames queued before the host has read the one that ends it
follow it exactly.
"""

from __future__ import annotations

from typing import List, Optional

from ...errors import SessionError  # noqa: F401  (the public name: session.SessionError)
from .batch import SessionBatch
from .events import FrameEvent
from .handle import SessionHandle


class Session(SessionHandle):
    """One conversation: see the module docstring. ``options``: those of
    :meth:`SessionBatch.open <mlx_voicechat.nemotron_voicechat.runtime.batch.SessionBatch.open>`
    (``seed``, ``noise``, ``prompt``, ``max_seconds``, ``tools``). Use it from one thread at a time
    (any thread); two sessions of one model may run in two threads."""

    def __init__(self, model, system_prompt: Optional[str] = None, **options):
        self.model = model
        self.config = model.config
        super().__init__(SessionBatch(model, max_sessions=1), system_prompt, **options)

    def _events(self) -> List[FrameEvent]:
        return self.batch.step().get(self, [])

    def feed(self, samples, sample_rate: Optional[int] = None) -> List[FrameEvent]:
        """Add mono audio (int or float PCM, at 16 kHz or ``sample_rate``); returns the events of
        every frame that became final with it."""
        self.push(samples, sample_rate)
        return self._events()

    def silence(self, frames: int) -> List[FrameEvent]:
        """Advance the clock by ``frames`` 80 ms frames of silent input."""
        super().silence(frames)
        return self._events()

    def finish(self, extra_decoding_seconds: float = 3.0) -> List[FrameEvent]:
        """End of the user's input: ``extra_decoding_seconds`` of trailing silence so the reply
        can finish, the frames that the end of input makes final, and the codec's tail."""
        super().finish(extra_decoding_seconds)
        return self._events()

"""The streaming session: talk to the model as audio arrives, one 80 ms frame at a time.

:meth:`Session.feed` runs the frame step on every frame its audio makes final and returns one
:class:`FrameEvent` per frame. For any chunking of the input the events equal
:func:`generate.generate` on the same samples (ids, codes and transcript identical; audio equal
after the codec's fixed delay). A session is the one conversation of a
:class:`~.batch.SessionBatch` of its own, so one conversation runs the code of many. One host
read per frame; a barge-in is a device flag, so frames queued before it is read follow it.
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

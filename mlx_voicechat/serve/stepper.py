"""The server's conversations as one batch on the worker thread.

Each conversation's audio is pushed into its session (a handle of one
:class:`~mlx_voicechat.runtime.batch.SessionBatch`) by a job of its own, and the first push
schedules a step; a step runs every frame that is in, the conversations that have one in one
batched forward per frame. Pushes that queue up while a step runs (every live conversation
sends 80 ms of audio, or the clock's silence, about every 80 ms) are all run by the next step:
a frame clock that ticks as fast as the model goes, so N conversations cost one batched frame,
not N frames one after the other.
"""

from __future__ import annotations

import asyncio
import time
from typing import List, Tuple


def _settle(future, result=None, error=None) -> None:
    if not future.done():  # a conversation that went away no longer waits
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


class Stepper:
    """Sessions of ``model`` in one batch of ``max_sessions``, all MLX work on ``worker``."""

    def __init__(self, model, worker, max_sessions: int):
        self.model, self.worker, self.max_sessions = model, worker, max_sessions
        self._batch = None  # made with the first conversation, on the worker
        self._waiting: List[tuple] = []  # (handle, future, loop) pushed since the last step
        self._scheduled = False
        self.on_step = None  # on_step(frames of each conversation, seconds) after each step

    @property
    def batch(self):
        if self._batch is None:
            self._batch = self.model.session_batch(max_sessions=self.max_sessions)
        return self._batch

    def open(self, *args, **kwargs):
        """On the worker: a new conversation of the batch (joins at its first frame)."""
        return self.batch.open(*args, **kwargs)

    async def feed(self, handle, samples) -> Tuple[list, float]:
        """Push ``samples`` into ``handle`` and wait for the step that runs their frames:
        returns the conversation's events and the step's seconds."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.worker.submit(self._push, handle, samples, future, loop)
        return await future

    def _push(self, handle, samples, future, loop) -> None:  # on the worker
        try:
            handle.push(samples)
        except BaseException as e:  # the conversation's own error (bad audio, ended)
            loop.call_soon_threadsafe(_settle, future, None, e)
            return
        self._waiting.append((handle, future, loop))
        if not self._scheduled:
            self._scheduled = True
            self.worker.submit(self._step)

    def _step(self) -> None:  # on the worker, behind every push queued before it
        self._scheduled = False
        waiting, self._waiting = self._waiting, []
        t = time.perf_counter()
        try:
            out = self.batch.step()
        except BaseException as e:
            for _, future, loop in waiting:
                loop.call_soon_threadsafe(_settle, future, None, e)
            return
        seconds = time.perf_counter() - t
        if self.on_step is not None:
            self.on_step([len(events) for events in out.values()], seconds)
        for handle, future, loop in waiting:
            loop.call_soon_threadsafe(_settle, future, (out.get(handle, []), seconds))

    def run_now(self, handle, samples) -> list:
        """On the worker: push and step at once (the warm-up)."""
        handle.push(samples)
        return self.batch.step().get(handle, [])

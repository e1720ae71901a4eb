"""The server's conversations as one batch on the worker thread.

Each push feeds a conversation's session (a handle of one
:class:`~mlx_voicechat.nemotron_voicechat.runtime.batch.SessionBatch`); a step runs the frames
that are in, all conversations in one batched forward per frame, and pushes that arrive
meanwhile wait for the next step, so N conversations cost one batched frame, not N. With
several live, a step runs one round, so none waits more than a round for another's backlog. A
joining prompt enters the LLM in slices about a round long (one per step), so a push waits at
most one slice more; with no other conversation live it enters in one call.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Dict, List, Optional, Tuple

import numpy as np

SLICE_ROWS = 64  # a joining prompt's first slice, rows (then adapted to a round's time)
SLICE_STEPS = 8  # the first slice of the seed's prompt chain's growth, speech steps (adapted)
SLICE_ROWS_MIN, SLICE_ROWS_MAX = 8, 4096  # bounds of an adapted slice, rows or steps
ALL = 1 << 30


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
        self._waiting: List[tuple] = []  # (handle, future, loop) whose frames are not all run
        self._held: Dict[object, Tuple[list, float]] = {}  # their events and seconds so far
        self._scheduled = False
        self.slice_rows = SLICE_ROWS
        self.slice_steps = SLICE_STEPS
        self.slices: deque = deque(maxlen=256)  # the last slices run: ("rows" / "steps", n)
        self.round_seconds: Optional[float] = None  # a round's time, smoothed
        self.on_step = None  # on_step(frames of each conversation, seconds) after each step

    @property
    def batch(self):
        if self._batch is None:
            self._batch = self.model.session_batch(
                max_sessions=self.max_sessions, join_rows=self.slice_rows
            )
        return self._batch

    def open(self, *args, **kwargs):
        """On the worker: a new conversation of the batch (joins at its first frame; a long
        prompt starts entering the LLM in slices right away)."""
        handle = self.batch.open(*args, **kwargs)
        self._schedule()
        return handle

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
        self._schedule(always=True)

    def _step(self) -> None:  # on the worker, behind every push queued before it
        self._scheduled = False
        waiting, self._waiting = self._waiting, []
        batch = self.batch
        t = time.perf_counter()
        try:
            # One round while others are live (a backlog runs a round per step, behind the
            # others' pushes); all that are in when one conversation is alone.
            out = batch.step(max_rounds=1 if len(batch) > 1 else None)
        except BaseException as e:
            self._reject(waiting, e)
            return
        seconds = time.perf_counter() - t
        if batch.last_rounds:  # a round's time, smoothed
            r, s = self.round_seconds, seconds / batch.last_rounds
            self.round_seconds = s if r is None else 0.8 * r + 0.2 * s
        if self.on_step is not None:
            self.on_step([len(events) for events in out.values()], seconds)
        for handle, future, loop in waiting:
            events, secs = self._held.pop(handle, ([], 0.0))
            events, secs = events + out.pop(handle, []), secs + seconds
            if not future.done() and not handle.closed and (handle.ready or handle.prefilling):
                self._held[handle] = (events, secs)  # its push has frames left to run
                self._waiting.append((handle, future, loop))
            else:
                loop.call_soon_threadsafe(_settle, future, (events, secs))
        if batch.prefilling is not None:  # after the round's events are on their way
            self._prefill_slice()
        self._schedule()

    def _schedule(self, always: bool = False) -> None:
        """Queue a step (one at a time) while a frame is ready or a prompt waits for slices
        (``always``: after a push); a push that comes in meanwhile is run by that step."""
        if not self._scheduled and (always or self.batch.pending):
            self._scheduled = True
            self.worker.submit(self._step)

    def _reject(self, waiting: List[tuple], error: BaseException) -> None:
        """The pushes ``waiting`` hear of ``error``; their held events are dropped."""
        for handle, future, loop in waiting:
            self._held.pop(handle, None)
            loop.call_soon_threadsafe(_settle, future, None, error)

    # -- a joining prompt in slices --

    def _prefill_slice(self) -> None:
        """One slice of the joining prompt, about a round's time when others are live (the
        whole of it when none is): speech steps of the seed's prompt chain while it is shorter
        than the prompt, then the prompt's LLM rows."""
        batch = self.batch
        joining = batch.prefilling
        alone = not any(h.joined for h in batch.sessions)
        opening = joining.opening
        if opening:
            units = ALL if alone else self.slice_steps
        else:
            units = joining.prefill_rows if alone else self.slice_rows
        t = time.perf_counter()
        try:
            batch.prefill(units, steps=units)
        except BaseException as e:  # the joining conversation's pushes hear of it
            self._fail(joining, e)
            return
        seconds = time.perf_counter() - t
        self.slices.append(("steps" if opening else "rows", units))
        if alone or self.round_seconds is None or seconds <= 0:
            return
        fit = max(SLICE_ROWS_MIN, min(SLICE_ROWS_MAX, int(units * self.round_seconds / seconds)))
        if opening:
            self.slice_steps = fit
        else:
            self.slice_rows = batch.join_rows = fit

    def _fail(self, handle, error) -> None:
        self._reject([w for w in self._waiting if w[0] is handle], error)
        self._waiting = [w for w in self._waiting if w[0] is not handle]
        handle.close()

    # -- start-up --

    def warm_up(self, open_session, samples_per_frame: int, frames: int = 2) -> None:
        """On the worker: trace a round at every batch size the server can hold (1 to
        ``max_sessions``), so no live conversation waits for a compile when another joins; the
        sessions are opened with ``open_session()`` and closed again."""
        sessions = []
        try:
            for _ in range(self.max_sessions):
                sessions.append(open_session())
                for s in sessions:
                    s.push(np.zeros(frames * samples_per_frame, dtype=np.float32))
                while self.batch.prefilling is not None:
                    self.batch.prefill(ALL, steps=ALL)
                self.batch.step()
        finally:
            for s in sessions:
                s.close()

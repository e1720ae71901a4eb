"""A WebSocket connection on the asyncio side, whatever its protocol: the driver's inbox, a bounded
send queue and its writer, a reader that waits while the client has many events still to read,
and the two ways a connection ends (``stop``: now; ``fail``: an error event, then the close).
"""

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from typing import List, Optional, Tuple

import numpy as np

from ..errors import VoiceChatError
from .wire import MODEL_INPUT_RATE, Append

CLOSE_POLICY = 1008
CLOSE_TRY_AGAIN = 1013
HANDED_OVER = "handed_over"  # ended_by of a run whose connection goes on in another kind
STOP_REASONS = {CLOSE_POLICY: "slow_client", 1011: "internal_error"}  # stop()'s close reasons
_CLOSE = object()  # in the send queue: close the connection after the events before it
log = logging.getLogger("mlx_voicechat.serve")


class Channel:
    """One WebSocket's queues and tasks around ``protocol`` (subclasses add the driver)."""

    kind = "connection"  # what the log calls it when one of its tasks fails

    def __init__(self, server, websocket, protocol):
        self.server = server
        self.ws = websocket
        self.protocol = protocol
        client = getattr(websocket, "client", None)
        if client:
            protocol.peer = f"{client[0]}:{client[1]}"
        self.inbox: deque = deque()  # commands for the driver
        self.wake = asyncio.Event()
        self.outbox: asyncio.Queue = asyncio.Queue(maxsize=server.send_queue_size)
        # queued server events past which the reader waits for the client to read them
        self.high_water = max(1, server.send_queue_size // 2)
        self.room = asyncio.Event()  # set while the send queue has room for a client's replies
        self.room.set()
        self.stopped = asyncio.Event()
        self.close_code = 1000
        self.close_reason = ""
        self.closing: Optional[tuple] = None  # (close code, reason) once fail() was called
        self.ended_by: Optional[str] = None  # why it ended (the metrics' close reason)
        self.t0: Optional[float] = None  # when the first audio arrived (set by the subclass)
        self.first_audio_sent = False
        self.session = None
        self.position = 0  # 16 kHz samples queued for the session so far
        self.consumed = 0  # 16 kHz samples fed to the session

    # -- plumbing --

    def send(self, events: List[dict]) -> None:
        for event in events:
            try:
                self.outbox.put_nowait(event)
            except asyncio.QueueFull:
                self.stop(CLOSE_POLICY, "the client does not read its events")
                return

    def stop(self, code: int, reason: str) -> None:
        """End the connection now (the tasks are cancelled, the slot is freed)."""
        if not self.stopped.is_set():
            self.close_code, self.close_reason = code, reason
            self.ended_by = self.ended_by or STOP_REASONS.get(code, f"close_{code}")
            self.stopped.set()

    def fail(self, code: str, message: str, close: int, param: Optional[str] = None) -> None:
        """An error event, then the connection closes with ``close`` once the events queued
        before it are sent; the session does no more work."""
        if self.closing is not None:
            return
        self.closing = (close, message[:120])
        self.ended_by = self.ended_by or code
        self.drop_work()
        self.wake.set()
        try:
            self.outbox.put_nowait(self.protocol.error(code, message, param, type_="server_error"))
            self.outbox.put_nowait(_CLOSE)
        except asyncio.QueueFull:
            self.stop(*self.closing)

    @property
    def lag_seconds(self) -> float:
        return (self.position - self.consumed) / MODEL_INPUT_RATE

    def lag_since(self) -> Tuple[float, int, Optional[float]]:
        """(wall clock, position) the lag's sides are judged from, and the seconds of the
        client's audio since (None: all the audio since is the client's)."""
        raise NotImplementedError

    def check_lag(self) -> bool:
        """Past ``max_lag_seconds`` of audio waiting for the model: ``lag_exceeded``, naming
        the side that is further behind (True): over ``elapsed`` seconds the connection took
        in ``audio`` seconds (``client`` of them the client's) and fed the model ``fed``."""
        lag, bound = self.lag_seconds, self.server.max_lag_seconds
        if lag <= bound:
            return False
        t0, start, client = self.lag_since()
        audio = (self.position - start) / MODEL_INPUT_RATE
        fed = (self.consumed - start) / MODEL_INPUT_RATE
        client = audio if client is None else client
        elapsed = time.monotonic() - t0
        why = "the machine is slower than real time"
        if audio - elapsed > elapsed - fed:
            why = (
                f"the client sent audio faster than real time ({client:.1f} s of audio in "
                f"{elapsed:.1f} s); send it at real time"
            )
        message = f"the model is {lag:.1f} s behind the audio (the bound is {bound:g} s): {why}"
        self.fail("lag_exceeded", message, CLOSE_TRY_AGAIN)
        return True

    def drop_work(self) -> None:
        """On ``fail``: forget the work queued for the session."""
        self.inbox.clear()

    async def _job(self, job, what: str = "session") -> bool:
        """Await one job of the driver; False when it failed and ended the connection: the
        session's own error as ``session_error`` (1008), anything else as a bug,
        ``server_error`` (1011, its traceback in the log)."""
        try:
            await job
        except VoiceChatError as e:
            self.fail("session_error", str(e), CLOSE_POLICY)
            return False
        except Exception as e:
            log.exception("%s job failed", what)
            self.fail("server_error", f"{type(e).__name__}: {e}".splitlines()[0], 1011)
            return False
        return True

    def take(self, raw) -> bool:
        """One client message through the protocol; False ends the reader."""
        events, commands = self.protocol.receive(raw)
        self.send(events)
        for c in commands:
            self.command(c)
        return True

    def command(self, c) -> None:
        """One of the protocol's commands into the driver's inbox."""
        raise NotImplementedError

    def drop_audio(self) -> int:
        """Drop the client audio queued for the driver (``Clear``); the samples dropped."""
        dropped = sum(x.samples.size for x in self.inbox if isinstance(x, Append))
        self.inbox = deque(x for x in self.inbox if not isinstance(x, Append))
        return dropped

    def _take_audio(self, first: Append) -> np.ndarray:
        """Consecutive queued appends merged into one job of at most ``chunk_samples``."""
        limit = self.server.chunk_samples
        parts, n, silence = [first.samples], first.samples.size, first.silence
        while self.inbox and isinstance(self.inbox[0], Append) and n < limit:
            c = self.inbox.popleft()
            parts.append(c.samples)
            n += c.samples.size
            silence = silence and c.silence
        samples = np.concatenate(parts) if len(parts) > 1 else parts[0]
        if samples.size > limit:
            self.inbox.appendleft(Append(samples[limit:], silence=silence))
            samples = samples[:limit]
        return samples

    def free(self) -> None:
        """Give the slot back (the tasks have ended)."""
        self.server.active -= 1
        self.server.sessions_served += 1

    # -- the tasks --

    def tasks(self) -> list:
        """The coroutines the connection runs until one ends or it is stopped."""
        return [self._reader(), self._driver(), self._writer()]

    def has_work(self) -> bool:
        return bool(self.inbox)

    async def step(self, worker) -> None:
        """One job of the driver."""
        raise NotImplementedError

    async def _driver(self) -> None:
        while True:
            if not self.has_work():
                self.wake.clear()
                await self.wake.wait()
                continue
            if self.closing is not None:
                await self.stopped.wait()  # the writer sends the error, then closes
            await self.step(self.server.worker)

    async def run(self) -> None:
        self.server.channels.add(self)
        tasks = [asyncio.create_task(c) for c in self.tasks()]
        stop = asyncio.create_task(self.stopped.wait())
        try:
            done, _ = await asyncio.wait(tasks + [stop], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not stop and not t.cancelled() and t.exception() is not None:
                    log.error("%s failed", self.kind, exc_info=t.exception())
                    self.stop(1011, "internal server error")
        finally:
            for t in tasks + [stop]:
                t.cancel()
            await asyncio.gather(*tasks, stop, return_exceptions=True)
            self.free()
            self.server.channels.discard(self)
            if self.ended_by != HANDED_OVER:
                self.server.metrics.closed(self.ended_by or "client_closed")
            if self.stopped.is_set():
                # A client that does not read cannot take a close frame either: bounded wait.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.ws.close(self.close_code, self.close_reason), 1.0)

    async def _reader(self) -> None:
        while True:
            # A burst of events that each get a reply (response.create, session.update) waits
            # here for the client to read the replies: only a client that does not read fills
            # the send queue.
            while self.outbox.qsize() >= self.high_water:
                self.room.clear()
                await self.room.wait()
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            raw = message.get("text")
            if raw is None:
                raw = message.get("bytes") or b""
            if not self.take(raw):
                return

    async def _writer(self) -> None:
        while True:
            event = await self.outbox.get()
            if self.outbox.qsize() < self.high_water:
                self.room.set()
            if event is _CLOSE:
                self.stop(*self.closing)
                return
            self._sent(event)
            try:
                try:
                    await self.ws.send_text(json.dumps(event, ensure_ascii=False))
                except UnicodeEncodeError:  # a lone surrogate in a string: sent escaped
                    log.warning("an event held text that is not UTF-8: %.80r", event)
                    await self.ws.send_text(json.dumps(event))
            except Exception:  # the client has gone: the reader sees the disconnect too
                return

    def _sent(self, event: dict) -> None:
        """Count what the metrics count of the events sent: errors by code, tool calls, the
        first audio."""
        kind, metrics = event.get("type"), self.server.metrics
        if kind == "error":
            metrics.error_sent((event.get("error") or {}).get("code"))
        elif kind == "response.function_call_arguments.done":
            metrics.tool_call("called")
        elif kind == "response.output_audio.delta" and not self.first_audio_sent:
            self.first_audio_sent = True
            if self.t0 is not None:
                metrics.first_audio(time.monotonic() - self.t0)

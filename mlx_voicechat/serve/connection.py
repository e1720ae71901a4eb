"""One WebSocket connection: four asyncio tasks around the protocol and the worker.

A reader (client events through the protocol), a driver (the protocol's commands to the
worker, a few frames per job so that a cancel or a disconnect waits for at most one short job),
a writer (a bounded queue of server events; a client that stops reading fills it and is
dropped) and a clock (silence at real time when the client falls behind, and the lag bound).
:class:`Server` is what the connections share: the model, the worker, the slots, the settings.
"""

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections import deque
from typing import Callable, Iterable, List, Optional
from urllib.parse import urlsplit

import numpy as np

from ..errors import VoiceChatError
from ..runtime.tools import ToolError
from .protocol import MODEL_INPUT_RATE, Append, Cancel, Clear, Commit, Realtime, Start, ToolResult
from .worker import Worker

SAMPLES_PER_FRAME = 1280  # 80 ms at 16 kHz, the session's input frame
FRAME_SECONDS = SAMPLES_PER_FRAME / MODEL_INPUT_RATE
KEY_PROTOCOL = "openai-insecure-api-key."
CLOSE_POLICY = 1008
CLOSE_TRY_AGAIN = 1013
MAX_QUEUED_COMMANDS = 4096  # audio is bounded by max_lag_seconds, the number of events by this
_CLOSE = object()  # in the send queue: close the connection after the events before it
log = logging.getLogger("mlx_voicechat.serve")


class Server:
    """What the connections share: the model, the worker, the session slots, the settings."""

    def __init__(
        self,
        model,
        *,
        model_id: str,
        api_key: Optional[str],
        max_sessions: int,
        allow_origins: Iterable[str],
        silence_feed: bool,
        max_lag_seconds: float,
        silence_grace_seconds: float,
        commit_seconds: float,
        max_reply_seconds: float,
        chunk_frames: int,
        send_queue_size: int,
        stats_every_frames: int,
        seed: int,
        session_options: Optional[dict],
        worker: Optional[Worker] = None,
    ):
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        self.model = model
        self.model_id = model_id
        self.api_key = api_key or None
        self.max_sessions = int(max_sessions)
        self.allow_origins = {o.rstrip("/") for o in allow_origins}
        self.silence_feed = silence_feed
        self.max_lag_seconds = float(max_lag_seconds)
        self.silence_grace_seconds = float(silence_grace_seconds)
        self.commit_frames = max(1, round(commit_seconds / FRAME_SECONDS))
        self.max_reply_frames = max(1, round(max_reply_seconds / FRAME_SECONDS))
        self.chunk_samples = max(1, int(chunk_frames)) * SAMPLES_PER_FRAME
        self.send_queue_size = int(send_queue_size)
        self.stats_every_frames = int(stats_every_frames)
        self.seed = int(seed)
        self.session_options = dict(session_options or {})
        self.worker = Worker.shared() if worker is None else worker
        self.active = 0
        self.ready = False
        self.sessions_served = 0
        self.vendor: dict = {}  # the x-voicechat fields of session.created

    def open_session(self, instructions: Optional[str], tools=()):
        """On the worker: a fresh streaming session with the client's instructions and tools."""
        options = dict(self.session_options)
        if tools:
            options["tools"] = list(tools)
        return self.model.session(instructions, seed=self.seed, **options)

    def warm_up(self, frames: int = 4) -> None:
        """On the worker: open a session and run a few frames, so the first client does not pay
        for the first-use costs (compiled steps, the TTS warm-up codes, the speech stream)."""
        session = self.open_session(None)
        try:
            session.feed(np.zeros(frames * SAMPLES_PER_FRAME, dtype=np.float32))
        finally:
            session.close()

    # -- admission --

    def authorized(self, headers, subprotocols: List[str]) -> bool:
        if self.api_key is None:
            return True
        key = self.api_key.encode()
        auth = headers.get("authorization", "")
        if auth[:7].lower() == "bearer " and hmac.compare_digest(auth[7:].strip().encode(), key):
            return True
        return any(
            p.startswith(KEY_PROTOCOL) and hmac.compare_digest(p[len(KEY_PROTOCOL) :].encode(), key)
            for p in subprotocols
        )

    def origin_allowed(self, headers) -> bool:
        origin = headers.get("origin")
        if origin is None:
            return True  # not a browser
        origin = origin.rstrip("/")
        if origin in self.allow_origins or "*" in self.allow_origins:
            return True
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and parts.netloc == headers.get("host")


class Conversation:
    """One WebSocket connection and its session."""

    def __init__(self, server: Server, websocket):
        self.server = server
        self.ws = websocket
        self.protocol = Realtime(server.model_id)
        self.inbox: deque = deque()
        self.wake = asyncio.Event()
        self.outbox: asyncio.Queue = asyncio.Queue(maxsize=server.send_queue_size)
        self.stopped = asyncio.Event()
        self.close_code = 1000
        self.close_reason = ""
        self.session = None
        self.cancel_pending = False
        self.t0: Optional[float] = None  # when the first audio arrived
        self.position = 0  # 16 kHz samples queued so far (client audio and clock silence)
        self.consumed = 0  # 16 kHz samples fed to the session
        self.drain: Optional[dict] = None
        self._stats = {"frames": 0, "seconds": 0.0}
        self.started = asyncio.Event()
        self.closing: Optional[tuple] = None  # (close code, reason) once fail() was called

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
            self.stopped.set()

    def fail(self, code: str, message: str, close: int) -> None:
        """An error event, then the connection closes with ``close`` once the events queued
        before it are sent; the session does no more work."""
        if self.closing is not None:
            return
        self.closing = (close, message[:120])
        self.inbox.clear()
        self.drain = None
        self.wake.set()
        try:
            self.outbox.put_nowait(self.protocol.error(code, message, type_="server_error"))
            self.outbox.put_nowait(_CLOSE)
        except asyncio.QueueFull:
            self.stop(*self.closing)

    @property
    def lag_seconds(self) -> float:
        return (self.position - self.consumed) / MODEL_INPUT_RATE

    def check_lag(self) -> None:
        if self.lag_seconds > self.server.max_lag_seconds:
            self.fail(
                "lag_exceeded",
                f"the model is {self.lag_seconds:.1f} s behind the audio (the bound is "
                f"{self.server.max_lag_seconds:g} s): the machine is slower than real time",
                CLOSE_TRY_AGAIN,
            )

    def command(self, c) -> None:
        if isinstance(c, Start):
            self.t0 = time.monotonic()
            self.inbox.append(c)
            self.started.set()
        elif isinstance(c, Append):
            self.position += c.samples.size
            self.inbox.append(c)
            self.check_lag()
        elif isinstance(c, Clear):
            kept = [x for x in self.inbox if not isinstance(x, Append)]
            dropped = sum(x.samples.size for x in self.inbox if isinstance(x, Append))
            self.inbox = deque(kept)
            self.position -= dropped
        elif isinstance(c, Cancel):
            self.cancel_pending = True
        elif not (isinstance(c, Commit) and self.inbox and isinstance(self.inbox[-1], Commit)):
            self.inbox.append(c)  # (a commit right after a commit adds nothing)
        if len(self.inbox) > MAX_QUEUED_COMMANDS:
            self.fail(
                "too_many_events",
                f"more than {MAX_QUEUED_COMMANDS} events wait for the model; send fewer, larger "
                "appends",
                CLOSE_TRY_AGAIN,
            )
        self.wake.set()

    # -- the tasks --

    async def run(self) -> None:
        self.send(self.protocol.open(self.server.vendor))
        tasks = [
            asyncio.create_task(self._reader()),
            asyncio.create_task(self._driver()),
            asyncio.create_task(self._writer()),
        ]
        if self.server.silence_feed:
            tasks.append(asyncio.create_task(self._clock()))
        stop = asyncio.create_task(self.stopped.wait())
        try:
            done, _ = await asyncio.wait(tasks + [stop], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not stop and not t.cancelled() and t.exception() is not None:
                    log.error("connection failed", exc_info=t.exception())
                    self.stop(1011, "internal server error")
        finally:
            for t in tasks + [stop]:
                t.cancel()
            await asyncio.gather(*tasks, stop, return_exceptions=True)
            self.free()
            if self.stopped.is_set():
                # A client that does not read cannot take a close frame either: bounded wait.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.ws.close(self.close_code, self.close_reason), 1.0)

    def free(self) -> None:
        """Give the slot back now; the session is closed on the worker after its current job."""
        self.server.active -= 1
        self.server.sessions_served += 1

        def close():
            if self.session is not None:
                self.session.close()
                self.session = None

        self.server.worker.submit(close)

    async def _reader(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            raw = message.get("text")
            if raw is None:
                raw = message.get("bytes") or b""
            events, commands = self.protocol.receive(raw)
            self.send(events)
            for c in commands:
                self.command(c)

    async def _writer(self) -> None:
        while True:
            event = await self.outbox.get()
            if event is _CLOSE:
                self.stop(*self.closing)
                return
            try:
                await self.ws.send_text(json.dumps(event, ensure_ascii=False))
            except Exception:  # the client has gone: the reader sees the disconnect too
                return

    async def _clock(self) -> None:
        """Silence at real time while the client's audio is behind the wall clock."""
        await self.started.wait()
        grace = self.server.silence_grace_seconds
        while True:
            now = time.monotonic()
            due = int((now - self.t0 - grace) * MODEL_INPUT_RATE) - self.position
            frames = due // SAMPLES_PER_FRAME
            if frames > 0:
                self.command(Append(np.zeros(frames * SAMPLES_PER_FRAME, np.float32), silence=True))
            self.check_lag()
            wait = self.t0 + grace + (self.position + SAMPLES_PER_FRAME) / MODEL_INPUT_RATE - now
            await asyncio.sleep(min(max(wait, 0.005), 1.0))

    async def _driver(self) -> None:
        worker = self.server.worker
        while True:
            if not (self.inbox or self.cancel_pending or self.drain):
                self.wake.clear()
                await self.wake.wait()
                continue
            if self.closing is not None:
                await self.stopped.wait()  # the writer sends the error, then closes
            if self.cancel_pending:
                self.cancel_pending = False
                if self.session is not None:
                    await worker.run(self.session.cancel)
                continue
            if self.drain is not None and not self._client_audio_waiting():
                await self._drain_step()
                continue
            if self.drain is not None:
                self._end_drain()
            c = self.inbox.popleft()
            try:
                if isinstance(c, Start):
                    await worker.run(self._open, c.instructions, c.tools)
                elif isinstance(c, ToolResult):
                    await self._tool_result(c)
                elif isinstance(c, Append):
                    samples = self._take_audio(c)
                    await self._feed(lambda s=samples: self.session.feed(s), samples.size)
            except VoiceChatError as e:
                self.fail("session_error", str(e), CLOSE_POLICY)
                continue
            except Exception as e:
                log.exception("session job failed")
                self.fail("server_error", f"{type(e).__name__}: {e}".splitlines()[0], 1011)
                continue
            if isinstance(c, Commit):
                self.drain = {"fed": 0, "done": self.protocol.responses_done}

    def _open(self, instructions, tools=()) -> None:  # on the worker
        self.session = self.server.open_session(instructions, tools)

    async def _tool_result(self, c: ToolResult) -> None:
        """Queue a function_call_output in the session; a refusal is an error event."""
        try:
            frames = await self.server.worker.run(self.session.add_tool_result, c.call_id, c.output)
        except ToolError as e:
            self.send([self.protocol.error("invalid_value", str(e), "item.output")])
            return
        self.send([self.protocol.tool_injection(c.call_id, frames)])

    def _client_audio_waiting(self) -> bool:
        return any(isinstance(c, Append) and not c.silence for c in self.inbox)

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

    async def _feed(self, job: Callable, samples: int) -> None:
        def timed():
            t = time.perf_counter()
            events = job()
            return events, time.perf_counter() - t

        events, seconds = await self.server.worker.run(timed)
        self.consumed += samples
        self.send(self.protocol.frames(events))
        self._stats["frames"] += len(events)
        self._stats["seconds"] += seconds
        every = self.server.stats_every_frames
        if every and self._stats["frames"] >= every:
            frames, secs = self._stats["frames"], self._stats["seconds"]
            self.send(
                [
                    self.protocol.stats(
                        lag_seconds=round(self.lag_seconds, 3),
                        rtf=round(secs / (frames * FRAME_SECONDS), 3),
                        seconds_per_frame=round(secs / frames, 4),
                        tool_frames=self.session.tool_frames,
                    )
                ]
            )
            self._stats = {"frames": 0, "seconds": 0.0}
        ended = [e.end for e in events if getattr(e, "end", None)]
        if ended:
            self.fail(
                "session_ended",
                f"the session ended by itself ({ended[-1]}); open a new connection to go on",
                1000,
            )

    async def _drain_step(self) -> None:
        """One job of a commit's trailing silence, fed as fast as the model goes."""
        d, p = self.drain, self.protocol
        frames = max(1, self.server.chunk_samples // SAMPLES_PER_FRAME)
        n = frames * SAMPLES_PER_FRAME
        self.position += n
        await self._feed(lambda: self.session.silence(frames), n)
        d["fed"] += frames
        replied = p.responses_done > d["done"]
        if p.response is None and (replied or d["fed"] >= self.server.commit_frames):
            self._end_drain()
        elif d["fed"] >= self.server.max_reply_frames:
            self._end_drain()

    def _end_drain(self) -> None:
        self.drain = None
        self.send(self.protocol.commit_done())

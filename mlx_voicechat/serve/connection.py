"""One duplex WebSocket connection: a :class:`~.channel.Channel` (reader, writer) plus a driver
(the protocol's commands to the worker, a few frames per job so a cancel waits at most one short
job), a clock (silence at real time while the client is behind; the lag bound) and the idle
bound. :class:`~.server.Server` is what the connections share.
"""

import asyncio
import time
from typing import Optional

import numpy as np

from ..nemotron_voicechat.runtime.tools import ToolError
from .channel import CLOSE_POLICY, CLOSE_TRY_AGAIN, Channel, log
from .mcp_runner import McpRunner
from .protocol import Realtime
from .server import Server
from .speech import SpeechEvents
from .wire import (
    FRAME_SECONDS,
    MODEL_INPUT_RATE,
    SAMPLES_PER_FRAME,
    Append,
    Cancel,
    Clear,
    Commit,
    Start,
    ToolResult,
)

EXTENSIONS_PARAM = "x-voicechat"  # ?x-voicechat=1: the client wants the x-voicechat.* events
CLOSE_IDLE = 4408  # an application close code (RFC 6455 4000-4999), as HTTP's 408 timeout
MAX_QUEUED_COMMANDS = 4096  # audio is bounded by max_lag_seconds, the number of events by this


class Conversation(Channel):
    """One WebSocket connection and its session."""

    def __init__(self, server: Server, websocket):
        super().__init__(
            server,
            websocket,
            Realtime(
                server.model_id,
                max_instructions_chars=server.max_instructions_chars,
                extensions=wants_extensions(websocket),
                mcp=server.mcp,
            ),
        )
        self.mcp = McpRunner(self, self.protocol.mcp.policy)  # MCP calls: not on the worker
        self.base = 0  # samples fed before the session now open (a restart opens a new one)
        self.cancel_pending = False
        # Samples past the last frame that the audio so far completes: held here, not fed, so
        # that input_audio_buffer.clear can drop them (the session keeps no partial frame).
        self.held = np.zeros(0, np.float32)
        self.client_seconds = 0.0  # client audio queued so far (position counts clock silence)
        self.last_audio = time.monotonic()  # when the client last sent audio (or connected)
        self.drain: Optional[dict] = None
        self._stats = {"frames": 0, "seconds": 0.0}
        self.speech = SpeechEvents(self.protocol)  # speech_started / _stopped as audio arrives
        self.started = asyncio.Event()

    # -- plumbing --

    def drop_work(self) -> None:
        super().drop_work()
        self.drain = None

    def lag_since(self):
        """Counted from the session's start (the clock keeps the input up with the wall clock
        while the client is quiet)."""
        return (time.monotonic() if self.t0 is None else self.t0), 0, self.client_seconds

    def command(self, c) -> None:
        if isinstance(c, Start):
            if self.t0 is None:
                self.t0 = time.monotonic()
            self.inbox.append(c)
            self.started.set()
        elif isinstance(c, Append):
            self.send(self.speech.push(c.samples, self.position))
            self.position += c.samples.size
            if not c.silence:
                self.client_seconds += c.samples.size / MODEL_INPUT_RATE
                self.last_audio = time.monotonic()
            self.inbox.append(c)
            self.check_lag()
        elif isinstance(c, Clear):
            self.position -= self.drop_audio() + self.held.size
            self.held = self.held[:0]
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
        await super().run()

    def tasks(self) -> list:
        tasks = super().tasks()
        if self.server.silence_feed:
            tasks.append(self._clock())
        if self.server.idle_timeout:
            tasks.append(self._idle())
        return tasks

    def free(self) -> None:
        """Give the slot back now; the session is closed on the worker after its current job."""
        super().free()
        self.mcp.close()

        def close():
            if self.session is not None:
                self.session.close()
                self.session = None

        self.server.worker.submit(close)

    async def _idle(self) -> None:
        """No client audio for ``idle_timeout`` seconds (since it connected or last sent
        some) ends the connection: an error event, then close 4408."""
        timeout = self.server.idle_timeout
        while True:
            left = self.last_audio + timeout - time.monotonic()
            if left <= 0:
                self.fail(
                    "idle_timeout",
                    f"no audio arrived for {timeout:g} s (the server's --idle-timeout); "
                    "open a new connection to go on",
                    CLOSE_IDLE,
                )
                return
            await asyncio.sleep(left)

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

    def has_work(self) -> bool:
        return bool(self.inbox or self.cancel_pending or self.drain)

    async def step(self, worker) -> None:
        if self.cancel_pending:
            self.cancel_pending = False
            if self.session is not None:
                await worker.run(self.session.cancel)
            return
        if self.drain is not None and not self._client_audio_waiting():
            await self._job(self._drain_step())
            return
        if self.drain is not None:
            self._end_drain()
        c = self.inbox.popleft()
        if await self._job(self._execute(c, worker)) and isinstance(c, Commit):
            self.drain = {"fed": 0, "done": self.protocol.responses_done}

    async def _execute(self, c, worker) -> None:
        """One client command (a commit's trailing silence is the driver's drain)."""
        if isinstance(c, Start):
            if self.session is not None:
                await self._restart(c, worker)
            elif not await self._prompt_too_long(c):
                await worker.run(self._open, c.instructions, c.tools)
        elif isinstance(c, ToolResult):
            await self._tool_result(c)
        elif isinstance(c, Append):
            samples = self._frames_of(self._take_audio(c))
            if samples.size:
                await self._feed(samples)

    def _open(self, instructions, tools=()) -> None:  # on the worker
        self.session = self.server.open_session(instructions, tools)

    async def _restart(self, c: Start, worker) -> None:
        """Instructions or tools changed after the audio started: the model's prompt is fixed
        when its session opens, so a new session opens with the new prompt at this point of
        the audio (what the model heard before is not in it), and the old one closes."""
        if await self._prompt_too_long(c):
            return
        self.send(self.protocol.responses.restarted())
        old = self.session

        def reopen():  # on the worker
            old.close()
            self.session = None
            self._open(c.instructions, c.tools)

        await worker.run(reopen)
        self.base = self.consumed
        log.info(
            "%s: the session restarted with new instructions or tools", self.protocol.session_id
        )

    async def _prompt_too_long(self, c: Start) -> bool:
        """Count the prompt's tokens on a thread of its own, not the worker (a long prompt
        would hold up every session's frames there); past the bound, an error and close."""
        if getattr(self.server.model, "tokenizer", None) is None:
            return False  # model.session says what a prompt needs
        n = await asyncio.to_thread(self.server.prompt_tokens, c.instructions, c.tools)
        most = self.server.max_prompt_tokens
        if n <= most:
            return False
        self.fail(
            "invalid_value",
            f"the instructions (with the tools) are {n} tokens; this server takes at most "
            f"{most} (--max-prompt-tokens)",
            CLOSE_POLICY,
            param="session.instructions",
        )
        return True

    async def _tool_result(self, c: ToolResult) -> None:
        """Queue a function_call_output in the session; a refusal is an error event."""
        try:
            frames = await self.server.worker.run(self.session.add_tool_result, c.call_id, c.output)
        except ToolError as e:
            self.server.metrics.tool_call("refused")
            self.send([self.protocol.error("invalid_value", str(e), "item.output")])
            return
        self.server.metrics.tool_call("answered")
        self.send(self.protocol.responses.tool_injection(c.call_id, frames))

    def _client_audio_waiting(self) -> bool:
        return any(isinstance(c, Append) and not c.silence for c in self.inbox)

    def _frames_of(self, samples: np.ndarray) -> np.ndarray:
        """The held samples and ``samples`` up to the last frame they complete; the rest
        (less than a frame) is held for the next audio."""
        if self.held.size:
            samples = np.concatenate([self.held, samples])
        session = self.session
        first = session.samples_needed(0)
        per = session.samples_needed(1) - first

        def frames(n):  # frames final once n samples are in
            return 0 if n < first else (n - first) // per + 1

        fed = self.consumed - self.base  # samples the open session took
        done, target = frames(fed), frames(fed + samples.size)
        cut = session.samples_needed(target - 1) - fed if target > done else 0
        self.held = samples[cut:]
        return samples[:cut]

    async def _feed(self, samples: np.ndarray) -> None:
        """Push whole frames of audio into the session; the server's next batched step runs
        them (with every other conversation's frames that are in)."""
        events, seconds = await self.server.stepper.feed(self.session, samples)
        self.consumed += samples.size
        self.server.metrics.lag(self.lag_seconds)
        self.send(self.protocol.frames(events))
        self._stats["frames"] += len(events)
        self._stats["seconds"] += seconds
        every = self.server.stats_every_frames
        if every and self._stats["frames"] >= every:
            frames, secs = self._stats["frames"], self._stats["seconds"]
            self.send(
                self.protocol.stats(
                    lag_seconds=round(self.lag_seconds, 3),
                    rtf=round(secs / (frames * FRAME_SECONDS), 3),
                    seconds_per_frame=round(secs / frames, 4),
                    tool_frames=self.session.tool_frames,
                )
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
        samples = self._frames_of(np.zeros(n, np.float32))
        if samples.size:
            await self._feed(samples)
        d["fed"] += frames
        replied = p.responses_done > d["done"]
        quiet = p.response is None and (replied or d["fed"] >= self.server.commit_frames)
        if quiet or d["fed"] >= self.server.max_reply_frames:
            self._end_drain()

    def _end_drain(self) -> None:
        self.drain = None
        self.send(self.protocol.commit_done())


def wants_extensions(websocket) -> bool:
    """Whether the client asked for the ``x-voicechat.*`` events (``?x-voicechat=1`` on the
    URL; a ``session.update`` with ``"x-voicechat": {"events": true}`` asks later)."""
    try:
        value = websocket.query_params.get(EXTENSIONS_PARAM)
    except AttributeError:  # a stand-in socket without a URL
        return False
    return value is not None and value.lower() not in ("0", "false", "no", "off")

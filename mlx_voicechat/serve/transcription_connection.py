"""Transcription connections: the asyncio side of :mod:`.transcription`.

:func:`serve_connection` runs each WebSocket: on a recognizer every connection transcribes; on
a VoiceChat server a connection is duplex until a first ``session.update`` asks for
``"transcription"`` before any audio. A :class:`TranscriptionConversation` has no clock: a
transcript needs no silence fed at real time.
"""

from __future__ import annotations

import time
from typing import List, Optional

from .channel import HANDED_OVER, Channel
from .connection import Conversation
from .transcription import TranscriptionRealtime, is_transcription_update
from .wire import MODEL_INPUT_RATE, Append, Clear, Commit, Start


def is_recognizer(model) -> bool:
    return getattr(model, "resolve_prompt", None) is not None


def open_session(model, language: Optional[str]):
    """On the worker: a transcription session on either kind of checkpoint (a VoiceChat RNNT
    head has no language prompt, so a client's language hint is not used there)."""
    from ..nemotron_asr.session import open_transcription

    if not is_recognizer(model):
        language = None
    return open_transcription(model, language=language)


def warm_up(server) -> None:
    """On the worker, before the first client: a few frames through the session kind the
    server's model offers first."""
    if not is_recognizer(server.model):
        server.warm_up()
        return
    import numpy as np

    s = open_session(server.model, None)
    s.feed(np.zeros(2 * s.frame_samples * server.model.config.chunk_frames, np.float32))
    s.finish()


async def serve_connection(server, websocket) -> None:
    """Run one accepted WebSocket to its end (the caller took its slot)."""
    if is_recognizer(server.model):
        await TranscriptionConversation(server, websocket).run()
        return
    duplex = _Duplex(server, websocket)
    await duplex.run()
    if duplex.switch is not None:
        server.active += 1  # the duplex run gave the slot back
        server.sessions_served -= 1
        announced = duplex.outbox.empty()  # its session.created went out
        await TranscriptionConversation(server, websocket, [duplex.switch], announced).run()


class _Duplex(Conversation):
    """The duplex conversation, handing over to transcription at a first transcription
    ``session.update`` (before any audio)."""

    switch: Optional[str] = None

    def take(self, raw) -> bool:
        if not self.protocol.started and is_transcription_update(raw):
            self.switch = raw
            self.ended_by = HANDED_OVER  # (the same conversation goes on: not closed)
            return False
        return super().take(raw)


class TranscriptionConversation(Channel):
    """One transcription connection and its session."""

    kind = "transcription connection"

    def __init__(self, server, websocket, pending: List[str] = (), announced: bool = False):
        super().__init__(server, websocket, TranscriptionRealtime(server.model_id))
        self.pending, self.announced = list(pending), announced
        self.item_start = 0  # position where the current item began
        # (wall clock, position) when audio last arrived with none waiting or being fed: the
        # lag's sides are judged from there (no silence is fed, so a client may pause)
        self.backlog_since = (time.monotonic(), 0)

    # -- plumbing --

    def command(self, c) -> None:
        if isinstance(c, Append):
            if self.position == self.consumed:
                self.backlog_since = (time.monotonic(), self.position)
            self.position += c.samples.size
            if self.check_lag():
                return
        elif isinstance(c, Clear):
            self.position -= self.drop_audio()
        self.inbox.append(c)
        self.wake.set()

    handle = Channel.take  # (one client message, as the tests feed it)

    def lag_since(self):
        return (*self.backlog_since, None)

    # -- the tasks --

    async def run(self) -> None:
        if not self.announced:
            self.send(self.protocol.open())
        for raw in self.pending:
            self.handle(raw)
        await super().run()

    def free(self) -> None:
        super().free()
        self.session = None

    async def step(self, worker) -> None:
        await self._job(self._execute(self.inbox.popleft(), worker), "transcription")

    async def _execute(self, c, worker) -> None:
        if isinstance(c, Start):
            self.session = await worker.run(open_session, self.server.model, c.instructions)
        elif isinstance(c, Append):
            samples = self._take_audio(c)
            events = await worker.run(self.session.feed, samples)
            self.consumed += samples.size
            self.send(self.protocol.transcript(events))
        elif isinstance(c, Commit):
            events = await worker.run(self.session.finish)
            seconds = (self.position - self.item_start) / MODEL_INPUT_RATE
            self.item_start = self.position
            self.send(self.protocol.completed(events, seconds, self.session.language))
            await worker.run(self.session.reset)
        elif isinstance(c, Clear) and self.session is not None:
            await worker.run(self.session.reset)
            self.protocol.item, self.protocol.text = None, ""
            self.item_start = self.position

"""What the framework tests (tests/serve/test_framework_*.py) share: a real server (the app
`serve` runs, uvicorn on 127.0.0.1 on a free port, an API key and its real-time silence feed)
around the shared short-turn tiny model (tests/support/server_support.py), a way to make the
model write a function call (random weights never write one: the call's tokens are forced into
the live session's function channel, as tests/serve/test_server_tools.py does), audio the model
answers, and a record of every error event the server sends (the server logs each one)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import numpy as np

from mlx_voicechat.serve.app import ServerThread, create_app

KEY = "framework-key"
TIMEOUT = 60.0  # seconds, any single wait on a framework (a loaded machine is slow)
INSTRUCTIONS = "You are a weather assistant. Answer in one short sentence."
TOOL_NAME = "get_weather"
WEATHER_RESULT = "sunny, 21 C"


def tone(seconds: float, rate: int = 24000, seed: int = 0) -> bytes:
    """PCM16 mono bytes the model hears as sound (noise at about -20 dBFS)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(int(seconds * rate)) * 3000).astype("<i2").tobytes()


class Recording:
    """The tiny model, recording the sessions the server opens (so a test can reach the live
    session and force a function call into it)."""

    def __init__(self, model):
        self.model, self.sessions = model, []
        self.prompts: list = []  # (instructions, tool names) of each session, as opened

    def __getattr__(self, name):
        return getattr(self.model, name)

    def session_batch(self, *args, **kwargs):
        batch = self.model.session_batch(*args, **kwargs)
        opened = batch.open

        def open_and_record(*a, **k):
            s = opened(*a, **k)
            names = sorted(t["name"] for t in k.get("tools") or ())
            self.prompts.append((a[0] if a else k.get("instructions"), names))
            self.sessions.append(s)
            return s

        batch.open = open_and_record
        return batch


class ErrorLog(logging.Handler):
    """Every error event the server sends (each is logged once, at WARNING)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list = []

    def emit(self, record):
        text = record.getMessage()
        if "error event" in text:
            self.lines.append(text)


class Served:
    """A running server: ``url`` (ws://.../v1/realtime), ``http`` (http://.../v1), the
    recorded sessions and the error events it sent."""

    def __init__(self, thread: ServerThread, rec: Recording, errors: ErrorLog, worker):
        self.thread, self.rec, self.errors, self.worker = thread, rec, errors, worker
        self.port = thread.port
        self.url = f"ws://127.0.0.1:{self.port}/v1/realtime"
        self.http = f"http://127.0.0.1:{self.port}/v1"

    async def session(self, timeout: float = TIMEOUT):
        """The model's session of the latest conversation, once it is open."""
        deadline = time.monotonic() + timeout
        while not self.rec.sessions:
            assert time.monotonic() < deadline, "the server opened no session"
            await asyncio.sleep(0.02)
        return self.rec.sessions[-1]

    async def force_call(self, arguments: str = '{"city": "Paris"}', name: str = TOOL_NAME):
        """Make the model write ``name(arguments)`` on its function channel over the next
        frames (the server's clock feeds silence meanwhile, so the frames run)."""
        session = await self.session()
        tok = self.rec.model.tokenizer
        start, end = tok.convert_tokens_to_ids(["<SPECIAL_20>", "<SPECIAL_21>"])
        text = f'<TOOLCALL>[{{"name": "{name}", "arguments": {arguments}}}]</TOOLCALL>'
        ids = [start] + tok.encode(text, add_special_tokens=False) + [end]

        def force_all():  # in one job: no frame runs between the ids (they go one per frame)
            for i in ids:
                session.force(None, i)

        await self.worker.run(force_all)

    @property
    def prompt(self) -> tuple:
        """(instructions, tool names) the model's latest session was opened with."""
        return self.rec.prompts[-1] if self.rec.prompts else (None, [])


@contextlib.contextmanager
def served(model, worker, **options):
    """`serve`'s defaults (an API key, the real-time silence feed) on 127.0.0.1."""
    rec = Recording(model)
    options.setdefault("max_lag_seconds", 60.0)  # a loaded test machine is not real time
    app = create_app(rec, api_key=KEY, worker=worker, warmup=False, **options)
    errors = ErrorLog()
    logger = logging.getLogger("mlx_voicechat.serve")
    logger.addHandler(errors)
    try:
        with ServerThread(app) as thread:
            yield Served(thread, rec, errors, worker)
    finally:
        logger.removeHandler(errors)


async def until(predicate, timeout: float = TIMEOUT, what: str = "the condition"):
    """Poll ``predicate`` until it is true (a framework's callbacks fill lists meanwhile)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(0.02)

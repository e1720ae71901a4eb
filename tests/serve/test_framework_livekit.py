"""LiveKit Agents' OpenAI plugin (``livekit-plugins-openai``, ``RealtimeModel(base_url=...)``)
on its defaults against a real server on 127.0.0.1, with only the URL and the key changed.

The plugin's ``RealtimeSession`` is driven as ``AgentSession`` drives it (no LiveKit room:
the test stands where the room's audio track and the agent loop stand): the agent's
instructions, chat context and tools go in, the user's audio frames are pushed, replies are
asked for with ``generate_reply()`` (which resolves only when a ``response.created`` echoes
its ``metadata.client_event_id``), a function call's output goes back through
``update_chat_ctx`` and a reply follows it, and ``interrupt()`` cancels."""

import asyncio

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip(
    "livekit.plugins.openai",
    reason="livekit-plugins-openai is not installed (pip install -e '.[dev]')",
)
from framework_support import (  # noqa: E402
    INSTRUCTIONS,
    KEY,
    TOOL_NAME,
    WEATHER_RESULT,
    served,
    tone,
    until,
)
from livekit import rtc  # noqa: E402
from livekit.agents import llm  # noqa: E402
from livekit.plugins import openai as lk_openai  # noqa: E402

RATE = 24000


@llm.function_tool(name=TOOL_NAME)
async def get_weather(city: str) -> str:
    """The current weather in a city."""
    return WEATHER_RESULT


class Watch:
    """What the session emits: generations (their audio and function calls), errors and the
    server events under them."""

    def __init__(self, session):
        self.generations, self.errors, self.server, self.calls = [], [], [], []
        self.audio_frames = 0
        self.tasks = []
        session.on("generation_created", self._generation)
        session.on("error", self.errors.append)
        session.on("openai_server_event_received", self.server.append)

    def _generation(self, ev):
        self.generations.append(ev)
        self.tasks.append(asyncio.ensure_future(self._read(ev)))

    async def _read(self, ev):
        async def messages():
            async for message in ev.message_stream:
                async for frame in message.audio_stream:
                    self.audio_frames += 1
                async for _ in message.text_stream:
                    pass

        async def calls():
            async for call in ev.function_stream:
                self.calls.append(call)

        await asyncio.gather(messages(), calls())

    def of(self, type_: str) -> list:
        return [e for e in self.server if e.get("type") == type_]


def frame(seconds: float, seed: int) -> rtc.AudioFrame:
    data = np.frombuffer(tone(seconds, RATE, seed), np.int16)
    return rtc.AudioFrame(data.tobytes(), RATE, 1, data.size)


async def _speak(session, stop: asyncio.Event):
    i = 0
    while not stop.is_set():
        session.push_audio(frame(0.1, i))
        i += 1
        await asyncio.sleep(0.1)


async def _conversation(server):
    rt = lk_openai.realtime.RealtimeModel(base_url=server.http, api_key=KEY)
    session = rt.session()
    watch = Watch(session)
    stop = asyncio.Event()
    mic = None
    try:
        # as AgentSession starts an agent: instructions, chat context, tools
        await session.update_instructions(INSTRUCTIONS)
        chat = llm.ChatContext.empty()
        chat.add_message(role="user", content="Hello there.")
        await session.update_chat_ctx(chat)
        await session.update_tools([get_weather])
        await until(
            lambda: any(
                [t["name"] for t in e["session"]["tools"]] == [TOOL_NAME]
                and e["session"]["instructions"].startswith(INSTRUCTIONS)
                for e in watch.of("session.updated")
            ),
            what="session.updated with the instructions and tools",
        )

        # a greeting on request, before any audio: generate_reply resolves
        created = await asyncio.wait_for(session.generate_reply(), 15)
        assert created.response_id

        # the user speaks; the model's audio comes
        mic = asyncio.create_task(_speak(session, stop))
        await until(lambda: watch.audio_frames > 0, what="the model's audio")
        assert server.prompt == (server.prompt[0], [TOOL_NAME])
        assert server.prompt[0].startswith(INSTRUCTIONS)

        # a forced call: its output goes back through the chat context, then a reply
        await server.force_call('{"city": "Paris"}')
        await until(lambda: watch.calls, what="the function call")
        call = watch.calls[0]
        assert call.name == TOOL_NAME and '"Paris"' in call.arguments
        chat = session.chat_ctx.copy()
        chat.insert(
            llm.FunctionCallOutput(
                call_id=call.call_id, name=call.name, output=WEATHER_RESULT, is_error=False
            )
        )
        await session.update_chat_ctx(chat)
        await until(lambda: server.rec.sessions[-1].tool_frames > 0, what="the output fed")
        created = await asyncio.wait_for(session.generate_reply(), 15)
        assert created.response_id

        # interrupt: the response in progress (or the one asked for) is cancelled, and the
        # session goes on (the next response, the one asked for, completes)
        session.generate_reply()
        await asyncio.sleep(0.2)
        session.interrupt()
        await until(
            lambda: any(e["response"]["status"] == "cancelled" for e in watch.of("response.done")),
            what="a cancelled response",
        )
        n = len(watch.of("response.done"))
        await until(lambda: len(watch.of("response.done")) > n, 60, "the next response's end")
    finally:
        stop.set()
        if mic is not None:
            await mic
        await session.aclose()
        await rt.aclose()
        for t in watch.tasks:
            t.cancel()
    return watch


def test_livekit_realtime_model_on_its_defaults(model, worker):  # noqa: F811
    with served(model, worker) as server:
        watch = asyncio.run(asyncio.wait_for(_conversation(server), 300))
        errors = list(server.errors.lines)
    assert not errors, errors[:3]
    assert not watch.errors and not watch.of("error"), (watch.errors + watch.of("error"))[:3]
    assert len(watch.generations) >= 3

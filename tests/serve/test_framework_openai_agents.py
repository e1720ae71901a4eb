"""The OpenAI Agents SDK (``openai-agents``, ``agents.realtime``) on its defaults against a
real server on 127.0.0.1, with only the URL and the key changed: it connects, keeps its
agent's instructions and tools (``session.updated`` shows them, and the model's session is
opened with them), hears the model, gets no ``error`` event, runs a tool round trip (a call
forced into the model's function channel) and interrupts."""

import asyncio

import pytest

pytest.importorskip("fastapi")
agents = pytest.importorskip(
    "agents.realtime", reason="openai-agents is not installed (pip install -e '.[dev]')"
)
from agents import function_tool  # noqa: E402
from agents.realtime import RealtimeAgent, RealtimeRunner  # noqa: E402
from framework_support import (  # noqa: E402
    INSTRUCTIONS,
    KEY,
    TOOL_NAME,
    WEATHER_RESULT,
    served,
    tone,
    until,
)

CITIES: list = []


@function_tool(name_override=TOOL_NAME)
def get_weather(city: str) -> str:
    """The current weather in a city."""
    CITIES.append(city)
    return WEATHER_RESULT


class Recorder:
    """The session's events, and the raw server events under them, as they come."""

    def __init__(self, session):
        self.session, self.events, self.raw = session, [], []

    async def read(self):
        async for event in self.session:
            self.events.append(event)
            if event.type == "raw_model_event" and event.data.type == "raw_server_event":
                self.raw.append(event.data.data)

    def types(self) -> list:
        return [e.type for e in self.events]

    def raw_of(self, type_: str) -> list:
        return [e for e in self.raw if e.get("type") == type_]

    def errors(self) -> list:
        """The SDK's own error events (a parse failure, an error from the server)."""
        return [e for e in self.events if e.type == "error"] + self.raw_of("error")


async def _conversation(server):
    agent = RealtimeAgent(name="Assistant", instructions=INSTRUCTIONS, tools=[get_weather])
    runner = RealtimeRunner(agent)
    session = await runner.run(model_config={"url": server.url, "api_key": KEY})
    async with session:
        rec = Recorder(session)
        reader = asyncio.create_task(rec.read())
        try:
            await _drive(server, session, rec)
        finally:
            reader.cancel()
    return rec


async def _drive(server, session, rec):
    # connects; the agent's instructions and tools are in effect
    await until(
        lambda: any(
            (e["session"].get("instructions") or "").startswith(INSTRUCTIONS)
            for e in rec.raw_of("session.updated")
        ),
        what="session.updated with the agent's instructions",
    )
    updated = rec.raw_of("session.updated")[-1]["session"]
    assert [t["name"] for t in updated["tools"]] == [TOOL_NAME], updated["tools"]

    # hears the model: the user speaks, the model answers in audio
    for i in range(10):
        await session.send_audio(tone(0.1, seed=i))
        await asyncio.sleep(0.05)
    await until(lambda: "audio" in rec.types(), what="the model's audio")
    assert server.prompt[1] == [TOOL_NAME] and server.prompt[0].startswith(INSTRUCTIONS)

    # a tool round trip: the model calls, the SDK runs the tool and sends its output
    await server.force_call()
    await until(lambda: "tool_end" in rec.types(), what="the tool's end")
    assert CITIES[-1] == "Paris"
    await until(
        lambda: any(
            e["item"].get("type") == "function_call_output"
            for e in rec.raw_of("conversation.item.done")
        ),
        what="the tool's output in the conversation",
    )

    # the interrupt is accepted while the model speaks
    await until(lambda: rec.raw_of("response.output_audio.delta"), what="audio")
    n = len(rec.raw_of("response.done"))
    for i in range(10):
        await session.send_audio(tone(0.1, seed=20 + i))
    await until(lambda: server.rec.sessions and rec.raw_of("response.created"), what="a response")
    await session.interrupt()
    await until(lambda: len(rec.raw_of("response.done")) > n, what="a response's end")
    # the SDK asks for the items it saw (after transcripts and truncates): they are answered
    await until(lambda: rec.raw_of("conversation.item.retrieved"), what="a retrieved item")


def test_openai_agents_on_its_defaults(model, worker):  # noqa: F811
    CITIES.clear()
    with served(model, worker) as server:
        rec = asyncio.run(asyncio.wait_for(_conversation(server), 300))
        errors = list(server.errors.lines)
    assert not rec.errors(), rec.errors()[:3]
    assert not errors, errors[:3]
    kinds = rec.types()
    assert "audio" in kinds and "tool_start" in kinds and "tool_end" in kinds

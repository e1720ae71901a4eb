"""pipecat's ``OpenAIRealtimeLLMService`` set up as its realtime example
(examples/foundational/19-openai-realtime.py) sets it up, against a real server on 127.0.0.1
with only the URL and the key changed: session properties with transcription, semantic turn
detection, noise reduction and instructions; a context that opens with a "Say hello!" user
message and holds the tools; an ``LLMRunFrame`` to start and an ``LLMSetToolsFrame`` with one
more tool later (after the audio started). pipecat treats every ``error`` event as fatal and
stops reading, so the test holds that none comes, that audio keeps coming, that the tools reach
the model, that a forced call runs pipecat's function and that an interruption is accepted.

The example's transport (Daily, WebRTC) is replaced by two small processors: one pushes the
user's audio in at real time, one collects what the service pushes out."""

import asyncio
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip(
    "pipecat.services.openai.realtime.llm",
    reason="pipecat-ai is not installed (pip install -e '.[dev]')",
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
from pipecat.adapters.schemas.function_schema import FunctionSchema  # noqa: E402
from pipecat.adapters.schemas.tools_schema import ToolsSchema  # noqa: E402
from pipecat.frames.frames import (  # noqa: E402
    ErrorFrame,
    FunctionCallResultFrame,
    InputAudioRawFrame,
    InterruptionFrame,
    LLMRunFrame,
    LLMSetToolsFrame,
    TTSAudioRawFrame,
)
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.pipeline.runner import PipelineRunner  # noqa: E402
from pipecat.pipeline.task import PipelineParams, PipelineTask  # noqa: E402
from pipecat.processors.aggregators.llm_context import LLMContext  # noqa: E402
from pipecat.processors.aggregators.llm_response_universal import (  # noqa: E402
    LLMContextAggregatorPair,
)
from pipecat.processors.frame_processor import FrameProcessor  # noqa: E402
from pipecat.services.openai.realtime.events import (  # noqa: E402
    AudioConfiguration,
    AudioInput,
    InputAudioNoiseReduction,
    InputAudioTranscription,
    SemanticTurnDetection,
    SessionProperties,
)
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService  # noqa: E402

WEATHER = FunctionSchema(
    name=TOOL_NAME,
    description="Get the current weather",
    properties={"city": {"type": "string", "description": "The city"}},
    required=["city"],
)
NEWS = FunctionSchema(name="get_news", description="The current news.", properties={}, required=[])
RATE = 24000


class Tap(FrameProcessor):
    """Where the example's transport input and output stand: records the frames that pass
    (downstream: the service's audio; upstream: its errors)."""

    def __init__(self):
        super().__init__()
        self.audio, self.errors, self.results = [], [], []

    async def process_frame(self, frame, direction):
        await super().process_frame(frame, direction)
        if isinstance(frame, ErrorFrame):
            self.errors.append(frame)
        elif isinstance(frame, TTSAudioRawFrame):
            self.audio.append(frame)
        elif isinstance(frame, FunctionCallResultFrame):
            self.results.append(frame)
        await self.push_frame(frame, direction)


def _pipeline(server, calls):
    session_properties = SessionProperties(
        audio=AudioConfiguration(
            input=AudioInput(
                transcription=InputAudioTranscription(),
                turn_detection=SemanticTurnDetection(),
                noise_reduction=InputAudioNoiseReduction(type="near_field"),
            )
        ),
        instructions=INSTRUCTIONS,
    )
    llm = OpenAIRealtimeLLMService(
        api_key=KEY, base_url=server.url, session_properties=session_properties
    )

    async def fetch_weather(params):
        calls.append(params.arguments)
        await params.result_callback({"conditions": WEATHER_RESULT})

    llm.register_function(TOOL_NAME, fetch_weather)
    context = LLMContext(
        [{"role": "user", "content": "Say hello!"}], ToolsSchema(standard_tools=[WEATHER])
    )
    user_aggregator, assistant_aggregator = LLMContextAggregatorPair(context)
    source, sink = Tap(), Tap()
    pipeline = Pipeline([source, user_aggregator, llm, sink, assistant_aggregator])
    task = PipelineTask(pipeline, params=PipelineParams(), idle_timeout_secs=None)
    return task, source, sink


async def _speak(task, stop: asyncio.Event):
    """The user's microphone: 100 ms of audio every 100 ms until ``stop``."""
    i = 0
    t0 = time.monotonic()
    while not stop.is_set():
        frame = InputAudioRawFrame(audio=tone(0.1, RATE, seed=i), sample_rate=RATE, num_channels=1)
        await task.queue_frames([frame])
        i += 1
        await asyncio.sleep(max(0.0, t0 + 0.1 * i - time.monotonic()))


async def _conversation(server):
    calls = []
    task, source, sink = _pipeline(server, calls)
    runner = PipelineRunner(handle_sigint=False)
    running = asyncio.create_task(runner.run(task))
    stop = asyncio.Event()
    mic = None
    try:
        # as the example's on_client_connected: kick off the conversation; the audio flows
        await task.queue_frames([LLMRunFrame()])
        mic = asyncio.create_task(_speak(task, stop))
        await until(lambda: sink.audio, what="the model's audio")
        instructions, tools = server.prompt
        assert instructions.startswith(INSTRUCTIONS) and tools == [TOOL_NAME], server.prompt

        # tools set while the audio flows (the example sets them 15 s in) reach the model
        tools = ToolsSchema(standard_tools=[WEATHER, NEWS])
        await task.queue_frames([LLMSetToolsFrame(tools=tools)])
        await until(lambda: server.prompt[1] == ["get_news", TOOL_NAME], what="the new tools")

        # a forced call runs pipecat's function, and its result goes back
        await server.force_call('{"city": "Paris"}')
        await until(lambda: calls, what="the function call")
        assert calls[0] == {"city": "Paris"}
        await until(lambda: sink.results, what="the function's result")
        await until(lambda: server.rec.sessions[-1].tool_frames > 0, what="the result fed")

        # an interruption (the user barges in) is accepted, and the audio keeps coming
        await task.queue_frames([InterruptionFrame()])
        n = len(sink.audio)
        await until(lambda: len(sink.audio) > n + 5, what="audio after the interruption")
    finally:
        stop.set()
        if mic is not None:
            await mic
        await task.cancel()
        await asyncio.wait_for(running, 30)
    return source, sink


def test_pipecat_realtime_example_on_its_defaults(model, worker):  # noqa: F811
    with served(model, worker) as server:
        source, sink = asyncio.run(asyncio.wait_for(_conversation(server), 300))
        errors = list(server.errors.lines)
    assert not errors, errors[:3]
    assert not source.errors and not sink.errors, (source.errors + sink.errors)[:3]
    assert len(sink.audio) > 10

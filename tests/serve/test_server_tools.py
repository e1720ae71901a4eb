"""Tool calls over the Realtime protocol: tools in session.update, a call the model writes
turned into a function_call item, and the client's function_call_output injected frame by
frame (pure protocol first, then through a real socket and the real session)."""

import asyncio
import json

import numpy as np
import pytest
from server_support import error_code, frame, pcm, send, started
from tool_specs import WEATHER

from mlx_voicechat.nemotron_voicechat.runtime.tools import ToolCall
from mlx_voicechat.serve.wire import Start, ToolResult


def test_tools_in_the_session_and_a_call_out_and_its_result_in():
    p, commands = started(tools=[WEATHER], instructions="Be brief.")
    assert isinstance(commands[0], Start) and commands[0].tools[0]["name"] == "get_weather"
    events, commands = send(p, type="session.update", session={"tools": [WEATHER]})
    assert [e["type"] for e in events] == ["session.updated"] and commands == []  # unchanged

    call = ToolCall("call_abc", "get_weather", '{"city":"Paris"}')
    f = frame(0)
    f.tool_calls = [call]
    events = p.frames([f])  # the model is not speaking: the call has a response of its own
    types = [e["type"] for e in events]
    assert types == [
        "response.created",
        "response.output_item.added",
        "conversation.item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    assert events[1]["item"]["type"] == "function_call" and events[1]["item"]["call_id"] == "call_abc"
    done = events[4]
    assert (done["name"], done["arguments"], done["call_id"]) == (
        "get_weather", '{"city":"Paris"}', "call_abc"
    )
    assert events[-1]["response"]["output"][0]["arguments"] == '{"city":"Paris"}'
    assert all(e["event_id"] for e in events)

    # a call while the model speaks goes into the open response, after its message
    events = p.frames([frame(1, turn="start", speaking=True)])
    f = frame(2, speaking=True)
    f.tool_calls = [ToolCall("call_def", "get_weather", "{}")]
    events = p.frames([f]) + p.frames([frame(3, turn="end")])
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert added[0]["output_index"] == 1
    final = [e for e in events if e["type"] == "response.done"][0]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call"]

    item = {"type": "function_call_output", "call_id": "call_abc", "output": '{"temp_c": 21}'}
    events, commands = send(p, type="conversation.item.create", item=item)
    assert [e["type"] for e in events] == ["conversation.item.added", "conversation.item.done"]
    assert commands == [ToolResult("call_abc", '{"temp_c": 21}')]
    # answered once only; an unknown call id and a non-string output are errors
    assert error_code(send(p, type="conversation.item.create", item=item)[0]) == "invalid_value"
    bad = dict(item, call_id="call_def", output={"x": 1})
    assert error_code(send(p, type="conversation.item.create", item=bad)[0]) == "invalid_value"


def test_a_malformed_call_is_an_error_event_and_the_session_goes_on():
    p, _ = started(tools=[WEATHER])
    f = frame(0)
    f.errors = ["the tool call is not valid JSON: ..."]
    (e,) = p.frames([f])
    assert e["type"] == "error" and e["error"]["code"] == "tool_call_invalid"
    assert p.frames([frame(1)]) == []


# --- through a socket, with the real session --------------------------------------------------

pytest.importorskip("fastapi")
websockets = pytest.importorskip("websockets")
from framework_support import Recording  # noqa: E402  (records the sessions the server opens)


def test_function_call_output_over_the_socket(model, worker):
    from server_support import connect, native_rates

    from mlx_voicechat.serve.app import ServerThread, create_app

    rec = Recording(model)
    app = create_app(rec, silence_feed=False, stats_every_frames=1, worker=worker, warmup=False)
    tok = model.tokenizer
    start, end = tok.convert_tokens_to_ids(["<SPECIAL_20>", "<SPECIAL_21>"])
    text = '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>'
    ids = [start] + tok.encode(text, add_special_tokens=False) + [end]
    silence = np.zeros(1280 * (len(ids) + 2), np.int16)

    async def main(server):
        c = await connect(server)
        await native_rates(c)
        await c.send(type="session.update", session={"tools": [WEATHER]})
        assert (await c.until_type("session.updated"))["session"]["tools"][0]["name"] == "get_weather"
        await c.send(type="input_audio_buffer.append", audio=pcm(np.zeros(1280, np.int16)))
        await c.until_frames(1)
        session = rec.sessions[-1]
        for i in ids:
            await worker.run(session.force, None, i)
        await c.append(silence, chunk=1280)
        done = await c.until_type("response.function_call_arguments.done")
        assert done["name"] == "get_weather" and json.loads(done["arguments"]) == {"city": "Paris"}
        item = {"type": "function_call_output", "call_id": done["call_id"], "output": '{"t": 21}'}
        await c.send(type="conversation.item.create", item=item)
        queued = await c.until_type("x-voicechat.tool_result.queued")
        assert queued["call_id"] == done["call_id"] and queued["frames"] > 0
        await c.append(np.zeros(1280 * (queued["frames"] + 2), np.int16), chunk=1280)
        stats = await c.until(
            lambda e: e["type"] == "x-voicechat.stats" and e.get("tool_frames") == queued["frames"]
        )
        assert stats["tool_frames"] == queued["frames"]  # the injected frames, and it goes on
        await c.ws.close()

    with ServerThread(app) as server:
        asyncio.run(asyncio.wait_for(main(server), 120))

"""Realtime ``mcp`` tools through ``serve``: the allow-list, the listing, a call the model
writes run by the server, approvals, and every event parsed by the ``openai`` SDK's own types
(socket-free first, then a stock ``openai`` client against a real server and a real MCP server
over streamable HTTP on 127.0.0.1)."""

import asyncio
import json
import logging
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from server_support import frame, pcm, send

pytest.importorskip("mcp", reason="the [mcp] extra (the official MCP SDK) is not installed")
from mcp.types import Tool  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

from mlx_voicechat.nemotron_voicechat.runtime.tools import ToolCall  # noqa: E402
from mlx_voicechat.serve.mcp_tools import McpPolicy  # noqa: E402
from mlx_voicechat.serve.protocol import Realtime  # noqa: E402
from mlx_voicechat.serve.wire import Start, ToolResult  # noqa: E402

URL = "http://127.0.0.1:8123/mcp"
ADD = Tool(name="add", description="Add two integers.",
           input_schema={"type": "object", "properties": {"a": {"type": "integer"}}})


def mcp_tool(url=URL, **kw):
    return dict({"type": "mcp", "server_label": "calc", "server_url": url,
                 "headers": {"Authorization": "Bearer s3cret"}, "require_approval": "never"}, **kw)


def openai_parses(events):
    """Every event through the openai SDK's own server-event union, strictly."""
    from openai.types.realtime import RealtimeServerEvent

    adapter = TypeAdapter(RealtimeServerEvent)
    return [type(adapter.validate_python(e)).__name__ for e in events]


def test_only_allowed_urls_and_a_clear_error_otherwise():
    p = Realtime("m")  # serve's default: no --mcp-allow, so no mcp tool at all
    events, _ = send(p, type="session.update", session={"tools": [mcp_tool()]})
    error = events[0]["error"]
    assert error["code"] == "mcp_server_not_allowed"
    assert error["param"] == "session.tools[0].server_url"
    assert "start serve with --mcp-allow PREFIX" in error["message"]
    assert events[1]["type"] == "session.updated" and events[1]["session"]["tools"] == []
    assert p.mcp.outbox == [] and "s3cret" not in json.dumps(events)
    p = Realtime("m", mcp=McpPolicy(("http://127.0.0.1:8123",)))
    for url in ("http://127.0.0.1:81234/mcp", "http://127.0.0.2:8123/mcp", "file:///etc/passwd"):
        events, _ = send(p, type="session.update", session={"tools": [mcp_tool(url)]})
        assert events[0]["type"] == "error" and p.mcp.outbox == [], url
    assert openai_parses(events) == ["RealtimeErrorEvent", "SessionUpdatedEvent"]
    secret = "http://user:pw@127.0.0.1:8124/mcp?token=t0ken"
    events, _ = send(p, type="session.update", session={"tools": [mcp_tool(secret)]})
    assert "'http://127.0.0.1:8124/mcp' is not an MCP server" in events[0]["error"]["message"]
    assert "t0ken" not in json.dumps(events) and "pw" not in events[0]["error"]["message"]


def _listed(p):
    events, _ = send(p, type="session.update", session={"tools": [mcp_tool()]})
    assert [e["type"] for e in events] == [
        "session.updated", "conversation.item.added", "mcp_list_tools.in_progress"]
    echoed = events[0]["session"]["tools"]
    assert echoed[0]["server_label"] == "calc" and "headers" not in echoed[0]
    (job,) = p.mcp.outbox
    assert job.kind == "list" and job.server.headers == {"Authorization": "Bearer s3cret"}
    p.mcp.outbox.clear()
    done, commands = p.mcp.listed("calc", [ADD])
    assert [e["type"] for e in done] == ["mcp_list_tools.completed", "conversation.item.done"]
    assert done[1]["item"]["tools"][0]["name"] == "add" and commands == []
    # the listing item's final state is the one retrieve answers with
    (got,) = send(p, type="conversation.item.retrieve", item_id=job.server.item_id)[0]
    assert got["item"]["tools"][0]["name"] == "add"
    return events + done


def test_list_then_a_call_run_by_the_server_with_openai_events():
    p = Realtime("m", mcp=McpPolicy(("http://127.0.0.1:8123",)))
    p.open()
    events = _listed(p)
    _, commands = send(p, type="input_audio_buffer.append", audio=pcm(np.zeros(320)))
    start = [c for c in commands if isinstance(c, Start)][0]
    assert [t["name"] for t in start.tools] == ["add"]  # the model's prompt has the tool
    f = frame(0)
    f.tool_calls = [ToolCall("call_1", "add", '{"a":1}')]
    out = p.frames([f])
    assert [e["type"] for e in out] == [
        "response.created", "response.output_item.added", "conversation.item.added",
        "response.mcp_call_arguments.delta", "response.mcp_call_arguments.done",
        "response.mcp_call.in_progress"]
    assert out[1]["item"]["type"] == "mcp_call" and out[1]["item"]["server_label"] == "calc"
    (job,) = p.mcp.outbox
    assert (job.kind, job.tool, job.arguments) == ("call", "add", '{"a":1}')
    done, commands = p.mcp.finished(job, "2", None, "ok")
    assert [e["type"] for e in done] == [
        "response.mcp_call.completed", "response.output_item.done", "conversation.item.done",
        "response.done"]
    assert done[1]["item"]["output"] == "2" and done[3]["response"]["output"][0]["output"] == "2"
    assert commands == [ToolResult("call_1", "2")]  # the result goes to the model
    (got,) = send(p, type="conversation.item.retrieve", item_id=job.item_id)[0]
    assert got["item"]["output"] == "2" and got["item"]["arguments"] == '{"a":1}'
    failed, commands = p.mcp.finished(job, "", "the tool 'add' did not answer within 30 s",
                                      "timeout")
    assert failed[0]["type"] == "response.mcp_call.failed"
    assert failed[1]["item"]["error"] == {"type": "protocol_error", "code": -32001,
                                          "message": "the tool 'add' did not answer within 30 s"}
    assert json.loads(commands[0].output) == {"error": "the tool 'add' did not answer within 30 s"}
    names = openai_parses(events + out + done + failed)
    assert "McpListToolsCompleted" in names and "ResponseMcpCallCompleted" in names
    assert "ResponseMcpCallFailed" in names and "ResponseMcpCallArgumentsDone" in names


def test_a_webrtc_calls_first_audio_opens_the_model_with_the_mcp_tools():
    from mlx_voicechat.serve.webrtc_call import RtcConversation

    p = Realtime("m", mcp=McpPolicy(("http://127.0.0.1:8123",)))
    p.open()
    _listed(p)
    sent = []
    call = SimpleNamespace(protocol=p, command=sent.append)  # the call's track -> the model
    RtcConversation._audio(call, np.zeros(320, np.float32))
    assert isinstance(sent[0], Start) and [t["name"] for t in sent[0].tools] == ["add"]
    assert p._restart() == []  # opened with them: nothing to restart for


def test_a_listing_that_fails_and_an_approval_asked_then_refused_or_given():
    p = Realtime("m", mcp=McpPolicy(("http://127.0.0.1:8123",)))
    send(p, type="session.update", session={"tools": [mcp_tool(server_label="down")]})
    failed, _ = p.mcp.listed("down", None, "the MCP server 'down' did not start: refused")
    assert [e["type"] for e in failed] == ["mcp_list_tools.failed", "error"]
    assert openai_parses(failed) == ["McpListToolsFailed", "RealtimeErrorEvent"]
    p = Realtime("m", mcp=McpPolicy(("http://127.0.0.1:8123",)))
    send(p, type="session.update", session={"tools": [mcp_tool(require_approval="always")]})
    p.mcp.outbox.clear()
    p.mcp.listed("calc", [ADD])
    asked = p.frames([_call_frame("call_a")])
    request = asked[1]["item"]
    assert request["type"] == "mcp_approval_request" and p.mcp.outbox == []
    item = {"type": "mcp_approval_response", "approval_request_id": request["id"],
            "approve": False, "reason": "not now"}
    events, commands = send(p, type="conversation.item.create", item=item)
    assert [e["type"] for e in events] == ["conversation.item.added", "conversation.item.done"]
    assert commands == [ToolResult("call_a", json.dumps(
        {"error": "the user did not approve the call: not now"}))]
    again, _ = send(p, type="conversation.item.create", item=item)
    assert again[0]["error"]["code"] == "invalid_value"  # answered once only
    asked = p.frames([_call_frame("call_b")])
    item = dict(item, approval_request_id=asked[1]["item"]["id"], approve=True)
    events, commands = send(p, type="conversation.item.create", item=item)
    assert events[-1]["type"] == "response.mcp_call.in_progress" and commands == []
    (job,) = p.mcp.outbox
    assert job.approval_request_id == item["approval_request_id"] and job.call_id == "call_b"
    assert "RealtimeMcpApprovalRequest" not in openai_parses(asked + events)  # events, not items
    assert all(openai_parses(asked + events))


def _call_frame(call_id):
    f = frame(0)
    f.tool_calls = [ToolCall(call_id, "add", '{"a": 1, "b": 2}')]
    return f


# --- the runner: a real MCP server over HTTP, calls that fail -----------------------------------


class _Conversation:
    """What McpRunner needs of a connection: the protocol, send and command."""

    def __init__(self, protocol):
        self.protocol, self.sent, self.commands = protocol, [], []

    def send(self, events):
        self.sent += events

    def command(self, c):
        self.commands.append(c)


def test_runner_turns_every_failure_into_a_failed_call_the_model_hears():
    import subprocess
    import sys
    from pathlib import Path

    from mlx_voicechat.serve.mcp_runner import McpRunner

    server = Path(__file__).resolve().parents[1] / "support" / "mcp_server.py"
    proc = subprocess.Popen([sys.executable, str(server), "http", "--only", "hang,fail,big,die"],
                            stdout=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{int(proc.stdout.readline())}/mcp"
        policy = McpPolicy((url,), timeout=3.0)
        p = Realtime("m", mcp=policy)
        conv = _Conversation(p)

        async def main():
            runner = McpRunner(conv, policy)
            try:
                send(p, type="session.update", session={"tools": [mcp_tool(url)]})
                while not any(e["type"].startswith("mcp_list_tools.c") for e in conv.sent):
                    await asyncio.sleep(0.02)
                for n, name in enumerate(["hang", "fail", "big", "die", "fail"]):
                    f = frame(n)
                    f.tool_calls = [ToolCall(f"call_{n}", name, "{}")]
                    p.frames([f])
                    while len(conv.commands) <= n:
                        await asyncio.sleep(0.02)
            finally:
                runner.close()

        asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        proc.kill()
        proc.wait(10)
    failed = [e for e in conv.sent if e["type"] == "response.output_item.done"]
    errors = [e["item"]["error"] for e in failed]
    assert [e["type"] for e in errors] == ["protocol_error", "tool_execution_error",
                                           "protocol_error", "protocol_error", "protocol_error"]
    assert errors[0] == {"type": "protocol_error", "code": -32001,
                         "message": "the tool 'hang' did not answer within 3 s"}
    assert "the tool failed: broken" in errors[1]["message"]
    assert "returned 1048576 characters" in errors[2]["message"]
    assert errors[3]["code"] == -32000 and errors[4]["code"] == -32000  # the server is gone
    heard = [json.loads(c.output) for c in conv.commands]
    assert heard == [{"error": e["message"]} for e in errors]
    assert sum(e["type"] == "response.mcp_call.failed" for e in conv.sent) == 5
    assert all(openai_parses(conv.sent))


# --- a stock openai client, a real server, a real MCP server over HTTP -------------------------

pytest.importorskip("fastapi")
pytest.importorskip("websockets")
from framework_support import Recording  # noqa: E402
from mcp_support import http_url  # noqa: E402, F401, F811  (the MCP test server over HTTP)


def test_stock_openai_client_lists_and_a_forced_call_completes(model, worker, http_url, caplog):
    import openai

    from mlx_voicechat.serve.app import ServerThread, create_app

    caplog.set_level(logging.DEBUG)
    rec = Recording(model)
    prefix = http_url.rsplit("/", 1)[0]
    app = create_app(rec, silence_feed=False, stats_every_frames=1, worker=worker, warmup=False,
                     mcp_allow=[prefix], tool_timeout=20)
    tok = model.tokenizer
    start, end = tok.convert_tokens_to_ids(["<SPECIAL_20>", "<SPECIAL_21>"])
    text = '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>'
    ids = [start] + tok.encode(text, add_special_tokens=False) + [end]
    tool = mcp_tool(http_url, server_label="weather", allowed_tools=["get_weather"])
    outside = mcp_tool("http://127.0.0.1:1/mcp", server_label="elsewhere")

    async def main(server):
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="k")
        seen = {}
        async with client.realtime.connect(model="m", extra_query={"x-voicechat": "1"}) as conn:
            await conn.session.update(session={"type": "realtime", "tools": [outside]})
            await conn.session.update(session={
                "type": "realtime", "tools": [tool],
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}})
            async for event in conn:
                seen.setdefault(event.type, []).append(event)
                if event.type == "mcp_list_tools.completed":
                    await conn.input_audio_buffer.append(audio=pcm(np.zeros(1280, np.int16)))
                elif event.type == "x-voicechat.stats" and "forced" not in seen:
                    seen["forced"] = True
                    for i in ids:
                        await worker.run(rec.sessions[-1].force, None, i)
                    silence = np.zeros(1280 * (len(ids) + 2), np.int16)
                    for k in range(0, len(silence), 1280):
                        await conn.input_audio_buffer.append(audio=pcm(silence[k : k + 1280]))
                elif event.type == "x-voicechat.tool_result.queued":
                    break
        return seen

    with ServerThread(app) as server:
        seen = asyncio.run(asyncio.wait_for(main(server), 120))
    for _ in range(300):  # the connection's MCP client stops with it
        if not [t for t in threading.enumerate() if t.name.startswith("mlx-voicechat-mcp")]:
            break
        time.sleep(0.05)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("mlx-voicechat-mcp")]
    (refused,) = seen["error"]
    assert refused.error.code == "mcp_server_not_allowed"
    listing = [e.item for e in seen["conversation.item.added"] if e.item.type == "mcp_list_tools"]
    assert listing[0].server_label == "weather"
    done = [e.item for e in seen["conversation.item.done"] if e.item.type == "mcp_list_tools"]
    assert [t.name for t in done[0].tools] == ["get_weather"]
    (completed,) = seen["response.mcp_call.completed"]
    assert type(completed).__name__ == "ResponseMcpCallCompleted"  # the SDK's own type
    (item,) = [e.item for e in seen["response.output_item.done"] if e.item.type == "mcp_call"]
    assert item.id == completed.item_id and json.loads(item.output)["temp_c"] == 21
    assert seen["x-voicechat.tool_result.queued"][0].model_dump()["frames"] > 0  # to the model
    assert "s3cret" not in caplog.text  # a client's headers are never logged


def test_serve_mcp_flags_are_checked_before_anything_starts(capsys):
    from mlx_voicechat.cli import main

    for flags, words in [
        (["--mcp-allow", "ftp://127.0.0.1/"], "--mcp-allow takes an http:// or https://"),
        (["--mcp-allow", "http://"], "--mcp-allow takes an http:// or https://"),
        (["--tool-timeout", "0"], "--tool-timeout must be > 0 seconds"),
    ]:
        assert main(["serve", "--model", "no-such-model", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err

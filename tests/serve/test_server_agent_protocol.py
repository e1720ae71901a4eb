"""What the agent frameworks' Realtime connectors send routinely (openai-agents, pipecat,
LiveKit): every voice name, text message items, ``conversation.item.retrieve``,
``response.create`` answered with a response that echoes its metadata, the ``x-voicechat.*``
events only on request, and every error event logged (pure protocol; the frameworks
themselves are driven in tests/serve/test_framework_*.py)."""

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from server_support import error_code, frame, pcm, send, started

from mlx_voicechat.nemotron_voicechat.runtime.tools import ToolCall
from mlx_voicechat.serve.items import MAX_ITEM_CHARS, MAX_ITEMS
from mlx_voicechat.serve.protocol import Realtime
from mlx_voicechat.serve.responses import REQUEST_WAIT_FRAMES
from mlx_voicechat.serve.wire import Start


def text_item(role, text, **fields):
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}], **fields}


def test_text_messages_join_the_conversation_and_system_ones_the_instructions():
    p = Realtime()
    p.open()
    send(p, type="session.update", session={"instructions": "Be brief."})
    for role in ("system", "developer", "user", "assistant"):
        events, commands = send(
            p, type="conversation.item.create", item=text_item(role, f"{role} says hi")
        )
        assert [e["type"] for e in events] == ["conversation.item.added", "conversation.item.done"]
        assert events[1]["item"]["role"] == role and events[1]["item"]["status"] == "completed"
        assert commands == []  # before the first audio nothing runs yet
    assert p.prompt == "Be brief.\n\nsystem says hi\n\ndeveloper says hi"
    updated = send(p, type="session.update", session={})[0][0]
    assert updated["session"]["instructions"] == p.prompt
    _, commands = send(p, type="input_audio_buffer.append", audio=pcm(np.zeros(320)))
    assert isinstance(commands[0], Start) and commands[0].instructions == p.prompt
    # user text after the start is kept, not heard: no restart
    _, commands = send(p, type="conversation.item.create", item=text_item("user", "more"))
    assert commands == []
    for bad in ({"type": "message", "role": "tool", "content": []}, {"type": "x"}, "item"):
        assert error_code(send(p, type="conversation.item.create", item=bad)[0]) == (
            "invalid_value"
        )


def test_previous_item_id_names_the_item_just_before():
    p, _ = started()
    for name in ("item_a", "item_b"):
        send(p, type="conversation.item.create", item=text_item("user", "hi", id=name))
    # the user's speech opens its item; a client's item joins the conversation after it
    p.frames([frame(0, transcript="hel")])
    opened = p.responses.user_item
    added, _ = send(p, type="conversation.item.create", item=text_item("user", "x", id="item_c"))
    assert [e["previous_item_id"] for e in added] == [opened, opened]
    events, _ = send(p, type="input_audio_buffer.commit")
    assert events == [dict(events[0], type="input_audio_buffer.committed", item_id=opened,
                           previous_item_id="item_b")]
    events = p.frames([frame(1, turn="start", speaking=True)])  # completes the user's item
    (done,) = [e for e in events if e["type"] == "conversation.item.done"]
    assert done["item"]["id"] == opened and done["previous_item_id"] == "item_b"
    # a commit that opens the user's item: the item before it is the model's last one
    p.frames([frame(2, turn="end", speaking=True)])
    said = p.responses.record.last
    events, _ = send(p, type="input_audio_buffer.commit")
    assert events[0]["type"] == "conversation.item.added"
    assert events[1]["previous_item_id"] == said == events[0]["previous_item_id"]


def test_retrieve_and_delete_answer_from_the_tracked_items():
    p, _ = started()
    item = text_item("user", "hello", id="item_mine")
    send(p, type="conversation.item.create", item=item)
    (got,) = send(p, type="conversation.item.retrieve", item_id="item_mine")[0]
    assert got["type"] == "conversation.item.retrieved"
    assert got["item"]["id"] == "item_mine" and got["item"]["content"][0]["text"] == "hello"
    # the model's own items: the assistant's message with its transcript once it is done
    p.frames([frame(0, turn="start", speaking=True, text="Hi")])
    p.frames([frame(1, turn="end", speaking=True, text=" there")])
    said = [i for i in p.items.values() if i.get("role") == "assistant"][-1]
    (got,) = send(p, type="conversation.item.retrieve", item_id=said["id"])[0]
    assert got["item"]["content"][0]["transcript"] == "Hi there"
    (deleted,) = send(p, type="conversation.item.delete", item_id="item_mine")[0]
    assert deleted == dict(deleted, type="conversation.item.deleted", item_id="item_mine")
    assert error_code(send(p, type="conversation.item.retrieve", item_id="item_mine")[0]) == (
        "invalid_value"
    )
    # the tracked items are bounded in number and in size: the oldest go first
    big = "x" * (MAX_ITEM_CHARS // 8)
    for i in range(MAX_ITEMS + 20):
        text = big if i % 10 == 0 else "hi"
        send(p, type="conversation.item.create", item=text_item("user", text, id=f"item_{i}"))
    assert len(p.items) <= MAX_ITEMS and p._item_chars <= MAX_ITEM_CHARS
    assert f"item_{MAX_ITEMS + 19}" in p.items and "item_0" not in p.items
    assert p._item_chars == sum(len(json.dumps(i, ensure_ascii=False)) for i in p.items.values())


def test_response_create_opens_a_response_that_echoes_its_metadata():
    p, _ = started()
    meta = {"client_event_id": "evt_livekit_1"}
    (created,) = send(p, type="response.create", response={"metadata": meta})[0]
    assert created["type"] == "response.created"
    rid = created["response"]["id"]
    assert created["response"]["metadata"] == meta
    # the model's next turn fills it: no second response.created
    events = p.frames([frame(0, turn="start", speaking=True, text="ok")])
    assert "response.created" not in [e["type"] for e in events]
    events = p.frames([frame(1, turn="end", speaking=True)])
    done = events[-1]
    assert done["type"] == "response.done" and done["response"]["id"] == rid
    assert done["response"]["metadata"] == meta and done["response"]["status"] == "completed"

    # a model that stays quiet: the request completes empty after REQUEST_WAIT_FRAMES frames
    (created,) = send(p, type="response.create", response={"metadata": {"k": "v"}})[0]
    quiet = p.frames([frame(i) for i in range(REQUEST_WAIT_FRAMES - 1)])
    assert quiet == []
    (done,) = p.frames([frame(99)])
    assert done["type"] == "response.done" and done["response"]["output"] == []
    assert done["response"]["id"] == created["response"]["id"]

    # a function call the model writes meanwhile completes the request that waits
    (created,) = send(p, type="response.create")[0]
    f = frame(100)
    f.tool_calls = [ToolCall("call_x", "f", "{}")]
    events = p.frames([f])
    assert events[-1]["type"] == "response.done"
    assert events[-1]["response"]["id"] == created["response"]["id"]
    assert events[-1]["response"]["output"][0]["call_id"] == "call_x"

    # out of band: created and done at once
    events, _ = send(p, type="response.create", response={"conversation": "none"})
    assert [e["type"] for e in events] == ["response.created", "response.done"]
    assert error_code(send(p, type="response.create", response={"metadata": 3})[0]) == (
        "invalid_value"
    )


def test_extension_events_only_on_request():
    assert Realtime().stats(lag_seconds=0) == []
    assert Realtime().tool_injection("c", 3) == []
    p = Realtime(extensions=True)
    assert p.stats(lag_seconds=0)[0]["type"] == "x-voicechat.stats"
    later = Realtime()
    send(later, type="session.update", session={"x-voicechat": {"events": True}})
    assert later.tool_injection("c", 3)[0]["type"] == "x-voicechat.tool_result.queued"


def test_every_error_event_is_logged_with_the_connection(caplog):
    p = Realtime()
    p.peer = "127.0.0.1:5555"
    with caplog.at_level(logging.WARNING, logger="mlx_voicechat.serve"):
        (e,) = send(p, type="no.such.event")[0]
    (record,) = caplog.records
    text = record.getMessage()
    assert p.session_id in text and "127.0.0.1:5555" in text
    assert "unknown_event" in text and "no.such.event" in text
    assert e["type"] == "error"


def test_serve_logs_an_error_event_at_its_default_log_level(tmp_path):
    """`mlx-voicechat serve` as a user runs it: the error event a client gets is on stderr."""
    websockets = pytest.importorskip("websockets")
    pytest.importorskip("uvicorn")
    from mlx_voicechat.factory import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "tiny", "tiny", seed=0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "mlx_voicechat", "serve", "--model", str(ckpt)]
    cmd += ["--port", str(port)]
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=dict(os.environ)
    )
    try:

        async def main():
            deadline = time.monotonic() + 120
            while True:
                try:
                    ws = await websockets.connect(f"ws://127.0.0.1:{port}/v1/realtime")
                    break
                except OSError:
                    assert proc.poll() is None and time.monotonic() < deadline, "serve died"
                    await asyncio.sleep(0.2)
            async with ws:
                created = json.loads(await ws.recv())
                await ws.send(json.dumps({"type": "no.such.event"}))
                while json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] != "error":
                    pass
            return created["session"]["id"]

        session_id = asyncio.run(main())
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    lines = [line for line in err.splitlines() if "no.such.event" in line]
    assert len(lines) == 1, err[-2000:]
    assert session_id in lines[0] and "unknown_event" in lines[0] and "127.0.0.1" in lines[0]

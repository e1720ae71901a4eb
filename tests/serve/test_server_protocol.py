"""The Realtime protocol state machine, without a socket or a model: client events in, server
events and worker commands out; the response lifecycle from hand-made FrameEvents."""

import base64
import json

import numpy as np
from server_support import error_code, frame, pcm, send, started

from mlx_voicechat.serve.protocol import Realtime
from mlx_voicechat.serve.wire import (
    MAX_EVENT_BYTES,
    Append,
    Cancel,
    Clear,
    Commit,
    Start,
    encode_pcm16,
)


def test_session_created_and_updated_ga_and_beta():
    p = Realtime("my-model")
    (created,) = p.open()
    assert created["type"] == "session.created" and created["event_id"]
    s = created["session"]
    assert s["model"] == "my-model" and s["id"].startswith("sess_")
    assert s["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert s["audio"]["input"]["turn_detection"] is None
    assert s["audio"]["output"]["voice"] == "Aria"

    events, commands = send(
        p,
        type="session.update",
        event_id="c1",
        session={
            "type": "realtime",
            "instructions": "Be brief.",
            "audio": {
                "input": {
                    "format": {"type": "audio/pcm", "rate": 16000},
                    "turn_detection": {"type": "server_vad"},  # accepted, ignored
                },
                "output": {"format": {"type": "audio/pcm", "rate": 22050}, "voice": "Aria"},
            },
        },
    )
    assert commands == []
    (updated,) = events
    assert updated["type"] == "session.updated"
    s = updated["session"]
    assert s["instructions"] == "Be brief."
    assert s["audio"]["input"]["format"]["rate"] == 16000
    assert s["audio"]["output"]["format"]["rate"] == 22050
    assert s["audio"]["input"]["turn_detection"] is None

    # beta's flat names are aliases
    events, _ = send(
        p,
        type="session.update",
        session={"modalities": ["text", "audio"], "voice": "Aria", "input_audio_format": "pcm16"},
    )
    assert events[0]["type"] == "session.updated"
    assert events[0]["session"]["audio"]["input"]["format"]["rate"] == 24000
    # any voice name is accepted; session.updated reports the voice the model has
    for voice in ("alloy", "ash", "marin", {"id": "custom"}):
        (updated,) = send(p, type="session.update", session={"voice": voice})[0]
        assert updated["session"]["audio"]["output"]["voice"] == "Aria", voice
    assert error_code(
        send(p, type="session.update", session={"output_audio_format": "g711_ulaw"})[0][:1]
    )
    # a field the model cannot honour is refused alone: the rest of the update is applied
    events, _ = send(
        p,
        type="session.update",
        event_id="c2",
        session={
            "audio": {"output": {"voice": "ash", "format": {"type": "audio/pcmu"}}},
            "instructions": "x",
        },
    )
    assert [e["type"] for e in events] == ["error", "session.updated"]
    assert events[0]["error"]["param"] == "session.audio.output.format"
    assert events[0]["error"]["event_id"] == "c2"
    assert p.instructions == "x" and events[1]["session"]["instructions"] == "x"


def test_tools_and_formats_are_errors():
    p = Realtime()
    p.open()
    cases = [
        ({"tools": [{"type": "function", "description": "no name"}]}, "invalid_value"),
        ({"tools": [{"type": "function", "name": f"f{i}"} for i in range(6)]}, "invalid_value"),
        ({"audio": {"input": {"format": {"type": "audio/pcmu"}}}}, "invalid_value"),
        ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 44100}}}}, "invalid_value"),
        ({"output_modalities": ["text"]}, "invalid_value"),
        ({"type": "transcription"}, "invalid_value"),
        ({"instructions": 3}, "invalid_value"),
    ]
    for session, code in cases:
        events, commands = send(p, type="session.update", event_id="e7", session=session)
        if session.get("type") is None:  # a refused field: the rest goes on
            assert events[-1]["type"] == "session.updated"
            events = events[:-1]
        assert error_code(events) == code, session
        assert events[0]["error"]["event_id"] == "e7"
        assert commands == []
    assert error_code(send(p, type="session.update", session="x")[0]) == "invalid_value"
    events, _ = send(p, type="session.update", session={"tools": []})
    assert events[0]["type"] == "session.updated"


def test_new_prompt_after_first_audio_restarts_the_session():
    p, commands = started(instructions="A")
    assert isinstance(commands[0], Start) and commands[0].instructions == "A"
    # the same values again change nothing
    events, commands = send(p, type="session.update", session={"instructions": "A", "voice": "x"})
    assert [e["type"] for e in events] == ["session.updated"] and commands == []
    # a new rate applies at once; new instructions or tools restart the model's session
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    events, commands = send(
        p,
        type="session.update",
        session={
            "instructions": "B",
            "tools": tools,
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}},
        },
    )
    assert [e["type"] for e in events] == ["session.updated"]
    assert events[0]["session"]["instructions"] == "B"
    assert [t["name"] for t in events[0]["session"]["tools"]] == ["f"]
    assert len(commands) == 1 and isinstance(commands[0], Start)
    assert commands[0].instructions == "B" and commands[0].tools[0]["name"] == "f"
    _, commands = send(p, type="input_audio_buffer.append", audio=pcm(np.ones(1600)))
    assert [type(c) for c in commands] == [Append] and commands[0].samples.size == 1600
    # a developer message joins the instructions: another restart
    text = [{"type": "input_text", "text": "C"}]
    item = {"type": "message", "role": "developer", "content": text}
    events, commands = send(p, type="conversation.item.create", item=item)
    assert [e["type"] for e in events] == ["conversation.item.added", "conversation.item.done"]
    assert commands[0].instructions == "B\n\nC"


def test_bad_events_are_error_events():
    p = Realtime()
    p.open()
    assert error_code(p.receive("{not json")[0]) == "invalid_json"
    assert error_code(p.receive("[1, 2]")[0]) == "invalid_event"
    assert error_code(p.receive('{"event_id": "x"}')[0]) == "invalid_event"
    assert error_code(p.receive(b"\x00\x01")[0]) == "invalid_event"
    assert error_code(send(p, type="no.such.event")[0]) == "unknown_event"
    assert error_code(send(p, type="conversation.item.delete", item_id="x")[0]) == "invalid_value"
    assert error_code(send(p, type="conversation.item.retrieve", item_id="x")[0]) == (
        "invalid_value"
    )
    item = {"type": "function_call_output", "call_id": "c", "output": "{}"}
    assert error_code(send(p, type="conversation.item.create", item=item)[0]) == (
        "invalid_value"  # no such call waits for its output
    )
    audio = "not base64!!"
    assert error_code(send(p, type="input_audio_buffer.append", audio=audio)[0]) == "invalid_base64"
    odd = base64.b64encode(b"\x01\x02\x03").decode()
    assert error_code(send(p, type="input_audio_buffer.append", audio=odd)[0]) == "invalid_audio"
    assert error_code(send(p, type="input_audio_buffer.append", audio=5)[0]) == "invalid_value"
    big = json.dumps({"type": "input_audio_buffer.append", "audio": "A" * MAX_EVENT_BYTES})
    assert error_code(p.receive(big)[0]) == "event_too_large"
    assert error_code(send(p, type="input_audio_buffer.commit")[0]) == (
        "input_audio_buffer_commit_empty"
    )
    assert error_code(send(p, type="response.cancel")[0]) == "response_cancel_not_active"
    for item_id in ({"a": 1}, ["x"], None, 3):  # any shape: an error event, never a crash
        events, _ = send(p, type="conversation.item.truncate", item_id=item_id, audio_end_ms=0)
        assert error_code(events) == "invalid_value"
    assert not p.started  # none of these started the session
    # ids of server events are unique
    ids = [p.receive("{")[0][0]["event_id"] for _ in range(50)]
    assert len(set(ids)) == 50


def test_append_commands_and_resampling():
    p, commands = started(audio={"input": {"format": {"type": "audio/pcm", "rate": 16000}}})
    x = (np.arange(-800, 800) * 20).astype(np.int16)
    _, commands = send(p, type="input_audio_buffer.append", audio=pcm(x))
    (append,) = commands
    np.testing.assert_array_equal(append.samples, x.astype(np.float32) / 32768.0)
    _, commands = send(p, type="input_audio_buffer.append", audio="")
    assert commands == []

    # 24 kHz in: resampled statefully to 16 kHz, chunk joins without a seam
    import soxr

    p, _ = started()
    t = np.arange(24000 * 2) / 24000
    x = (np.sin(2 * np.pi * 440 * t) * 12000).astype(np.int16)
    out = []
    for chunk in np.array_split(x, 37):
        _, commands = send(p, type="input_audio_buffer.append", audio=pcm(chunk))
        out += [c.samples for c in commands]
    got = np.concatenate(out)
    sent = np.concatenate([np.zeros(320), x]).astype(np.float32) / 32768.0  # started() sent 320
    want = soxr.resample(sent, 24000, 16000)
    assert 0 <= want.size - got.size < 800  # the stream holds back its filter's delay
    np.testing.assert_allclose(got, want[: got.size], atol=1e-6)


def test_response_lifecycle_from_frames():
    p, _ = started(audio={"output": {"format": {"type": "audio/pcm", "rate": 22050}}})
    frames = [
        frame(0),  # silent, no response: nothing sent
        frame(1, transcript="hel"),
        frame(2, transcript="lo"),
        frame(3, turn="start", speaking=True, text="Hi"),
        frame(4, speaking=True, text=" there", transcript="x"),
        frame(5, speaking=True),
        frame(6, turn="end", speaking=True, text="."),
        frame(7),
    ]
    events = p.frames(frames)
    types = [e["type"] for e in events]
    assert types == [
        "conversation.item.added",  # the user's item
        "conversation.item.input_audio_transcription.delta",
        "conversation.item.input_audio_transcription.delta",
        "conversation.item.input_audio_transcription.completed",  # the model takes the turn
        "conversation.item.done",
        "response.created",
        "response.output_item.added",
        "conversation.item.added",
        "response.content_part.added",
        "response.output_audio.delta",
        "response.output_audio_transcript.delta",
        "conversation.item.added",  # the user talks over the reply: a new user item
        "conversation.item.input_audio_transcription.delta",
        "response.output_audio.delta",
        "response.output_audio_transcript.delta",
        "response.output_audio.delta",
        "response.output_audio.delta",
        "response.output_audio_transcript.delta",
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    assert all(e["event_id"] for e in events)
    assert len({e["event_id"] for e in events}) == len(events)
    user = events[0]["item"]
    assert user["role"] == "user" and events[1]["item_id"] == user["id"]
    assert events[3]["transcript"] == "hello" and events[3]["item_id"] == user["id"]
    created = events[5]["response"]
    assert created["status"] == "in_progress" and created["id"].startswith("resp_")
    item_id = events[6]["item"]["id"]
    deltas = [e for e in events if e["type"] == "response.output_audio.delta"]
    assert len(deltas) == 4  # one per spoken frame
    for e in deltas + [e for e in events if e["type"].startswith("response.output_audio")]:
        assert e["response_id"] == created["id"] and e["item_id"] == item_id
    for d, f in zip(deltas, frames[3:7]):
        assert d["delta"] == encode_pcm16(f.audio)  # 22.05 kHz out: the frame's samples
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["id"] == created["id"]
    assert done["output"][0]["content"][0]["transcript"] == "Hi there."
    assert events[-5]["transcript"] == "Hi there."
    assert p.response is None and p.responses_done == 1
    # truncate refers to the item's audio sent so far (4 frames = 320 ms)
    events, _ = send(
        p, type="conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=300
    )
    assert events[0]["type"] == "conversation.item.truncated"
    assert error_code(
        send(p, type="conversation.item.truncate", item_id=item_id, audio_end_ms=999)[0]
    )


def test_cancel_commit_clear_create():
    p, _ = started()
    p.frames([frame(0, turn="start", speaking=True, text="a")])
    opened = p.response["id"]
    events, commands = send(p, type="response.create")
    assert events == [] and commands == []  # it waits for the response in progress
    assert error_code(send(p, type="response.cancel", response_id="resp_other")[0]) == (
        "invalid_value"
    )
    events, commands = send(p, type="response.cancel")
    assert commands == [Cancel()]
    assert events[-2]["type"] == "response.done"
    assert events[-2]["response"]["status"] == "cancelled"
    assert events[-2]["response"]["id"] == opened
    # the waiting request opened when the cancelled response ended
    assert events[-1]["type"] == "response.created" and events[-1]["response"]["id"] != opened
    requested = events[-1]["response"]["id"]
    # the cancelled turn's remaining frames are not sent; the model's next turn fills the request
    assert p.frames([frame(1, speaking=True), frame(2, turn="end", speaking=True)]) == []
    events = p.frames([frame(3, turn="start", speaking=True)])
    assert events[0]["type"] == "response.output_item.added"
    assert events[0]["response_id"] == requested  # the model's turn fills the request

    events, commands = send(p, type="input_audio_buffer.commit")
    assert commands == [Commit()]
    assert [e["type"] for e in events] == [
        "conversation.item.added",
        "input_audio_buffer.committed",
    ]
    assert events[1]["item_id"] == events[0]["item"]["id"]
    done = p.commit_done()
    assert [e["type"] for e in done] == [
        "conversation.item.input_audio_transcription.completed",
        "conversation.item.done",
    ]
    events, commands = send(p, type="input_audio_buffer.clear")
    assert commands == [Clear()] and events[0]["type"] == "input_audio_buffer.cleared"


def test_output_resampled_to_24k_without_seams():
    import soxr

    p, _ = started()
    t = np.arange(1764 * 10) / 22050
    wave = (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32)
    frames = []
    for i in range(10):
        f = frame(i, turn="start" if i == 0 else "end" if i == 9 else None, speaking=True)
        f.audio = wave[i * 1764 : (i + 1) * 1764]
        frames.append(f)
    events = p.frames(frames)
    deltas = [e["delta"] for e in events if e["type"] == "response.output_audio.delta"]
    assert len(deltas) == 10
    got = np.concatenate([np.frombuffer(base64.b64decode(d), "<i2") for d in deltas]) / 32767.0
    want = soxr.resample(wave, 22050, 24000)
    assert abs(got.size - want.size) <= 2 and abs(got.size - 19200) <= 2
    n = min(got.size, want.size)
    assert np.max(np.abs(got[:n] - want[:n])) < 2e-3


def test_fuzzed_events_always_get_well_formed_answers():
    rng = np.random.default_rng(0)
    valid = [
        {"type": "session.update", "session": {"instructions": "x", "voice": "Aria"}},
        {"type": "session.update", "session": {"audio": {"input": {"format": {"rate": 16000}}}}},
        {"type": "input_audio_buffer.append", "audio": pcm(np.ones(64))},
        {"type": "input_audio_buffer.commit"},
        {"type": "input_audio_buffer.clear"},
        {"type": "response.create"},
        {"type": "response.cancel", "response_id": "r"},
        {"type": "conversation.item.create", "item": {"type": "message"}},
        {"type": "conversation.item.truncate", "item_id": "i", "audio_end_ms": 1},
    ]
    odd = [None, 0, -1, 1e308, True, "", "é", [], {}, [[]], {"a": [1]}]
    p = Realtime()
    p.open()
    p.frames([frame(0, turn="start", speaking=True)])
    for _ in range(2000):
        event = json.loads(json.dumps(valid[rng.integers(len(valid))]))
        for _ in range(rng.integers(0, 3)):
            target = event
            while True:
                key = list(target)[rng.integers(len(target))]
                if isinstance(target[key], dict) and target[key] and rng.random() < 0.6:
                    target = target[key]
                    continue
                target[key] = json.loads(json.dumps(odd[rng.integers(len(odd))]))
                break
        raw = json.dumps(event)
        if rng.random() < 0.2:
            raw = raw[: rng.integers(len(raw))]
        events, commands = p.receive(raw)
        for e in events:
            assert isinstance(e["type"], str) and e["event_id"]
            json.dumps(e)  # serializable
            if e["type"] == "error":
                assert e["error"]["code"] and e["error"]["message"]
        for c in commands:
            if isinstance(c, Append):
                assert c.samples.dtype == np.float32 and c.samples.ndim == 1

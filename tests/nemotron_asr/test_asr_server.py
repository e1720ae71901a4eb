"""Realtime transcription sessions through real sockets on 127.0.0.1: a Nemotron-3.5-ASR
server and a VoiceChat server (its RNNT head), the stock `openai` SDK client and `websockets`.
All MLX work runs on the shared worker thread (MLX streams belong to threads)."""

import asyncio
import base64
import json
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
websockets = pytest.importorskip("websockets")

from mlx_voicechat.serve.app import ServerThread, create_app  # noqa: E402
from mlx_voicechat.serve.transcription import TranscriptionRealtime  # noqa: E402
from mlx_voicechat.serve.transcription_connection import TranscriptionConversation  # noqa: E402
from mlx_voicechat.serve.wire import encode_pcm16  # noqa: E402
from mlx_voicechat.serve.worker import Worker  # noqa: E402

TIMEOUT = 30.0


@pytest.fixture(scope="module")
def worker():
    return Worker.shared()


@pytest.fixture(scope="module")
def recognizer(tmp_path_factory, worker):
    def build():
        from mlx_voicechat import load
        from mlx_voicechat.nemotron_asr.factory import make_recognizer_checkpoint

        return load(make_recognizer_checkpoint(tmp_path_factory.mktemp("srv") / "asr", seed=3))

    return worker.submit(build).result()


@pytest.fixture(scope="module")
def asr_server(recognizer, worker):
    s = ServerThread(create_app(recognizer, worker=worker, model_id="nemotron-3.5-asr")).__enter__()
    yield s
    s.__exit__(None, None, None)


def noise(n, seed=0):
    return (0.1 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def session_update(rate=16000, language=None, turn_detection=None):
    return {
        "type": "transcription",
        "audio": {
            "input": {
                "format": {"type": "audio/pcm", "rate": rate},
                "transcription": {"model": "nemotron-3.5-asr", "language": language},
                "turn_detection": turn_detection,
            }
        },
    }


def test_openai_sdk_realtime_transcription(asr_server, recognizer, worker):
    openai = pytest.importorskip("openai")
    x = noise(40000, 2)

    async def main():
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{asr_server.port}/v1", api_key="k")
        got = {"delta": ""}
        async with client.realtime.connect(model="nemotron-3.5-asr") as conn:
            await conn.session.update(session=session_update(language="en"))
            async for event in conn:
                got.setdefault(event.type, event)
                if event.type == "session.updated":
                    for i in range(0, len(x), 3200):
                        await conn.input_audio_buffer.append(audio=encode_pcm16(x[i : i + 3200]))
                    await conn.input_audio_buffer.commit()
                elif event.type == "conversation.item.input_audio_transcription.delta":
                    got["delta"] += event.delta
                elif event.type in (
                    "conversation.item.input_audio_transcription.completed",
                    "error",
                ):
                    break
        return got

    got = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert "error" not in got, got.get("error")
    assert got["session.created"].session.type == "transcription"
    done = got["conversation.item.input_audio_transcription.completed"]
    committed = got["input_audio_buffer.committed"]
    assert done.item_id == committed.item_id and done.content_index == 0
    # PCM16 rounding of the samples changes nothing here: the tokens are those of the offline run.
    pcm = np.frombuffer(base64.b64decode(encode_pcm16(x)), "<i2").astype(np.float32) / 32768
    want = worker.submit(lambda: recognizer.transcribe(pcm, language="en")).result()
    assert done.transcript == want.text == got["delta"] and want.text
    assert done.usage.seconds == pytest.approx(len(x) / 16000, abs=1e-3)


async def _transcribe_ws(port, x, first_update=True, rate=16000):
    """A raw client: the session events, deltas and the completed event, for one item."""
    async with websockets.connect(f"ws://127.0.0.1:{port}/v1/realtime") as ws:
        created = json.loads(await ws.recv())
        await ws.send(json.dumps({"type": "session.update", "session": session_update(rate)}))
        events = [created]
        while events[-1]["type"] not in ("session.updated", "error"):
            events.append(json.loads(await ws.recv()))
        for i in range(0, len(x), 4000):
            await ws.send(
                json.dumps(
                    {"type": "input_audio_buffer.append", "audio": encode_pcm16(x[i : i + 4000])}
                )
            )
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        while events[-1]["type"] not in (
            "conversation.item.input_audio_transcription.completed",
            "error",
        ):
            events.append(json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT)))
        return events


def test_voicechat_server_serves_a_transcription_session(tiny, worker):
    """A VoiceChat server switches a connection whose first event asks for transcription to
    a transcription session on the model's RNNT head."""
    app = create_app(tiny, worker=worker, silence_feed=False)
    with ServerThread(app) as s:
        x = noise(24000, 5)
        events = asyncio.run(_transcribe_ws(s.port, x))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "session.created" and "error" not in kinds, events[-1]
    assert events[kinds.index("session.updated")]["session"]["type"] == "transcription"
    pcm = np.frombuffer(base64.b64decode(encode_pcm16(x)), "<i2").astype(np.float32) / 32768
    want = worker.submit(tiny.transcribe, pcm).result()
    deltas = "".join(e["delta"] for e in events if e["type"].endswith("transcription.delta"))
    assert events[-1]["transcript"] == want.text == deltas


def test_two_items_and_24khz(asr_server):
    async def main():
        async with websockets.connect(f"ws://127.0.0.1:{asr_server.port}/v1/realtime") as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update", "session": session_update(24000)}))
            done = []
            for item in range(2):
                x = noise(36000, item)
                for i in range(0, len(x), 4800):
                    await ws.send(
                        json.dumps(
                            {
                                "type": "input_audio_buffer.append",
                                "audio": encode_pcm16(x[i : i + 4800]),
                            }
                        )
                    )
                await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
                while True:
                    e = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
                    assert e["type"] != "error", e
                    if e["type"].endswith("transcription.completed"):
                        done.append(e)
                        break
            return done

    a, b = asyncio.run(main())
    assert a["item_id"] != b["item_id"] and a["usage"]["seconds"] == pytest.approx(1.5, abs=0.01)


def test_lag_exceeded_says_which_side_is_behind(asr_server, recognizer):
    async def main():
        async with websockets.connect(f"ws://127.0.0.1:{asr_server.port}/v1/realtime") as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update", "session": session_update()}))
            audio = encode_pcm16(noise(int(10.5 * 16000)))
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
            while True:
                e = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
                if e["type"] == "error":
                    break
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), TIMEOUT)
            return e["error"], closed.value.rcvd.code

    error, code = asyncio.run(main())
    assert error["code"] == "lag_exceeded" and code == 1013
    assert "faster than real time (10.5 s of audio in 0." in error["message"], error
    # A client at real time and a model that falls behind it: the machine is named.
    server = create_app(recognizer, warmup=False).state.server
    c = TranscriptionConversation(server, websocket=None)
    c.backlog_since = (time.monotonic() - 20.0, 0)
    c.position, c.consumed = 20 * 16000, 5 * 16000
    assert c.check_lag()
    error = c.outbox.get_nowait()["error"]
    assert error["code"] == "lag_exceeded"
    assert "15.0 s behind the audio (the bound is 10 s): the machine is slower" in error["message"]
    # A client that paused after its first second (fed long ago), then sent 10.5 s at once:
    # judged from when the new audio began waiting, the client is named.
    c = TranscriptionConversation(server, websocket=None)
    c.handle(json.dumps({"type": "session.update", "session": session_update()}))
    c.backlog_since = (time.monotonic() - 60.0, 0)
    c.position = c.consumed = 16000
    audio = encode_pcm16(noise(int(10.5 * 16000)))
    c.handle(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
    events = [c.outbox.get_nowait() for _ in range(c.outbox.qsize())]
    error = next(e["error"] for e in events if e.get("type") == "error")
    assert "faster than real time (10.5 s of audio in 0." in error["message"], error


def test_protocol_refusals():
    p = TranscriptionRealtime("m")
    bad = [
        (
            {
                "type": "session.update",
                "session": session_update(turn_detection={"type": "server_vad"}),
            },
            "turn_detection",
        ),
        ({"type": "session.update", "session": {"type": "realtime"}}, "transcription session"),
        ({"type": "input_audio_buffer.commit"}, "nothing to commit"),
        ({"type": "response.create"}, "not served in a transcription session"),
        ({"type": "session.update", "session": session_update(rate=44100)}, "input rate 44100"),
    ]
    for event, message in bad:
        events, commands = p.receive(json.dumps(event))
        assert events[0]["type"] == "error" and message in events[0]["error"]["message"]
        assert commands == []
    events, commands = p.receive(
        json.dumps(
            {
                "type": "transcription_session.update",
                "session": {"input_audio_transcription": {"language": "de"}},
            }
        )
    )
    assert events[0]["type"] == "transcription_session.updated" and p.language == "de"

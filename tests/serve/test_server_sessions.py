"""Realtime sessions on a live server (uvicorn on 127.0.0.1, the shared tiny model, the
`websockets` client and the stock `openai` SDK client): one session at a time, cancel and
commit, the lag bound, disconnects and clients that stop reading, sessions that end by
themselves, and --max-sessions 2 and 4 (batched) with each conversation as if alone.
"""

import asyncio
import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
websockets = pytest.importorskip("websockets")

from server_support import (  # noqa: E402
    TIMEOUT,
    connect,
    drain,
    expected_responses,
    free_after_each_test,
    http,
    native_rates,
    noise,
    pcm,
    plain,  # noqa: E402, F401  (a module fixture)
    reference,
    responses,
    run,
    server_fixture,
    wait_free,
    ws_url,
)

# --- fixtures -----------------------------------------------------------------------------

small_queue = server_fixture(
    "small_queue", "A send queue of 8 events.", silence_feed=False, send_queue_size=8, warmup=False
)
short = server_fixture(
    "short",
    "Sessions that end by themselves after 0.4 s (the session's max_seconds).",
    silence_feed=False,
    session_options={"max_seconds": 0.4},
    warmup=False,
)
_SLOTS = dict(silence_feed=False, stats_every_frames=1, warmup=False)
two_slots = server_fixture(
    "two_slots", "`serve --max-sessions 2`: two conversations at a time.", max_sessions=2, **_SLOTS
)
four_slots = server_fixture(
    "four_slots",
    "`serve --max-sessions 4`: the server steps its conversations in one batch.",
    max_sessions=4,
    **_SLOTS,
)
_slots_free_after_each_test = free_after_each_test(
    "plain", "small_queue", "short", "two_slots", "four_slots"
)


# --- the tests ------------------------------------------------------------------------------


def test_busy_1013_while_another_session_computes(plain, worker):
    """The first session's frames are held behind a job on the worker (a latch) while the
    second client connects: the busy answer needs no worker and comes while the first
    session computes, whatever the machine's speed."""
    latch = threading.Event()

    async def main():
        first = await connect(plain)
        await native_rates(first)
        x = noise(1.5, 16000)
        frames = (len(x) - 199) // 1280 + 1
        held = worker.submit(latch.wait, 2 * TIMEOUT)  # the worker is busy until released
        await first.append(x, chunk=len(x))  # its frames queue behind the latch
        second = await websockets.connect(ws_url(plain), open_timeout=TIMEOUT)
        e = json.loads(await asyncio.wait_for(second.recv(), TIMEOUT))
        assert e["type"] == "error" and e["error"]["code"] == "server_busy" and e["event_id"]
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(second.recv(), TIMEOUT)
        assert second.close_code == 1013
        assert not held.done()  # answered while the first session's frames were still to run
        latch.set()
        assert held.result(TIMEOUT) is True
        await first.until_frames(frames)  # then the first session goes on
        await first.ws.close()

    try:
        run(main())
    finally:
        latch.set()  # never leave the shared worker parked


def test_cancel_keeps_the_session(plain):
    async def main():
        c = await connect(plain)
        await native_rates(c)
        x = noise(3.0, 16000, seed=5)
        sent = 0
        # one frame at a time: with no silence feed the session advances only with the audio,
        # so the response that opens stays open until the cancel
        while not any(e["type"] == "response.created" for e in c.events):
            await c.append(x[sent : sent + 1280], chunk=1280)
            sent += 1280
            await c.until(lambda e: e["type"] == "x-voicechat.stats")
        rid = next(e for e in c.events if e["type"] == "response.created")["response"]["id"]
        await c.send(type="response.cancel")
        done = await c.until_type("response.done")
        assert done["response"]["id"] == rid and done["response"]["status"] == "cancelled"
        assert done["response"]["output"][0]["status"] == "incomplete"
        n = len(c.events)
        frames = [e["frames"] for e in c.events if e["type"] == "x-voicechat.stats"][-1]
        await c.append(x[sent : sent + 12800])
        await c.until_frames(frames + 9)  # the session goes on: 9 frames more than before
        later = c.events[n:]
        assert not [e for e in later if e.get("response_id") == rid]
        # quiet from the cancel on: nothing is spoken until the model starts a new turn
        kinds = [e["type"] for e in later]
        opened = kinds.index("response.created") if "response.created" in kinds else len(kinds)
        assert "response.output_audio.delta" not in kinds[:opened]
        await c.ws.close()

    run(main())


def test_commit_lets_the_reply_finish(plain):
    async def main():
        c = await connect(plain)
        await native_rates(c)
        await c.append(noise(0.3, 16000, seed=7))
        await c.send(type="input_audio_buffer.commit")
        committed = await c.until_type("input_audio_buffer.committed")
        n = len(c.events)
        # no more client audio: the server's trailing silence lets a reply finish
        done = await c.until_type("response.done")
        assert done["response"]["status"] == "completed"
        assert any(e["type"] == "response.output_audio.delta" for e in c.events[n:])
        assert any(
            e["type"] == "conversation.item.input_audio_transcription.completed"
            and e["item_id"] == committed["item_id"]
            for e in c.events
        ) or await c.until(
            lambda e: (
                e["type"] == "conversation.item.input_audio_transcription.completed"
                and e["item_id"] == committed["item_id"]
            )
        )
        await c.ws.close()

    run(main())


def test_lag_bound_closes_1013(plain):
    async def main():
        c = await connect(plain)
        await native_rates(c)
        x = noise(10.5, 16000)  # more queued audio than the 10 s bound, in one append
        await c.send(type="input_audio_buffer.append", audio=pcm(x))
        e = await c.until_type("error")
        assert e["error"]["code"] == "lag_exceeded"
        with pytest.raises(websockets.ConnectionClosed):
            await c.recv()
        assert c.ws.close_code == 1013

    run(main())
    wait_free(plain)


def test_disconnect_mid_frame_frees_the_session(plain):
    async def main():
        c = await connect(plain)
        await native_rates(c)
        await c.append(noise(1.0, 16000), chunk=16000)
        await c.until_frames(1)
        c.ws.transport.abort()  # no close frame, while the worker computes

    run(main())
    wait_free(plain)

    async def again():
        c = await connect(plain)
        await native_rates(c)
        await c.append(noise(0.2, 16000))
        await c.until_frames(2)
        await c.ws.close()

    run(again())


def test_client_that_stops_reading_is_dropped(small_queue):
    async def main():
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", small_queue.port))
        ws = await websockets.connect(
            ws_url(small_queue), sock=sock, max_queue=1, open_timeout=TIMEOUT
        )
        x = noise(6.0, 24000)
        for i in range(0, len(x), 24000):
            await ws.send(
                json.dumps({"type": "input_audio_buffer.append", "audio": pcm(x[i : i + 24000])})
            )
        deadline = time.monotonic() + 40
        while json.loads(http(small_queue, "/health")[1])["sessions"]:
            assert time.monotonic() < deadline, "a client that does not read was not dropped"
            await asyncio.sleep(0.1)
        ws.transport.abort()

    run(main(), timeout=60)
    wait_free(small_queue)


def test_a_session_that_ends_by_itself_says_so_and_closes(short):
    async def main():
        c = await connect(short)
        await native_rates(c)
        await c.append(noise(1.0, 16000), chunk=16000)
        e = await c.until_type("error")
        assert e["error"]["code"] == "session_ended" and "max_seconds" in e["error"]["message"]
        with pytest.raises(websockets.ConnectionClosed):
            await c.recv()
        assert c.ws.close_code == 1000

    run(main())
    wait_free(short)


def test_max_sessions_2_serves_two_at_once_and_refuses_a_third(two_slots, model, worker):
    inputs = {"a": noise(1.2, 16000, seed=11), "b": noise(1.0, 16000, seed=12)}
    chunks = {k: [x[i : i + 1000] for i in range(0, len(x), 1000)] for k, x in inputs.items()}
    refs = {k: reference(worker, model, c) for k, c in chunks.items()}
    assert [f.text_id for f in refs["a"]][:12] != [f.text_id for f in refs["b"]][:12]

    async def main():
        clients = {k: await connect(two_slots) for k in inputs}
        for c in clients.values():
            await native_rates(c)
        assert json.loads(http(two_slots, "/health")[1])["sessions"] == 2
        third = await websockets.connect(ws_url(two_slots), open_timeout=TIMEOUT)
        e = json.loads(await asyncio.wait_for(third.recv(), TIMEOUT))
        assert e["type"] == "error" and e["error"]["code"] == "server_busy"
        assert "all 2 session(s)" in e["error"]["message"]
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(third.recv(), TIMEOUT)
        assert third.close_code == 1013
        for i in range(max(len(c) for c in chunks.values())):  # both stream at once
            for k, c in clients.items():
                if i < len(chunks[k]):
                    await c.append(chunks[k][i])
        for k, c in clients.items():
            await c.until_frames(len(refs[k]))
        await clients["a"].ws.close()
        deadline = time.monotonic() + TIMEOUT
        while json.loads(http(two_slots, "/health")[1])["sessions"] != 1:
            assert time.monotonic() < deadline, "the closed session's slot was not freed"
            await asyncio.sleep(0.05)
        again = await connect(two_slots)  # a freed slot takes a new conversation
        await again.ws.close()
        await clients["b"].ws.close()
        return {k: c.events for k, c in clients.items()}

    events = run(main())
    for k in inputs:  # each conversation is its own session's, as if it were alone
        got, want = responses(events[k]), expected_responses(refs[k], 22050)
        assert want and len(got) == len(want), k
        for (_, audio, text, _), (w_audio, w_text, _) in zip(got, want):
            assert audio == w_audio and text == w_text, k
    wait_free(two_slots)


async def _sdk_conversation(server, x, start=None):
    """A stock ``openai`` realtime client: 16 kHz in / 22.05 kHz out, ``x`` in 100 ms chunks;
    returns its audio deltas and transcript deltas once every frame of the input is in (the
    server's stats events count them)."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused")
    audio, text = [], []
    frames = (len(x) - 199) // 1280 + 1
    extensions = {"x-voicechat": "1"}  # the stats events count the frames
    async with client.realtime.connect(model="nemotron-voicechat", extra_query=extensions) as conn:
        await conn.session.update(
            session={
                "type": "realtime",
                "audio": {
                    "input": {"format": {"type": "audio/pcm", "rate": 16000}},
                    "output": {"format": {"type": "audio/pcm", "rate": 22050}},
                },
            }
        )
        async for event in conn:
            if event.type == "session.updated":
                if start is not None:
                    await start.wait()  # every client streams at once
                for i in range(0, len(x), 1600):
                    await conn.input_audio_buffer.append(audio=pcm(x[i : i + 1600]))
            elif event.type == "response.output_audio.delta":
                audio.append(event.delta)
            elif event.type == "response.output_audio_transcript.delta":
                text.append(event.delta)
            elif event.type == "x-voicechat.stats" and event.model_dump()["frames"] >= frames:
                break
            assert event.type != "error", event
        reader = asyncio.create_task(drain(conn))
    await asyncio.wait_for(reader, TIMEOUT)
    return audio, text


def test_max_sessions_4_batches_four_stock_clients_each_as_alone(four_slots, worker, monkeypatch):
    """Four stock ``openai`` realtime clients at once on one server with --max-sessions 4:
    its steps are batched (more than one conversation per step), and each client gets the
    audio and text it gets alone on the same server."""
    pytest.importorskip("openai")
    from mlx_voicechat.nemotron_voicechat.runtime.batch import SessionBatch

    inputs = [noise(1.6, 16000, seed=40 + i) for i in range(4)]
    alone = [run(_sdk_conversation(four_slots, x)) for x in inputs]
    wait_free(four_slots)
    widths = []
    real = SessionBatch.step
    monkeypatch.setattr(
        SessionBatch,
        "step",
        lambda self, *a, **k: widths.append(sum(h.ready for h in self.sessions)) or real(self, *a, **k),
    )

    async def together():
        start = asyncio.Event()
        tasks = [asyncio.create_task(_sdk_conversation(four_slots, x, start)) for x in inputs]
        await asyncio.sleep(0.5)
        start.set()
        return await asyncio.gather(*tasks)

    got = run(together())
    for (a, t), (wa, wt) in zip(got, alone):
        assert a and a == wa and t == wt
    assert max(widths) > 1  # conversations shared a step
    wait_free(four_slots)

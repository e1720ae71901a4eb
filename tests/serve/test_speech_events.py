"""input_audio_buffer.speech_started / speech_stopped: the speech detector on its own (espeak-ng
speech after 1 s of silence starts speech within 200 ms of its onset, dated at the onset;
10 s of silence or of noise at -50 dBFS never does; any chunking gives the same edges), and
through a real socket at real time (the events, their item_id and times, turn_detection)."""

import asyncio
import shutil
import subprocess
import time

import numpy as np
import pytest

from mlx_voicechat.audio.vad import SpeechDetector, SpeechEdge
from mlx_voicechat.serve.protocol import Realtime
from mlx_voicechat.serve.speech import SpeechEvents
from mlx_voicechat.serve.wire import Resampler

RATE = 16000
SPOKEN = "Hello there. What is the weather like in Paris today?"


def noise(seconds, dbfs, seed=0):
    """White noise whose RMS is ``dbfs`` (20 log10 of the RMS, full scale 1)."""
    x = np.random.default_rng(seed).standard_normal(int(seconds * RATE))
    return (x / np.sqrt(np.mean(x**2)) * 10 ** (dbfs / 20)).astype(np.float32)


def onset(x, dbfs=-60.0, window=160):
    """The first sample of the first 10 ms window louder than ``dbfs``."""
    n = x.size // window
    rms = np.sqrt(np.mean(x[: n * window].reshape(n, window) ** 2, axis=1))
    return int(np.argmax(rms > 10 ** (dbfs / 20))) * window


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    """espeak-ng's voice saying SPOKEN, at 16 kHz float32 (its own leading and trailing
    silence cut)."""
    import soundfile as sf

    espeak = shutil.which("espeak-ng")
    if espeak is None:
        pytest.skip("espeak-ng is needed for spoken test audio (apt-get install espeak-ng)")
    wav = tmp_path_factory.mktemp("speech") / "spoken.wav"
    subprocess.run([espeak, "-w", str(wav), SPOKEN], check=True, capture_output=True, timeout=30)
    x, rate = sf.read(wav, dtype="float32")
    x = Resampler(rate, RATE)(x, last=True)
    x = x[onset(x) :]
    return x[: x.size - onset(x[::-1].copy())]


def run(detector, x, chunk):
    """Push ``x`` in chunks of ``chunk`` samples: [(edge, samples pushed when it came)]."""
    out, pushed = [], 0
    for i in range(0, x.size, chunk):
        part = x[i : i + chunk]
        pushed += part.size
        out += [(e, pushed) for e in detector.push(part)]
    return out


def test_speech_after_a_second_of_silence_starts_within_200_ms_and_stops(speech):
    lead, tail = RATE, 2 * RATE
    x = np.concatenate([np.zeros(lead, np.float32), speech, np.zeros(tail, np.float32)])
    edges = run(SpeechDetector(RATE), x, chunk=320)  # 20 ms appends, as a microphone sends
    kinds = [e.kind for e, _ in edges]
    assert kinds == ["started", "stopped"], edges
    (start, seen_at), (stop, stop_seen) = edges
    assert lead - 160 <= start.sample <= lead + 800  # dated at the onset (50 ms)
    assert seen_at - lead <= 0.2 * RATE  # known within 200 ms of the onset
    end = lead + speech.size
    assert end - 0.2 * RATE <= stop.sample <= end + 160  # the last loud window
    assert stop_seen - stop.sample <= 0.6 * RATE  # after the 500 ms hangover


def test_speech_over_low_noise_is_found_too(speech):
    bed = noise(4.0, -50, seed=1)
    x = bed.copy()
    x[RATE : RATE + speech.size] += speech[: bed.size - RATE]
    edges = run(SpeechDetector(RATE), x, chunk=480)
    assert edges[0][0].kind == "started" and edges[0][1] - RATE <= 0.2 * RATE
    assert abs(edges[0][0].sample - RATE) <= 800


@pytest.mark.parametrize(
    "audio",
    [np.zeros(10 * RATE, np.float32), noise(10.0, -50, seed=2), noise(10.0, -50, seed=3)],
    ids=["silence", "noise-50dBFS", "noise-50dBFS-b"],
)
def test_ten_seconds_of_silence_or_low_noise_never_start_speech(audio):
    assert run(SpeechDetector(RATE), audio, chunk=320) == []


def test_any_chunking_gives_the_same_edges(speech):
    x = np.concatenate([np.zeros(RATE, np.float32), speech, np.zeros(RATE, np.float32)])
    want = [e for e, _ in run(SpeechDetector(RATE), x, chunk=x.size)]
    rng = np.random.default_rng(4)
    d, got, i = SpeechDetector(RATE), [], 0
    while i < x.size:
        n = int(rng.integers(1, 3000))
        got += d.push(x[i : i + n])
        i += n
    assert got == want and len(want) == 2 and all(isinstance(e, SpeechEdge) for e in want)


def test_the_events_name_the_user_item_and_the_session_says_server_vad(speech):
    p = Realtime()
    assert p.session_object()["audio"]["input"]["turn_detection"] is None  # no detector: none
    events = SpeechEvents(p)
    td = p.session_object()["audio"]["input"]["turn_detection"]
    assert td["type"] == "server_vad" and td["silence_duration_ms"] == 500
    assert td["create_response"] is False and td["interrupt_response"] is False
    x = np.concatenate([np.zeros(RATE, np.float32), speech, np.zeros(RATE, np.float32)])
    out = events.push(x[:RATE], 8000) + events.push(x[RATE:], 8000 + RATE)  # 0.5 s in already
    types = [e["type"] for e in out]
    assert types == [
        "conversation.item.added",
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
    ]
    item = out[0]["item"]["id"]
    assert out[1]["item_id"] == out[2]["item_id"] == item
    assert abs(out[1]["audio_start_ms"] - 1500) <= 50
    assert out[2]["audio_end_ms"] > out[1]["audio_start_ms"] + 1000


# --- through a socket, at real time -----------------------------------------------------------

pytest.importorskip("fastapi")
websockets = pytest.importorskip("websockets")
from server_support import connect, native_rates, pcm


def test_speech_events_over_the_socket_at_real_time(model, worker, speech):  # noqa: F811
    from mlx_voicechat.serve.app import ServerThread, create_app

    app = create_app(model, worker=worker, warmup=False)
    chunk = 320  # 20 ms
    x = np.concatenate([np.zeros(RATE, np.float32), speech, np.zeros(RATE, np.float32)])
    x16 = np.clip(np.round(x * 32767), -32768, 32767).astype(np.int16)

    async def main(server):
        c = await connect(server)
        td = c.events[0]["session"]["audio"]["input"]["turn_detection"]
        assert td["type"] == "server_vad"
        await native_rates(c)
        t0, started_at, sent = time.monotonic(), None, 0
        for i in range(0, x16.size, chunk):
            await c.send(type="input_audio_buffer.append", audio=pcm(x16[i : i + chunk]))
            sent = i + chunk
            while True:  # what has come back by now
                try:
                    e = await c.recv(timeout=0.001)
                except asyncio.TimeoutError:
                    break
                if e["type"] == "input_audio_buffer.speech_started" and started_at is None:
                    started_at = sent
            await asyncio.sleep(max(0.0, t0 + sent / RATE - time.monotonic()))
        def of(kind):
            return [e for e in c.events if e["type"] == "input_audio_buffer." + kind]

        if not of("speech_stopped"):
            await c.until_type("input_audio_buffer.speech_stopped")
        (started,), (stopped,) = of("speech_started"), of("speech_stopped")
        await c.ws.close()
        return started, started_at, stopped

    with ServerThread(app) as server:
        started, started_at, stopped = asyncio.run(asyncio.wait_for(main(server), 120))
    # audio times count from the session's first sample (the client's, here)
    assert abs(started["audio_start_ms"] - 1000) <= 50
    assert started_at is not None and started_at - RATE <= 0.2 * RATE  # within 200 ms of audio
    assert stopped["item_id"] == started["item_id"] and isinstance(started["item_id"], str)
    assert stopped["audio_end_ms"] > started["audio_start_ms"] + 1000

"""Figures for input_audio_buffer.speech_started: how soon a client hears that the user started
speaking, and what the detector costs.

1. latency: a real server (the tiny checkpoint, 127.0.0.1) and a client that sends 1 s of
   silence then espeak-ng speech, in 20 ms appends paced at real time; per trial, the wall time
   from the append holding the speech's first sample leaving the client to speech_started
   arriving, and the event's audio_start_ms against the true onset (1000 ms).
2. cost: the detector alone (runtime/vad.py) on 60 s of speech and noise, microseconds per 80 ms
   frame of 16 kHz audio (it runs on the event loop as audio arrives, never on the worker).

Run: python benchmarks/bench_speech.py [--trials 5]
"""

import argparse
import asyncio
import base64
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_voicechat.audio.vad import SpeechDetector
from mlx_voicechat.serve.app import ServerThread, create_app
from mlx_voicechat.serve.wire import Resampler
from mlx_voicechat.serve.worker import Worker

RATE = 16000
CHUNK = 320  # 20 ms
SPOKEN = "Hello there. What is the weather like in Paris today?"


def speech(tmp: Path) -> np.ndarray:
    import soundfile as sf

    espeak = shutil.which("espeak-ng")
    if espeak is None:
        sys.exit("bench_speech: espeak-ng is needed (apt-get install espeak-ng)")
    wav = tmp / "spoken.wav"
    subprocess.run([espeak, "-w", str(wav), SPOKEN], check=True, capture_output=True, timeout=30)
    x, rate = sf.read(wav, dtype="float32")
    x = Resampler(rate, RATE)(x, last=True)
    n = x.size // 160
    rms = np.sqrt(np.mean(x[: n * 160].reshape(n, 160) ** 2, axis=1))
    return x[int(np.argmax(rms > 1e-3)) * 160 :]


def pcm(x: np.ndarray) -> str:
    x16 = np.clip(np.round(x * 32767), -32768, 32767).astype("<i2")
    return base64.b64encode(x16.tobytes()).decode()


async def trial(port: int, audio: np.ndarray):
    import websockets

    async with websockets.connect(f"ws://127.0.0.1:{port}/v1/realtime", max_queue=None) as ws:
        await ws.recv()  # session.created
        await ws.send(
            json.dumps(
                {
                    "type": "session.update",
                    "session": {
                        "type": "realtime",
                        "audio": {"input": {"format": {"type": "audio/pcm", "rate": RATE}}},
                    },
                }
            )
        )
        got = {}

        async def reader():
            async for raw in ws:
                e = json.loads(raw)
                if e["type"] == "input_audio_buffer.speech_started" and "t" not in got:
                    got.update(t=time.perf_counter(), ms=e["audio_start_ms"])

        task = asyncio.create_task(reader())
        t0, onset_sent = time.perf_counter(), None
        for i in range(0, audio.size, CHUNK):
            await ws.send(
                json.dumps(
                    {"type": "input_audio_buffer.append", "audio": pcm(audio[i : i + CHUNK])}
                )
            )
            if onset_sent is None and i + CHUNK > RATE:
                onset_sent = time.perf_counter()
            await asyncio.sleep(max(0.0, t0 + (i + CHUNK) / RATE - time.perf_counter()))
            if "t" in got and i > 2 * RATE:
                break
        task.cancel()
        if "t" not in got:
            return None
        return (got["t"] - onset_sent) * 1000, got["ms"] - 1000


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=5)
    args = p.parse_args(argv)
    import mlx_voicechat
    from mlx_voicechat.factory import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        voice = speech(Path(tmp))
        audio = np.concatenate([np.zeros(RATE, np.float32), voice[: 2 * RATE]])
        worker = Worker.shared()
        model = worker.submit(
            lambda: mlx_voicechat.load(make_checkpoint(Path(tmp) / "tiny", "tiny", seed=0))
        ).result()
        app = create_app(model, worker=worker)
        results = []
        with ServerThread(app) as server:
            for _ in range(args.trials):
                results.append(asyncio.run(trial(server.port, audio)))
    found = [r for r in results if r is not None]
    print(f"latency: {len(found)}/{len(results)} trials saw speech_started")
    if found:
        wall = [r[0] for r in found]
        dated = [r[1] for r in found]
        median = statistics.median(wall)
        print(
            f"  onset append sent -> speech_started received: median {median:.0f} ms, "
            f"max {max(wall):.0f} ms (200 ms budget)"
        )
        print(f"  audio_start_ms - true onset: {', '.join(f'{d:+d}' for d in dated)} ms")

    rng = np.random.default_rng(0)
    long = np.concatenate(
        [
            np.tile(voice, 60 * RATE // voice.size + 1)[: 30 * RATE],
            (rng.standard_normal(30 * RATE) * 10 ** (-50 / 20)).astype(np.float32),
        ]
    )
    d, t = SpeechDetector(RATE), time.perf_counter()
    for i in range(0, long.size, 1280):
        d.push(long[i : i + 1280])
    per_frame = (time.perf_counter() - t) / (long.size / 1280) * 1e6
    print(f"cost: {per_frame:.1f} us per 80 ms frame ({per_frame / 80e3 * 100:.3f} % of real time)")


if __name__ == "__main__":
    main()

"""The paced microphone track of the WebRTC tests and of benchmarks/bench_webrtc_network.py
(aiortc and PyAV needed)."""

import asyncio
import fractions
import time

import numpy as np
from aiortc import MediaStreamTrack


class Noise(MediaStreamTrack):
    """A microphone: 20 ms Opus-sized frames at 48 kHz, noise for ``sound`` seconds (the model
    hears sound), then silence, paced at real time."""

    kind = "audio"

    def __init__(self, sound=1.2):
        super().__init__()
        self.sound, self.pts, self.t0 = sound, 0, None
        self.rng = np.random.default_rng(0)

    async def recv(self):
        import av

        if self.t0 is None:
            self.t0 = time.monotonic()
        else:
            self.pts += 960
            await asyncio.sleep(max(0.0, self.t0 + self.pts / 48000 - time.monotonic()))
        loud = 3000 if self.pts < self.sound * 48000 else 0
        pcm = (self.rng.standard_normal(960) * loud).astype("<i2")
        frame = av.AudioFrame(format="s16", layout="mono", samples=960)
        frame.planes[0].update(pcm.tobytes())
        frame.sample_rate, frame.pts = 48000, self.pts
        frame.time_base = fractions.Fraction(1, 48000)
        return frame

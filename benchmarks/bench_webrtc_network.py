"""WebRTC under a bad network: does the model's input keep its 80 ms clock?

`serve`'s app on 127.0.0.1 (the tiny random-weight checkpoint) takes one aiortc call per
condition: packet loss 0 / 5 / 10 % and up to 30 ms of jitter (each RTP/RTCP packet, both ways,
dropped with that probability or delayed by a uniform 0..jitter, so packets also arrive out of
order), injected inside the transport (aiortc's DTLS transport's send). The client's track is
1.2 s of noise, then silence, paced at real time, for --seconds.

Then the same audio over the WebSocket, as 80 ms appends, with TCP's behaviour under the same
loss and jitter emulated per message (in order; a lost one resent after the 200 ms minimum RTO,
holding back every one after it).

Printed per condition, from the server:
- frames: 80 ms input frames the model stepped; late: frames stepped more than 0.4 s after their
  audio was due on the wall clock (the clock's silence grace is 0.24 s, a job is up to 4
  frames), and the p50 / p95 / max of that delay;
- concealed: seconds of lost audio heard as silence at once; dropped: seconds of audio that came
  after the clock had filled its place; clock: seconds of silence the clock fed;
and from the client: the model's audio frames received, and gaps (receive intervals over 60 ms)
in them.

Run: python benchmarks/bench_webrtc_network.py [--seconds 10] [--loss 0 5 10] [--jitter-ms 30]
"""

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlx_voicechat.serve.app import ServerThread, create_app  # noqa: E402
from mlx_voicechat.serve.connection import Conversation  # noqa: E402
from mlx_voicechat.serve.wire import MODEL_INPUT_RATE, Append  # noqa: E402
from mlx_voicechat.serve.worker import Worker  # noqa: E402

LATE_SECONDS = 0.4
FRAME = 1280  # samples at 16 kHz


class Impairment:
    """Loss and jitter on every packet aiortc sends (both peers live in this process)."""

    def __init__(self):
        self.loss, self.jitter, self.rng = 0.0, 0.0, random.Random(0)
        self.sent = self.lost = 0

    def install(self):
        from aiortc.rtcdtlstransport import RTCDtlsTransport

        original = RTCDtlsTransport._send_rtp
        impairment = self

        async def send(transport, data):
            impairment.sent += 1
            if impairment.rng.random() < impairment.loss:
                impairment.lost += 1
                return
            delay = impairment.rng.uniform(0, impairment.jitter)
            if delay <= 0:
                return await original(transport, data)

            async def later():
                await asyncio.sleep(delay)
                with contextlib.suppress(ConnectionError):  # the call closed meanwhile
                    await original(transport, data)

            asyncio.get_running_loop().create_task(later())

        RTCDtlsTransport._send_rtp = send


class Record:
    """What the server's call did: when each frame was stepped, what was concealed."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.delays, self.totals = [], None

    def install(self):
        rec = self
        feed, free = Conversation._feed, Conversation.free  # both transports
        command = Conversation.command

        def first_audio(self, c):
            # The audio's origin on the wall clock: the first client audio's arrival less its
            # length (a WebSocket append carries 80 ms, an RTP packet 20 ms).
            if isinstance(c, Append) and not c.silence and not hasattr(self, "_origin"):
                self._origin = time.monotonic() - c.samples.size / MODEL_INPUT_RATE
            return command(self, c)

        async def timed_feed(self, samples):
            before = self.consumed
            await feed(self, samples)
            now = time.monotonic()
            for end in range(before + FRAME, self.consumed + 1, FRAME):
                rec.delays.append(now - (self._origin + end / MODEL_INPUT_RATE))

        def counted_free(self):
            heard = self.position / MODEL_INPUT_RATE
            concealed, dropped = getattr(self, "concealed", 0.0), getattr(self, "dropped", 0.0)
            clock = heard - self.client_seconds - concealed
            rec.totals = (concealed, dropped, max(clock, 0.0))
            return free(self)

        Conversation._feed = timed_feed
        Conversation.command = first_audio
        Conversation.free = counted_free


def noise_track(sound_seconds: float):
    """The WebRTC tests' paced microphone (tests/support/webrtc_support.py): noise, then silence."""
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from webrtc_support import Noise

    return Noise(sound=sound_seconds)


async def one_call(url: str, seconds: float) -> dict:
    from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
    from aiortc.mediastreams import MediaStreamError

    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTrack(noise_track(1.2))
    channel = pc.createDataChannel("oai-events")
    events, arrivals = [], []
    channel.on("message", lambda m: events.append(json.loads(m)["type"]))

    async def listen(track):
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            arrivals.append((time.monotonic(), float(np.abs(frame.to_ndarray()).max())))

    pc.on("track", lambda t: asyncio.ensure_future(listen(t)))
    await pc.setLocalDescription(await pc.createOffer())
    request = urllib.request.Request(
        url + "/v1/realtime/calls",
        data=pc.localDescription.sdp.encode(),
        headers={"Content-Type": "application/sdp"},
        method="POST",
    )
    answer = await asyncio.to_thread(lambda: urllib.request.urlopen(request, timeout=30).read())
    await pc.setRemoteDescription(RTCSessionDescription(answer.decode(), "answer"))
    await asyncio.sleep(seconds)
    await pc.close()
    times = [t for t, _ in arrivals]
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {
        "received": len(arrivals),
        "gaps": sum(g > 0.06 for g in gaps),
        "max_gap": max(gaps, default=0.0),
        "errors": events.count("error"),
        "responses": events.count("response.done"),
    }


RTO_SECONDS = 0.2  # Linux's minimum TCP retransmission timeout


async def ws_call(url: str, seconds: float, loss: float, jitter: float, seed: int = 0) -> dict:
    """The same audio over the WebSocket, 80 ms appends at real time, with TCP's behaviour under
    the same loss and jitter emulated per message: a lost one is resent after the minimum RTO,
    and TCP delivers in order, so a late or lost message holds back every one after it."""
    import base64

    import websockets

    rng, noise = random.Random(seed), np.random.default_rng(0)
    held, sent = 0, 0
    async with websockets.connect(url.replace("http", "ws") + "/v1/realtime") as ws:
        update = {
            "type": "session.update",
            "session": {
                "type": "realtime",
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}},
            },
        }
        await ws.send(json.dumps(update))

        async def drain():
            async for _ in ws:
                pass

        reader = asyncio.ensure_future(drain())
        t0, delivered = time.monotonic(), 0.0
        for k in range(int(seconds / 0.08)):
            loud = 3000 if k * 0.08 < 1.2 else 0
            pcm = (noise.standard_normal(1280) * loud).astype("<i2").tobytes()
            ready = t0 + (k + 1) * 0.08  # the frame's audio is complete
            at = ready + rng.uniform(0, jitter) + (RTO_SECONDS if rng.random() < loss else 0)
            if at < delivered:
                held += 1  # head-of-line: waits for an earlier message
            delivered = max(at, delivered)
            await asyncio.sleep(max(0.0, delivered - time.monotonic()))
            append = {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}
            await ws.send(json.dumps(append))
            sent += 1
        await asyncio.sleep(0.5)
        reader.cancel()
    return {"sent": sent, "held": held}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--loss", type=float, nargs="+", default=[0, 5, 10])
    parser.add_argument("--jitter-ms", type=float, default=30.0)
    args = parser.parse_args()

    from mlx_voicechat.factory import make_checkpoint

    worker = Worker.shared()
    path = make_checkpoint(Path(tempfile.mkdtemp()) / "tiny", "tiny", seed=0)
    model = worker.submit(lambda: __import__("mlx_voicechat").load(path)).result()
    impairment, record = Impairment(), Record()
    impairment.install()
    record.install()
    app = create_app(model, worker=worker)
    print(f"tiny checkpoint, {args.seconds:g} s per call, jitter 0..{args.jitter_ms:g} ms")
    print(
        "loss%  sent  lost | frames  late  delay p50/p95/max (s) | concealed dropped clock (s)"
        " | rx frames gaps max_gap(s) errors"
    )
    with ServerThread(app) as server:
        print("WebRTC (RTP/UDP, loss and jitter on each packet):")
        for loss in args.loss:
            impairment.loss, impairment.jitter = loss / 100, args.jitter_ms / 1000
            impairment.sent = impairment.lost = 0
            record.reset()
            client = asyncio.run(one_call(server.url, args.seconds))
            deadline = time.monotonic() + 30
            while app.state.server.active and time.monotonic() < deadline:
                time.sleep(0.05)
            d = np.array(record.delays) if record.delays else np.zeros(1)
            late = int((d > LATE_SECONDS).sum())
            concealed, dropped, clock = record.totals or (0.0, 0.0, 0.0)
            print(
                f"{loss:5g} {impairment.sent:5d} {impairment.lost:5d} | {len(record.delays):6d}"
                f" {late:5d}  {np.percentile(d, 50):.3f}/{np.percentile(d, 95):.3f}/{d.max():.3f}"
                f" | {concealed:9.2f} {dropped:7.2f} {clock:5.2f}"
                f" | {client['received']:9d} {client['gaps']:4d} {client['max_gap']:10.3f}"
                f" {client['errors']:6d}"
            )
        print("WebSocket (TCP emulated per 80 ms message: in order, a loss resent after 200 ms):")
        print("loss%  sent  held | frames  late  delay p50/p95/max (s)")
        for loss in args.loss:
            record.reset()
            impairment.loss = impairment.jitter = 0.0
            r = asyncio.run(ws_call(server.url, args.seconds, loss / 100, args.jitter_ms / 1000))
            deadline = time.monotonic() + 30
            while app.state.server.active and time.monotonic() < deadline:
                time.sleep(0.05)
            d = np.array(record.delays) if record.delays else np.zeros(1)
            late = int((d > LATE_SECONDS).sum())
            print(
                f"{loss:5g} {r['sent']:5d} {r['held']:5d} | {len(record.delays):6d}"
                f" {late:5d}  {np.percentile(d, 50):.3f}/{np.percentile(d, 95):.3f}/{d.max():.3f}"
            )


if __name__ == "__main__":
    main()

"""WebRTC under a bad network: does the model's input keep its 80 ms clock, and how long from
the user's sound to the model's answer reaching the client, against the WebSocket?

`serve`'s app on 127.0.0.1 (the tiny random-weight checkpoint) takes one aiortc call per
condition: a clean loopback (no loss, no jitter), then packet loss 0 / 5 / 10 % with up to 30 ms
of jitter (each RTP/RTCP packet, both ways, dropped with that probability or delayed by a
uniform 0..jitter, so packets also arrive out of order), injected inside the transport (aiortc's
DTLS transport's send; the first 20 packets pass untouched so that both sides' timelines start
together). The client's track is 1.2 s of noise, then silence, paced at real time, for
--seconds.

Then the same audio over the WebSocket to the same server, as 80 ms appends at real time,
through a TCP proxy on 127.0.0.1 that simulates the same network for TCP (this kernel has no
netem): both ways, each MSS-sized (1448 bytes) segment is delayed by uniform 0..jitter, a lost
one arrives one retransmission timeout later (Linux's minimum RTO, 200 ms), and TCP delivers in
order, so everything after a late or lost segment is held back with it (head-of-line blocking).
Fast retransmit (three duplicate ACKs, about one round trip) is not simulated: this is TCP's
behaviour when a loss is repaired by the timeout, its worst common case.

Printed per condition, from the server:
- frames: 80 ms input frames the model stepped; late: frames stepped more than 0.4 s after their
  audio was due on the wall clock (the clock's silence grace is 0.24 s, a job is up to 4
  frames), and the p50 / p95 / max of that delay;
- concealed: seconds of lost audio heard as silence at once; dropped: seconds of audio that came
  after the clock had filled its place; clock: seconds of silence the clock fed;
from the client: the model's audio frames received, and gaps (receive intervals over 60 ms)
in them; and mouth-to-ear: for each input frame whose step gave audio, from the frame's last
sample leaving the client (the RTP packet handed to the encoder; the WebSocket append written
to its socket) to the first of that frame's output audio reaching the client (the RTP packet
decoded, with a live jitter buffer: no playout delay; the audio delta read off the socket),
p50 / p95 / max. The WebRTC track is paced at real time by the server, so its audio arrives
as it is to be played; the WebSocket's deltas come as fast as the server steps, so for it also
"plays": each frame at the later of its arrival and the end of the frame before (a player that
never drops, with no start buffer). Client and server share the clock (one process).

Run: python benchmarks/bench_webrtc_network.py [--seconds 10] [--loss 0 5 10] [--jitter-ms 30]
"""

import argparse
import asyncio
import contextlib
import json
import os
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
UNTOUCHED = 20  # RTP/RTCP packets of a call that pass unimpaired (both timelines start together)
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
            if impairment.sent <= UNTOUCHED:
                return await original(transport, data)
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
    """What the server's call did: when each frame was stepped, what was concealed, and where
    each frame's output audio went (the WebSocket's delta, the WebRTC track's sample)."""

    def __init__(self):
        self.reset()
        self.needed = None  # the session's samples_needed(k)

    def reset(self):
        self.delays, self.totals, self.track_at = [], None, {}

    def install(self):
        from mlx_voicechat.serve import webrtc_call
        from mlx_voicechat.serve.protocol import Realtime

        rec = self
        feed, free = Conversation._feed, Conversation.free  # both transports
        command, frames = Conversation.command, Realtime.frames
        speak, track_class = webrtc_call.RtcConversation._speak, webrtc_call._track_class

        def first_audio(self, c):
            # The audio's origin on the wall clock: the first client audio's arrival less its
            # length (a WebSocket append carries 80 ms, an RTP packet 20 ms).
            if isinstance(c, Append) and not c.silence and not hasattr(self, "_origin"):
                self._origin = time.monotonic() - c.samples.size / MODEL_INPUT_RATE
            return command(self, c)

        async def timed_feed(self, samples):
            rec.needed = self.session.samples_needed
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

        def tagged_frames(self, frame_events):
            # Each audio delta names the input frame whose step made it (x_frame: read by the
            # WebSocket client and by the WebRTC track's bookkeeping below).
            out = []
            for f in frame_events:
                events = frames(self, [f])
                for e in events:
                    if e.get("type") == "response.output_audio.delta":
                        e["x_frame"] = self.responses.frames_seen - 1
                out += events
            return out

        def placed_speak(self, e):
            # Where the delta's audio starts on the outgoing track: after what was sent and
            # what is queued.
            at = self.out.taken + self.out.buffered
            rec.track_at.setdefault(e.get("x_frame"), at)
            return speak(self, e)

        def counting_track_class():
            class Counted(track_class()):
                taken = 0  # samples the track has sent (audio and silence)

                def _take(self, n):
                    self.taken += n
                    return super()._take(n)

            return Counted

        Conversation._feed = timed_feed
        Conversation.command = first_audio
        Conversation.free = counted_free
        Realtime.frames = tagged_frames
        webrtc_call.RtcConversation._speak = placed_speak
        webrtc_call._track_class = counting_track_class


class TimedNoise:
    """The WebRTC tests' paced microphone (tests/support/webrtc_support.py): noise, then silence; when
    each 20 ms packet left for the encoder (pts -> monotonic seconds)."""

    def __new__(cls, sound_seconds: float):
        sys.path.insert(0, str(ROOT / "tests" / "support"))
        from webrtc_support import Noise

        class Timed(Noise):
            async def recv(self):
                frame = await super().recv()
                self.left[frame.pts] = time.monotonic()
                return frame

        track = Timed(sound=sound_seconds)
        track.left = {}
        return track


def percentiles(values) -> str:
    if not values:
        return "     –/     –/     –"
    v = np.array(values)
    return f"{np.percentile(v, 50):6.3f}/{np.percentile(v, 95):6.3f}/{v.max():6.3f}"


async def one_call(url: str, seconds: float, record: Record) -> dict:
    from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
    from aiortc.mediastreams import MediaStreamError

    from mlx_voicechat.serve.webrtc_call import live_receiver

    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    mic = TimedNoise(1.2)
    pc.addTrack(mic)
    channel = pc.createDataChannel("oai-events")
    events, arrivals = [], []
    channel.on("message", lambda m: events.append(json.loads(m)["type"]))

    async def listen(track):
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            level = float(np.abs(frame.to_ndarray()).max())
            arrivals.append((time.monotonic(), frame.pts, level))

    pc.on("track", lambda t: asyncio.ensure_future(listen(t)))
    await pc.setLocalDescription(await pc.createOffer())
    for t in pc.getTransceivers():  # decoded as it arrives, as the server does: no playout wait
        live_receiver(t.receiver)
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
    times = [t for t, _, _ in arrivals]
    gaps = [b - a for a, b in zip(times, times[1:])]
    # mouth-to-ear: frame k's last sample (16 kHz index needed(k) - 1, 48 kHz on the wire) left
    # in the packet holding it; its output's first sample arrived in the packet holding it.
    first = arrivals[0][1] if arrivals else 0
    got = {pts - first: t for t, pts, _ in arrivals}
    ear = []
    for k, at in record.track_at.items():
        last = 3 * (record.needed(k) - 1)
        left = mic.left.get(last // PACKET * PACKET)
        heard = got.get(at // PACKET * PACKET)
        if left is not None and heard is not None:
            ear.append(heard - left)
    return {
        "received": len(arrivals),
        "gaps": sum(g > 0.06 for g in gaps),
        "max_gap": max(gaps, default=0.0),
        "errors": events.count("error"),
        "ear": ear,
    }


PACKET = 960  # 20 ms at 48 kHz
RTO_SECONDS = 0.2  # Linux's minimum TCP retransmission timeout
MSS = 1448  # bytes of a TCP segment (Ethernet MTU less IP and TCP headers with timestamps)


class TcpNetwork:
    """A TCP proxy on 127.0.0.1 that gives a connection the network's loss and jitter, both
    ways, as TCP would see them: each segment delayed by 0..jitter, a lost one delivered one RTO
    later, and in order, so a late segment holds back every one after it."""

    def __init__(self, target: tuple, loss: float, jitter: float, seed: int = 0):
        self.target, self.loss, self.jitter = target, loss, jitter
        self.rng = random.Random(seed)
        self.segments = self.lost = self.held = 0
        self.connections: set = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def stop(self):
        """Stop listening; the connections finish (both sides closed) or are ended in 2 s."""
        self.server.close()
        if self.connections:
            _, left = await asyncio.wait(self.connections, timeout=2.0)
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)

    def _connection(self, client_r, client_w):
        task = asyncio.ensure_future(self._relay(client_r, client_w))
        self.connections.add(task)

    async def _relay(self, client_r, client_w):
        server_r, server_w = await asyncio.open_connection(*self.target)
        await asyncio.gather(
            self._pipe(client_r, server_w), self._pipe(server_r, client_w), return_exceptions=True
        )

    async def _pipe(self, src, dst):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver():
            while True:
                at, data = await queue.get()
                await asyncio.sleep(max(0.0, at - loop.time()))
                if data is None:
                    dst.close()
                    return
                dst.write(data)
                await dst.drain()

        sender = asyncio.ensure_future(deliver())
        last = 0.0
        try:
            while data := await src.read(65536):
                now = loop.time()
                for i in range(0, len(data), MSS):
                    self.segments += 1
                    at = now + self.rng.uniform(0, self.jitter)
                    if self.rng.random() < self.loss:
                        self.lost += 1
                        at += RTO_SECONDS
                    if at < last:
                        self.held += 1  # head-of-line: waits for an earlier segment
                    last = max(last, at)
                    queue.put_nowait((last, data[i : i + MSS]))
        finally:
            queue.put_nowait((last, None))
            await sender


async def ws_call(url: str, seconds: float, loss: float, jitter: float, record: Record) -> dict:
    """The same audio over the WebSocket through :class:`TcpNetwork`, 80 ms appends at real
    time; mouth-to-ear from each append written to the socket to its frame's delta read."""
    import base64
    from urllib.parse import urlparse

    import websockets

    target = urlparse(url)
    network = TcpNetwork((target.hostname, target.port), loss, jitter)
    port = await network.start()
    noise = np.random.default_rng(0)
    left, heard = {}, {}
    async with websockets.connect(f"ws://127.0.0.1:{port}/v1/realtime") as ws:
        update = {
            "type": "session.update",
            "session": {
                "type": "realtime",
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}},
            },
        }
        await ws.send(json.dumps(update))

        async def read():
            async for message in ws:
                e = json.loads(message)
                if e.get("type") == "response.output_audio.delta":
                    heard.setdefault(e["x_frame"], time.monotonic())

        reader = asyncio.ensure_future(read())
        t0 = time.monotonic()
        count = int(seconds / 0.08)
        for k in range(count):
            loud = 3000 if k * 0.08 < 1.2 else 0
            pcm = (noise.standard_normal(1280) * loud).astype("<i2").tobytes()
            await asyncio.sleep(max(0.0, t0 + (k + 1) * 0.08 - time.monotonic()))
            append = {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}
            await ws.send(json.dumps(append))
            left[k] = time.monotonic()  # samples 1280 k .. 1280 (k + 1) - 1 have left
        await asyncio.sleep(1.0)
        reader.cancel()
    await network.stop()
    # A WebRTC track is paced at real time by its sender; deltas come as fast as the server
    # steps, so a burst waits in the client's player: each frame plays at the later of its
    # arrival and the end of the frame before it (a player that never drops, no start buffer).
    played, before = {}, None
    for k in sorted(heard):
        played[k] = heard[k] if before is None or before[0] != k - 1 else max(heard[k], before[1])
        before = (k, played[k] + 0.08)
    ear, ear_played = [], []
    for k, at in heard.items():
        sent = left.get((record.needed(k) - 1) // 1280)
        if sent is not None:
            ear.append(at - sent)
            ear_played.append(played[k] - sent)
    return {
        "sent": count,
        "segments": network.segments,
        "lost": network.lost,
        "held": network.held,
        "ear": ear,
        "ear_played": ear_played,
    }


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
    jitter = args.jitter_ms / 1000
    conditions = [(0.0, 0.0)] + [(loss / 100, jitter) for loss in args.loss]  # loopback first
    print(f"tiny checkpoint, {args.seconds:g} s per call; mouth-to-ear p50/p95/max in seconds")
    load = os.getloadavg()[0]

    def wait_free():
        deadline = time.monotonic() + 30
        while app.state.server.active and time.monotonic() < deadline:
            time.sleep(0.05)

    def server_side():
        d = np.array(record.delays) if record.delays else np.zeros(1)
        late = int((d > LATE_SECONDS).sum())
        return f"{len(record.delays):6d} {late:5d}  {percentiles(record.delays)}"

    webrtc_rows, ws_rows = [], []
    with ServerThread(app) as server:
        asyncio.run(one_call(server.url, 2.0, record))  # a warm-up call, not counted
        wait_free()
        # Each condition: a WebRTC call, then the WebSocket, so that both meet the same load.
        for loss, jit in conditions:
            head = f"{loss * 100:5g} {jit * 1000:7g}"
            impairment.loss, impairment.jitter = loss, jit
            impairment.sent = impairment.lost = 0
            record.reset()
            client = asyncio.run(one_call(server.url, args.seconds, record))
            wait_free()
            concealed, dropped, clock = record.totals or (0.0, 0.0, 0.0)
            webrtc_rows.append(
                f"{head} {impairment.sent:5d} {impairment.lost:5d} |"
                f" {server_side()} | {concealed:9.2f} {dropped:7.2f} {clock:5.2f}"
                f" | {client['received']:9d} {client['gaps']:4d} {client['max_gap']:10.3f}"
                f" {client['errors']:6d} | {percentiles(client['ear'])} ({len(client['ear'])})"
            )
            impairment.loss = impairment.jitter = 0.0
            record.reset()
            r = asyncio.run(ws_call(server.url, args.seconds, loss, jit, record))
            wait_free()
            ws_rows.append(
                f"{head} {r['segments']:8d} {r['lost']:4d} {r['held']:4d}"
                f" | {server_side()} | {percentiles(r['ear'])} | {percentiles(r['ear_played'])}"
                f" ({len(r['ear'])})"
            )
    print(f"load average (1 min): {load:.1f} before, {os.getloadavg()[0]:.1f} after")
    print("WebRTC (RTP/UDP, loss and jitter on each packet):")
    print(
        "loss% jit(ms)  sent  lost | frames  late  delay p50/p95/max (s)"
        " | concealed dropped clock (s) | rx frames gaps max_gap(s) errors | mouth-to-ear (n)"
    )
    print("\n".join(webrtc_rows))
    print(
        "WebSocket (TCP through a proxy simulating the loss and jitter per segment: in"
        f" order, a loss delivered after the {RTO_SECONDS * 1000:g} ms minimum RTO):"
    )
    print(
        "loss% jit(ms) segments lost held | frames  late  delay p50/p95/max (s)"
        " | mouth-to-ear: arrives | plays (n)"
    )
    print("\n".join(ws_rows))


if __name__ == "__main__":
    main()

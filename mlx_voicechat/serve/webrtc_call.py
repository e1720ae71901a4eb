"""One WebRTC call of ``POST /v1/realtime/calls``: the peer connection, its two Opus tracks and
the :class:`~.connection.Conversation` it holds (a row of the same batch), fed by
:class:`RtcSocket` (the data channel as a WebSocket) and the incoming track. The model never
waits on the network: a gap in the RTP timeline is filled with silence at once, and audio
arriving after the clock already filled its place is dropped. aiortc is imported only here.
"""

import asyncio
import contextlib
import fractions
import secrets
import time
from collections import deque
from typing import Optional

import numpy as np

from .channel import log
from .connection import Conversation
from .secrets import PresetSocket
from .wire import MODEL_INPUT_RATE, Append, Cancel, Resampler

WIRE_RATE = 48000  # Hz, Opus's clock on the wire
PACKET_SAMPLES = 960  # 20 ms at 48 kHz, what the outgoing track sends per frame
GAP_SECONDS = 0.03  # RTP timeline vs. audio queued: past this, a gap is filled / overlap dropped
MAX_OUT_SECONDS = 60.0  # the model's speech buffered for the track, at most


# --- the WebSocket stand-in -----------------------------------------------------------------


class RtcSocket:
    """What :class:`~.channel.Channel` needs of a WebSocket, over the call's data channel:
    ``receive()`` the client's events, ``send_text`` the server's, ``close`` the call."""

    def __init__(self, call: "Call", query_params=None):
        self.call = call
        self.query_params = query_params or {}
        self.client = None
        self.incoming: asyncio.Queue = asyncio.Queue()
        self.channel = None  # the data channel, once the client's arrives

    def message(self, text) -> None:
        self.incoming.put_nowait({"type": "websocket.receive", "text": text})

    def disconnect(self) -> None:
        self.incoming.put_nowait({"type": "websocket.disconnect"})

    async def receive(self) -> dict:
        return await self.incoming.get()

    async def send_text(self, text: str) -> None:
        channel = self.channel
        if channel is not None and channel.readyState == "open":
            channel.send(text)

    async def close(self, code: int = 1000, reason: str = "") -> None:
        # The events queued before a close (an error) go out first: SCTP keeps the order, but
        # closing the transport at once would cut them off.
        channel = self.channel
        deadline = time.monotonic() + 1.0
        while channel is not None and channel.bufferedAmount and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await self.call.close()


# --- the model's audio track ----------------------------------------------------------------


def _track_class():
    from aiortc import MediaStreamTrack

    class ModelTrack(MediaStreamTrack):
        """The model's speech at 48 kHz, 20 ms frames paced at real time (silence between
        replies); ``push`` adds samples, ``flush`` drops what has not been sent."""

        kind = "audio"

        def __init__(self):
            super().__init__()
            self.buffer: deque = deque()
            self.buffered = 0
            self._start: Optional[float] = None
            self._pts = 0
            self.on_drained = None  # called once the buffer runs dry after audio

        def push(self, samples: np.ndarray) -> None:
            if self.buffered > MAX_OUT_SECONDS * WIRE_RATE:
                return  # a reader that never plays: the model's speech is not kept for it
            self.buffer.append(samples)
            self.buffered += samples.size

        def flush(self) -> None:
            self.buffer.clear()
            self.buffered = 0

        def _take(self, n: int) -> np.ndarray:
            out = np.zeros(n, np.float32)
            filled = 0
            while filled < n and self.buffer:
                head = self.buffer[0]
                k = min(n - filled, head.size)
                out[filled : filled + k] = head[:k]
                filled += k
                if k == head.size:
                    self.buffer.popleft()
                else:
                    self.buffer[0] = head[k:]
            self.buffered -= filled
            if filled and not self.buffered and self.on_drained is not None:
                self.on_drained()
            return out

        async def recv(self):
            import av

            if self.readyState != "live":
                from aiortc.mediastreams import MediaStreamError

                raise MediaStreamError
            if self._start is None:
                self._start = time.monotonic()
            else:
                self._pts += PACKET_SAMPLES
                wait = self._start + self._pts / WIRE_RATE - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
            pcm = np.clip(np.rint(self._take(PACKET_SAMPLES) * 32767.0), -32768, 32767)
            frame = av.AudioFrame(format="s16", layout="mono", samples=PACKET_SAMPLES)
            frame.planes[0].update(pcm.astype("<i2").tobytes())
            frame.sample_rate = WIRE_RATE
            frame.pts = self._pts
            frame.time_base = fractions.Fraction(1, WIRE_RATE)
            return frame

    return ModelTrack


def mono_float(frame) -> np.ndarray:
    """An av.AudioFrame (s16 or flt, packed or planar, any channels) as mono float32."""
    x = frame.to_ndarray()
    channels = len(frame.layout.channels)
    if frame.format.is_planar:
        x = x.reshape(channels, -1).mean(axis=0)
    else:
        x = x.reshape(-1, channels).mean(axis=1)
    if x.dtype.kind == "i":
        return (x / 32768.0).astype(np.float32)
    return x.astype(np.float32)


class LiveJitterBuffer:
    """In place of aiortc's audio jitter buffer (which stalls up to 320 ms at a lost packet):
    each packet is decoded as it arrives; one older than the newest taken is dropped, and its
    time, like a lost packet's, is heard as silence (:meth:`RtcConversation._listen`)."""

    capacity = 1

    def __init__(self):
        self.newest: Optional[int] = None
        self.late = 0

    def add(self, packet):
        from aiortc.jitterbuffer import JitterFrame

        seq = packet.sequence_number
        if self.newest is not None and not 0 < (seq - self.newest) % 65536 < 32768:
            self.late += 1
            return False, None
        self.newest = seq
        return False, JitterFrame(data=packet._data, timestamp=packet.timestamp)


def live_receiver(receiver) -> bool:
    """Give an aiortc audio receiver a :class:`LiveJitterBuffer`; False where this aiortc has
    no such place (its own buffer stays)."""
    name = "_RTCRtpReceiver__jitter_buffer"
    if not hasattr(receiver, name):
        return False
    setattr(receiver, name, LiveJitterBuffer())
    return True


# --- the conversation -----------------------------------------------------------------------


class RtcConversation(Conversation):
    """A :class:`~.connection.Conversation` whose audio comes from and goes to the call's
    tracks; its events travel on the data channel."""

    kind = "WebRTC call"

    def __init__(self, server, socket: RtcSocket, track, out_track):
        super().__init__(server, socket)
        self.track = track  # the client's audio (None: none came)
        self.out = out_track
        self.out.on_drained = self._drained
        self._out_rate = None
        self._out_resampler = None
        self._playing: Optional[str] = None  # the response whose audio is on the track
        self._stop_pending: Optional[str] = None  # its audio is all queued: stopped when played

    # server events: the model's audio to the track, the rest to the data channel
    def send(self, events) -> None:
        kept = []
        for e in events:
            kind = e.get("type")
            if kind == "response.output_audio.delta":
                kept += self._speak(e)
                continue
            if kind in ("response.done", "response.output_audio.done"):
                rid = e.get("response_id") or (e.get("response") or {}).get("id")
                if rid is not None and rid == self._playing:
                    self._stop_pending = rid
                    if not self.out.buffered:
                        kept.append(self._stopped())
            kept.append(e)
        super().send(kept)

    def _speak(self, e: dict) -> list:
        """The delta's audio onto the track; the events that go in its place, in order."""
        from .wire import decode_pcm16

        out = []
        rate = self.protocol.output_rate
        if rate != self._out_rate:
            self._out_rate, self._out_resampler = rate, Resampler(rate, WIRE_RATE)
        samples = self._out_resampler(decode_pcm16(e["delta"]))
        rid = e.get("response_id")
        if rid != self._playing:
            if self._playing is not None:  # the last response's audio is still playing
                self._stop_pending = self._playing
                out.append(self._stopped())
            self._playing, self._stop_pending = rid, None
            out.append(self.protocol._event("output_audio_buffer.started", response_id=rid))
        if samples.size:
            self.out.push(samples)
        return out

    def _stopped(self) -> dict:
        rid, self._playing, self._stop_pending = self._stop_pending, None, None
        return self.protocol._event("output_audio_buffer.stopped", response_id=rid)

    def _drained(self) -> None:
        if self._stop_pending is not None:
            super().send([self._stopped()])

    def command(self, c) -> None:
        if isinstance(c, Cancel):
            self.out.flush()
        super().command(c)

    def take(self, raw) -> bool:
        if isinstance(raw, str) and '"output_audio_buffer.clear"' in raw:
            self.out.flush()
        return super().take(raw)

    # the client's audio
    def tasks(self) -> list:
        tasks = super().tasks()
        if self.track is not None:
            tasks.append(self._listen())
        return tasks

    def _audio(self, samples: np.ndarray, silence: bool = False) -> None:
        p = self.protocol
        if not p.started:
            self.command(p.start())
        self.command(Append(samples, silence=silence))

    async def _listen(self) -> None:
        """The incoming track to the model, on the RTP timeline (see the module's doc)."""
        from aiortc.mediastreams import MediaStreamError

        first_pts = None
        resampler, rate = None, None
        while True:
            try:
                frame = await self.track.recv()
            except MediaStreamError:
                self.ws.disconnect()
                return
            if self.closing is not None:
                continue
            x = mono_float(frame)
            if frame.sample_rate != rate:
                rate, resampler = frame.sample_rate, Resampler(frame.sample_rate, MODEL_INPUT_RATE)
            if first_pts is None:
                first_pts = frame.pts or 0
            at = ((frame.pts or 0) - first_pts) / rate  # where the frame sits, seconds
            queued = self.position / MODEL_INPUT_RATE  # audio and clock silence queued so far
            if at - queued > GAP_SECONDS:  # lost packets (or DTX): their time is silence
                self._audio(np.zeros(int((at - queued) * MODEL_INPUT_RATE), np.float32), True)
                self.server.metrics.audio_gap("missing", at - queued)
            elif queued - at > GAP_SECONDS:  # late: the clock filled its place already
                self.server.metrics.audio_gap("late", min(queued - at, x.size / rate))
                x = x[int((queued - at) * rate) :]
            if x.size:
                y = resampler(x)
                if y.size:
                    self._audio(y)


# --- one call -------------------------------------------------------------------------------


class Call:
    """One WebRTC call: the peer connection, its tracks and the conversation."""

    def __init__(self, server, calls: dict, session: dict, query_params, secret=None, store=None):
        """A call in ``calls`` (until it closes), holding a session slot the caller took."""
        from aiortc import RTCConfiguration, RTCPeerConnection

        self.server = server
        self.calls = calls
        self.id = "rtc_" + secrets.token_hex(12)
        self.session = session
        # No STUN/TURN servers: the server answers with its own addresses (a client reaches it
        # directly); aiortc's default would ask a public STUN server.
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.socket = RtcSocket(self, query_params)
        self.out = _track_class()()
        self.track = None
        self.connected = asyncio.Event()
        self.channel_open = asyncio.Event()
        self.secret = secret  # the client secret that admitted it, if one did: given back to
        self.secrets = store  # the store it came from if the call never connects
        self.started = False  # the conversation began (it gives the slot back at its end)
        self.task: Optional[asyncio.Task] = None
        self._closed = False
        self.pc.addTrack(self.out)
        calls[self.id] = self

        @self.pc.on("track")
        def on_track(track):
            if track.kind == "audio" and self.track is None:
                self.track = track

        @self.pc.on("datachannel")
        def on_datachannel(channel):
            if self.socket.channel is not None:
                return
            self.socket.channel = channel
            channel.on("message", self.socket.message)
            channel.on("close", self.socket.disconnect)
            if channel.readyState == "open":
                self.channel_open.set()
            else:
                channel.on("open", self.channel_open.set)

        @self.pc.on("connectionstatechange")
        def on_state():
            state = self.pc.connectionState
            if state == "connected":
                self.connected.set()
            elif state in ("failed", "closed"):
                self.socket.disconnect()

    async def answer(self, sdp: str) -> str:
        from aiortc import RTCSessionDescription

        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
        if self.track is None:
            raise ValueError("the offer has no audio track the server can receive")
        for t in self.pc.getTransceivers():
            if t.kind == "audio" and not live_receiver(t.receiver):
                log.warning("this aiortc's audio receiver has no jitter buffer to replace")
        await self.pc.setLocalDescription(await self.pc.createAnswer())
        return self.pc.localDescription.sdp

    async def run(self, wants_channel: bool, ice_timeout: float) -> None:
        """Wait for the connection (at most ``ice_timeout``; a hangup cancels the wait), then
        hold the conversation."""

        async def ready():
            await self.connected.wait()
            if wants_channel:
                await self.channel_open.wait()

        try:
            try:
                await asyncio.wait_for(ready(), ice_timeout)
            except asyncio.TimeoutError:
                log.warning(
                    "WebRTC call %s: no connection within %g s (ICE, DTLS or the data channel "
                    "did not complete); closed",
                    self.id,
                    ice_timeout,
                )
                return
            if self._closed:  # hung up as the wait ended (3.11's wait_for drops that cancel)
                return
            socket = PresetSocket(self.socket, self.session)
            conversation = RtcConversation(self.server, socket, self.track, self.out)
            self.started = True
            await conversation.run()
        finally:
            await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.calls.pop(self.id, None)
        if not self.started:  # no connection was made: the slot and the secret are given back
            if self.task is not None and self.task is not asyncio.current_task():
                self.task.cancel()  # (it waits for the connection)
            self.server.active -= 1
            if self.secret is not None:
                self.secrets.release(self.secret)
        with contextlib.suppress(Exception):
            self.out.stop()
        with contextlib.suppress(Exception):
            await self.pc.close()

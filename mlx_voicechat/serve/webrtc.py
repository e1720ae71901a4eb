"""WebRTC for the Realtime server (``POST /v1/realtime/calls``), as OpenAI's Realtime API offers
it, and the client secrets a browser connects with (``POST /v1/realtime/client_secrets``).

A client POSTs an SDP offer (``application/sdp``, or ``multipart/form-data`` with an ``sdp``
part and a ``session`` JSON part) and gets the SDP answer. Audio flows as Opus over RTP (48 kHz
on the wire, one track each way); the Realtime events travel as JSON text on the data channel
the client opens (``oai-events``), the same events as on ``/v1/realtime`` except the model's
audio: it goes out on the track, not as ``response.output_audio.delta`` events, and
``output_audio_buffer.started`` / ``.stopped`` say when it starts and ends playing, as OpenAI's
WebRTC sessions do.

A call is a :class:`~.connection.Conversation` like a WebSocket's (same session, tools,
limits, batching: a row of the same batch), fed by :class:`RtcSocket`, a stand-in for the
WebSocket that reads the data channel, and by the incoming track. The model's input keeps its
80 ms clock whatever the network does: a gap in the RTP timestamps (lost packets) is filled
with silence at once, audio that arrives after the server's clock already filled its place
with silence is dropped, and the conversation's clock feeds silence at real time when audio
stops coming, so the server never waits on a lost packet.

aiortc (the ``[webrtc]`` extra) is imported only when a call comes; without it the endpoint
answers 501 with what to install.
"""

import asyncio
import contextlib
import fractions
import json
import time
from collections import deque
from typing import Optional

import numpy as np

from .channel import log
from .connection import Conversation
from .protocol import Realtime
from .secrets import ClientSecrets, SecretRefused, bearer_secret, refusal, ttl_of
from .transcription_connection import is_recognizer
from .wire import MODEL_INPUT_RATE, Append, Cancel, Resampler, Start

WIRE_RATE = 48000  # Hz, Opus's clock on the wire
PACKET_SAMPLES = 960  # 20 ms at 48 kHz, what the outgoing track sends per frame
ICE_TIMEOUT = 20.0  # seconds a call waits for its connection (ICE, DTLS, the data channel)
GAP_SECONDS = 0.03  # RTP timeline vs. audio queued: past this, a gap is filled / overlap dropped
MAX_OUT_SECONDS = 60.0  # the model's speech buffered for the track, at most
MAX_SDP_BYTES = 64 << 10
EVENTS_CHANNEL = "oai-events"
SDP_TYPES = ("application/sdp",)


def available() -> Optional[str]:
    """None when aiortc can be imported, else why not (one line)."""
    try:
        import aiortc  # noqa: F401
    except ImportError as e:
        return (
            f"WebRTC needs aiortc ({e}); install it with `pip install 'mlx-voicechat[webrtc]'` "
            "or connect over the WebSocket /v1/realtime"
        )
    return None


def error_body(message: str, code: str, type_: str = "invalid_request_error") -> dict:
    return {"error": {"type": type_, "code": code, "message": message, "param": None}}


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
    """In place of aiortc's audio jitter buffer, which holds every packet until four more have
    come and, at a lost one, stalls until sixteen have (320 ms), then drops frames to catch up:
    each Opus packet is decoded as it arrives; one older than the newest already taken (late,
    reordered, or repeated) is dropped, and its time, like a lost packet's, is heard as silence
    (:meth:`RtcConversation._listen` fills the gaps in the RTP timeline). The server never
    waits on a packet."""

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
        # seconds of the client's audio lost on the way (heard as silence) and come too late
        self.concealed = self.dropped = 0.0

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
            p.started = True
            p.opened_with = (p.prompt, tuple(p.tools))
            self.command(Start(p.prompt, tuple(p.tools)))
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
                self.concealed += at - queued
            elif queued - at > GAP_SECONDS:  # late: the clock filled its place already
                self.dropped += min(queued - at, x.size / rate)
                x = x[int((queued - at) * rate) :]
            if x.size:
                y = resampler(x)
                if y.size:
                    self._audio(y)


# --- one call -------------------------------------------------------------------------------


class Call:
    """One WebRTC call: the peer connection, its tracks and the conversation."""

    def __init__(self, server, calls: dict, call_id: str, session: dict, query_params):
        from aiortc import RTCConfiguration, RTCPeerConnection

        self.server = server
        self.calls = calls
        self.id = call_id
        self.session = session
        # No STUN/TURN servers: the server answers with its own addresses (a client reaches it
        # directly); aiortc's default would ask a public STUN server.
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.socket = RtcSocket(self, query_params)
        self.out = _track_class()()
        self.track = None
        self.connected = asyncio.Event()
        self.channel_open = asyncio.Event()
        self.hung_up = asyncio.Event()
        self.secret: Optional[str] = None  # the client secret that admitted it, if one did
        self.task: Optional[asyncio.Task] = None
        self._closed = False
        self.pc.addTrack(self.out)

        @self.pc.on("track")
        def on_track(track):
            if track.kind == "audio" and self.track is None:
                self.track = track

        @self.pc.on("datachannel")
        def on_datachannel(channel):
            if self.socket.channel is not None:
                return
            self.socket.channel = channel

            @channel.on("message")
            def on_message(message):
                self.socket.message(message)

            @channel.on("close")
            def on_close():
                self.socket.disconnect()

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
        """Wait for the connection (at most ``ice_timeout``), then hold the conversation;
        the slot taken for the call is given back either way."""
        conversation = None
        try:
            events = [self.connected] + ([self.channel_open] if wants_channel else [])

            async def ready():
                for e in events:
                    await e.wait()

            waits = [asyncio.ensure_future(ready()), asyncio.ensure_future(self.hung_up.wait())]
            try:
                done, _ = await asyncio.wait(
                    waits, timeout=ice_timeout, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                for w in waits:
                    w.cancel()
            if self.hung_up.is_set():
                return
            if waits[0] not in done:
                log.warning(
                    "WebRTC call %s: no connection within %g s (ICE, DTLS or the data channel "
                    "did not complete); closed",
                    self.id,
                    ice_timeout,
                )
                return
            conversation = RtcConversation(self.server, self.socket, self.track, self.out)
            if self.session:
                self.socket.message(json.dumps({"type": "session.update", "session": self.session}))
            await conversation.run()  # gives the slot back at its end
        finally:
            if conversation is None:
                self.server.active -= 1
            await self.close()

    async def close(self) -> None:
        self.hung_up.set()
        if self._closed:
            return
        self._closed = True
        self.calls.pop(self.id, None)
        with contextlib.suppress(Exception):
            self.out.stop()
        with contextlib.suppress(Exception):
            await self.pc.close()


# --- the routes -----------------------------------------------------------------------------


def check_session(server, session) -> Optional[dict]:
    """The error of a session config (a ``session.update``'s ``session``), or None."""
    if session is None:
        return None
    if not isinstance(session, dict):
        return error_body("`session` must be a JSON object", "invalid_value")
    probe = Realtime(server.model_id, max_instructions_chars=server.max_instructions_chars)
    events, _ = probe.receive(json.dumps({"type": "session.update", "session": session}))
    for e in events:
        if e["type"] == "error":
            return {"error": {k: v for k, v in e["error"].items() if k != "event_id"}}
    return None


def install(app, server, ice_timeout: float = ICE_TIMEOUT) -> None:
    """Add ``POST /v1/realtime/calls`` and ``POST /v1/realtime/client_secrets`` to ``app``;
    ``app.state.client_secrets`` holds the minted secrets (the WebSocket route redeems them),
    ``app.state.webrtc_calls`` the calls in progress (``close_calls`` ends them)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse, Response

    store = ClientSecrets()
    calls: dict = {}
    app.state.client_secrets = store
    app.state.webrtc_calls = calls

    def cors(request) -> dict:
        """A web app's page on its own origin calls the server (with a client secret): the
        CORS headers for an origin the server allows (``--allow-origin``), else none."""
        origin = request.headers.get("origin")
        if origin is None or not server.origin_allowed(
            request.headers, request.scope.get("server")
        ):
            return {}
        return {
            "access-control-allow-origin": origin,
            "access-control-expose-headers": "location",
            "vary": "origin",
        }

    def refused(status: int, body: dict, request=None):
        log.warning("refused a %s request: %s", "Realtime", body["error"]["message"])
        headers = cors(request) if request is not None else {}
        return JSONResponse(body, status_code=status, headers=headers)

    async def preflight(request: Request):
        headers = cors(request)
        if not headers:
            return Response(status_code=403)
        headers.update(
            {
                "access-control-allow-methods": "POST",
                # what the client asks for (the Agents SDK adds X-OpenAI-Agents-SDK)
                "access-control-allow-headers": request.headers.get(
                    "access-control-request-headers", "authorization, content-type"
                )[:1000],
                "access-control-max-age": "600",
            }
        )
        return Response(status_code=204, headers=headers)

    for path in ("/v1/realtime/calls", "/v1/realtime/calls/{call_id}/hangup"):
        app.add_api_route(path, preflight, methods=["OPTIONS"], include_in_schema=False)

    @app.post("/v1/realtime/client_secrets")
    async def client_secrets(request: Request):
        if bearer_secret(request.headers) or not server.authorized(request.headers, []):
            return refused(401, refusal("missing or wrong API key (a client secret mints none)"))
        try:
            body = json.loads(await request.body() or b"{}")
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            seconds = ttl_of(body)
        except ValueError as e:
            return refused(400, error_body(f"{e}".splitlines()[0], "invalid_value"))
        session = body.get("session") or {}
        bad = check_session(server, session)
        if bad is not None:
            return refused(400, bad)
        try:
            value, expires_at = store.mint(session, seconds)
        except SecretRefused as e:
            return refused(429, error_body(str(e), "rate_limit_exceeded"))
        probe = Realtime(server.model_id, max_instructions_chars=server.max_instructions_chars)
        probe.receive(json.dumps({"type": "session.update", "session": session}))
        return {
            "value": value,
            "expires_at": expires_at,
            "session": probe.session_object(),
        }

    @app.post("/v1/realtime/calls")
    async def create_call(request: Request):
        response = await answer_call(request)
        response.headers.update(cors(request))
        return response

    @app.post("/v1/realtime/calls/{call_id}/hangup")
    async def hangup(call_id: str, request: Request):
        """End a call (OpenAI's hangup): with the server's key, or the client secret that
        admitted it."""
        response = await end_call(call_id, request)
        response.headers.update(cors(request))
        return response

    async def answer_call(request):
        missing = available()
        if missing is not None:
            return refused(501, error_body(missing, "webrtc_unavailable", "server_error"))
        if is_recognizer(server.model):
            return refused(
                501,
                error_body(
                    "this server runs a recognizer: its transcription sessions are on the "
                    "WebSocket /v1/realtime",
                    "webrtc_unavailable",
                    "server_error",
                ),
            )
        if not server.origin_allowed(request.headers, request.scope.get("server")):
            return refused(403, error_body("origin not allowed", "origin_not_allowed"))
        preset = None
        secret = bearer_secret(request.headers)
        if secret is None and not server.authorized(request.headers, []):
            return refused(401, refusal("missing or wrong API key"))
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        session = None
        if kind in SDP_TYPES:
            raw = await request.body()
        elif kind == "multipart/form-data":
            try:
                form = await request.form(max_files=2, max_fields=8, max_part_size=MAX_SDP_BYTES)
            except Exception as e:
                return refused(400, error_body(f"unreadable multipart body: {e}", "invalid_body"))
            raw = form.get("sdp")
            raw = (await raw.read()) if hasattr(raw, "read") else (raw or "").encode()
            text = form.get("session")
            text = (await text.read()) if hasattr(text, "read") else text
            if text:
                try:
                    session = json.loads(text)
                except ValueError as e:
                    return refused(
                        400, error_body(f"the `session` part is not JSON: {e}", "invalid_json")
                    )
        else:
            return refused(
                415,
                error_body(
                    f"content type {kind[:80] or '(none)'!r} is not an SDP offer: send "
                    "application/sdp, or multipart/form-data with `sdp` and `session` parts",
                    "unsupported_content_type",
                ),
            )
        if len(raw) > MAX_SDP_BYTES:
            return refused(413, error_body("the SDP offer is too large", "invalid_sdp"))
        try:
            sdp = raw.decode("utf-8")
        except UnicodeDecodeError:
            return refused(400, error_body("the SDP offer is not UTF-8 text", "invalid_sdp"))
        if not sdp.lstrip().startswith("v=0"):
            return refused(400, error_body("the body is not an SDP offer (no v=0)", "invalid_sdp"))
        if "\nm=audio " not in sdp.replace("\r\n", "\n"):
            return refused(
                400, error_body("the SDP offer has no audio (m=audio) section", "invalid_sdp")
            )
        for needed, what in (("a=fingerprint:", "DTLS fingerprint"), ("a=ice-ufrag:", "ICE ufrag")):
            if needed not in sdp:
                return refused(
                    400, error_body(f"the SDP offer has no {what} ({needed})", "invalid_sdp")
                )
        bad = check_session(server, session)
        if bad is not None:
            return refused(400, bad)
        if server.shutting_down:
            server.metrics.refused("shutting_down")
            return refused(
                503,
                error_body(
                    "the server is shutting down; try again later",
                    "server_shutting_down",
                    "server_error",
                ),
            )
        if secret is not None:  # checked last: a request refused above does not use it up
            try:
                preset = store.redeem(secret)
            except SecretRefused as e:
                return refused(401, refusal(str(e)))
        config = dict(preset or {})
        config.update(session or {})
        if server.active >= server.max_sessions:
            server.metrics.refused("server_busy")
            return refused(
                503,
                error_body(
                    f"all {server.max_sessions} session(s) of this server are in use; try again "
                    "later",
                    "server_busy",
                    "server_error",
                ),
            )
        import secrets as random

        call_id = "rtc_" + random.token_hex(12)
        server.active += 1
        call = Call(server, calls, call_id, config, request.query_params)
        call.secret = secret
        calls[call_id] = call
        try:
            answer = await call.answer(sdp)
        except Exception as e:
            server.active -= 1
            await call.close()
            message = f"{e}".splitlines()[0] if str(e) else type(e).__name__
            return refused(400, error_body(f"the SDP offer was refused: {message}", "invalid_sdp"))
        server.metrics.opened()
        wants_channel = "\nm=application " in sdp.replace("\r\n", "\n")
        call.task = asyncio.create_task(call.run(wants_channel, ice_timeout))
        log.info("WebRTC call %s answered", call_id)
        return Response(
            answer,
            status_code=201,
            media_type="application/sdp",
            headers={"location": f"/v1/realtime/calls/{call_id}"},
        )

    async def end_call(call_id: str, request):
        call = calls.get(call_id)
        secret = bearer_secret(request.headers)
        own = call is not None and secret is not None and secret == call.secret
        if not own and (secret is not None or not server.authorized(request.headers, [])):
            return refused(401, refusal("missing or wrong API key"))
        if call is None:
            return refused(404, error_body(f"no call {call_id[:40]!r} in progress", "not_found"))
        await call.close()
        return JSONResponse({}, status_code=200)


async def close_calls(app) -> None:
    """End the calls in progress (the server is shutting down)."""
    calls = getattr(app.state, "webrtc_calls", None) or {}
    for call in list(calls.values()):
        if call.task is not None:
            call.task.cancel()
        await call.close()

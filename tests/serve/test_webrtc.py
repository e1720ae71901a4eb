"""WebRTC (``POST /v1/realtime/calls``) and client secrets (``POST /v1/realtime/client_secrets``)
through real sockets: uvicorn on 127.0.0.1 on a free port, the tiny random-weight checkpoint of
tests/serve/test_server.py, and aiortc as the client (an SDP offer with one Opus track and the
``oai-events`` data channel, as a browser or OpenAI's SDKs make it)."""

import asyncio
import json
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

pytest.importorskip("fastapi")
aiortc = pytest.importorskip("aiortc")
websockets = pytest.importorskip("websockets")

from aiortc import (  # noqa: E402 (after the importorskip)
    RTCConfiguration,
    RTCPeerConnection,
    RTCSessionDescription,
)
from webrtc_support import Noise  # noqa: E402

from mlx_voicechat.serve.app import ServerThread, create_app  # noqa: E402

KEY = "webrtc-key"
TIMEOUT = 60.0  # seconds, any single wait (a loaded 2-core machine is slow)


@pytest.fixture(scope="module")
def served(model, worker):  # noqa: F811
    app = create_app(model, api_key=KEY, worker=worker, warmup=False, ice_timeout=3.0)
    s = ServerThread(app).__enter__()
    s.app = app
    yield s
    s.__exit__(None, None, None)


def state(served):
    """(sessions in use, calls in progress) of the server."""
    return served.app.state.server.active, len(served.app.state.webrtc_calls)


def wait_idle(served, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while state(served) != (0, 0):
        assert time.monotonic() < deadline, f"left running: {state(served)}"
        time.sleep(0.05)


def post(served, path, body: bytes, headers: dict):
    """(status, headers, body) of a POST."""
    request = urllib.request.Request(served.url + path, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def mint(served, seconds=600, session=None, key=KEY):
    body = {"expires_after": {"anchor": "created_at", "seconds": seconds}}
    if session is not None:
        body["session"] = session
    return post(
        served,
        "/v1/realtime/client_secrets",
        json.dumps(body).encode(),
        {"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )


class Client:
    """An aiortc peer: the microphone track, the oai-events channel, what comes back."""

    def __init__(self, audio=True, channel=True):
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.events, self.heard = [], []
        if audio:
            self.pc.addTrack(Noise())
        if channel:
            self.channel = self.pc.createDataChannel("oai-events")
            self.channel.on("message", lambda m: self.events.append(json.loads(m)))

        @self.pc.on("track")
        def on_track(track):
            asyncio.ensure_future(self._listen(track))

    async def _listen(self, track):
        from aiortc.mediastreams import MediaStreamError

        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            self.heard.append(frame.to_ndarray().astype(np.float32).ravel())

    async def offer(self) -> str:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        return self.pc.localDescription.sdp

    async def call(self, served, token=KEY):
        sdp = await self.offer()
        status, headers, body = await asyncio.to_thread(
            post,
            served,
            "/v1/realtime/calls",
            sdp.encode(),
            {"Authorization": f"Bearer {token}", "Content-Type": "application/sdp"},
        )
        assert status == 201, body
        assert headers["content-type"].startswith("application/sdp")
        await self.pc.setRemoteDescription(RTCSessionDescription(body.decode(), "answer"))

    def types(self):
        return [e["type"] for e in self.events]

    async def until(self, kind, timeout=TIMEOUT):
        deadline = time.monotonic() + timeout
        while kind not in self.types():
            assert time.monotonic() < deadline, f"no {kind} in {sorted(set(self.types()))}"
            await asyncio.sleep(0.05)


def run(coro, timeout=2 * TIMEOUT):
    return asyncio.run(asyncio.wait_for(coro, timeout))


# --- a conversation -------------------------------------------------------------------------


def _opened(served) -> float:
    """The server's conversations-opened counter, read from its registry."""
    registry = served.app.state.server.metrics.registry
    return registry.get_sample_value("voicechat_conversations_opened_total") or 0.0


def test_a_conversation_over_webrtc(served):
    """Speech on the track, transcripts and the response lifecycle on the data channel; the
    model's audio is not also sent as events; the call ends with the client's close."""

    async def main():
        c = Client()
        await c.call(served)
        await c.until("session.created")
        c.channel.send(json.dumps({"type": "session.update", "session": {"instructions": "Hi"}}))
        await c.until("response.created")
        await c.until("output_audio_buffer.started")
        await c.until("response.output_audio_transcript.delta")
        await c.until("response.done")
        await c.until("output_audio_buffer.stopped")
        await asyncio.sleep(0.5)
        await c.pc.close()
        return c

    opened = _opened(served)
    c = run(main())
    types = c.types()
    assert "session.updated" in types and "error" not in types, types
    assert "response.output_audio.delta" not in types
    assert _opened(served) == opened + 1, "the call is not counted in /metrics"
    assert types.index("output_audio_buffer.started") < types.index("output_audio_buffer.stopped")
    assert types.index("response.created") < types.index("output_audio_buffer.started")
    heard = np.concatenate(c.heard)
    assert np.count_nonzero(np.abs(heard) > 64) > 4800, "no speech came on the track"
    wait_idle(served)


# --- client secrets -------------------------------------------------------------------------


def test_a_client_secret_authorizes_one_connection_with_its_session(served):
    status, _, body = mint(served, session={"instructions": "Be brief."})
    assert status == 200, body
    secret = json.loads(body)
    assert secret["value"].startswith("ek_") and secret["expires_at"] > time.time() + 500
    assert secret["session"]["instructions"] == "Be brief."

    async def main():
        c = Client()
        await c.call(served, token=secret["value"])
        await c.until("session.updated")
        update = next(e for e in c.events if e["type"] == "session.updated")
        assert update["session"]["instructions"] == "Be brief."
        await c.pc.close()
        again = Client()
        sdp = await again.offer()
        await again.pc.close()
        return sdp

    sdp = run(main())
    wait_idle(served)
    headers = {"Authorization": f"Bearer {secret['value']}", "Content-Type": "application/sdp"}
    status, _, body = post(served, "/v1/realtime/calls", sdp.encode(), headers)
    assert status == 401, body
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert "already used" in error["message"]
    # a secret is no API key: it mints nothing and lists nothing
    assert mint(served, key=secret["value"])[0] == 401
    wait_idle(served)


def test_a_client_secret_on_the_websocket_once(served):
    value = json.loads(mint(served, session={"instructions": "Be brief."})[2])["value"]
    url = served.url.replace("http", "ws") + "/v1/realtime"

    async def main():
        auth = {"Authorization": f"Bearer {value}"}
        async with websockets.connect(url, additional_headers=auth) as ws:
            created = json.loads(await ws.recv())
            updated = json.loads(await ws.recv())
        assert created["type"] == "session.created"
        assert updated["session"]["instructions"] == "Be brief."
        wait_idle(served)
        async with websockets.connect(url, additional_headers=auth) as ws:
            refused = json.loads(await ws.recv())
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
            assert ws.close_code == 1008
        return refused

    refused = run(main())
    assert refused["type"] == "error" and refused["error"]["code"] == "invalid_api_key"
    assert "already used" in refused["error"]["message"]
    wait_idle(served)


def test_a_busy_server_leaves_a_calls_secret_unused(served, offers, monkeypatch):
    """An offer refused because every session is in use does not use its secret up: the
    secret then admits a connection once a slot is free."""
    value = json.loads(mint(served)[2])["value"]
    server = served.app.state.server
    monkeypatch.setattr(server, "active", server.max_sessions)
    headers = {"Authorization": f"Bearer {value}", "Content-Type": "application/sdp"}
    status, _, body = post(served, "/v1/realtime/calls", offers[0].encode(), headers)
    assert status == 503 and json.loads(body)["error"]["code"] == "server_busy"
    monkeypatch.undo()
    url = served.url.replace("http", "ws") + "/v1/realtime"

    async def main():
        auth = {"Authorization": f"Bearer {value}"}
        async with websockets.connect(url, additional_headers=auth) as ws:
            return json.loads(await ws.recv())

    assert run(main())["type"] == "session.created"
    wait_idle(served)


@pytest.fixture(scope="module")
def offers():
    """An SDP offer with audio and the data channel, and one with the data channel only."""

    async def main():
        with_audio, without = Client(), Client(audio=False)
        sdp = await with_audio.offer(), await without.offer()
        await with_audio.pc.close()
        await without.pc.close()
        return sdp

    return run(main())


def test_expired_and_forged_secrets_are_refused(served, monkeypatch, offers):
    store = served.app.state.client_secrets
    value = json.loads(mint(served, seconds=10)[2])["value"]
    later = time.time() + 11
    monkeypatch.setattr(store, "_clock", lambda: later)
    headers = {"Authorization": f"Bearer {value}", "Content-Type": "application/sdp"}
    status, _, body = post(served, "/v1/realtime/calls", offers[0].encode(), headers)
    assert status == 401 and "expired" in json.loads(body)["error"]["message"]
    forged = "ek_" + "A" * 32
    headers["Authorization"] = f"Bearer {forged}"
    status, _, body = post(served, "/v1/realtime/calls", offers[0].encode(), headers)
    assert status == 401 and "not one this server issued" in json.loads(body)["error"]["message"]
    assert mint(served, seconds=5)[0] == 400  # under OpenAI's 10 s
    assert mint(served, key="wrong")[0] == 401
    wait_idle(served)


# --- refusals that leave nothing running ----------------------------------------------------


def test_refused_offers_are_clear_errors_and_leave_nothing_running(served, offers):
    sdp, no_audio = offers
    auth = {"Authorization": f"Bearer {KEY}"}
    cases = [
        (b"v=0\r\nthis is no SDP", "application/sdp", 400, "invalid_sdp"),
        (sdp.replace("a=fingerprint", "a=fingerprinx").encode(), "application/sdp", 400, None),
        (sdp.encode(), "text/plain", 415, "unsupported_content_type"),
        (no_audio.encode(), "application/sdp", 400, "invalid_sdp"),
        (b"hello", "application/sdp", 400, "invalid_sdp"),
    ]
    for body, kind, status, code in cases:
        got, _, answer = post(served, "/v1/realtime/calls", body, {**auth, "Content-Type": kind})
        error = json.loads(answer)["error"]
        assert got == status, (kind, body[:40], answer)
        assert error["message"] and (code is None or error["code"] == code), error
        assert state(served) == (0, 0)
    got, _, answer = post(served, "/v1/realtime/calls", sdp.encode(), {"Content-Type": kind})
    assert got == 401


def test_multipart_offer_with_a_session_part(served):
    async def main():
        c = Client()
        sdp = await c.offer()
        boundary = "xXxBoundary"
        session = json.dumps({"type": "realtime", "instructions": "Multipart."})
        body = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="sdp"\r\n\r\n{sdp}\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="session"\r\n\r\n'
            f"{session}\r\n--{boundary}--\r\n"
        ).encode()
        headers = {
            "Authorization": f"Bearer {KEY}",
            "Content-Type": f"multipart/form-data; boundary={boundary}",
        }
        status, _, answer = await asyncio.to_thread(
            post, served, "/v1/realtime/calls", body, headers
        )
        assert status == 201, answer
        await c.pc.setRemoteDescription(RTCSessionDescription(answer.decode(), "answer"))
        await c.until("session.updated")
        update = next(e for e in c.events if e["type"] == "session.updated")
        await c.pc.close()
        return update

    assert run(main())["session"]["instructions"] == "Multipart."
    wait_idle(served)


def test_a_call_that_never_connects_is_closed(served):
    """An answered offer whose client never starts ICE holds its slot only until the server's
    ICE timeout (3 s here), then the call is closed and the slot given back."""

    async def main():
        c = Client()
        sdp = await c.offer()
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/sdp"}
        status, _, _ = await asyncio.to_thread(
            post, served, "/v1/realtime/calls", sdp.encode(), headers
        )
        await c.pc.close()  # the answer is never applied: no ICE
        return status

    assert run(main()) == 201
    assert state(served) == (1, 1)
    wait_idle(served, timeout=10)


def test_a_call_is_hung_up_with_the_key(served, offers):
    """OpenAI's hangup ends an answered call at once (the page's fallback to the WebSocket
    gives the slot back this way); unknown calls are 404, no key is 401."""
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/sdp"}
    status, answer, _ = post(served, "/v1/realtime/calls", offers[0].encode(), headers)
    assert status == 201 and state(served) == (1, 1)
    where = answer["location"]
    assert post(served, where + "/hangup", b"", {})[0] == 401
    assert post(served, where + "/hangup", b"", {"Authorization": f"Bearer {KEY}"})[0] == 200
    wait_idle(served, timeout=1.5)  # well before the ICE timeout (3 s)
    assert post(served, where + "/hangup", b"", {"Authorization": f"Bearer {KEY}"})[0] == 404


def test_without_aiortc_the_endpoint_says_what_to_install(served, monkeypatch, offers):
    monkeypatch.setitem(__import__("sys").modules, "aiortc", None)  # import aiortc fails
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/sdp"}
    status, _, body = post(served, "/v1/realtime/calls", offers[0].encode(), headers)
    error = json.loads(body)["error"]
    assert status == 501 and error["code"] == "webrtc_unavailable", error
    assert "mlx-voicechat[webrtc]" in error["message"]
    assert state(served) == (0, 0)


def test_a_web_apps_page_on_another_origin_may_call(model, worker, offers):  # noqa: F811
    """CORS for an origin the server allows: the preflight, then the answer (its Location
    readable by the page); another origin gets neither."""
    app = create_app(model, worker=worker, warmup=False, allow_origins=("https://app.example",))
    with ServerThread(app) as s:
        s.app = app
        ask = {
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        request = urllib.request.Request(
            s.url + "/v1/realtime/calls", headers=ask, method="OPTIONS"
        )
        with urllib.request.urlopen(request, timeout=TIMEOUT) as r:
            allowed = {k.lower(): v for k, v in r.headers.items()}
        assert allowed["access-control-allow-origin"] == "https://app.example"
        assert "authorization" in allowed["access-control-allow-headers"]
        sdp = {"Origin": "https://app.example", "Content-Type": "application/sdp"}
        status, headers, _ = post(s, "/v1/realtime/calls", offers[0].encode(), sdp)
        assert status == 201 and headers["access-control-allow-origin"] == "https://app.example"
        assert "location" in headers["access-control-expose-headers"]
        where = headers["location"]
        assert post(s, where + "/hangup", b"", {"Origin": "https://app.example"})[0] == 200
        wait_idle(s, timeout=5)
        other = dict(ask, Origin="https://evil.example")
        request = urllib.request.Request(
            s.url + "/v1/realtime/calls", headers=other, method="OPTIONS"
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=TIMEOUT)
        assert refused.value.code == 403
        sdp["Origin"] = "https://evil.example"
        status, headers, _ = post(s, "/v1/realtime/calls", offers[0].encode(), sdp)
        assert status == 403 and "access-control-allow-origin" not in headers

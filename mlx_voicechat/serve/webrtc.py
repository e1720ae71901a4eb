"""WebRTC for the Realtime server (``POST /v1/realtime/calls``) and the client secrets a browser
connects with (``POST /v1/realtime/client_secrets``), as OpenAI's Realtime API offers them.

The offer is ``application/sdp`` or ``multipart/form-data`` (``sdp`` and ``session`` parts);
audio is Opus on one track each way, the events JSON on the ``oai-events`` data channel (the
model's audio is on the track, with ``output_audio_buffer.started`` / ``.stopped``). This
module holds the routes; :mod:`.webrtc_call` a call. Without aiortc (the ``[webrtc]`` extra)
the endpoint answers 501.
"""

import asyncio
import json
from typing import Optional, Tuple

from .channel import log
from .protocol import Realtime
from .secrets import ClientSecrets, SecretRefused, bearer_secret, refusal, ttl_of
from .transcription_connection import is_recognizer
from .webrtc_call import Call, LiveJitterBuffer  # noqa: F401  (LiveJitterBuffer: tests import it)

ICE_TIMEOUT = 20.0  # seconds a call waits for its connection (ICE, DTLS, the data channel)
MAX_SDP_BYTES = 64 << 10
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


# --- the routes -----------------------------------------------------------------------------


def check_session(server, session) -> Tuple[Optional[dict], Optional[Realtime]]:
    """A session config (a ``session.update``'s ``session``) tried on a new protocol: (its
    error, or None; the protocol that took it)."""
    if session is None:
        return None, None
    if not isinstance(session, dict):
        return refusal("`session` must be a JSON object", "invalid_value"), None
    probe = Realtime(server.model_id, max_instructions_chars=server.max_instructions_chars)
    events, _ = probe.receive(json.dumps({"type": "session.update", "session": session}))
    for e in events:
        if e["type"] == "error":
            return {"error": {k: v for k, v in e["error"].items() if k != "event_id"}}, probe
    return None, probe


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

    def refused(status: int, body: dict):
        log.warning("refused a %s request: %s", "Realtime", body["error"]["message"])
        return JSONResponse(body, status_code=status)

    def bad_sdp(message: str, status: int = 400):
        return refused(status, refusal(message, "invalid_sdp"))

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
            return refused(400, refusal(f"{e}".splitlines()[0], "invalid_value"))
        session = body.get("session") or {}
        bad, probe = check_session(server, session)
        if bad is not None:
            return refused(400, bad)
        try:
            value, expires_at = store.mint(session, seconds)
        except SecretRefused as e:
            return refused(429, refusal(str(e), "rate_limit_exceeded"))
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
        if missing is None and is_recognizer(server.model):
            missing = (
                "this server runs a recognizer: its transcription sessions are on the "
                "WebSocket /v1/realtime"
            )
        if missing is not None:
            return refused(501, refusal(missing, "webrtc_unavailable", "server_error"))
        no, secret = server.caller(request.headers, request.scope.get("server"))
        if no is not None:
            return refused(no.status, no.body())
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        session = None
        if kind in SDP_TYPES:
            raw = await request.body()
        elif kind == "multipart/form-data":
            try:
                form = await request.form(max_files=2, max_fields=8, max_part_size=MAX_SDP_BYTES)
            except Exception as e:
                return refused(400, refusal(f"unreadable multipart body: {e}", "invalid_body"))
            raw = form.get("sdp")
            raw = (await raw.read()) if hasattr(raw, "read") else (raw or "").encode()
            text = form.get("session")
            text = (await text.read()) if hasattr(text, "read") else text
            if text:
                try:
                    session = json.loads(text)
                except ValueError as e:
                    return refused(
                        400, refusal(f"the `session` part is not JSON: {e}", "invalid_json")
                    )
        else:
            return refused(
                415,
                refusal(
                    f"content type {kind[:80] or '(none)'!r} is not an SDP offer: send "
                    "application/sdp, or multipart/form-data with `sdp` and `session` parts",
                    "unsupported_content_type",
                ),
            )
        if len(raw) > MAX_SDP_BYTES:
            return bad_sdp("the SDP offer is too large", 413)
        try:
            sdp = raw.decode("utf-8")
        except UnicodeDecodeError:
            return bad_sdp("the SDP offer is not UTF-8 text")
        if not sdp.lstrip().startswith("v=0"):
            return bad_sdp("the body is not an SDP offer (no v=0)")
        if "\nm=audio " not in sdp.replace("\r\n", "\n"):
            return bad_sdp("the SDP offer has no audio (m=audio) section")
        for needed, what in (("a=fingerprint:", "DTLS fingerprint"), ("a=ice-ufrag:", "ICE ufrag")):
            if needed not in sdp:
                return bad_sdp(f"the SDP offer has no {what} ({needed})")
        bad, _ = check_session(server, session)
        if bad is not None:
            return refused(400, bad)
        # last: a request refused above does not use its secret up (a busy server's does)
        no, preset = await server.seat(secret, store, secret_first=True)
        if no is not None:
            return refused(no.status, no.body())
        config = {**(preset or {}), **(session or {})}
        call = Call(server, calls, config, request.query_params, secret, store)
        try:
            answer = await call.answer(sdp)
        except Exception as e:
            await call.close()
            message = f"{e}".splitlines()[0] if str(e) else type(e).__name__
            return bad_sdp(f"the SDP offer was refused: {message}")
        server.metrics.opened()
        wants_channel = "\nm=application " in sdp.replace("\r\n", "\n")
        call.task = asyncio.create_task(call.run(wants_channel, ice_timeout))
        log.info("WebRTC call %s answered", call.id)
        return Response(
            answer,
            status_code=201,
            media_type="application/sdp",
            headers={"location": f"/v1/realtime/calls/{call.id}"},
        )

    async def end_call(call_id: str, request):
        call = calls.get(call_id)
        secret = bearer_secret(request.headers)
        own = call is not None and secret is not None and secret == call.secret
        if not own and (secret is not None or not server.authorized(request.headers, [])):
            return refused(401, refusal("missing or wrong API key"))
        if call is None:
            return refused(404, refusal(f"no call {call_id[:40]!r} in progress", "not_found"))
        await call.close()
        return JSONResponse({}, status_code=200)


async def close_calls(app) -> None:
    """End the calls in progress (the server is shutting down)."""
    calls = getattr(app.state, "webrtc_calls", None) or {}
    for call in list(calls.values()):
        if call.task is not None:
            call.task.cancel()
        await call.close()

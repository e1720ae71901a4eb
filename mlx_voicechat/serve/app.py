"""The Realtime server's FastAPI app (WebSocket ``/v1/realtime``, ``/health``, ``/metrics``,
``/v1/models``, the web page); :class:`ServerThread` serves it on a background thread (tests,
benchmarks), :func:`graceful_server` makes the uvicorn server ``serve`` runs. Sockets live on
the asyncio loop, every MLX call on the one worker thread (:mod:`.worker`).
"""

import contextlib
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

from .limits import Limits, uvicorn_options
from .protocol import Realtime
from .secrets import PresetSocket, refusal
from .server import Server
from .settings import ServerSettings
from .transcription_connection import serve_connection, warm_up
from .webrtc import ICE_TIMEOUT, close_calls
from .webrtc import install as install_webrtc
from .worker import Worker

STATIC_DIR = Path(__file__).parent / "static"
ADMISSION_GRACE_SECONDS = 0.25  # how long a connection to a full server waits for a slot
WS_MAX_SIZE = 4 << 20  # bytes; events over protocol.MAX_EVENT_BYTES get an error, over this a close
# The page loads only its own files and talks only to its own server; nothing may frame it
# (it holds the microphone).
PAGE_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        b"connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
        b"frame-ancestors 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
]


def create_app(
    model,
    settings: Optional[ServerSettings] = None,
    *,
    worker: Optional[Worker] = None,
    warmup: bool = True,
    static_dir: Optional[Path] = None,
    health_extra: Optional[Callable[[], Awaitable[dict]]] = None,
    **changes,
):
    """The FastAPI app serving ``model`` (``WebSocket /v1/realtime``, ``GET /health``,
    ``GET /v1/models``, ``GET /metrics``, the web page at ``/`` and ``/static/...``) as
    ``settings`` say (:class:`~.settings.ServerSettings`; default ones), with ``changes``:
    settings by name (``create_app(model, api_key="k", max_sessions=2)``).

    ``worker``: the :class:`Worker` thread for the MLX work (default: the process's shared
    one). ``warmup``: run a few frames before the first client. ``static_dir``: the web page's
    files. ``health_extra``: an async function whose dict is added to ``/health``'s."""
    from fastapi import FastAPI, Request, WebSocket
    from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response

    settings = (settings or ServerSettings()).replace(**changes)
    server = Server(model, settings, worker)
    static = Path(static_dir) if static_dir is not None else STATIC_DIR

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if warmup:
            await server.worker.run(warm_up, server)
        server.ready = True
        yield
        await close_calls(app)

    app = FastAPI(title="mlx-voicechat", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    app.add_middleware(_PageHeaders)
    # /v1/realtime/calls, /v1/realtime/client_secrets
    install_webrtc(app, server, settings.ice_timeout or ICE_TIMEOUT)

    @app.get("/health")
    async def health():
        status = "stopping" if server.shutting_down else "ok" if server.ready else "starting"
        body = {
            "status": status,
            "model": server.model_id,
            "sessions": server.active,
            "max_sessions": server.max_sessions,
            "sessions_served": server.sessions_served,
        }
        if health_extra is not None:
            body.update(await health_extra())
        if server.shutting_down:  # a load balancer sends no one here any more
            return JSONResponse(body, status_code=503)
        return body

    def unauthorized():
        return JSONResponse(refusal("missing or wrong API key"), status_code=401)

    @app.get("/metrics")
    async def prometheus_metrics(request: Request):
        if server.metrics.registry is None:
            where = (
                "Ray's own metrics export (the series of every replica)"
                if server.metrics.backend == "ray"
                else "nowhere (prometheus_client is not installed)"
            )
            return PlainTextResponse(f"this server's metrics go to {where}", status_code=404)
        if not settings.metrics_public and not server.authorized(request.headers, []):
            return unauthorized()
        body, content_type = server.metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request):
        if not server.authorized(request.headers, []):
            return unauthorized()
        return {
            "object": "list",
            "data": [
                {
                    "id": server.model_id,
                    "object": "model",
                    "created": 0,
                    "owned_by": "mlx-voicechat",
                }
            ],
        }

    def _missing(what: str):
        return PlainTextResponse(
            f"{what} is not installed: the web page's files go in {static}/ "
            "(index.html and what it loads)",
            status_code=404,
        )

    @app.get("/")
    async def index():
        page = static / "index.html"
        if not page.is_file():
            return _missing("the web page")
        return FileResponse(page)

    @app.get("/static/{path:path}")
    async def static_file(path: str):
        if not static.is_dir():
            return _missing(f"/static/{path[:100]}")
        root = static.resolve()
        try:
            target = (root / path).resolve()
            found = root in target.parents and target.is_file()
        except (ValueError, OSError):  # a NUL byte, a name too long for the file system
            found = False
        if not found:
            return PlainTextResponse(f"/static/{path[:100]} not found", status_code=404)
        return FileResponse(target)

    @app.websocket("/v1/realtime")
    async def realtime(websocket: WebSocket):
        subprotocols = list(websocket.scope.get("subprotocols") or [])
        local = websocket.scope.get("server")
        refused, secret = server.caller(websocket.headers, local, subprotocols)
        if refused is not None:
            await websocket.close(code=refused.close, reason=refused.message)
            return
        await websocket.accept(subprotocol="realtime" if "realtime" in subprotocols else None)
        # A client's close completes before the server has seen its connection end: one that
        # reconnects at once waits that long for the slot it just gave up, no longer.
        refused, preset = await server.seat(
            secret, app.state.client_secrets, ADMISSION_GRACE_SECONDS
        )
        if refused is not None:  # an error event, then the close
            event = Realtime(server.model_id).error(
                refused.code, refused.message, type_=refused.type
            )
            server.metrics.error_sent(refused.code)
            with contextlib.suppress(Exception):
                await websocket.send_text(json.dumps(event))
                await websocket.close(refused.close, (refused.reason or refused.message)[:120])
            return
        if preset is not None:
            websocket = PresetSocket(websocket, preset)
        server.metrics.opened()
        await serve_connection(server, websocket)  # duplex, or a transcription session

    return app


class _PageHeaders:
    """ASGI middleware: :data:`PAGE_HEADERS` on every HTTP response."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", ()), *PAGE_HEADERS])
            await send(message)

        return await self.app(scope, receive, send_with_headers)


class ServerThread:
    """uvicorn serving ``app`` on a background thread (tests and benchmarks), with the
    connection bounds of ``limits``: ``with ServerThread(app) as s: ... s.port``."""

    def __init__(
        self,
        app,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        limits: Optional[Limits] = None,
        ssl_certfile: Optional[str] = None,
        ssl_keyfile: Optional[str] = None,
    ):
        import socket

        import uvicorn

        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP,
        # and without it every second event of a burst waits ~40 ms for a delayed ACK.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        self.scheme = "https" if ssl_certfile else "http"
        config = uvicorn.Config(
            app,
            log_level=log_level,
            ws_max_size=WS_MAX_SIZE,
            lifespan="on",
            ws_ping_interval=None,
            ssl_certfile=ssl_certfile,
            ssl_keyfile=ssl_keyfile,
            **uvicorn_options(limits or Limits()),
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=lambda: self.server.run(sockets=[self._sock]), daemon=True, name="uvicorn"
        )

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        self._sock.close()

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"


SHUTDOWN_TIMEOUT = 10.0  # seconds from a signal to the process's end, at most (--shutdown-timeout)
DRAIN_SECONDS = 2.0  # of those, the most the conversations get to take their error and close
SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


def graceful_server(config, server: Server, shutdown_timeout: float = SHUTDOWN_TIMEOUT):
    """A uvicorn server whose shutdown (on SIGINT, SIGTERM or SIGHUP, the same) first tells
    every live conversation (``error`` ``server_shutting_down``, close 1012) and refuses new
    ones, then lets uvicorn close the rest, all within ``shutdown_timeout`` seconds of the
    signal. The signals are not raised again at the end (uvicorn's own does), and its
    handlers stay to the process's end (they only note a signal): the caller stops the worker
    (:meth:`.worker.Worker.stop` with ``time_left()``) and exits as the signal asks; ``signals``
    lists those that came."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        def __init__(self):
            super().__init__(config)
            self.signals: list = []
            self.deadline: Optional[float] = None

        def time_left(self) -> float:
            if self.deadline is None:
                return shutdown_timeout
            return max(0.0, self.deadline - time.monotonic())

        @contextlib.contextmanager
        def capture_signals(self):
            # The handlers stay after uvicorn's end: the worker is stopped under them, and a
            # signal meanwhile only hurries the stop along.
            if threading.current_thread() is threading.main_thread():
                for name in SIGNALS:
                    if hasattr(signal, name):
                        signal.signal(getattr(signal, name), self.handle_exit)
            yield

        def handle_exit(self, sig, frame) -> None:
            self.signals.append(sig)
            if self.deadline is None:
                self.deadline = time.monotonic() + shutdown_timeout
            if self.should_exit:
                self.force_exit = True  # a second signal: no more waiting for connections
            self.should_exit = True

        async def shutdown(self, sockets=None) -> None:
            if self.deadline is None:
                self.deadline = time.monotonic() + shutdown_timeout
            server.begin_shutdown()
            if not self.force_exit:
                await server.drained(min(DRAIN_SECONDS, self.time_left() / 2))
            # uvicorn's own: stop listening, close what is left (1012), the lifespan's end
            self.config.timeout_graceful_shutdown = max(0.1, self.time_left() / 2)
            await super().shutdown(sockets)

    return GracefulServer()

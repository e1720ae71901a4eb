"""The Realtime server as a Ray Serve deployment: replicas of the app ``serve`` runs
(:func:`.app.create_app` around one model each, with one :class:`~.settings.ServerSettings`).

Each replica takes ``max_sessions`` plus :data:`CONTROL_SLOTS` requests, so a full one still
answers ``server_busy`` and ``/health``; a replica whose model failed to load says so (503,
``model_unavailable``). ``/health`` adds the deployment's sessions from the :class:`SessionBoard`;
the :mod:`.metrics` series go to Ray's metrics, tagged ``replica``. Stopping
(:func:`stop_sessions`, or Ray's drain) sends ``server_shutting_down`` and close 1012 first.
Config files use ``mlx_voicechat.serve.ray_app:app_builder``.
"""

import asyncio
import contextlib
import dataclasses
import os
import time
from typing import Optional

import ray
from ray import serve
from ray.serve.config import DeploymentActorConfig, RequestRouterConfig

from .limits import replica_counts
from .ray_proxy import PROXY_CALLBACK, PROXY_CALLBACK_ENV
from .settings import ServerSettings, model_id_of

APP_NAME = "mlx-voicechat"
BOARD = "sessions"
CONTROL_SLOTS = 4  # requests a replica takes beside its sessions: /health, the page, busy answers
REPORT_SECONDS = 1.0  # a replica reports to the board at least this often (and Ray's routers
#   get its routing stats this often)
CHANGE_SECONDS = 0.1  # and within this long of a change in its sessions
STALE_SECONDS = 3.0  # a replica not heard from for this long is not counted live
HEALTH_CHECK_SECONDS = 2.0  # how soon Ray's controller sees a dead replica and starts another
DRAIN_SECONDS = 10.0  # a replica Ray stops gives its open sessions this long before closing
DRAIN_POLL_SECONDS = 0.5  # how often Ray looks whether a stopping replica's sessions ended
AUTOSCALE_HEADROOM = 0.8  # autoscaling keeps the replicas' sessions at this share of capacity
API_KEY_ENV = "MLX_VOICECHAT_API_KEY"  # as `serve`: the key when none is given
CLOSE_NO_MODEL = 1011  # "internal error": this replica cannot serve at all


@ray.remote(num_cpus=0)
class SessionBoard:
    """The replicas' latest reports, for ``/health``; one per deployment (Ray keeps it)."""

    def __init__(self):
        self._rows = {}
        self._stopping = False

    def report(self, replica: str, row: dict) -> bool:
        """Keep ``row``; True once the deployment is being stopped (:meth:`stop`)."""
        self._rows[replica] = (time.monotonic(), row)
        return self._stopping

    def stop(self) -> None:
        """The deployment is about to be deleted: each replica, at its next report, tells its
        conversations (``server_shutting_down``, close 1012) and takes no more."""
        self._stopping = True

    def forget(self, replica: str) -> None:
        self._rows.pop(replica, None)

    def rows(self, max_age: float) -> list:
        now = time.monotonic()
        self._rows = {k: v for k, v in self._rows.items() if now - v[0] <= 10 * max_age}
        return [row for t, row in self._rows.values() if now - t <= max_age]


def _one_line(e: BaseException) -> str:
    return (f"{type(e).__name__}: {e}".splitlines() or [type(e).__name__])[0]


@serve.deployment(name="VoiceChatReplica")
@serve.ingress()
class VoiceChatReplica:
    """One replica: one model and the Realtime app of ``serve`` around it."""

    async def __init__(self, model: str, settings: ServerSettings, tokenizer: Optional[str] = None):
        from .. import load
        from .worker import Worker

        self.name = serve.get_replica_context().replica_id.unique_id
        self.node = ray.util.get_node_ip_address()
        self.settings = settings.replace(
            vendor={"replica": self.name, "node": self.node},
            metrics="ray",
            metric_tags={"replica": self.name},
        )
        self.server = None
        self.error: Optional[str] = None
        try:
            # MLX on the worker's thread
            self.model = await Worker.shared().run(lambda: load(model, tokenizer=tokenizer))
        except Exception as e:  # reported in /health; the replica takes no sessions
            self.model, self.error = None, f"the model failed to load: {_one_line(e)}"
        self._board = None  # the SessionBoard, found by _report_forever
        self._reporter = asyncio.get_running_loop().create_task(self._report_forever())

    def __serve_build_asgi_app__(self):
        if self.model is None:
            return self._unavailable_app()
        from .app import create_app

        app = create_app(self.model, self.settings, health_extra=self.deployment_health)
        self.server = app.state.server
        return app

    # -- what the replica tells Ray and the board --

    def row(self) -> dict:
        server = self.server
        ready = server is not None and server.ready
        status = "error" if self.error else "ok" if ready else "starting"
        row = {
            "replica": self.name,
            "node": self.node,
            "pid": os.getpid(),
            "status": status,
            "sessions": server.active if server is not None else 0,
            "max_sessions": self.settings.max_sessions,
            "sessions_served": server.sessions_served if server is not None else 0,
        }
        if self.error:
            row["error"] = self.error
        return row

    def record_routing_stats(self) -> dict:
        """Polled by Ray; :class:`~.ray_proxy.SessionRouter` ranks replicas by it."""
        return {"ready": self.row()["status"] == "ok"}

    async def _report_forever(self) -> None:
        """A report when the row changes (looked at every :data:`CHANGE_SECONDS`), and at
        least every :data:`REPORT_SECONDS` (the board's sign of life)."""
        last, sent = None, 0.0
        while True:
            row = self.row()
            if row != last or time.monotonic() - sent >= REPORT_SECONDS:
                try:
                    if self._board is None:
                        self._board = serve.get_deployment_actor(BOARD)
                    stopping = await self._board.report.remote(self.name, row)
                    last, sent = row, time.monotonic()
                    if stopping and self.server is not None and not self.server.shutting_down:
                        self.server.begin_shutdown()
                except Exception:  # not up yet, or being recreated: look it up again
                    self._board = None
            await asyncio.sleep(CHANGE_SECONDS)

    async def deployment_health(self) -> dict:
        """The ``/health`` fields beside the single server's: this replica and the deployment."""
        try:
            rows = await self._board.rows.remote(STALE_SECONDS)
        except Exception:  # (no board yet: this replica alone)
            rows = []
        rows = sorted(
            [r for r in rows if r["replica"] != self.name] + [self.row()],
            key=lambda r: r["replica"],
        )
        ready = [r for r in rows if r["status"] == "ok"]
        return {
            "replica": self.name,
            "deployment": {
                "replicas_live": len(rows),
                "replicas_ready": len(ready),
                "sessions": sum(r["sessions"] for r in rows),
                "capacity": sum(r["max_sessions"] for r in ready),
                "replicas": rows,
            },
        }

    async def __del__(self):
        """Ray stops the replica (its deployment deleted, scaled down): every live conversation
        hears ``server_shutting_down`` and close 1012, and the worker ends before the process
        does (an MLX thread alive at the interpreter's end aborts it)."""
        if hasattr(self, "_reporter"):  # (not where __init__ failed)
            self._reporter.cancel()
        server = getattr(self, "server", None)
        if server is not None:
            server.begin_shutdown()
            await server.drained(DRAIN_SECONDS / 2)
        with contextlib.suppress(Exception):
            await self._board.forget.remote(self.name)
        if server is not None:
            await asyncio.to_thread(server.worker.stop, DRAIN_SECONDS / 4)

    # -- a replica without a model --

    def _unavailable_app(self):
        from fastapi import FastAPI, WebSocket
        from fastapi.responses import JSONResponse, PlainTextResponse

        from .protocol import Realtime

        app = FastAPI(title="mlx-voicechat (no model)", docs_url=None, redoc_url=None)

        @app.get("/health")
        async def health():
            body = {"status": "error", "model": self.settings.model_id, "error": self.error}
            body.update(await self.deployment_health())
            return JSONResponse(body, status_code=503)

        @app.websocket("/v1/realtime")
        async def realtime(websocket: WebSocket):
            await websocket.accept()
            event = Realtime(self.settings.model_id).error(
                "model_unavailable",
                "the model failed to load on this replica (see /health); try again later",
                type_="server_error",
            )
            with contextlib.suppress(Exception):
                await websocket.send_json(event)
                await websocket.close(code=CLOSE_NO_MODEL, reason="model failed to load")

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def anything(path: str):
            return PlainTextResponse(self.error, status_code=503)

        return app


def deployment_options(
    *,
    max_sessions: int = 1,
    replicas: Optional[int] = None,
    min_replicas: Optional[int] = None,
    max_replicas: Optional[int] = None,
    ray_actor_options: Optional[dict] = None,
) -> dict:
    """Ray Serve options of the deployment: ``replicas`` fixed, or autoscaling between
    ``min_replicas`` and ``max_replicas`` (on sessions in use, keeping
    :data:`AUTOSCALE_HEADROOM`); ``ray_actor_options`` per replica (default one CPU)."""
    if max_sessions < 1:
        raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
    counts = replica_counts(replicas, min_replicas, max_replicas)
    options = {
        "max_ongoing_requests": max_sessions + CONTROL_SLOTS,
        "ray_actor_options": {"num_cpus": 1, **(ray_actor_options or {})},
        "graceful_shutdown_timeout_s": DRAIN_SECONDS,
        "graceful_shutdown_wait_loop_s": DRAIN_POLL_SECONDS,
        "health_check_period_s": HEALTH_CHECK_SECONDS,
        "request_router_config": RequestRouterConfig(
            request_router_class="mlx_voicechat.serve.ray_proxy.SessionRouter",
            request_routing_stats_period_s=REPORT_SECONDS,
        ),
        "deployment_actors": [
            DeploymentActorConfig(
                name=BOARD, actor_class=SessionBoard, actor_options={"num_cpus": 0}
            )
        ],
    }
    if "num_replicas" in counts:
        return {**options, **counts}
    options["autoscaling_config"] = {
        **counts,
        "target_ongoing_requests": max_sessions * AUTOSCALE_HEADROOM,
        "metrics_interval_s": 2.0,
        "look_back_period_s": 10.0,
        "upscale_delay_s": 5.0,
        "downscale_delay_s": 300.0,
    }
    return options


def realtime_app(
    model: str,
    settings: Optional[ServerSettings] = None,
    *,
    replicas: Optional[int] = None,
    min_replicas: Optional[int] = None,
    max_replicas: Optional[int] = None,
    ray_actor_options: Optional[dict] = None,
    tokenizer: Optional[str] = None,
    **changes,
):
    """The Ray Serve application (``serve.run(realtime_app(...))``): replicas of the app
    ``serve`` runs around ``model``, each with ``settings`` (:class:`~.settings.ServerSettings`,
    default ones, its ``model_id`` the model's name) and ``changes`` (settings by name:
    ``max_sessions``, ``silence_feed``, ...)."""
    if changes.get("model_id") is None:
        changes.pop("model_id", None)
    settings = (settings or ServerSettings(model_id=model_id_of(model))).replace(**changes)
    options = deployment_options(
        max_sessions=settings.max_sessions,
        replicas=replicas,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        ray_actor_options=ray_actor_options,
    )
    return VoiceChatReplica.options(**options).bind(str(model), settings, tokenizer)


_BUILDER_ARGS = {"model", "tokenizer", "replicas", "min_replicas", "max_replicas"}
_BUILDER_ARGS |= {"ray_actor_options"} | {f.name for f in dataclasses.fields(ServerSettings)}


def app_builder(args: dict):
    """``serve run`` / ``serve deploy`` entry point (``import_path:
    mlx_voicechat.serve.ray_app:app_builder``). ``args``: ``model`` (required), ``tokenizer``,
    ``replicas`` or ``min_replicas`` / ``max_replicas``, ``ray_actor_options`` and any field of
    :class:`~.settings.ServerSettings` (``max_sessions``, ``allow_origins``, ...; ``api_key``
    by default ``$MLX_VOICECHAT_API_KEY`` where Ray builds the application, e.g. from its
    ``runtime_env.env_vars``)."""
    args = dict(args or {})
    unknown = sorted(set(args) - _BUILDER_ARGS)
    if unknown:
        raise ValueError(f"unknown argument(s) {unknown}; known: {sorted(_BUILDER_ARGS)}")
    if not args.get("model"):
        raise ValueError("the argument 'model' (a checkpoint folder or hub id) is required")
    if args.get("api_key") is None and os.environ.get(API_KEY_ENV):
        args["api_key"] = os.environ[API_KEY_ENV]
    if isinstance(args.get("allow_origins"), str):
        args["allow_origins"] = [args["allow_origins"]]
    return realtime_app(args.pop("model"), **args)


def stop_sessions(timeout: float = 3.0) -> int:
    """From a driver: mark every board of this application stopping (:meth:`SessionBoard.stop`)
    and wait, at most ``timeout`` seconds, until the replicas report no session; returns the
    sessions still open then."""
    from ray.serve._private.constants import SERVE_DEPLOYMENT_ACTOR_PREFIX

    boards = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        name = a["name"]
        if name.startswith(SERVE_DEPLOYMENT_ACTOR_PREFIX) and APP_NAME in name and BOARD in name:
            with contextlib.suppress(ValueError):
                boards.append(ray.get_actor(name, namespace=a["namespace"]))
    ray.get([b.stop.remote() for b in boards], timeout=timeout)
    deadline = time.monotonic() + timeout
    while True:
        rows = [r for b in boards for r in ray.get(b.rows.remote(STALE_SECONDS), timeout=timeout)]
        open_sessions = sum(r["sessions"] for r in rows)
        if not open_sessions or time.monotonic() > deadline:
            return open_sessions
        time.sleep(0.1)


def start_serve(host: str = "127.0.0.1", port: int = 8000, log_level: str = "INFO"):
    """Start Ray Serve on the connected cluster with its HTTP proxies on ``host:port`` and
    :class:`~.ray_proxy.ReplicaLossMiddleware` in them; ``log_level`` of Serve's own logs (its
    access log only at DEBUG). Returns False where Serve was already running (its proxies keep
    their own options and hooks)."""
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    with contextlib.suppress(ValueError):  # (serve.status() would start Serve on port 8000)
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        return False
    serve.start(
        http_options={"host": host, "port": int(port)},
        logging_config={"log_level": log_level, "enable_access_log": log_level == "DEBUG"},
        controller_options={"runtime_env": {"env_vars": {PROXY_CALLBACK_ENV: PROXY_CALLBACK}}},
    )
    return True

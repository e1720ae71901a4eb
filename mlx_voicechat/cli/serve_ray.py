"""``mlx-voicechat serve --ray``: the same server as replicas on a Ray cluster (Ray Serve).

Joins ``--ray-address`` (or starts a local cluster), deploys
:func:`mlx_voicechat.serve.ray_app.realtime_app` behind Ray's proxy on ``--host:--port``, and on
Ctrl-C / SIGTERM deletes the deployment and stops whatever it started (every process of a local
cluster included).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

from . import _raise_terminated
from .options import ServeError, flag, say, urls

RAY_EXTRA = "pip install 'mlx-voicechat[ray]'"
# Ray Serve's INFO is a line per controller step and per request: shown at --log-level debug
SERVE_LOG_LEVELS = {"debug": "DEBUG", "info": "WARNING", "warning": "WARNING", "error": "ERROR"}
READY_TIMEOUT = 30.0  # seconds for /health to answer once Ray says the replicas run
LEFTOVER_GRACE = 2.0  # seconds the local cluster's processes get to end after ray.shutdown()
PR_SET_CHILD_SUBREAPER = 36  # prctl(2): orphans below this process become its children


def add_arguments(p) -> None:
    g = p.add_argument_group("scale-out on Ray Serve")
    g.add_argument(
        "--ray",
        action="store_true",
        help=f"serve replicas of the model on a Ray cluster through Ray Serve ({RAY_EXTRA})",
    )
    g.add_argument("--replicas", type=int, default=None, help="replicas (default 1)")
    g.add_argument("--min-replicas", type=int, default=None, help="autoscale from this many")
    g.add_argument("--max-replicas", type=int, default=None, help="autoscale up to this many")
    g.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="the Ray cluster to join (host:port or auto; default: start a local one)",
    )


def check(args) -> None:
    """One-line errors for Ray flags that do not go together."""
    if not args.ray:
        for attr in ("replicas", "min_replicas", "max_replicas", "ray_address"):
            if getattr(args, attr) is not None:
                raise ServeError(f"{flag(attr)} needs --ray")
        return
    from ..serve.limits import replica_counts

    try:
        replica_counts(args.replicas, args.min_replicas, args.max_replicas, spell=flag)
    except ValueError as e:
        raise ServeError(str(e)) from None


def _health(host: str, port: int):
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    url = f"http://{host}:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _wait_ready(args) -> dict:
    """``/health`` through Ray's proxy; the error of a deployment where no replica has a model."""
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        try:
            status, body = _health(args.host, args.port)
        except (OSError, ValueError) as e:
            if time.monotonic() > deadline:
                raise ServeError(
                    f"nothing answers at {args.host}:{args.port} ({e}); where Serve already ran "
                    "on this cluster, its proxies keep their own host and port"
                ) from None
            time.sleep(0.5)
            continue
        if status == 503 and body.get("error"):
            raise ServeError(f"no replica is ready: {body['error']}")
        if status == 200:
            return body
        if time.monotonic() > deadline:
            raise ServeError(f"/health answers {status}: {body}")
        time.sleep(0.5)


def run(args, settings) -> int:
    """Serve replicas with ``settings`` (:class:`~mlx_voicechat.serve.settings.ServerSettings`)
    until Ctrl-C / SIGTERM."""
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise ServeError(f"--ray needs Ray Serve ({e.name} is missing): {RAY_EXTRA}") from None
    from ..serve.ray_app import APP_NAME, realtime_app, start_serve

    local = args.ray_address is None and not os.environ.get("RAY_ADDRESS")
    if local:
        _adopt_orphans()
    started_serve = False
    deployed = False
    try:
        try:
            ray.init(address=args.ray_address, logging_level=SERVE_LOG_LEVELS[args.log_level])
        except (ConnectionError, RuntimeError, ValueError) as e:
            where = f"at {args.ray_address}" if args.ray_address else "here"
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            if "InvalidAuthToken" in str(e):
                why = (
                    "the cluster asks for its token (Ray's token authentication): set "
                    "RAY_AUTH_MODE=token, and the cluster's token in ~/.ray/auth_token or "
                    "RAY_AUTH_TOKEN"
                )
            raise ServeError(f"cannot start or join a Ray cluster {where}: {why}") from None
        # Ray's core installs its own SIGTERM handler in a driver (a stack dump, then death):
        # put back the one that unwinds like Ctrl-C, so SIGTERM deletes the deployment too.
        _set_signals({"SIGTERM": _raise_terminated, "SIGINT": signal.default_int_handler})
        if local:
            address = ray.get_runtime_context().gcs_address
            say(f"started a local Ray cluster at {address} (it stops with this command)")
        need = args.replicas or args.min_replicas or 1
        cpus = ray.cluster_resources().get("CPU", 0)
        if need > cpus:
            message = f"{need} replica(s) need {need} CPU(s); the Ray cluster has {cpus:g}"
            if local:
                raise ServeError(message + " (join a larger one with --ray-address)")
            say(f"warning: {message}: the rest wait for the cluster to grow")
        started_serve = start_serve(args.host, args.port, SERVE_LOG_LEVELS[args.log_level])
        if APP_NAME in serve.status().applications:
            raise ServeError(f"an application named {APP_NAME!r} already runs on this cluster")
        app = realtime_app(
            args.model,
            settings,
            replicas=args.replicas,
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas,
            tokenizer=args.tokenizer,
        )
        deployed = True
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        deployment = _wait_ready(args).get("deployment", {})
        for row in deployment.get("replicas", []):
            if row.get("error"):
                say(f"warning: replica {row['replica']} on {row['node']}: {row['error']}")
        say(
            f"{urls(args)}, {deployment.get('replicas_ready', '?')} replica(s) x "
            f"{args.max_sessions} session(s) on Ray; Ctrl-C stops"
        )
        while True:
            time.sleep(3600)
    finally:
        if ray.is_initialized():
            _stop(serve, ray, local=local, started_serve=started_serve, deployed=deployed)


def _stop(serve, ray, *, local: bool, started_serve: bool, deployed: bool) -> None:
    """Delete this deployment; stop Serve if this started it and nothing else runs on it, and
    the cluster if this started it."""
    from ..serve.ray_app import APP_NAME, stop_sessions

    # From here on SIGINT, SIGTERM and SIGHUP are noted and ignored (the stop is bounded): a
    # second Ctrl-C must not cut the stop short (and leave the cluster up).
    _set_signals(dict.fromkeys(("SIGINT", "SIGTERM", "SIGHUP"), lambda *_: None))
    started = _descendants() if local else {}
    try:
        if deployed:
            say("stopping: the open sessions are told, then the deployment is deleted")
            with contextlib.suppress(Exception):  # (a board gone: Ray's drain still runs)
                stop_sessions()
            serve.delete(APP_NAME)
        if local or (started_serve and not serve.status().applications):
            serve.shutdown()
    finally:
        ray.shutdown()
        if local:
            started.update(_descendants())
            ended = _end_processes(started, LEFTOVER_GRACE)
            if ended:
                say(f"ended {ended} process(es) of the local cluster that outlived it")
        say("stopped")


def _set_signals(handlers: dict) -> None:
    """Signal name -> handler, where this is the main thread and the system has the signal."""
    if threading.current_thread() is threading.main_thread():
        for name, handler in handlers.items():
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), handler)


def _adopt_orphans() -> None:
    """Linux: this process becomes the reaper of its descendants' orphans, so a process of the
    local cluster whose parent died first (a worker of a replica Ray restarted) is still found
    below it at the end."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _descendants() -> dict:
    """pid -> start time of every process below this one (Ray's psutil)."""
    try:
        import psutil
    except ImportError:
        return {}
    out = {}
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            out[p.pid] = p.create_time()
    return out


def _end_processes(started: dict, grace: float) -> int:
    """The processes of ``started`` (pid -> start time, so that a pid used again is never
    touched) still running: SIGTERM, then SIGKILL after ``grace`` seconds; zombies below this
    process reaped. Returns how many had to be ended."""
    try:
        import psutil
    except ImportError:
        return 0

    def alive():
        out = []
        for pid, t in started.items():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.create_time() == t and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
        return out

    deadline = time.monotonic() + grace / 4
    while alive() and time.monotonic() < deadline:  # they end by themselves, mostly
        time.sleep(0.1)
    left = alive()
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, still = psutil.wait_procs(left, timeout=grace / 2)
    for p in still:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(still, timeout=1.0)
    with contextlib.suppress(ChildProcessError, OSError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:  # what was left to this process to reap
            pass
    return len(left)

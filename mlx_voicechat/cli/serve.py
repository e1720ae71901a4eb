"""``mlx-voicechat serve``: the OpenAI Realtime protocol over WebSocket (``/v1/realtime``)."""

from __future__ import annotations

import ipaddress
import os
import sys
from functools import partial

from .options import (
    MODEL_HELP,
    ServeError,
    add_seed_option,
    add_tokenizer_option,
    flag,
    say,
    urls,
)

KEY_ENV = "MLX_VOICECHAT_API_KEY"


def add_parser(subparsers):
    p = subparsers.add_parser(
        "serve",
        help="serve the model over the OpenAI Realtime protocol (WebSocket)",
        description=(
            "Serve the model at ws://HOST:PORT/v1/realtime (OpenAI Realtime protocol, GA event "
            "names), with a web page at http://HOST:PORT/ (wss:// and https:// with "
            "--ssl-certfile)."
        ),
    )
    seconds = partial(p.add_argument, type=float, metavar="SECONDS")  # a duration option
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require this key of every client (default: ${KEY_ENV}; none: no key)",
    )
    p.add_argument(
        "--max-sessions",
        type=int,
        default=1,
        help="conversations at once; one more gets server_busy (default 1)",
    )
    p.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a browser origin allowed besides the server's own (repeatable)",
    )
    p.add_argument(
        "--no-silence-feed",
        action="store_true",
        help="do not feed silence at real time when the client's audio falls behind",
    )
    p.add_argument(
        "--max-lag-seconds",
        type=float,
        default=10.0,
        help="close a connection whose audio waits longer than this (default 10)",
    )
    seconds(
        "--idle-timeout",
        default=180.0,
        help="close a connection that sends no audio for this long, error idle_timeout and "
        "close 4408 (default 180; 0: never)",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=4096,
        help="the longest session prompt, instructions and tools, in tokens (default 4096)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=1000,
        help="open connections at most; past it the oldest one still sending its request is "
        "closed (default 1000)",
    )
    seconds(
        "--header-timeout",
        default=10.0,
        help="close a connection whose request headers are not all in after this long (default 10)",
    )
    seconds(
        "--keep-alive-timeout",
        default=5.0,
        help="close an idle HTTP keep-alive connection after this long (uvicorn's "
        "timeout_keep_alive, default 5)",
    )
    p.add_argument(
        "--ssl-certfile",
        default=None,
        metavar="FILE",
        help="serve TLS with this PEM certificate (chain): wss:// and https:// (with "
        "--ssl-keyfile; docs/serving.md says how to make one)",
    )
    p.add_argument(
        "--ssl-keyfile",
        default=None,
        metavar="FILE",
        help="the PEM private key of --ssl-certfile (may be in the certificate file itself)",
    )
    p.add_argument(
        "--mcp-allow",
        action="append",
        default=[],
        metavar="PREFIX",
        help="URL prefix of MCP servers a client's mcp tools may name (repeatable; default none, "
        "so no client makes the server connect anywhere; needs the [mcp] extra)",
    )
    seconds(
        "--tool-timeout",
        default=30.0,
        help="how long an MCP tool call may take before it fails (default 30)",
    )
    seconds(
        "--shutdown-timeout",
        default=10.0,
        help="on SIGINT / SIGTERM, end within this long: live conversations get an error "
        "event and close 1012, the work in flight is dropped (default 10)",
    )
    p.add_argument(
        "--metrics-public",
        action="store_true",
        help="serve GET /metrics without the API key (for a scraper on a private network)",
    )
    add_seed_option(p)
    add_tokenizer_option(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    from . import serve_ray

    serve_ray.add_arguments(p)
    return p


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_tls(certfile, keyfile) -> bool:
    """Whether TLS is asked for; a certificate and key that do not load are a one-line
    error here, before the model loads (uvicorn would print a traceback after it)."""
    if keyfile is not None and certfile is None:
        raise ServeError("--ssl-keyfile needs --ssl-certfile (the certificate it belongs to)")
    if certfile is None:
        return False
    import ssl

    for attr, path in (("ssl_certfile", certfile), ("ssl_keyfile", keyfile)):
        if path is not None and not os.path.isfile(path):
            raise ServeError(f"{flag(attr)} {path}: no such file")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, OSError, ValueError) as e:
        where = certfile if keyfile is None else f"{certfile} and {keyfile}"
        reason = getattr(e, "reason", None) or getattr(e, "strerror", None) or str(e)
        raise ServeError(
            f"--ssl-certfile/--ssl-keyfile: {where} do not load as a PEM certificate and its "
            f"private key ({reason})"
        ) from None
    return True


def run(args) -> int:
    from ..serve.limits import Limits, open_file_limits
    from . import serve_ray

    # Before anything imports mlx_lm.utils, which lowers the open-file limits at its import
    # (building the parser imports no mlx; the import below keeps them; whatever else lowers
    # them is undone after the load).
    saved_limits = open_file_limits()
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ServeError(
            f"serving needs FastAPI and uvicorn ({e.name} is missing): "
            "pip install 'mlx-voicechat[server]'"
        ) from None
    for attr, ok, rule in (
        ("port", 0 < args.port < 65536, "in 1..65535"),
        ("max_sessions", args.max_sessions >= 1, "at least 1"),
        ("max_lag_seconds", args.max_lag_seconds > 0, "> 0"),
        ("idle_timeout", args.idle_timeout >= 0, ">= 0 seconds"),
        ("max_prompt_tokens", args.max_prompt_tokens >= 1, "at least 1"),
        ("max_connections", args.max_connections >= 1, "at least 1"),
        ("header_timeout", args.header_timeout > 0, "> 0 seconds"),
        ("keep_alive_timeout", args.keep_alive_timeout > 0, "> 0 seconds"),
        ("shutdown_timeout", args.shutdown_timeout > 0, "> 0 seconds"),
        ("tool_timeout", args.tool_timeout > 0, "> 0 seconds"),
    ):
        if not ok:
            raise ServeError(f"{flag(attr)} must be {rule}, got {getattr(args, attr)}")
    for prefix in args.mcp_allow:
        if not prefix.startswith(("http://", "https://")) or "://" == prefix[-3:]:
            raise ServeError(f"--mcp-allow takes an http:// or https:// URL prefix, not {prefix!r}")
    if args.mcp_allow:
        from ..nemotron_voicechat.runtime.mcp import require_sdk

        require_sdk()  # a one-line error now rather than at a client's first mcp tool
    limits = Limits(args.max_connections, args.header_timeout, args.keep_alive_timeout)
    tls = check_tls(args.ssl_certfile, args.ssl_keyfile)
    if tls and args.ray:
        raise ServeError(
            "--ssl-certfile is not served through Ray's HTTP proxy (--ray); put a TLS proxy in "
            "front of it"
        )
    serve_ray.check(args)
    key = args.api_key if args.api_key is not None else os.environ.get(KEY_ENV) or None
    if not _loopback(args.host) and key is None:
        say(
            f"warning: listening on {args.host} without an API key: anyone who reaches this "
            f"address can use the model (set --api-key or ${KEY_ENV})"
        )

    from ..serve.limits import import_mlx_lm_keeping_limits, raise_open_file_limit, uvicorn_options
    from ..serve.settings import ServerSettings, model_id_of

    import_mlx_lm_keeping_limits()
    settings = ServerSettings(
        model_id=model_id_of(args.model),
        api_key=key,
        max_sessions=args.max_sessions,
        allow_origins=args.allow_origin,
        silence_feed=not args.no_silence_feed,
        max_lag_seconds=args.max_lag_seconds,
        seed=args.seed,
        idle_timeout=args.idle_timeout,
        max_prompt_tokens=args.max_prompt_tokens,
        mcp_allow=args.mcp_allow,
        tool_timeout=args.tool_timeout,
        metrics_public=args.metrics_public,
    )
    if args.ray:
        return serve_ray.run(args, settings)

    from .. import load
    from ..serve.app import WS_MAX_SIZE, create_app

    app = create_app(load(args.model, tokenizer=args.tokenizer), settings)
    open_files = raise_open_file_limit(saved_limits, limits.files_needed)
    fitted = limits.fitted(open_files)
    if fitted.max_connections < limits.max_connections:
        say(
            f"warning: the process may open {open_files} files (ulimit -n), enough for "
            f"{fitted.max_connections} connections: --max-connections lowered to that"
        )
    say(urls(args, tls))
    return _serve_app(
        app,
        args.shutdown_timeout,
        host=args.host,
        port=args.port,
        ws_max_size=WS_MAX_SIZE,
        log_level=args.log_level,
        lifespan="on",
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        **uvicorn_options(fitted),
    )


def _serve_app(app, shutdown_timeout: float, **options) -> int:
    """uvicorn serving ``app`` with ``options`` (uvicorn.Config's) until a signal, then the
    shutdown of :func:`~mlx_voicechat.serve.app.graceful_server` and :func:`_exit`."""
    import uvicorn

    from ..serve.app import graceful_server

    server = graceful_server(uvicorn.Config(app, **options), app.state.server, shutdown_timeout)
    server.run()
    # Its signal handlers stay to the process's end: a second Ctrl-C while the worker stops
    # or the interpreter exits is noted, never a KeyboardInterrupt around a busy worker.
    return _exit(server, app.state.server.worker)


def _exit(server, worker) -> int:
    """After uvicorn: stop the worker (what it runs is dropped) before the interpreter exits,
    which would abort the process were the worker inside MLX; then exit as the signal asks
    (KeyboardInterrupt or Terminated: 130 / 128 + signal and one line, as every verb)."""
    import signal

    from . import Terminated

    stopped = worker.stop(server.time_left())
    if not server.started and not server.signals:
        raise ServeError("the server did not start (see the lines above)")
    sig = server.signals[0] if server.signals else None
    if not stopped:
        # The worker is still inside one MLX call: no finalizing interpreter may meet it.
        name = signal.Signals(sig).name if sig else "stopped"
        say(
            f"{'terminated' if sig else 'stopped'} ({name}); the work in flight was dropped at "
            "--shutdown-timeout"
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + sig if sig else 1)
    if sig == signal.SIGINT:
        raise KeyboardInterrupt
    if sig is not None:
        raise Terminated(sig)
    return 0

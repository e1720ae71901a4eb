"""What bounds a server process below the protocol: open connections, the time a client has to
send its request headers (:class:`ConnectionGuard`; uvicorn bounds neither), the open-file
limit, logs that neither flood nor carry a secret, and a Ray deployment's replica counts. At
the connection bound the oldest connection still sending headers (else the oldest plain HTTP
one) makes room; WebSockets never do (the sessions bound them).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import re
import time
from dataclasses import dataclass
from typing import Optional, Tuple

try:
    import resource
except ImportError:  # pragma: no cover - not a POSIX system
    resource = None

HEADERS_END = b"\r\n\r\n"
FILES_PER_CONNECTION = 2  # its socket and, for a static file being sent, that file
RESERVED_FILES = 128  # the listening socket, the checkpoint's files, logs, pipes, the worker
LOG_EVERY_SECONDS = 10.0  # a repeated warning is written at most this often
log = logging.getLogger("mlx_voicechat.serve")


@dataclass(frozen=True)
class Limits:
    """The transport's bounds (``serve --max-connections / --header-timeout /
    --keep-alive-timeout``, checked there)."""

    max_connections: int = 1000
    header_timeout: float = 10.0  # seconds for a new connection's request headers
    keep_alive_timeout: float = 5.0  # seconds an idle HTTP keep-alive connection stays open

    @property
    def files_needed(self) -> int:
        """Open files the process may need with every connection taken."""
        return FILES_PER_CONNECTION * self.max_connections + RESERVED_FILES

    def fitted(self, open_files: Optional[int]) -> "Limits":
        """These limits with ``max_connections`` lowered to what ``open_files`` allows."""
        if open_files is None:
            return self
        most = max(1, (open_files - RESERVED_FILES) // FILES_PER_CONNECTION)
        if self.max_connections <= most:
            return self
        return Limits(most, self.header_timeout, self.keep_alive_timeout)


class _Every:
    """True at most once per ``seconds`` (a warning that would repeat per connection)."""

    def __init__(self, seconds: float = LOG_EVERY_SECONDS):
        self.seconds, self.last = seconds, float("-inf")

    def __call__(self) -> bool:
        now = time.monotonic()
        if now - self.last < self.seconds:
            return False
        self.last = now
        return True


class ConnectionGuard:
    """The bound on open connections and on the time to send request headers (see the module
    docstring). :attr:`protocol` is the HTTP protocol class to hand to uvicorn: a subclass of
    uvicorn's own that reports to this guard."""

    def __init__(self, limits: Limits):
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        self.limits = limits
        self._open: dict = {}  # transport -> None, oldest first
        self._waiting: dict = {}  # transport -> timer, while its request headers are not all in
        self.closed_for_room = 0
        self._warn = _Every()
        self.protocol = _guarded(AutoHTTPProtocol, self)

    # -- what the protocol reports --

    def admit(self, transport) -> None:
        limit = self.limits.max_connections
        if len(self._open) >= limit:
            self._prune()
        if len(self._open) >= limit:
            victim = next(iter(self._waiting), None) or self._oldest_http()
            self.closed_for_room += 1
            if self._warn():
                log.warning(
                    "%d connections are open (--max-connections); closing the oldest one that "
                    "has not finished its request (%d closed so far)",
                    limit,
                    self.closed_for_room,
                )
            if victim is None:  # every open connection is a WebSocket: the new one goes
                transport.abort()
                return
            self.lost(victim)
            victim.abort()
        self._open[transport] = None
        loop = asyncio.get_running_loop()
        self._waiting[transport] = loop.call_later(
            self.limits.header_timeout, self._expire, transport
        )

    def headers_done(self, transport) -> None:
        timer = self._waiting.pop(transport, None)
        if timer is not None:
            timer.cancel()

    def lost(self, transport) -> None:
        self._open.pop(transport, None)
        self.headers_done(transport)

    # -- internals --

    def _expire(self, transport) -> None:
        self._waiting.pop(transport, None)
        if isinstance(transport.get_protocol(), self.protocol):  # not a WebSocket by now
            transport.abort()

    def _prune(self) -> None:
        """Forget connections that have closed (a WebSocket's end is not reported here)."""
        for t in [t for t in self._open if t.is_closing()]:
            self.lost(t)

    def _oldest_http(self):
        cls = self.protocol
        return next(
            (t for t in self._open if isinstance(t.get_protocol(), cls) and not t.is_closing()),
            None,
        )


def _guarded(base, guard: ConnectionGuard):
    class GuardedHTTPProtocol(base):
        def connection_made(self, transport):
            self._guard_transport = transport
            self._guard_tail = b""
            super().connection_made(transport)
            guard.admit(transport)

        def data_received(self, data: bytes) -> None:
            if self._guard_tail is not None:
                seen = self._guard_tail + data
                if HEADERS_END in seen:
                    self._guard_tail = None
                    guard.headers_done(self._guard_transport)
                else:
                    self._guard_tail = seen[-(len(HEADERS_END) - 1) :]
            super().data_received(data)

        def connection_lost(self, exc):
            guard.lost(self._guard_transport)
            super().connection_lost(exc)

    GuardedHTTPProtocol.__name__ = f"Guarded{base.__name__}"
    return GuardedHTTPProtocol


# --- the open-file limit ------------------------------------------------------------------


def _size(v) -> float:
    return float("inf") if v == resource.RLIM_INFINITY else v


def _value(v: float) -> int:
    return resource.RLIM_INFINITY if v == float("inf") else int(v)


def open_file_limits() -> Optional[Tuple[int, int]]:
    """The process's (soft, hard) open-file limits, or None where there are none (Windows)."""
    return None if resource is None else resource.getrlimit(resource.RLIMIT_NOFILE)


def import_mlx_lm_keeping_limits() -> None:
    """Import ``mlx_lm.utils`` (which loading the model does anyway) while ``resource.setrlimit``
    may raise the soft open-file limit but neither lower it nor touch the hard one.

    ``mlx_lm.utils`` sets them to (2048, 4096) at its import ("for large models with lots of
    files"); a process without privileges can never raise a hard limit again, so a server that
    imported it unguarded could not have more than 4096 files open."""
    if resource is None:  # pragma: no cover - not a POSIX system
        importlib.import_module("mlx_lm.utils")
        return
    real = resource.setrlimit

    def setrlimit(which, limits):
        if which == resource.RLIMIT_NOFILE:
            soft, hard = resource.getrlimit(which)
            limits = (_value(max(_size(soft), min(_size(limits[0]), _size(hard)))), hard)
        return real(which, limits)

    resource.setrlimit = setrlimit
    try:
        importlib.import_module("mlx_lm.utils")
    finally:
        resource.setrlimit = real


def raise_open_file_limit(saved: Optional[Tuple[int, int]], wanted: int) -> Optional[int]:
    """Put back the open-file limits ``saved`` if something lowered them since, and raise the
    soft limit to ``wanted`` where the hard limit allows; returns the soft limit now in force
    (None: no limit)."""
    if resource is None:  # pragma: no cover - not a POSIX system
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard_wanted = saved[1] if saved is not None and _size(saved[1]) > _size(hard) else hard
    floor = max(_size(soft), _size(saved[0]) if saved is not None else 0, wanted)
    soft_wanted = _value(min(floor, _size(hard_wanted)))
    if (soft_wanted, hard_wanted) != (soft, hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft_wanted, hard_wanted))
        except (ValueError, OSError):
            # Raising a hard limit needs privileges: go as far as the current one allows.
            fallback = _value(min(_size(soft_wanted), _size(hard)))
            if _size(fallback) > _size(soft):
                try:
                    resource.setrlimit(resource.RLIMIT_NOFILE, (fallback, hard))
                except (ValueError, OSError):
                    pass  # (macOS refuses a soft limit past kern.maxfilesperproc)
    now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if now == resource.RLIM_INFINITY else int(now)


# --- logs ---------------------------------------------------------------------------------

_QUERY_VALUE = re.compile(r"=[^&]*")


def _redact(arg):
    if isinstance(arg, str) and arg.startswith("/") and "?" in arg:
        path, query = arg.split("?", 1)
        return f"{path}?{_QUERY_VALUE.sub('=(hidden)', query)}"
    return arg


class RedactQuery(logging.Filter):
    """Hides the values of a request's query string in uvicorn's request lines: a client may
    put a secret there (``?api_key=...``) even though it is refused."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(isinstance(a, str) for a in record.args):
            record.args = tuple(_redact(a) for a in record.args)
        return True


class OncePer(logging.Filter):
    """Lets a message that starts with ``prefix`` through at most once per ``seconds``,
    without its traceback (asyncio logs each failed ``accept`` when files run out)."""

    def __init__(self, prefix: str, seconds: float = LOG_EVERY_SECONDS):
        super().__init__()
        self.prefix, self._every = prefix, _Every(seconds)

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.prefix):
            return True
        record.exc_info = None
        record.exc_text = None
        return self._every()


def install_log_filters() -> None:
    """The filters above on uvicorn's and asyncio's loggers (once per process)."""
    for name in ("uvicorn.access", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactQuery) for f in logger.filters):
            logger.addFilter(RedactQuery())
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, OncePer) for f in logger.filters):
        logger.addFilter(OncePer("socket.accept() out of system resource"))


def uvicorn_options(limits: Limits) -> dict:
    """uvicorn settings for ``limits`` (its HTTP protocol behind a :class:`ConnectionGuard`),
    with the log filters installed."""
    install_log_filters()
    return {
        "http": ConnectionGuard(limits).protocol,
        "timeout_keep_alive": limits.keep_alive_timeout,
    }


def replica_counts(replicas=None, min_replicas=None, max_replicas=None, spell=str) -> dict:
    """A Ray deployment's replicas: ``{"num_replicas": n}`` (default 1), or autoscaling
    ``{"min_replicas": low, "max_replicas": high}``; a ValueError names them by ``spell`` (the
    CLI's flags, the library's arguments). Here, not in :mod:`.ray_app`, so that
    ``serve --ray`` checks its flags before it imports Ray."""
    n, low, high = spell("replicas"), spell("min_replicas"), spell("max_replicas")
    if min_replicas is None and max_replicas is None:
        replicas = 1 if replicas is None else int(replicas)
        if replicas < 1:
            raise ValueError(f"{n} must be at least 1, got {replicas}")
        return {"num_replicas": replicas}
    if replicas is not None:
        raise ValueError(f"give {n}, or {low} / {high}, not both")
    lo = 1 if min_replicas is None else int(min_replicas)
    hi = max(lo, 1) if max_replicas is None else int(max_replicas)
    if lo < 0 or hi < max(lo, 1):
        raise ValueError(f"need 0 <= {low} <= {high} (>= 1), got {lo}, {hi}")
    return {"min_replicas": lo, "max_replicas": hi}

"""What an operator scrapes: the series of :data:`SERIES` (listed in docs/operating.md) for
Prometheus (``GET /metrics``) or, in a Ray Serve replica, through ``ray.util.metrics``.
Recording never fails the server: without ``prometheus_client`` nothing is recorded.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, Optional

log = logging.getLogger("mlx_voicechat.serve")

PREFIX = "voicechat_"
SECONDS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LONG_SECONDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0)
SIZES = (1, 2, 4, 8, 16, 32, 64, 128)

# name: (kind, help, label names, buckets)
SERIES = {
    "conversations_live": ("gauge", "Conversations holding a session slot now.", (), None),
    "conversations_opened": ("counter", "Conversations given a session slot.", (), None),
    "conversations_refused": (
        "counter",
        "Connections refused before a session: reason is origin, unauthorized, server_busy "
        "or shutting_down.",
        ("reason",),
        None,
    ),
    "conversations_closed": (
        "counter",
        "Conversations ended: reason is client_closed, or the code of the error event that "
        "ended it (session_ended, idle_timeout, lag_exceeded, server_shutting_down, ...).",
        ("reason",),
        None,
    ),
    "frames": ("counter", "Conversation frames (80 ms each) stepped by the model.", (), None),
    "frame_step_seconds": (
        "histogram",
        "Seconds of one batched frame of every conversation that had one (real time is 0.08).",
        (),
        SECONDS,
    ),
    "batch_size": ("histogram", "Conversations in one batched frame.", (), SIZES),
    "lag_seconds": (
        "histogram",
        "Audio queued for the model, seconds behind, after each feed of a conversation.",
        (),
        SECONDS,
    ),
    "time_to_first_audio_seconds": (
        "histogram",
        "Seconds from a conversation's first audio in to its first audio out.",
        (),
        LONG_SECONDS,
    ),
    "session_open_seconds": (
        "histogram",
        "Seconds the worker spent opening a conversation's session (its prompt's prefill).",
        (),
        LONG_SECONDS,
    ),
    "prompt_state_cache": (
        "counter",
        "Session opens whose post-prompt state was cached (result=hit) or computed (miss).",
        ("result",),
        None,
    ),
    "error_events": ("counter", "error events sent to clients, by error code.", ("code",), None),
    "webrtc_audio_gap_seconds": (
        "counter",
        "Seconds of WebRTC callers' audio heard as silence: kind is missing (packets lost, or "
        "not sent while the caller was muted or silent) or late (came after its time).",
        ("kind",),
        None,
    ),
    "tool_calls": (
        "counter",
        "Tool calls: outcome is called (sent to the client), answered (its output was "
        "accepted) or refused (its output was not).",
        ("outcome",),
        None,
    ),
}


class Metrics:
    """The server's series. ``backend``: ``"prometheus"`` (a registry of the app's own, with
    the process metrics; :meth:`exposition` renders it), ``"ray"`` (``ray.util.metrics``, tagged
    with the replica by Ray) or ``None`` (nothing recorded). ``live``: the live conversations
    now (read at scrape time with Prometheus, set on each change with Ray)."""

    def __init__(
        self,
        backend: Optional[str],
        live: Callable[[], int] = lambda: 0,
        tags: Optional[Dict[str, str]] = None,
    ):
        self.backend = backend
        self._tags = dict(tags or {})  # with Ray: tags of every series (the replica)
        self._live = live
        self._series: Dict[str, object] = {}
        self.registry = None
        try:
            if backend == "prometheus":
                self._prometheus()
            elif backend == "ray":
                self._ray()
        except ImportError as e:
            log.warning("no metrics: %s is not installed", e.name)
            self.backend, self._series = None, {}

    def _prometheus(self) -> None:
        import prometheus_client as pc

        self.registry = pc.CollectorRegistry()
        for collector in (pc.ProcessCollector, pc.PlatformCollector, pc.GCCollector):
            collector(registry=self.registry)
        kinds = {"counter": pc.Counter, "gauge": pc.Gauge, "histogram": pc.Histogram}
        for name, (kind, doc, labels, buckets) in SERIES.items():
            extra = {"buckets": buckets} if buckets else {}
            self._series[name] = kinds[kind](
                PREFIX + name, doc, labels, registry=self.registry, **extra
            )
        self._series["conversations_live"].set_function(lambda: self._live())

    def _ray(self) -> None:
        from ray.util import metrics as rm

        for name, (kind, doc, labels, buckets) in SERIES.items():
            keys = tuple(labels) + tuple(self._tags)
            if kind == "histogram":
                s = rm.Histogram(PREFIX + name, doc, boundaries=list(buckets), tag_keys=keys)
            else:
                s = {"counter": rm.Counter, "gauge": rm.Gauge}[kind](
                    PREFIX + name, doc, tag_keys=keys
                )
            if self._tags:
                s.set_default_tags(self._tags)
            self._series[name] = _RaySeries(s)

    # -- what the server records --

    def _count(self, name: str, n: float = 1, **labels) -> None:
        s = self._series.get(name)
        if s is not None:
            (s.labels(**labels) if labels else s).inc(n)

    def _observe(self, name: str, value: float, times: int = 1) -> None:
        s = self._series.get(name)
        if s is not None:
            for _ in range(times):
                s.observe(value)

    def live_changed(self) -> None:
        """The live conversations changed (Prometheus reads them when scraped)."""
        s = self._series.get("conversations_live")
        if isinstance(s, _RaySeries):
            s.set(self._live())

    def opened(self) -> None:
        self._count("conversations_opened")
        self.live_changed()

    def refused(self, reason: str) -> None:
        self._count("conversations_refused", reason=reason)

    def closed(self, reason: str) -> None:
        self._count("conversations_closed", reason=reason)
        self.live_changed()

    def error_sent(self, code) -> None:
        self._count("error_events", code=str(code or "unknown"))

    def tool_call(self, outcome: str) -> None:
        self._count("tool_calls", outcome=outcome)

    def audio_gap(self, kind: str, seconds: float) -> None:
        """A WebRTC caller's audio that the model hears as silence (``missing`` or ``late``)."""
        self._count("webrtc_audio_gap_seconds", seconds, kind=kind)

    def lag(self, seconds: float) -> None:
        self._observe("lag_seconds", max(0.0, seconds))

    def first_audio(self, seconds: float) -> None:
        self._observe("time_to_first_audio_seconds", max(0.0, seconds))

    def session_opened(self, seconds: float, cached: Optional[bool]) -> None:
        self._observe("session_open_seconds", seconds)
        if cached is not None:
            self._count("prompt_state_cache", result="hit" if cached else "miss")

    def step(self, frames_per_conversation, seconds: float) -> None:
        """One batched step (a round of the worker): ``frames_per_conversation`` the frames
        each conversation in it got, ``seconds`` the step's wall time. Recorded per batched
        frame: the step's seconds shared among its frames, and each frame's batch size."""
        counts = [n for n in frames_per_conversation if n > 0]
        if not counts:
            return
        rounds = max(counts)
        self._count("frames", sum(counts))
        self._observe("frame_step_seconds", seconds / rounds, rounds)
        for i in range(rounds):
            self._observe("batch_size", sum(1 for n in counts if n > i))

    def exposition(self):
        """(body, content type) of ``GET /metrics`` (Prometheus' text format)."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _RaySeries:
    """A ``ray.util.metrics`` series with prometheus_client's calls (``labels().inc()``,
    ``observe``, ``set``)."""

    def __init__(self, series, tags: Optional[dict] = None):
        self._s, self._tags = series, tags

    def labels(self, **tags) -> "_RaySeries":
        return _RaySeries(self._s, tags)

    def inc(self, n: float = 1) -> None:
        self._s.inc(n, tags=self._tags)

    def observe(self, value: float) -> None:
        self._s.observe(value, tags=self._tags)

    def set(self, value: float) -> None:
        self._s.set(value, tags=self._tags)

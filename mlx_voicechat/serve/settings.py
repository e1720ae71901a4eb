"""One server's settings, built once (by ``serve``'s flags, a test, a Ray replica) and read by
the app, the server and every connection: :class:`ServerSettings`."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

from .mcp_tools import DEFAULT_TOOL_TIMEOUT

IDLE_TIMEOUT = 180.0  # seconds without client audio before a connection is closed
MAX_PROMPT_TOKENS = 4096  # default bound of a session's prompt (instructions and tools), tokens


@dataclass(frozen=True)
class ServerSettings:
    """What one server does with its model.

    ``api_key``: required of every WebSocket (``Authorization: Bearer KEY`` or the subprotocol
    ``openai-insecure-api-key.KEY``), of ``/v1/models`` and (unless ``metrics_public``) of
    ``/metrics``. ``allow_origins``: browser origins besides the server's own. ``silence_feed``:
    feed silence at real time while the client's audio is behind. ``max_lag_seconds``: queued
    audio past this closes the connection (1013). ``commit_seconds`` / ``max_reply_seconds``:
    the trailing silence a commit feeds when no reply comes / at most. ``chunk_frames``: frames
    per worker job. ``send_queue_size``: server events waiting for a slow client before it is
    dropped. ``session_options``: more keyword arguments of ``model.session`` (e.g.
    ``max_seconds``). ``idle_timeout``: seconds without client audio before the connection is
    closed (error ``idle_timeout``, close 4408; None or 0: no bound). ``max_prompt_tokens``: the
    longest prompt (instructions and tools) a session takes, in tokens; longer instructions are
    refused by their length before any tokenizing. ``mcp_allow``: URL prefixes of the MCP
    servers a client's ``mcp`` tools may name (none: no ``mcp`` tool is accepted);
    ``tool_timeout``: seconds an MCP call (and a server's start) may take. ``metrics``: where
    the series of :mod:`.metrics` go: ``"prometheus"`` (``GET /metrics``), ``"ray"`` (Ray's
    metrics; ``/metrics`` answers 404) or None; ``metric_tags``: with Ray's, tags of every
    series. ``vendor``: fields of the vendor object ``x-voicechat`` in ``session.created``
    (e.g. which replica serves it). ``ice_timeout``: seconds a WebRTC call waits for its
    connection before it is closed (None: :data:`.webrtc.ICE_TIMEOUT`)."""

    model_id: str = "nemotron-voicechat"
    api_key: Optional[str] = None
    max_sessions: int = 1
    allow_origins: Iterable[str] = ()
    silence_feed: bool = True
    max_lag_seconds: float = 10.0
    silence_grace_seconds: float = 0.24
    commit_seconds: float = 3.0
    max_reply_seconds: float = 30.0
    chunk_frames: int = 4
    send_queue_size: int = 512
    stats_every_frames: int = 25
    seed: int = 0
    session_options: Optional[Mapping[str, Any]] = None
    idle_timeout: Optional[float] = IDLE_TIMEOUT
    max_prompt_tokens: int = MAX_PROMPT_TOKENS
    mcp_allow: Iterable[str] = ()
    tool_timeout: float = DEFAULT_TOOL_TIMEOUT
    metrics: Optional[str] = "prometheus"
    metrics_public: bool = False
    metric_tags: Optional[Mapping[str, str]] = None
    vendor: Optional[Mapping[str, Any]] = None
    ice_timeout: Optional[float] = None

    def __post_init__(self):
        if self.max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        if int(self.max_prompt_tokens) < 1:
            raise ValueError(f"max_prompt_tokens must be at least 1, got {self.max_prompt_tokens}")
        # One spelling of each (a frozen dataclass sets its own fields through object's).
        normal = {
            "api_key": self.api_key or None,
            "allow_origins": frozenset(o.rstrip("/") for o in self.allow_origins),
            "mcp_allow": tuple(self.mcp_allow),
            "idle_timeout": float(self.idle_timeout) if self.idle_timeout else None,
            "session_options": dict(self.session_options or {}),
            "vendor": dict(self.vendor or {}),
        }
        for name, value in normal.items():
            object.__setattr__(self, name, value)

    def replace(self, **changes) -> "ServerSettings":
        """These settings with ``changes``; a name that is not a setting is a TypeError that
        lists them."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            known = ", ".join(f.name for f in dataclasses.fields(self))
            raise TypeError(f"unknown server setting(s) {unknown}; the settings are: {known}")
        return dataclasses.replace(self, **changes) if changes else self


def model_id_of(model) -> str:
    """The id a server gives a model by default: its folder's name, or the hub id."""
    return os.path.basename(os.path.normpath(str(model))) or str(model)

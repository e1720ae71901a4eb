"""What the Ray Serve deployment (:mod:`.ray_app`) plugs into Ray's proxy and routers (no MLX).

:class:`SessionRouter` sends a new connection to the ready replica with the fewest ongoing
requests (not two drawn at random, as Ray's default does), so a full replica is chosen only
when all are full. :class:`ReplicaLossMiddleware` gives a connection whose replica went away
an ``error`` event ``replica_lost`` and close :data:`CLOSE_REPLICA_LOST`.
"""

from __future__ import annotations

import json
import secrets
import time

from ray.serve.request_router import FIFOMixin, RequestRouter

CLOSE_REPLICA_LOST = 1012  # "service restart": reconnect, a live replica takes the session
CLOSE_UNAVAILABLE = 1013  # "try again later": no replica could take the connection
REALTIME_PATH = "/v1/realtime"
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "mlx_voicechat.serve.ray_proxy.proxy_middlewares"


def replica_rank(stats: dict) -> int:
    """0: the model is ready, or the replica has not reported yet (it just started); 1: the
    replica has no model (it failed to load)."""
    return 1 if stats and not stats.get("ready") else 0


PENDING_SECONDS = 5.0  # a choice not confirmed as routed by then no longer counts


class SessionRouter(FIFOMixin, RequestRouter):
    """Orders the replicas by :func:`replica_rank`, then by load: Ray's cached queue length
    plus this router's choices Ray has not confirmed yet (connections that arrive together
    would otherwise all see the same cached lengths and crowd one replica, which would refuse
    the last as busy while another had room). Ray takes the first replica that is not full."""

    @property
    def _pending(self) -> dict:
        """Replica id -> when this router chose it for connections Ray has not confirmed."""
        return self.__dict__.setdefault("_pending_marks", {})

    def _load(self, replica, now: float) -> int:
        pending = self._pending
        marks = [t for t in pending.get(replica.replica_id, ()) if now - t < PENDING_SECONDS]
        pending[replica.replica_id] = marks
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        return (cached or 0) + len(marks)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        now = time.monotonic()
        ordered = sorted(
            candidate_replicas,
            key=lambda r: (replica_rank(r.routing_stats or {}), self._load(r, now)),
        )
        if ordered:
            self._pending.setdefault(ordered[0].replica_id, []).append(now)
        return [[r] for r in ordered]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        """Ray accepted a request on ``replica_id``: its queue length now counts it."""
        marks = self._pending.get(replica_id)
        if marks:
            marks.pop(0)


def _error_event(code: str, message: str) -> str:
    """A Realtime ``error`` server event (the shape of :meth:`.protocol.Realtime.error`)."""
    return json.dumps(
        {
            "type": "error",
            "event_id": f"event_{secrets.token_hex(6)}_proxy",
            "error": {
                "type": "server_error",
                "code": code,
                "message": message,
                "param": None,
                "event_id": None,
            },
        }
    )


class ReplicaLossMiddleware:
    """ASGI middleware for Ray's proxy: ends a ``/v1/realtime`` connection that its replica
    left without a close (the replica died or was stopped, or no replica could take it) with
    an ``error`` event and a close code the client can act on."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "websocket" or not scope.get("path", "").endswith(REALTIME_PATH):
            await self.app(scope, receive, send)
            return
        state = {"accepted": False, "ended": False, "client_gone": False}

        async def receive_tracked():
            message = await receive()
            if message["type"] == "websocket.disconnect":
                state["client_gone"] = True
            return message

        async def send_tracked(message):
            kind = message["type"]
            if kind in ("http.response.start", "http.response.body"):
                return  # the proxy's HTTP error for a WebSocket: answered below instead
            if kind == "websocket.accept":
                state["accepted"] = True
            elif kind in ("websocket.close", "websocket.http.response.start"):
                state["ended"] = True
            await send(message)

        try:
            await self.app(scope, receive_tracked, send_tracked)
        finally:
            if not state["ended"] and not state["client_gone"]:
                await self._close(send, state["accepted"])

    @staticmethod
    async def _close(send, accepted: bool) -> None:
        if accepted:
            code, reason = CLOSE_REPLICA_LOST, "replica lost"
            event = _error_event(
                "replica_lost",
                "the replica serving this session stopped; reconnect for a new session",
            )
        else:
            await send({"type": "websocket.accept"})
            code, reason = CLOSE_UNAVAILABLE, "no replica available"
            event = _error_event(
                "server_unavailable", "no replica could take this connection; try again later"
            )
        try:
            await send({"type": "websocket.send", "text": event})
            await send({"type": "websocket.close", "code": code, "reason": reason})
        except Exception:  # the client went away meanwhile: nothing left to tell it
            pass


def proxy_middlewares():
    """The callback Ray's proxy calls at start when :data:`PROXY_CALLBACK_ENV` names it."""
    from starlette.middleware import Middleware

    return [Middleware(ReplicaLossMiddleware)]

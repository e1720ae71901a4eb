"""Short-lived client secrets (``POST /v1/realtime/client_secrets``), as OpenAI's Realtime API
mints them: a web app's back-end, holding the server's API key, asks for one and hands it to its
page; the page connects with it (WebSocket ``/v1/realtime`` or WebRTC ``/v1/realtime/calls``,
``Authorization: Bearer ek_...``) and the session starts with the configuration the secret
carries. A secret authorizes exactly one connection before it expires and nothing else (not
``/v1/models``, not minting another); an expired, used or unknown one is refused with OpenAI's
error shape (``invalid_request_error``, code ``invalid_api_key``).
"""

import hmac
import json
import secrets as _random
import threading
import time
from typing import Dict, List, Optional, Tuple

from ..errors import is_int

PREFIX = "ek_"  # what OpenAI's ephemeral keys start with; a bearer token so named is a secret
KEY_PROTOCOL = "openai-insecure-api-key."  # a WebSocket subprotocol carrying a key
DEFAULT_TTL = 600  # seconds, OpenAI's default (expires_after.seconds)
MIN_TTL, MAX_TTL = 10, 7200  # seconds, the bounds OpenAI accepts
MAX_LIVE = 10000  # minted secrets kept at once; past it, minting is refused until some expire


class SecretRefused(Exception):
    """A client secret that authorizes nothing: why, for the client (one line)."""


class ClientSecrets:
    """The secrets this server minted: value -> (expires_at, session config, used)."""

    def __init__(self, clock=time.time):
        self._clock = clock
        self._lock = threading.Lock()
        self._live: Dict[str, Tuple[float, dict, bool]] = {}

    def __len__(self) -> int:
        return len(self._live)

    def _prune(self, now: float) -> None:
        for value in [v for v, (exp, _, _) in self._live.items() if exp <= now - 60]:
            del self._live[value]  # an expired one is still named "expired" for a minute

    def mint(self, session: dict, seconds: int = DEFAULT_TTL) -> Tuple[str, int]:
        """A new secret for one connection with ``session`` (the client's config): its value
        and when it expires (Unix seconds)."""
        now = self._clock()
        with self._lock:
            self._prune(now)
            if len(self._live) >= MAX_LIVE:
                raise SecretRefused(
                    f"{MAX_LIVE} client secrets are live; wait for some to expire or be used"
                )
            value = PREFIX + _random.token_urlsafe(24)
            expires_at = int(now + seconds)
            self._live[value] = (expires_at, dict(session), False)
        return value, expires_at

    def redeem(self, value: str) -> dict:
        """Use ``value`` up (once, before it expires): its session config, or
        :class:`SecretRefused` saying why not."""
        now = self._clock()
        with self._lock:
            self._prune(now)
            found = None
            for known in self._live:  # constant-time comparison against each, not a dict hit
                if hmac.compare_digest(known.encode(), value.encode()):
                    found = known
            if found is None:
                raise SecretRefused("the client secret is not one this server issued")
            expires_at, session, used = self._live[found]
            if used:
                raise SecretRefused("the client secret was already used for a connection")
            if expires_at <= now:
                raise SecretRefused("the client secret has expired; ask your back-end for another")
            self._live[found] = (expires_at, session, True)
            return dict(session)

    def release(self, value: str) -> None:
        """Give back a secret whose WebRTC call was answered but never connected (ICE, DTLS or
        the data channel did not complete, or it was hung up first): no connection was made, so
        the secret may admit one, e.g. the page's WebSocket fallback, until it expires."""
        with self._lock:
            if value in self._live:
                expires_at, session, _ = self._live[value]
                self._live[value] = (expires_at, session, False)


def credentials(headers, subprotocols=()) -> List[str]:
    """The keys a request presents: ``Authorization: Bearer ...``, then the WebSocket
    subprotocols ``openai-insecure-api-key....`` (a browser's WebSocket sets no header)."""
    auth = headers.get("authorization", "")
    found = [auth[7:].strip()] if auth[:7].lower() == "bearer " else []
    return found + [p[len(KEY_PROTOCOL) :] for p in subprotocols if p.startswith(KEY_PROTOCOL)]


def bearer_secret(headers, subprotocols=()) -> Optional[str]:
    """The client secret a request presents (``ek_...``, as a key), or None."""
    return next((c for c in credentials(headers, subprotocols) if c.startswith(PREFIX)), None)


def refusal(message: str, code: str = "invalid_api_key", type_="invalid_request_error") -> dict:
    """OpenAI's error body of a refused HTTP request (by default, a refused credential)."""
    return {"error": {"type": type_, "code": code, "message": message, "param": None}}


def ttl_of(body: dict) -> int:
    """``expires_after.seconds`` of a client_secrets request (default 600 s), checked."""
    after = body.get("expires_after")
    if after is None:
        return DEFAULT_TTL
    if not isinstance(after, dict):
        raise ValueError("`expires_after` must be an object")
    anchor = after.get("anchor", "created_at")
    if anchor != "created_at":
        raise ValueError('`expires_after.anchor` must be "created_at"')
    seconds = after.get("seconds", DEFAULT_TTL)
    if not is_int(seconds):
        raise ValueError("`expires_after.seconds` must be an integer")
    if not MIN_TTL <= seconds <= MAX_TTL:
        raise ValueError(f"`expires_after.seconds` must be between {MIN_TTL} and {MAX_TTL}")
    return seconds


class PresetSocket:
    """A WebSocket whose first message is a ``session.update`` with ``session`` (the config a
    client secret carries), then the client's own; everything else is the socket's."""

    def __init__(self, websocket, session: dict):
        self._ws = websocket
        self._first = {"type": "session.update", "session": session} if session else None

    def __getattr__(self, name):
        return getattr(self._ws, name)

    async def receive(self):
        if self._first is not None:
            first, self._first = self._first, None
            return {"type": "websocket.receive", "text": json.dumps(first)}
        return await self._ws.receive()

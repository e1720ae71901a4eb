"""What the connections of one server share (:class:`Server`: the model, the worker, the
session slots, the settings) and what it admits: an API key, the browser origins that are its
own (from the address a connection arrived at, never from the request's ``Host``) and how long
a session's prompt may be (from the model's context and vocabulary)."""

import asyncio
import hmac
import ipaddress
import time
from typing import NamedTuple, Optional, Set, Tuple

from ..nemotron_voicechat.runtime.request import prompt_ids, resolve_system_prompt
from ..nemotron_voicechat.runtime.tools import render_system_prompt
from .channel import CLOSE_POLICY, CLOSE_TRY_AGAIN
from .mcp_tools import McpPolicy
from .metrics import Metrics
from .secrets import SecretRefused, bearer_secret, credentials, refusal
from .settings import ServerSettings
from .stepper import Stepper
from .wire import FRAME_SECONDS, SAMPLES_PER_FRAME
from .worker import Worker

CLOSE_RESTART = 1012  # "service restart": the server shuts down, the client may reconnect
SHUTDOWN_CODE = "server_shutting_down"  # the error event every live conversation gets then


class Refusal(NamedTuple):
    """Why a connection gets no session, for either transport: an HTTP status and OpenAI's
    error body (a WebRTC call), or an error event and a close (a WebSocket)."""

    status: int
    code: str
    message: str
    type: str = "invalid_request_error"
    close: int = CLOSE_POLICY
    reason: Optional[str] = None  # the WebSocket's close reason (None: the message)

    def body(self) -> dict:
        return refusal(self.message, self.code, self.type)


class Server:
    """What the connections share: the model, the worker, the session slots, the settings
    (:class:`~.settings.ServerSettings`, whose fields read as the server's own:
    ``server.max_sessions``)."""

    def __init__(self, model, settings: ServerSettings, worker: Optional[Worker] = None):
        self.model = model
        self.settings = settings
        self.commit_frames = max(1, round(settings.commit_seconds / FRAME_SECONDS))
        self.max_reply_frames = max(1, round(settings.max_reply_seconds / FRAME_SECONDS))
        self.chunk_samples = max(1, int(settings.chunk_frames)) * SAMPLES_PER_FRAME
        self.worker = Worker.shared() if worker is None else worker
        self.stepper = Stepper(model, self.worker, settings.max_sessions)
        self.metrics = Metrics(
            settings.metrics, live=lambda: self.active, tags=settings.metric_tags
        )
        self.stepper.on_step = self.metrics.step
        self.mcp = McpPolicy(settings.mcp_allow, float(settings.tool_timeout))
        self.max_prompt_tokens, self.max_instructions_chars = prompt_bounds(
            model, settings.max_prompt_tokens
        )
        self.active = 0
        self.ready = False
        self.sessions_served = 0
        self.channels: set = set()  # the live connections (Channel objects)
        self.shutting_down = False

    def __getattr__(self, name: str):
        if name == "settings":  # (not set yet)
            raise AttributeError(name)
        return getattr(self.settings, name)

    # -- shutdown --

    def begin_shutdown(self) -> None:
        """Refuse new connections, and end every live one: an ``error`` event
        (``server_shutting_down``), then close 1012; their work on the worker is dropped."""
        self.shutting_down = True
        for channel in list(self.channels):
            channel.fail(
                SHUTDOWN_CODE,
                "the server is shutting down; open a new connection to go on",
                CLOSE_RESTART,
            )

    async def drained(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until every connection has closed."""
        deadline = time.monotonic() + timeout
        while self.channels and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self.channels

    def open_session(self, instructions: Optional[str], tools=()):
        """On the worker: a new conversation of the server's batch with the client's
        instructions and tools (see :mod:`.stepper`)."""
        from ..nemotron_voicechat.runtime.framestate import PROMPT_STATES

        t, before = time.perf_counter(), dict(PROMPT_STATES)
        session = self._open(instructions, tools)
        # (on the worker, the one thread that opens sessions: the counts moved by this open only)
        moved = [k for k in ("hit", "miss") if PROMPT_STATES[k] > before[k]]
        cached = {"hit": True, "miss": False}.get(moved[-1]) if moved else None
        self.metrics.session_opened(time.perf_counter() - t, cached)
        return session

    def _open(self, instructions: Optional[str], tools=()):
        options = dict(self.settings.session_options)
        if tools:
            options["tools"] = list(tools)
        return self.stepper.open(instructions, seed=self.settings.seed, **options)

    def prompt_tokens(self, instructions: Optional[str], tools=()) -> int:
        """The prompt's length in tokens (the tokenizer only: any thread but the worker's)."""
        text = resolve_system_prompt(instructions)
        if tools:
            text = render_system_prompt(text, tools)
        return len(prompt_ids(self.model, text))

    def warm_up(self, frames: int = 4) -> None:
        """On the worker: run a few frames at every batch size the server holds, so neither the
        first client nor a join pays for first-use costs (compiled steps at each batch size, the
        TTS warm-up codes, the seed's prompt chain, the speech stream). Its sessions are not
        clients': they are not in the metrics."""
        self.stepper.warm_up(lambda: self._open(None), SAMPLES_PER_FRAME, frames)

    # -- admission --

    def caller(self, headers, local, subprotocols=()) -> Tuple[Optional[Refusal], Optional[str]]:
        """Judge a connection's origin and credentials: (why it is refused, None), or (None,
        the client secret it presents; None for the API key or none needed)."""
        if not self.origin_allowed(headers, local):
            self.metrics.refused("origin")
            return Refusal(403, "origin_not_allowed", "origin not allowed"), None
        secret = bearer_secret(headers, subprotocols)  # a client secret, ek_...
        if secret is None and not self.authorized(headers, subprotocols):
            self.metrics.refused("unauthorized")
            return Refusal(401, "invalid_api_key", "missing or wrong API key"), None
        return None, secret

    async def seat(
        self, secret: Optional[str], secrets, grace: float = 0.0, secret_first: bool = False
    ) -> Tuple[Optional[Refusal], Optional[dict]]:
        """Take a session slot (waiting at most ``grace`` seconds for one) and use up the client
        secret, if one, once there is a slot (``secret_first``: checked before the slot is judged,
        as for a WebRTC offer, and given back if there is none): (why not, None), or (None, the
        secret's session config)."""
        if self.shutting_down:
            self.metrics.refused("shutting_down")
            message = "the server is shutting down; try again later"
            return Refusal(
                503, SHUTDOWN_CODE, message, "server_error", CLOSE_RESTART, "server shutting down"
            ), None
        try:
            preset = secrets.redeem(secret) if secret is not None and secret_first else None
            deadline = time.monotonic() + grace
            while self.active >= self.max_sessions and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            if self.active >= self.max_sessions:
                if secret is not None and secret_first:
                    secrets.release(secret)  # refused, so not used up
                self.metrics.refused("server_busy")
                message = (
                    f"all {self.max_sessions} session(s) of this server are in use; try again later"
                )
                return Refusal(
                    503, "server_busy", message, "server_error", CLOSE_TRY_AGAIN, "server busy"
                ), None
            if secret is not None and not secret_first:
                preset = secrets.redeem(secret)
        except SecretRefused as e:
            return Refusal(401, "invalid_api_key", str(e)), None
        self.active += 1
        return None, preset

    def authorized(self, headers, subprotocols=()) -> bool:
        if self.api_key is None:
            return True
        key = self.api_key.encode()
        return any(hmac.compare_digest(c.encode(), key) for c in credentials(headers, subprotocols))

    def origin_allowed(self, headers, local: Optional[tuple]) -> bool:
        """A browser's ``Origin`` is the server's own (the address the connection arrived at,
        ``local``) or one of ``allow_origins``; never judged by the request's ``Host``, which
        a page whose name resolves to this address (DNS rebinding) sets as it likes."""
        origin = headers.get("origin")
        if origin is None:
            return True  # not a browser
        origin = origin.rstrip("/")
        if origin in self.allow_origins or "*" in self.allow_origins:
            return True
        return origin.lower() in own_origins(local)


def own_origins(local: Optional[tuple]) -> Set[str]:
    """The origins of a page served from the socket address ``local`` (host, port): that
    address, and for a loopback one ``localhost`` and the other loopback spellings."""
    if not local or local[1] is None:
        return set()
    host, port = str(local[0]).lower(), int(local[1])
    hosts = {host}
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        hosts |= {"localhost", "127.0.0.1", "::1"}
    out = set()
    for h in hosts:
        name = f"[{h}]" if ":" in h else h
        for scheme, default in (("http", 80), ("https", 443)):
            out.add(f"{scheme}://{name}:{port}")
            if port == default:
                out.add(f"{scheme}://{name}")
    return out


def prompt_bounds(model, max_prompt_tokens: int):
    """(tokens, characters) a session's prompt may have: at most ``max_prompt_tokens`` and the
    LLM's context less one frame; in characters, that many of the vocabulary's longest token,
    so that a longer prompt is refused before anything tokenizes it."""
    tokens = int(max_prompt_tokens)  # (at least 1: ServerSettings checks it)
    config = getattr(model, "config", None)
    context = getattr(getattr(config, "text_args", None), "max_position_embeddings", None)
    if isinstance(context, int):
        tokens = min(tokens, context - 1)
    tokenizer = getattr(model, "tokenizer", None)
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else None
    if not vocab:
        return tokens, None
    return tokens, tokens * max(len(t) for t in vocab)

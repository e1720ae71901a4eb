"""The function channel, one id per frame, parsed into tool calls: :class:`ToolCallParser`
collects the ids between the ``<SPECIAL_20>`` / ``<SPECIAL_21>`` markers and parses the
``<TOOLCALL>[...]</TOOLCALL>`` between them once, at the end marker (O(1) per frame).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Callable, FrozenSet, Iterable, List, Optional, Tuple

from ...errors import VoiceChatError
from ..nets.char_encoder import tokenizer_vocab

MAX_CALL_TOKENS = 1024  # ~82 s of function channel at one token per 80 ms frame

START_TOKEN = "<SPECIAL_20>"  # start of a tool call
END_TOKEN = "<SPECIAL_21>"  # end of a tool call
RESERVED_TOKEN = "<SPECIAL_22>"  # end of a tool response: reserved, vllm-omni does not use it

CALL_OPEN, CALL_CLOSE = "<TOOLCALL>", "</TOOLCALL>"


class ToolError(VoiceChatError, ValueError):
    """Tools, a tokenizer or a tool result that cannot be used."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model made; ``arguments`` is a JSON object as a string, as OpenAI sends it."""

    call_id: str
    name: str
    arguments: str


# --- markers ------------------------------------------------------------------------------


def _token_id(tokenizer, token: str) -> Optional[int]:
    vocab = tokenizer_vocab(tokenizer)
    if vocab is not None:
        i = vocab.get(token)
        return None if i is None else int(i)
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    if convert is None:
        return None
    i = convert(token)
    # transformers answers an unknown token with the unk id rather than None.
    if i is None or i == getattr(tokenizer, "unk_token_id", None):
        return None
    return int(i)


@dataclass(frozen=True)
class ToolMarkers:
    """The function-channel ids that open and close a call (``reserved`` may be None)."""

    start: int
    end: int
    reserved: Optional[int] = None

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: Optional[int] = None) -> "ToolMarkers":
        """Resolve the markers by their strings; ``vocab_size`` (the model's) bounds the ids."""
        if tokenizer is None:
            raise ToolError(
                f"tools need the model's tokenizer (with the {START_TOKEN} / {END_TOKEN} "
                "call markers); load the model with one"
            )
        start, end = _token_id(tokenizer, START_TOKEN), _token_id(tokenizer, END_TOKEN)
        if start is None or end is None:
            missing = [t for t, i in ((START_TOKEN, start), (END_TOKEN, end)) if i is None]
            raise ToolError(
                f"tools need a tokenizer with the {START_TOKEN} / {END_TOKEN} call-marker "
                f"tokens; this one lacks {' and '.join(missing)}"
            )
        reserved = _token_id(tokenizer, RESERVED_TOKEN)
        if vocab_size is not None:
            for token, i in ((START_TOKEN, start), (END_TOKEN, end)):
                if not 0 <= i < vocab_size:
                    raise ToolError(
                        f"the tokenizer's {token} is id {i}, outside the model's "
                        f"{vocab_size}-token vocabulary, so the function channel cannot write it"
                    )
        return cls(start=start, end=end, reserved=reserved)


# --- calls out ----------------------------------------------------------------------------


def _clip(text: str, n: int = 120) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def parse_call_text(text: str) -> Tuple[List[Tuple[str, str]], List[str]]:
    """``(name, arguments JSON string)`` pairs and error messages for one decoded call.

    ``text`` is what lies between the markers (special tokens already skipped); ``<TOOLCALL>``
    / ``</TOOLCALL>`` are stripped. Each item of the list is judged on its own, so one bad
    item does not lose the good ones.
    """
    body = text
    if CALL_OPEN in body:
        body = body.split(CALL_OPEN, 1)[1]
    if CALL_CLOSE in body:
        body = body.split(CALL_CLOSE, 1)[0]
    body = body.strip()
    if not body:
        return [], [f"the model wrote an empty tool call: {_clip(text)}"]
    try:
        value = json.loads(body)
    except ValueError as e:
        return [], [f"malformed tool call (not JSON: {e}): {_clip(body)}"]
    items = value if isinstance(value, list) else [value]
    if not items:
        return [], ["the model wrote a tool call with no calls in it: []"]
    calls: List[Tuple[str, str]] = []
    errors: List[str] = []
    for item in items:
        if not isinstance(item, dict):
            errors.append(f"malformed tool call (an item is not an object): {_clip(body)}")
            continue
        name = item.get("name")
        if not isinstance(name, str) or not name:
            errors.append(f"malformed tool call (no name): {_clip(json.dumps(item))}")
            continue
        args = item.get("arguments")
        if args is None or args == "":
            args = {}
        elif isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        if not isinstance(args, dict):
            errors.append(
                f"tool call {name!r}: arguments are not a JSON object: "
                f"{_clip(json.dumps(item.get('arguments'), ensure_ascii=False))}"
            )
            continue
        calls.append((name, json.dumps(args, separators=(",", ":"), ensure_ascii=False)))
    return calls, errors


class ToolCallParser:
    """Turns the function channel, one id per frame, into :class:`ToolCall` objects.

    ``decode(ids) -> str`` must skip special tokens; ``pad_ids`` are skipped; ``tool_names``,
    when given, makes a call of any other name an error. Call ids come from
    :func:`secrets.token_hex`, never from a seed, so no two sessions or servers name a call
    alike (the ids go to the client only; the audio does not depend on them).
    """

    def __init__(
        self,
        markers: ToolMarkers,
        decode: Callable[[List[int]], str],
        pad_ids: Iterable[int] = (),
        *,
        tool_names: Optional[Iterable[str]] = None,
        max_call_tokens: int = MAX_CALL_TOKENS,
    ):
        self.markers = markers
        self.decode = decode
        self.pad_ids: FrozenSet[int] = frozenset(int(i) for i in pad_ids)
        self.tool_names = None if tool_names is None else frozenset(tool_names)
        self.max_call_tokens = int(max_call_tokens)
        self._ids: Optional[List[int]] = None  # None: outside a call

    @property
    def pending(self) -> bool:
        """A call has started and not ended."""
        return self._ids is not None

    def reset(self) -> None:
        self._ids = None

    def close(self) -> Optional[str]:
        """End of the session: an error message for an unfinished call, else None."""
        if self._ids is None:
            return None
        n = len(self._ids)
        self._ids = None
        return (
            f"the model started a tool call that never ended ({n} tokens written); it was dropped"
        )

    def feed(self, token_id: int) -> Tuple[List[ToolCall], List[str]]:
        """One frame's function-channel id -> (calls completed now, error messages)."""
        if token_id == self.markers.start:
            dropped = self._ids
            self._ids = []
            if dropped is not None:
                message = (
                    f"the model started a tool call inside another ({len(dropped)} tokens); "
                    "the unfinished one was dropped"
                )
                return [], [message]
            return [], []
        if self._ids is None:
            return [], []  # outside markers: the channel's idle output, ignored
        if token_id == self.markers.end:
            ids, self._ids = self._ids, None
            return self._finish(ids)
        if token_id in self.pad_ids:
            return [], []
        self._ids.append(int(token_id))
        if len(self._ids) > self.max_call_tokens:
            self._ids = None
            message = (
                f"the model's tool call ran past {self.max_call_tokens} tokens without ending; "
                "it was dropped"
            )
            return [], [message]
        return [], []

    def _finish(self, ids: List[int]) -> Tuple[List[ToolCall], List[str]]:
        try:
            text = self.decode(ids)
        except Exception as e:  # the session goes on whatever the tokenizer says
            return [], [f"the tool call's tokens cannot be decoded ({type(e).__name__}: {e})"]
        pairs, errors = parse_call_text(text)
        calls = []
        for name, arguments in pairs:
            if self.tool_names is not None and name not in self.tool_names:
                errors.append(f"the model called {name!r}, which is not one of the session's tools")
                continue
            calls.append(ToolCall(self.new_call_id(), name, arguments))
        return calls, errors

    def new_call_id(self) -> str:
        return f"call_{secrets.token_hex(12)}"

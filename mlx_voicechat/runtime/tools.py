"""Tool calls: tools rendered into the system prompt, the function channel parsed into calls,
tool results turned into the ids that are injected one per frame.

The format is the one NVIDIA's model is served with (vllm-omni's VoiceChat adapter; see
``shared/spec/realtime-and-tools.md`` section 3). The model writes a call on its function
channel as ``<SPECIAL_20><TOOLCALL>[{"name": ..., "arguments": ...}]</TOOLCALL><SPECIAL_21>``;
a result goes back on the same channel, one token per 80 ms frame, as
``<TOOL_RESPONSE>[...]</TOOL_RESPONSE>``.

Nothing here touches the model: the session feeds one function-channel id per frame to a
:class:`ToolCallParser` and asks a :class:`ToolResultQueue` which id to force next.
"""

from __future__ import annotations

import json
import random
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

from mlx_voicechat.errors import VoiceChatError

MAX_TOOLS = 5  # vllm-omni's limit for this model
MAX_CALL_TOKENS = 1024  # ~82 s of function channel at one token per 80 ms frame

START_TOKEN = "<SPECIAL_20>"  # start of a tool call
END_TOKEN = "<SPECIAL_21>"  # end of a tool call
RESERVED_TOKEN = "<SPECIAL_22>"  # end of a tool response: reserved, vllm-omni does not use it

CALL_OPEN, CALL_CLOSE = "<TOOLCALL>", "</TOOLCALL>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<TOOL_RESPONSE>", "</TOOL_RESPONSE>"

TOOLS_INTRO = "You can use the following tools to assist the user if required:\n"
TOOLS_FORMAT = (
    "\n\n"
    "If you decide to call any tool(s), use the following format:\n"
    '<TOOLCALL>[{"name": "tool_name1", "arguments": "tool_args1"}, '
    '{"name": "tool_name2", "arguments": "tool_args2"}]</TOOLCALL>\n'
    "\n"
    "The user will execute tool-calls and return responses from tool(s) in this format:\n"
    '<TOOL_RESPONSE>[{"tool_response1"}, {"tool_response2"}]</TOOL_RESPONSE>\n'
    "\n"
    "Based on the tool responses, you can call additional tools if needed, correct tool calls "
    "if any errors are found, or just respond to the user."
)


class ToolError(VoiceChatError, ValueError):
    """Tools, a tokenizer or a tool result that cannot be used."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model made; ``arguments`` is a JSON object as a string, as OpenAI sends it."""

    call_id: str
    name: str
    arguments: str


# --- tools in -----------------------------------------------------------------------------


def normalize_tools(tools: Optional[Iterable[Any]]) -> List[Dict[str, Any]]:
    """The function objects of ``tools``, validated, as plain JSON values (deep copies).

    Accepts OpenAI Realtime tools ``{"type": "function", "name", "description", "parameters"}``
    and the chat-completions wrapping ``{"type": "function", "function": {...}}``; ``type`` is
    dropped. ``None`` means no tools.
    """
    if tools is None:
        return []
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ToolError(f"tools must be a list of tool objects, not {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise ToolError(
            f"{len(tools)} tools given; at most {MAX_TOOLS} are allowed "
            "(the limit NVIDIA's vllm-omni serving of this model sets)"
        )
    out: List[Dict[str, Any]] = []
    names = set()
    for n, tool in enumerate(tools, 1):
        if not isinstance(tool, Mapping):
            raise ToolError(f"tool {n} is a {type(tool).__name__}, not an object")
        kind = tool.get("type", "function")
        if kind != "function":
            raise ToolError(f"tool {n} has type {kind!r}; only function tools are supported")
        fn = tool.get("function", tool)
        if not isinstance(fn, Mapping):
            raise ToolError(f"tool {n}'s 'function' is a {type(fn).__name__}, not an object")
        fn = {k: v for k, v in fn.items() if k != "type"}
        name = fn.get("name")
        if name is None:
            raise ToolError(f"tool {n} has no name")
        if not isinstance(name, str) or not name.strip():
            raise ToolError(f"tool {n}'s name must be a non-empty string, not {name!r}")
        if name in names:
            raise ToolError(f"two tools are named {name!r}; tool names must be unique")
        names.add(name)
        if "parameters" in fn and not isinstance(fn["parameters"], Mapping):
            raise ToolError(f"tool {name!r}: parameters must be a JSON Schema object")
        if "description" in fn and not isinstance(fn["description"], str):
            raise ToolError(f"tool {name!r}: description must be a string")
        try:
            text = json.dumps(fn, sort_keys=True, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ToolError(f"tool {name!r} is not JSON-serialisable: {e}") from None
        out.append(json.loads(text))
    return out


def render_system_prompt(instructions: Optional[str], tools: Optional[Iterable[Any]]) -> str:
    """The system prompt text: ``instructions``, then the tools block of the spec's template.

    Without tools the instructions are returned unchanged (``None`` reads as ``""``). With
    empty instructions the text starts at the tools block, as the Nemotron chat template does
    (it writes the blank line only after a non-empty system message).
    """
    instructions = "" if instructions is None else instructions
    if not isinstance(instructions, str):
        raise ToolError(f"instructions must be a string, not {type(instructions).__name__}")
    functions = normalize_tools(tools)
    if not functions:
        return instructions
    # json.dumps' default separators (", " and ": " when indent is None) are kept on purpose:
    # they are what jinja's tojson writes in the template the model was trained with (tools
    # joined by ", " inside [...]), and the same spacing as the format example in the prompt.
    tools_json = json.dumps(functions, sort_keys=True, ensure_ascii=False)
    head = instructions + "\n\n" if instructions else ""
    return f"{head}{TOOLS_INTRO}<AVAILABLE_TOOLS>{tools_json}</AVAILABLE_TOOLS>{TOOLS_FORMAT}"


# --- markers ------------------------------------------------------------------------------


def _vocab(tokenizer) -> Optional[Dict[str, int]]:
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        return dict(get_vocab(with_added_tokens=True))  # tokenizers.Tokenizer
    except TypeError:
        return dict(get_vocab())  # transformers tokenizers include added tokens


def _token_id(tokenizer, token: str) -> Optional[int]:
    vocab = _vocab(tokenizer)
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

    Ids between the start and end markers are collected (``pad_ids`` skipped) and decoded
    once, at the end marker, so a frame costs O(1) until then. ``decode(ids) -> str`` must skip
    special tokens. Call ids come from a private ``random.Random(seed)``. ``tool_names``, when
    given, makes a call of any other name an error.
    """

    def __init__(
        self,
        markers: ToolMarkers,
        decode: Callable[[List[int]], str],
        pad_ids: Iterable[int] = (),
        *,
        seed: int = 0,
        tool_names: Optional[Iterable[str]] = None,
        max_call_tokens: int = MAX_CALL_TOKENS,
    ):
        self.markers = markers
        self.decode = decode
        self.pad_ids: FrozenSet[int] = frozenset(int(i) for i in pad_ids)
        self.tool_names = None if tool_names is None else frozenset(tool_names)
        self.max_call_tokens = int(max_call_tokens)
        self._rng = random.Random(seed)
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
        return f"call_{self._rng.getrandbits(96):024x}"


# --- results in ---------------------------------------------------------------------------


def render_tool_result(output: Any) -> str:
    """``<TOOL_RESPONSE>`` + compact ASCII JSON of ``[output]`` + ``</TOOL_RESPONSE>``.

    A string output that parses as JSON goes in as that value, any other string as itself;
    other values must be JSON-serialisable.
    """
    value = output
    if isinstance(output, (bytes, bytearray)):
        value = output = bytes(output).decode("utf-8", errors="replace")
    if isinstance(output, str):
        try:
            value = json.loads(output)
        except ValueError:
            value = output
    try:
        body = json.dumps([value], separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ToolError(f"the tool result is not JSON-serialisable: {e}") from None
    # A result quoting "<SPECIAL_20>" would tokenize to the call marker itself; inside a JSON
    # string "\u003c" is the same "<", so the model reads the same value without a marker.
    body = body.replace("<SPECIAL_", "\\u003cSPECIAL_")
    return f"{RESPONSE_OPEN}{body}{RESPONSE_CLOSE}"


def tool_result_ids(tokenizer, output: Any) -> List[int]:
    """The ids of :func:`render_tool_result`, tokenized without bos / eos."""
    if tokenizer is None:
        raise ToolError("tool results need the model's tokenizer; load the model with one")
    text = render_tool_result(output)
    encoded = tokenizer.encode(text, add_special_tokens=False)
    # transformers returns a list; a bare tokenizers.Tokenizer returns an Encoding.
    return [int(i) for i in getattr(encoded, "ids", encoded)]


class ToolResultQueue:
    """Results waiting to be injected, one function-channel id per frame, in arrival order.

    ``expect(call_id)`` registers a call the model made; ``add(call_id, ids)`` queues its
    result (an unknown or already answered call id is a :class:`ToolError`).
    """

    def __init__(self):
        self._queue: Deque[Deque[int]] = deque()
        self._pending = 0
        self._expected: Dict[str, bool] = {}  # call id -> answered

    def expect(self, call_id: str) -> None:
        self._expected.setdefault(call_id, False)

    def add(self, call_id: str, ids: Sequence[int]) -> None:
        answered = self._expected.get(call_id)
        if answered is None:
            raise ToolError(f"no tool call has the id {call_id!r}")
        if answered:
            raise ToolError(f"the tool call {call_id!r} already has a result")
        ids = deque(int(i) for i in ids)
        if not ids:
            raise ToolError(f"the result of {call_id!r} has no tokens")
        self._expected[call_id] = True
        self._queue.append(ids)
        self._pending += len(ids)

    def next_forced(self) -> Optional[int]:
        """The function id to force at this frame, or None when the heads are free."""
        if not self._queue:
            return None
        head = self._queue[0]
        i = head.popleft()
        if not head:
            self._queue.popleft()
        self._pending -= 1
        return i

    @property
    def pending(self) -> int:
        """Ids still to inject, over all queued results."""
        return self._pending

    @property
    def pending_results(self) -> int:
        return len(self._queue)

    @property
    def unanswered(self) -> List[str]:
        return [c for c, answered in self._expected.items() if not answered]

    def clear(self) -> None:
        self._queue.clear()
        self._pending = 0
        self._expected.clear()


def prepare_tools(model, system_prompt: Optional[str], tools, seed: int = 0):
    """For a conversation with ``tools``: (the system prompt text with the tools rendered in,
    the normalized tools, a ``ToolCallParser`` for the function channel). Without tools:
    (system_prompt, [], None)."""
    if not tools:
        return system_prompt, [], None
    cfg = model.config
    normalized = normalize_tools(tools)
    markers = ToolMarkers.from_tokenizer(model.tokenizer, cfg.text_args.vocab_size)
    tokenizer = model.tokenizer
    parser = ToolCallParser(
        markers,
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        pad_ids=(cfg.pad_token_id, cfg.silence_token_id),
        seed=seed,
        tool_names=[t["name"] for t in normalized],
    )
    return render_system_prompt(system_prompt, normalized), normalized, parser


def calls_in(parser: Optional["ToolCallParser"], function_ids: Sequence[int]):
    """The tool calls (and errors) of a whole function channel, as a session finds them."""
    calls: List[ToolCall] = []
    errors: List[str] = []
    if parser is None:
        return calls, errors
    for i in function_ids:
        c, e = parser.feed(int(i))
        calls += c
        errors += e
    unfinished = parser.close()
    if unfinished:
        errors.append(unfinished)
    return calls, errors


def read_tools_file(path) -> List[Dict[str, Any]]:
    """The tools of a ``--tools FILE.json`` option: a JSON list of tool objects (or an object
    with a ``tools`` list, as a Realtime ``session.update`` carries them), validated."""
    if path is None:
        return []
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ToolError(f"cannot read the tools file {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ToolError(f"the tools file {path} is not valid JSON: {e}") from None
    if isinstance(data, dict) and "tools" in data:
        data = data["tools"]
    return normalize_tools(data)

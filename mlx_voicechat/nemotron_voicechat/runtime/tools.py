"""Tool calls: tools rendered into the system prompt, tool results turned into the ids injected
on the function channel one per frame, in the format NVIDIA's model is served with
(vllm-omni's VoiceChat adapter; ``shared/spec/realtime-and-tools.md`` section 3). Parsing the
channel into calls is :mod:`.toolcalls`. Nothing here touches the model.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Mapping
from typing import Any, Deque, Dict, Iterable, List, Optional, Sequence

from ...files import read_json
from .toolcalls import (  # noqa: F401  (re-exported: tools.ToolCall etc. are the public names)
    ToolCall,
    ToolCallParser,
    ToolError,
    ToolMarkers,
    parse_call_text,
)

MAX_TOOLS = 5  # vllm-omni's limit for this model


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


def prepare_tools(model, system_prompt: Optional[str], tools):
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
    data = read_json(path, ToolError, f"the tools file {path}")
    if isinstance(data, dict) and "tools" in data:
        data = data["tools"]
    return normalize_tools(data)

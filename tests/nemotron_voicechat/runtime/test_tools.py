"""Tools without a model: the tools in (normalizing, the system prompt byte for byte) and the
results in (rendered, tokenized, queued). The markers and the function-channel parser are in
test_toolcalls.py; shared fixtures in tests/support/toolcall_support.py."""

import json
import re

import pytest
from tool_specs import WEATHER_CITY_REQUIRED as WEATHER
from toolcall_support import (  # noqa: F401  (fixtures)
    BOS,
    EOS,
    PAD,
    call_frames,
    factory_json,
    factory_tokenizer,
    make_parser,
    markerless_tokenizer,
    markers,
    run,
    tok,
)

from mlx_voicechat.errors import VoiceChatError
from mlx_voicechat.nemotron_voicechat.runtime.tools import (
    MAX_TOOLS,
    ToolError,
    ToolMarkers,
    ToolResultQueue,
    normalize_tools,
    render_system_prompt,
    render_tool_result,
    tool_result_ids,
)

# The spec's template (shared/spec/realtime-and-tools.md section 3), written out as it stands.
TEMPLATE = """\
{instructions}

You can use the following tools to assist the user if required:
<AVAILABLE_TOOLS>{tools_json}</AVAILABLE_TOOLS>

If you decide to call any tool(s), use the following format:
<TOOLCALL>[{"name": "tool_name1", "arguments": "tool_args1"}, {"name": "tool_name2", "arguments": "tool_args2"}]</TOOLCALL>

The user will execute tool-calls and return responses from tool(s) in this format:
<TOOL_RESPONSE>[{"tool_response1"}, {"tool_response2"}]</TOOL_RESPONSE>

Based on the tool responses, you can call additional tools if needed, correct tool calls if any errors are found, or just respond to the user."""

WEATHER_JSON = (
    '[{"description": "Current weather for a city.", "name": "get_weather", "parameters": '
    '{"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"}}]'
)

FIVE = [
    WEATHER,
    {
        "type": "function",
        "function": {
            "type": "function",
            "name": "météo",
            "description": "Météo à Zürich, 東京",
            "parameters": {"type": "object", "properties": {}},
        },
    },
    {"type": "function", "name": "now"},
    {"name": "add", "parameters": {"required": ["b", "a"], "type": "object"}, "description": "a+b"},
    {"type": "function", "function": {"name": "stop", "strict": True}},
]
FIVE_JSON = (
    "["
    '{"description": "Current weather for a city.", "name": "get_weather", "parameters": '
    '{"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"}}, '
    '{"description": "Météo à Zürich, 東京", "name": "météo", "parameters": '
    '{"properties": {}, "type": "object"}}, '
    '{"name": "now"}, '
    '{"description": "a+b", "name": "add", "parameters": '
    '{"required": ["b", "a"], "type": "object"}}, '
    '{"name": "stop", "strict": true}'
    "]"
)


# --- tools in -----------------------------------------------------------------------------


def test_normalize_unwraps_and_drops_type():
    tools = normalize_tools(FIVE)
    assert [t["name"] for t in tools] == ["get_weather", "météo", "now", "add", "stop"]
    assert all("type" not in t for t in tools)
    assert tools[0] == {k: v for k, v in WEATHER.items() if k != "type"}
    assert tools[1]["parameters"] == {"type": "object", "properties": {}}
    tools[0]["parameters"]["required"].append("x")  # a copy: the caller's dict is untouched
    assert WEATHER["parameters"]["required"] == ["city"]
    assert normalize_tools(None) == [] and normalize_tools([]) == []
    assert normalize_tools(tools) == normalize_tools(normalize_tools(tools))


@pytest.mark.parametrize(
    "tools, message",
    [
        ({"name": "x"}, "tools must be a list of tool objects"),
        ("get_weather", "tools must be a list of tool objects"),
        (["get_weather"], "tool 1 is a str, not an object"),
        ([WEATHER, {"description": "no name"}], "tool 2 has no name"),
        ([{"name": ""}], "tool 1's name must be a non-empty string"),
        ([{"type": "function", "function": {"description": "d"}}], "tool 1 has no name"),
        ([WEATHER, dict(WEATHER)], "two tools are named 'get_weather'"),
        ([{"name": f"t{i}"} for i in range(6)], "6 tools given; at most 5 are allowed"),
        (
            [{"name": "x", "parameters": {"type": "object", "default": {1, 2}}}],
            "not JSON-serialisable",
        ),
        ([{"name": "x", "parameters": {"maximum": float("nan")}}], "not JSON-serialisable"),
        ([{"type": "file_search", "name": "x"}], "only function tools are supported"),
        ([{"name": "x", "parameters": "object"}], "parameters must be a JSON Schema object"),
    ],
)
def test_normalize_refuses_clearly(tools, message):
    with pytest.raises(ToolError, match=re.escape(message)) as e:
        normalize_tools(tools)
    assert isinstance(e.value, VoiceChatError) and isinstance(e.value, ValueError)
    assert "\n" not in str(e.value)


def test_tool_limit_is_five():
    assert MAX_TOOLS == 5
    assert len(normalize_tools([{"name": f"t{i}"} for i in range(5)])) == 5


def test_prompt_without_tools_is_the_instructions():
    assert render_system_prompt("Be brief.", None) == "Be brief."
    assert render_system_prompt("Be brief.", []) == "Be brief."
    assert render_system_prompt(None, []) == ""


def test_prompt_one_tool_byte_for_byte():
    text = render_system_prompt("You are a helpful assistant.", [WEATHER])
    expected = TEMPLATE.replace("{instructions}", "You are a helpful assistant.")
    expected = expected.replace("{tools_json}", WEATHER_JSON)
    assert text == expected
    assert text.encode("utf-8") == expected.encode("utf-8")


def test_prompt_five_tools_byte_for_byte():
    text = render_system_prompt("Sé breve.", FIVE)
    expected = TEMPLATE.replace("{instructions}", "Sé breve.").replace("{tools_json}", FIVE_JSON)
    assert text.encode("utf-8") == expected.encode("utf-8")
    assert "Zürich, 東京" in text  # non-ASCII kept, not \u-escaped


def test_prompt_without_instructions_starts_at_the_tools():
    # The Nemotron chat template writes the blank line only after a non-empty system message.
    expected = TEMPLATE.replace("{instructions}\n\n", "").replace("{tools_json}", WEATHER_JSON)
    assert render_system_prompt("", [WEATHER]) == expected
    assert render_system_prompt(None, [WEATHER]) == expected


def test_prompt_refuses_bad_tools():
    with pytest.raises(ToolError, match="at most 5"):
        render_system_prompt("hi", [{"name": f"t{i}"} for i in range(6)])


# --- results in ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "output, text",
    [
        ('{"temp": 21, "sky": "clear"}', '[{"temp":21,"sky":"clear"}]'),
        ("sunny, 21 degrees", '["sunny, 21 degrees"]'),
        ("42", "[42]"),
        ('"quoted"', '["quoted"]'),
        ("Zürich 東京", '["Z\\u00fcrich \\u6771\\u4eac"]'),
        ({"ok": True, "items": [1, 2]}, '[{"ok":true,"items":[1,2]}]'),
        ("", '[""]'),
        ('say "<SPECIAL_21>"', '["say \\"\\u003cSPECIAL_21>\\""]'),
    ],
)
def test_render_tool_result(output, text):
    rendered = render_tool_result(output)
    assert rendered == "<TOOL_RESPONSE>" + text + "</TOOL_RESPONSE>"
    assert rendered.isascii()
    body = rendered[len("<TOOL_RESPONSE>") : -len("</TOOL_RESPONSE>")]
    expected = output if not isinstance(output, str) else None
    if expected is not None:
        assert json.loads(body) == [expected]


def test_render_tool_result_refuses_what_is_not_json():
    with pytest.raises(ToolError, match="not JSON-serialisable"):
        render_tool_result({"x": {1, 2}})


def test_tool_result_ids(tok, markers):
    ids = tool_result_ids(tok, '{"temp": 21}')
    text = '<TOOL_RESPONSE>[{"temp":21}]</TOOL_RESPONSE>'
    assert ids == tok.encode(text, add_special_tokens=False)
    assert BOS not in ids and EOS not in ids
    assert tok.decode(ids) == text
    assert markers.start not in tool_result_ids(tok, "<SPECIAL_20>")
    with pytest.raises(ToolError, match="need the model's tokenizer"):
        tool_result_ids(None, "x")


def test_result_queue_injects_in_order(tok):
    queue = ToolResultQueue()
    assert queue.next_forced() is None and queue.pending == 0
    queue.expect("call_a")
    queue.expect("call_b")
    assert queue.unanswered == ["call_a", "call_b"]
    a, b = tool_result_ids(tok, "sunny"), tool_result_ids(tok, {"t": 3})
    queue.add("call_a", a)
    queue.add("call_b", b)
    assert (queue.pending, queue.pending_results, queue.unanswered) == (len(a) + len(b), 2, [])
    forced = []
    while (i := queue.next_forced()) is not None:
        forced.append(i)
        assert queue.pending == len(a) + len(b) - len(forced)
    assert forced == a + b
    assert queue.pending == 0 and queue.pending_results == 0 and queue.next_forced() is None


def test_result_queue_refuses_unknown_and_repeated_calls():
    queue = ToolResultQueue()
    with pytest.raises(ToolError, match="no tool call has the id 'call_x'"):
        queue.add("call_x", [5])
    queue.expect("call_a")
    with pytest.raises(ToolError, match="has no tokens"):
        queue.add("call_a", [])
    queue.add("call_a", [5, 6])
    with pytest.raises(ToolError, match="already has a result"):
        queue.add("call_a", [7])
    queue.clear()
    assert queue.pending == 0 and queue.next_forced() is None
    with pytest.raises(ToolError, match="no tool call has the id"):
        queue.add("call_a", [5])


def test_a_call_answered_end_to_end(tok, markers):
    """What a session does: parse a call, answer it, force the result's ids frame by frame."""
    parser, queue = make_parser(tok, markers), ToolResultQueue()
    frames = [PAD] * 2 + call_frames(
        tok, markers, '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    )
    ((_, call),) = run(parser, frames)[0]
    queue.expect(call.call_id)
    queue.add(call.call_id, tool_result_ids(tok, json.dumps({"city": "Paris", "temp_c": 21})))
    forced = [queue.next_forced() for _ in range(queue.pending)]
    assert tok.decode(forced) == '<TOOL_RESPONSE>[{"city":"Paris","temp_c":21}]</TOOL_RESPONSE>'
    assert queue.next_forced() is None


def test_markers_through_convert_tokens_to_ids_only():
    class Lookup:  # a tokenizer exposing only convert_tokens_to_ids, unknown tokens -> unk
        unk_token_id = 0

        def __init__(self, ids):
            self.ids = ids

        def convert_tokens_to_ids(self, token):
            return self.ids.get(token, self.unk_token_id)

    both = Lookup({"<SPECIAL_20>": 20, "<SPECIAL_21>": 21})
    assert ToolMarkers.from_tokenizer(both) == ToolMarkers(start=20, end=21, reserved=None)
    with pytest.raises(ToolError, match="this one lacks <SPECIAL_21>$"):
        ToolMarkers.from_tokenizer(Lookup({"<SPECIAL_20>": 20}))

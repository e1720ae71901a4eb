"""Tool calls without a model: prompt rendering, markers, the function-channel parser, results."""

import json
import random
import re

import pytest
from tool_specs import WEATHER_CITY_REQUIRED as WEATHER
from transformers import PreTrainedTokenizerFast

from mlx_voicechat.errors import VoiceChatError
from mlx_voicechat.weights.factory import build_tokenizer
from mlx_voicechat.runtime.tools import (
    MAX_TOOLS,
    ToolCall,
    ToolCallParser,
    ToolError,
    ToolMarkers,
    ToolResultQueue,
    normalize_tools,
    parse_call_text,
    render_system_prompt,
    render_tool_result,
    tool_result_ids,
)

VOCAB = 400  # the tiny checkpoint's text vocabulary
PAD, SILENCE, BOS, EOS = 12, 11, 1, 2
MARKERS = [f"<SPECIAL_{i}>" for i in range(16, 24)]

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


def hf_tokenizer(path):
    return PreTrainedTokenizerFast(
        tokenizer_file=str(path), bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="module")
def factory_json(tmp_path_factory):
    """The tiny checkpoint's tokenizer.json, as the factory writes it."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    build_tokenizer(VOCAB).save(str(path))
    return path


@pytest.fixture(scope="module")
def factory_tokenizer(factory_json):
    return hf_tokenizer(factory_json)


@pytest.fixture(scope="module")
def markerless_tokenizer(factory_json, tmp_path_factory):
    """The factory tokenizer with any <SPECIAL_16>..<SPECIAL_23> taken out."""
    data = json.loads(factory_json.read_text(encoding="utf-8"))
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in MARKERS]
    vocab = data["model"]["vocab"]
    for token in MARKERS:
        vocab.pop(token, None)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return hf_tokenizer(path)


@pytest.fixture(scope="module")
def tok(factory_json):
    """The factory tokenizer with the tool markers <SPECIAL_16>..<SPECIAL_23> (added when the
    factory does not write them)."""
    t = hf_tokenizer(factory_json)
    t.add_special_tokens({"additional_special_tokens": MARKERS})
    assert all(m in t.get_vocab() for m in MARKERS)
    return t


@pytest.fixture(scope="module")
def markers(tok):
    return ToolMarkers.from_tokenizer(tok)


def make_parser(tok, markers, **kw):
    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    return ToolCallParser(markers, decode, pad_ids=(PAD, SILENCE), **kw)


def call_frames(tok, markers, text, pad_between=0):
    """The function channel of a call: start, the text's ids (pad between), end."""
    ids = []
    for i in tok.encode(text, add_special_tokens=False):
        ids += [i] + [PAD] * pad_between
    return [markers.start] + ids + [markers.end]


def run(parser, frames):
    """Feed one id per frame -> ([(frame, ToolCall)], [(frame, error)])."""
    calls, errors = [], []
    for n, i in enumerate(frames):
        c, e = parser.feed(i)
        calls += [(n, x) for x in c]
        errors += [(n, x) for x in e]
    return calls, errors


CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")


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


# --- markers ------------------------------------------------------------------------------


def test_markers_from_tokenizer(tok):
    m = ToolMarkers.from_tokenizer(tok)
    assert (m.start, m.end, m.reserved) == tuple(
        tok.convert_tokens_to_ids(t) for t in ("<SPECIAL_20>", "<SPECIAL_21>", "<SPECIAL_22>")
    )
    assert len({m.start, m.end, m.reserved, tok.unk_token_id}) == 4
    assert ToolMarkers.from_tokenizer(tok, vocab_size=len(tok)) == m


def test_markers_refused_for_a_tokenizer_without_them(markerless_tokenizer):
    t = markerless_tokenizer
    # transformers maps the unknown "<SPECIAL_20>" to the unk id; that must not pass as a marker.
    assert t.convert_tokens_to_ids("<SPECIAL_20>") == t.unk_token_id
    with pytest.raises(
        ToolError, match=r"tools need a tokenizer with the <SPECIAL_20> / <SPECIAL_21>"
    ):
        ToolMarkers.from_tokenizer(t)
    with pytest.raises(ToolError, match="tools need the model's tokenizer"):
        ToolMarkers.from_tokenizer(None)


def test_markers_of_the_factory_tokenizer(factory_tokenizer):
    # Before the factory writes <SPECIAL_16>..<SPECIAL_23>, tools are refused clearly; once it
    # does, the markers sit at the real tokenizer's ids (<SPECIAL_N> is id N).
    if "<SPECIAL_20>" not in factory_tokenizer.get_vocab():
        with pytest.raises(ToolError, match="lacks <SPECIAL_20> and <SPECIAL_21>"):
            ToolMarkers.from_tokenizer(factory_tokenizer)
    else:
        m = ToolMarkers.from_tokenizer(factory_tokenizer, vocab_size=VOCAB)
        assert (m.start, m.end, m.reserved) == (20, 21, 22)


def test_markers_outside_the_model_vocabulary_are_refused(tok, markers):
    with pytest.raises(ToolError, match="outside the model's 20-token vocabulary"):
        ToolMarkers.from_tokenizer(tok, vocab_size=20)
    assert ToolMarkers.from_tokenizer(tok, vocab_size=max(markers.start, markers.end) + 1)


def test_markers_from_a_bare_tokenizers_object(markerless_tokenizer):
    bare = markerless_tokenizer.backend_tokenizer  # a tokenizers.Tokenizer
    with pytest.raises(ToolError, match="lacks <SPECIAL_20> and <SPECIAL_21>"):
        ToolMarkers.from_tokenizer(bare)
    bare = build_tokenizer(VOCAB)
    bare.add_special_tokens(MARKERS)
    m = ToolMarkers.from_tokenizer(bare)
    assert (m.start, m.end) == (bare.token_to_id("<SPECIAL_20>"), bare.token_to_id("<SPECIAL_21>"))


# --- calls out ----------------------------------------------------------------------------


def test_one_call(tok, markers):
    parser = make_parser(tok, markers)
    body = '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>'
    frames = [PAD] * 3 + call_frames(tok, markers, body) + [PAD] * 2
    calls, errors = run(parser, frames)
    assert errors == []
    assert len(calls) == 1
    frame, call = calls[0]
    assert frame == frames.index(markers.end)  # completed at the end marker's frame
    assert isinstance(call, ToolCall)
    assert (call.name, call.arguments) == ("get_weather", '{"city":"Paris"}')
    assert CALL_ID.match(call.call_id)
    assert not parser.pending and parser.close() is None


def test_two_calls_in_one_block(tok, markers):
    body = (
        '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"zone": "CET", "24h": true}}]</TOOLCALL>'
    )
    calls, errors = run(make_parser(tok, markers), call_frames(tok, markers, body))
    assert errors == []
    assert [(c.name, c.arguments) for _, c in calls] == [
        ("get_weather", '{"city":"Paris"}'),
        ("get_time", '{"zone":"CET","24h":true}'),
    ]
    assert calls[0][0] == calls[1][0]
    assert calls[0][1].call_id != calls[1][1].call_id


def test_string_and_object_arguments_give_the_same_call(tok, markers):
    as_object = '<TOOLCALL>[{"name": "f", "arguments": {"city": "Zürich", "n": 2}}]</TOOLCALL>'
    as_string = (
        '<TOOLCALL>[{"name": "f", "arguments": "{\\"city\\": \\"Zürich\\", \\"n\\": 2}"}]'
        "</TOOLCALL>"
    )
    single = '<TOOLCALL>{"name": "f", "arguments": {"city": "Zürich", "n": 2}}</TOOLCALL>'
    no_tags = '[{"name": "f", "arguments": {"city": "Zürich", "n": 2}}]'
    out = []
    for body in (as_object, as_string, single, no_tags):
        calls, errors = run(make_parser(tok, markers), call_frames(tok, markers, body))
        assert errors == []
        out.append([(c.name, c.arguments) for _, c in calls])
    assert out == [[("f", '{"city":"Zürich","n":2}')]] * 4
    assert json.loads(out[0][0][1]) == {"city": "Zürich", "n": 2}


def test_missing_arguments_are_an_empty_object():
    assert parse_call_text('[{"name": "now"}]') == ([("now", "{}")], [])
    assert parse_call_text('[{"name": "now", "arguments": ""}]') == ([("now", "{}")], [])


def test_malformed_json_is_an_error_and_the_parser_goes_on(tok, markers):
    parser = make_parser(tok, markers)
    bad = call_frames(
        tok, markers, '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": </TOOLCALL>'
    )
    good = call_frames(tok, markers, '<TOOLCALL>[{"name": "now"}]</TOOLCALL>')
    calls, errors = run(parser, bad + [PAD] * 2 + good)
    assert errors[0][1].startswith("malformed tool call (not JSON")
    assert len(errors) == 1 and "\n" not in errors[0][1]
    assert [(c.name, c.arguments) for _, c in calls] == [("now", "{}")]


@pytest.mark.parametrize(
    "body, message",
    [
        ('[{"arguments": {"city": "Paris"}}]', "no name"),
        ('[{"name": "f", "arguments": "not json"}]', "arguments are not a JSON object"),
        ('[{"name": "f", "arguments": [1, 2]}]', "arguments are not a JSON object"),
        ('["f"]', "an item is not an object"),
        ("[]", "no calls in it"),
        ("<TOOLCALL></TOOLCALL>", "empty tool call"),
    ],
)
def test_bad_calls_are_errors(tok, markers, body, message):
    calls, errors = run(make_parser(tok, markers), call_frames(tok, markers, body))
    assert calls == []
    assert len(errors) == 1 and message in errors[0][1]


def test_one_bad_item_keeps_the_good_ones():
    calls, errors = parse_call_text(
        '[{"name": "a"}, {"arguments": {}}, {"name": "b", "arguments": {"x": 1}}]'
    )
    assert calls == [("a", "{}"), ("b", '{"x":1}')]
    assert len(errors) == 1 and "no name" in errors[0]


def test_start_without_end(tok, markers):
    parser = make_parser(tok, markers)
    frames = call_frames(tok, markers, '<TOOLCALL>[{"name": "get_weather"')[:-1]
    calls, errors = run(parser, frames + [PAD] * 5)
    assert (calls, errors) == ([], [])
    assert parser.pending
    message = parser.close()
    assert "never ended" in message and "\n" not in message
    assert not parser.pending and parser.close() is None


def test_pad_tokens_inside_are_skipped(tok, markers):
    body = '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>'
    plain = run(make_parser(tok, markers), call_frames(tok, markers, body))
    padded = call_frames(tok, markers, body, pad_between=3)
    padded.insert(1, SILENCE)
    calls, errors = run(make_parser(tok, markers), padded)
    assert errors == []
    assert [(c.name, c.arguments) for _, c in calls] == [
        (c.name, c.arguments) for _, c in plain[0]
    ]
    assert calls[0][0] == len(padded) - 1


def test_a_call_over_many_frames_is_decoded_once(tok, markers):
    decoded = []

    def decode(ids):
        decoded.append(list(ids))
        return tok.decode(ids, skip_special_tokens=True)

    parser = ToolCallParser(markers, decode, pad_ids=(PAD,))
    body = (
        '<TOOLCALL>[{"name": "search", "arguments": {"query": "'
        + "the capital of France " * 8
        + '"}}]</TOOLCALL>'
    )
    frames = call_frames(tok, markers, body, pad_between=1)
    assert len(frames) > 100
    calls, errors = run(parser, frames)
    assert errors == [] and [c.name for _, c in calls] == ["search"]
    assert len(decoded) == 1  # no re-decoding per frame
    assert PAD not in decoded[0] and decoded[0] == tok.encode(body, add_special_tokens=False)


def test_text_outside_markers_is_ignored(tok, markers):
    parser = make_parser(tok, markers)
    stray = tok.encode(
        '<TOOLCALL>[{"name": "get_weather"}]</TOOLCALL> hello', add_special_tokens=False
    )
    frames = stray + [markers.end, PAD, markers.reserved, BOS, EOS] + stray
    assert run(parser, frames) == ([], [])
    assert not parser.pending
    good = call_frames(tok, markers, '[{"name": "now"}]')
    calls, errors = run(parser, stray + good + stray)
    assert errors == [] and [c.name for _, c in calls] == ["now"]


def test_special_tokens_inside_a_call_are_skipped_by_decode(tok, markers):
    ids = tok.encode('[{"name": "now"}]', add_special_tokens=False)
    frames = [markers.start, markers.reserved, BOS] + ids + [EOS, markers.end]
    calls, errors = run(make_parser(tok, markers), frames)
    assert errors == [] and [c.name for _, c in calls] == ["now"]


def test_a_start_inside_a_call_drops_the_first(tok, markers):
    parser = make_parser(tok, markers)
    first = call_frames(tok, markers, '[{"name": "a"')[:-1]
    second = call_frames(tok, markers, '[{"name": "b"}]')
    calls, errors = run(parser, first + second)
    assert [c.name for _, c in calls] == ["b"]
    assert len(errors) == 1 and "inside another" in errors[0][1]


def test_a_call_that_runs_too_long_is_dropped(tok, markers):
    parser = make_parser(tok, markers, max_call_tokens=10)
    frames = call_frames(tok, markers, '[{"name": "get_weather", "arguments": {"city": "Paris"}}]')
    calls, errors = run(parser, frames)
    assert calls == [] and len(errors) == 1 and "ran past 10 tokens" in errors[0][1]
    assert not parser.pending


def test_unknown_tool_names_are_errors_when_the_tools_are_known(tok, markers):
    parser = make_parser(tok, markers, tool_names=["get_weather"])
    body = '[{"name": "get_weather", "arguments": {}}, {"name": "launch", "arguments": {}}]'
    calls, errors = run(parser, call_frames(tok, markers, body))
    assert [c.name for _, c in calls] == ["get_weather"]
    assert len(errors) == 1 and "'launch', which is not one of the session's tools" in errors[0][1]


def test_a_failing_decode_is_an_error(markers):
    def decode(ids):
        raise ValueError("bad id")

    parser = ToolCallParser(markers, decode)
    assert parser.feed(markers.start) == ([], [])
    assert parser.feed(7) == ([], [])
    calls, errors = parser.feed(markers.end)
    assert calls == [] and "cannot be decoded (ValueError: bad id)" in errors[0]


def test_call_ids_are_unique_and_never_from_the_global_generator(tok, markers):
    frames = call_frames(tok, markers, '[{"name": "a"}, {"name": "b"}]')
    state = random.getstate()
    ids = [[c.call_id for _, c in run(make_parser(tok, markers), frames)[0]] for _ in range(3)]
    assert random.getstate() == state  # the global generator is never used
    flat = [i for row in ids for i in row]
    assert len(set(flat)) == len(flat) == 6  # not even two parsers made alike repeat one
    assert all(CALL_ID.match(i) for i in flat)


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

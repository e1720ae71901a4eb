"""Tool calls out of the function channel (runtime/toolcalls.py), without a model: the markers
from a tokenizer and the parser (one call, several, bad ones, calls over many frames, ids).
Shared fixtures in tests/support/toolcall_support.py."""

import json
import random

import pytest
from toolcall_support import (  # noqa: F401  (fixtures)
    BOS,
    CALL_ID,
    EOS,
    MARKERS,
    PAD,
    SILENCE,
    VOCAB,
    call_frames,
    factory_json,
    factory_tokenizer,
    make_parser,
    markerless_tokenizer,
    markers,
    run,
    tok,
)

from mlx_voicechat.nemotron_voicechat.runtime.tools import (
    ToolCall,
    ToolCallParser,
    ToolError,
    ToolMarkers,
    parse_call_text,
)
from mlx_voicechat.nemotron_voicechat.weights.factory import build_tokenizer

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

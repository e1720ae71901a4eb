"""Tool calls through the session: the rendered prompt, a call forced through the function
channel and parsed, the result injected one token per frame, generate(tools=...), the CLI."""

import json

import numpy as np
import pytest

from mlx_voicechat.runtime import request
from mlx_voicechat.runtime.tools import ToolError, render_system_prompt, tool_result_ids

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def _wave(seconds, seed=1):
    rng = np.random.default_rng(seed)
    return (0.05 * rng.standard_normal(int(seconds * 16000))).astype(np.float32)


def _call_ids(tok, text):
    start, end = tok.convert_tokens_to_ids(["<SPECIAL_20>", "<SPECIAL_21>"])
    return [start] + tok.encode(text, add_special_tokens=False) + [end]


def test_tools_go_into_the_prompt(tiny):
    s = tiny.session("Be brief.", tools=[WEATHER])
    text = render_system_prompt("Be brief.", [WEATHER])
    assert "<AVAILABLE_TOOLS>" in text
    assert s.prompt_ids == request.prompt_ids(tiny, text)
    assert tiny.session("Be brief.").prompt_ids == request.prompt_ids(tiny, "Be brief.")
    with pytest.raises(ToolError, match="at most 5"):
        tiny.session("x", tools=[dict(WEATHER, name=f"t{i}") for i in range(6)])
    with pytest.raises(ToolError, match="unique"):
        tiny.session("x", tools=[WEATHER, WEATHER])
    with pytest.raises(ToolError, match="no tools"):
        tiny.session("x").add_tool_result("call_1", "{}")


def _force_call(session, ids):
    events = []
    for i in ids:
        session.force(function_id=i)
        events += session.silence(1)
    return events


def test_a_call_comes_out_and_its_result_is_injected_frame_by_frame(tiny):
    cfg = tiny.config
    tok = tiny.tokenizer
    s = tiny.session("Be brief.", tools=[WEATHER], seed=2)
    s.feed(_wave(0.3))
    call = '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>'
    events = _force_call(s, _call_ids(tok, call))
    calls = [c for e in events for c in e.tool_calls]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert events[-1].tool_calls == calls and not any(e.errors for e in events)
    with pytest.raises(ToolError):
        s.add_tool_result("call_unknown", "{}")

    result = {"temp_c": 21}
    ids = tool_result_ids(tok, result)
    assert s.add_tool_result(calls[0].call_id, json.dumps(result)) == len(ids)
    # A twin session driven by hand with the same forced ids gives the same outputs.
    twin = tiny.session("Be brief.", tools=[WEATHER], seed=2)
    twin.feed(_wave(0.3))
    _force_call(twin, _call_ids(tok, call))
    for i in ids:
        twin.force(text_id=cfg.pad_token_id, function_id=i)
    injected = s.silence(len(ids) + 2)
    by_hand = twin.silence(len(ids) + 2)
    assert [e.function_id for e in injected[: len(ids)]] == ids
    assert all(e.text_id == cfg.pad_token_id and e.forced for e in injected[: len(ids)])
    assert not injected[-1].forced  # the heads take over again
    assert s.tool_frames == len(ids)
    for a, b in zip(injected, by_hand):
        assert (a.text_id, a.function_id) == (b.text_id, b.function_id)
        assert np.array_equal(a.codes, b.codes) and np.array_equal(a.audio, b.audio)


def test_malformed_and_unfinished_calls_are_errors_and_the_session_goes_on(tiny):
    tok = tiny.tokenizer
    s = tiny.session("Be brief.", tools=[WEATHER])
    events = _force_call(s, _call_ids(tok, "<TOOLCALL>[{not json</TOOLCALL>"))
    assert any("JSON" in m or "json" in m for e in events for m in e.errors)
    start = tok.convert_tokens_to_ids("<SPECIAL_20>")
    _force_call(s, [start] + tok.encode('[{"name": "get_weather"', add_special_tokens=False))
    last = s.finish(0.2)
    assert last and any("unfinished" in m or "never" in m or "end" in m for m in last[-1].errors)


def test_generate_with_tools_returns_calls(tiny):
    out = tiny.generate(_wave(0.5), system_prompt="Be brief.", tools=[WEATHER], seed=0,
                        extra_decoding_seconds=0.2)
    assert out.tool_calls == [] or all(c.name == "get_weather" for c in out.tool_calls)
    assert isinstance(out.tool_errors, list)
    plain = tiny.generate(_wave(0.5), system_prompt="Be brief.", seed=0, extra_decoding_seconds=0.2)
    assert plain.tool_calls == []


def test_cli_tools_file(tiny_checkpoints, tmp_path, capsys):
    import soundfile as sf

    from mlx_voicechat.cli import main

    wav = tmp_path / "q.wav"
    sf.write(wav, _wave(0.4), 16000)
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER]))
    args = ["generate", "--model", str(tiny_checkpoints["mlx-community"]), "--audio", str(wav),
            "--output-audio", str(tmp_path / "r.wav"), "-p", "Be brief.",
            "--extra-decoding-seconds", "0.1", "--quiet"]
    assert main(args + ["--tools", str(tools)]) == 0
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    assert main(args + ["--tools", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    bad.write_text(json.dumps([{"description": "no name"}]))
    assert main(args + ["--tools", str(bad)]) == 2
    assert "name" in capsys.readouterr().err

"""Tool calls through the session: the rendered prompt, a call forced through the function
channel and parsed, the result injected one token per frame, generate(tools=...), the CLI."""

import json

import numpy as np
import pytest
from tool_specs import WEATHER

from mlx_voicechat.nemotron_voicechat.runtime import request
from mlx_voicechat.nemotron_voicechat.runtime.tools import (
    ToolError,
    render_system_prompt,
    tool_result_ids,
)


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
    cfg = tiny.config
    tok = tiny.tokenizer
    s = tiny.session("Be brief.", tools=[WEATHER])
    events = _force_call(s, _call_ids(tok, "<TOOLCALL>[{not json</TOOLCALL>"))
    assert [e.errors for e in events] == [[]] * (len(events) - 1) + [[
        "malformed tool call (not JSON: Expecting property name enclosed in double quotes: "
        "line 1 column 3 (char 2)): '[{not json'"
    ]]
    assert not any(e.tool_calls for e in events)
    start = tok.convert_tokens_to_ids("<SPECIAL_20>")
    partial = tok.encode('[{"name": "get_weather"', add_special_tokens=False)
    events = _force_call(s, [start] + partial)
    for _ in range(4):  # the frames finish() makes write pad: the call stays as forced
        s.force(function_id=cfg.pad_token_id)
    last = s.finish(0.1)
    assert not any(e.errors for e in events + last[:-1])
    assert last[-1].errors == [
        f"the model started a tool call that never ended ({len(partial)} tokens written); "
        "it was dropped"
    ]


def test_two_sessions_never_share_a_call_id_and_the_seed_still_fixes_the_audio(tiny):
    """Call ids come from a secure random source, not the session's seed: two sessions with
    one seed (two servers started alike) name their first call differently, and still speak
    the same audio."""
    tok = tiny.tokenizer
    call = '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>'
    runs = []
    for _ in range(2):
        s = tiny.session("Be brief.", tools=[WEATHER], seed=3)
        events = s.feed(_wave(0.3)) + _force_call(s, _call_ids(tok, call)) + s.silence(3)
        runs.append(events)
    (a,), (b,) = ([c for e in evs for c in e.tool_calls] for evs in runs)
    assert (a.name, a.arguments) == (b.name, b.arguments) == ("get_weather", '{"city":"Paris"}')
    assert a.call_id != b.call_id
    assert all(c.call_id.startswith("call_") and len(c.call_id) == 29 for c in (a, b))
    for x, y in zip(*runs):
        assert np.array_equal(x.audio, y.audio) and x.text_id == y.text_id

class _ScriptedHead:
    """Stands in for the function head: frame k's logits put ``script[k]`` first (pad after
    the script), so generate's function channel is exactly the script."""

    def __init__(self, script, vocab, pad):
        self.script, self.vocab, self.pad, self.frame = list(script), vocab, pad, 0

    def __call__(self, h):
        import mlx.core as mx

        k, self.frame = self.frame, self.frame + 1
        i = self.script[k] if k < len(self.script) else self.pad
        one_hot = (mx.arange(self.vocab) == i).astype(h.dtype)
        return mx.broadcast_to(one_hot, h.shape[:-1] + (self.vocab,))


def _generate_scripted(model, monkeypatch, script, **kw):
    """generate() with the function channel written by ``script``, which ends before the
    audio (0.5 s and enough trailing silence) does."""
    cfg = model.config
    head = _ScriptedHead(script, cfg.text_args.vocab_size, cfg.pad_token_id)
    monkeypatch.setattr(model.stt_model, "function_head", head)
    seconds = len(script) * cfg.frame_duration
    out = model.generate(_wave(0.5), system_prompt="Be brief.", seed=0,
                         extra_decoding_seconds=seconds, **kw)
    assert head.frame == out.frames and out.function_ids[: len(script)] == script
    return out


def test_generate_with_tools_returns_calls(tiny, monkeypatch):
    tok = tiny.tokenizer
    pad = tiny.config.pad_token_id
    call = '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>'
    empty = "<TOOLCALL>[]</TOOLCALL>"
    script = [pad] * 2 + _call_ids(tok, call) + [pad] + _call_ids(tok, empty)
    out = _generate_scripted(tiny, monkeypatch, script, tools=[WEATHER])
    # the session with the same seed makes the same call (under an id of its own)
    s = tiny.session("Be brief.", tools=[WEATHER], seed=0)
    (want,) = [c for e in _force_call(s, _call_ids(tok, call)) for c in e.tool_calls]
    assert (want.name, want.arguments) == ("get_weather", '{"city":"Paris"}')
    assert [(c.name, c.arguments) for c in out.tool_calls] == [(want.name, want.arguments)]
    assert out.tool_calls[0].call_id != want.call_id
    assert out.tool_errors == ["the model wrote a tool call with no calls in it: []"]
    plain = _generate_scripted(tiny, monkeypatch, script)
    assert plain.tool_calls == [] and plain.tool_errors == []  # no tools: not parsed


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


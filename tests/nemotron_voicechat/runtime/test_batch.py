"""Batched live sessions: every conversation of a batch gets exactly what it gets alone through
``model.session()``, whoever else joins, leaves, barges in or calls a tool, for any chunking;
one host read per batched frame; bad input is the one conversation's error."""

import json

import numpy as np
import pytest
from test_session import _noise, _same_as_offline, offline04  # noqa: F401 (a fixture)
from tool_specs import WEATHER

from mlx_voicechat.errors import SessionError
from mlx_voicechat.nemotron_voicechat.runtime.batch import SessionBatch
from mlx_voicechat.nemotron_voicechat.runtime.tools import ToolError

CALL = '<TOOLCALL>[{"name":"get_weather","arguments":{}}]</TOOLCALL>'


def _wave(seconds, seed):
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(int(seconds * 16000))).astype(np.float32)


def _chunks(wave, seed):
    rng = np.random.default_rng(seed)
    out, i = [], 0
    while i < len(wave):
        n = int(rng.choice([1, 160, 999, 1280, 2000, 3001]))
        out.append(wave[i : i + n])
        i += n
    return out


class Script:
    """One conversation: how it opens, its audio in chunks, when it joins a batch (round) and
    what is done to it after a given number of its frames (before its next chunk)."""

    def __init__(self, kwargs, wave, seed, join=0, actions=None, leave_after=None, extra=0.3):
        self.kwargs, self.chunks, self.join = kwargs, _chunks(wave, seed), join
        self.actions = dict(actions or {})
        self.leave_after, self.extra = leave_after, extra

    def act(self, target, events, model):
        done = len([e for e in events if not e.remainder])
        for k in sorted(self.actions):
            if k <= done:
                self.actions.pop(k)(target, model)
        for e in events[getattr(self, "_seen", 0) :]:
            for call in e.tool_calls:
                target.add_tool_result(call.call_id, json.dumps({"t": 1}))
        self._seen = len(events)


def _copy(script):
    clone = Script.__new__(Script)
    clone.__dict__.update(script.__dict__)
    clone.actions = dict(script.actions)
    return clone


def alone(model, script):
    sc = _copy(script)
    s = model.session(**sc.kwargs)
    events = []
    for j, chunk in enumerate(sc.chunks):
        sc.act(s, events, model)
        if sc.leave_after is not None and j == sc.leave_after:
            s.close()
            return events
        if s.finished:  # max_seconds
            return events
        events += s.feed(chunk)
    sc.act(s, events, model)
    return events + s.finish(sc.extra)


def together(model, scripts):
    scripts = [_copy(s) for s in scripts]
    batch = model.session_batch(max_sessions=len(scripts))
    handles, events, pos, over = {}, {i: [] for i in range(len(scripts))}, {}, set()
    rnd = 0
    while len(over) < len(scripts):
        for i, sc in enumerate(scripts):
            if rnd == sc.join:
                handles[i], pos[i] = batch.open(**sc.kwargs), 0
            if i not in handles or i in over:
                continue
            h = handles[i]
            sc.act(h, events[i], model)
            j = pos[i]
            if h.finished:  # max_seconds
                over.add(i)
            elif sc.leave_after is not None and j == sc.leave_after:
                h.close()
                over.add(i)
            elif j < len(sc.chunks):
                h.push(sc.chunks[j])
                pos[i] = j + 1
            else:
                sc.act(h, events[i], model)
                h.finish(sc.extra)
                over.add(i)
        for h, evs in batch.step().items():
            i = next(k for k, v in handles.items() if v is h)
            events[i] += evs
        rnd += 1
    return [events[i] for i in range(len(scripts))]


def _same(a, b):
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert (x.index, x.text_id, x.function_id, x.remainder) == (y.index, y.text_id, y.function_id, y.remainder)
        assert np.array_equal(x.codes, y.codes) and np.array_equal(x.audio, y.audio)
        assert (x.text, x.function_text, x.transcript, x.turn, x.forced, x.end) == (
            y.text, y.function_text, y.transcript, y.turn, y.forced, y.end
        )
        assert [(c.name, c.arguments) for c in x.tool_calls] == [  # ids: secure random
            (c.name, c.arguments) for c in y.tool_calls
        ]
        assert x.errors == y.errors


def _cancel(target, model):
    target.cancel()


def test_oracle04_joined_by_two_that_barge_in_and_leave(nvidia, io04, offline04):
    """Oracle 04 (NeMo's recorded draws replayed) joined at rounds 3 and 7 by conversations
    with other prompts and seeds, one cancelled mid-turn, one leaving early: oracle 04 still
    equals its offline run, and each other conversation its run alone."""
    oracle = Script(
        {"prompt": io04["prompt_tokens"][0].tolist(), "noise": _noise(io04)}, io04["wav"][0], 0,
        extra=0.0,
    )
    b = Script({"prompt": [1, 45, 67, 2], "seed": 5}, _wave(1.2, 2), 1, join=3, actions={6: _cancel})
    c = Script({"prompt": [], "seed": 7}, _wave(1.0, 3), 2, join=7, leave_after=6)
    got = together(nvidia, [oracle, b, c])
    _same_as_offline(got[0], offline04)
    b_alone, c_alone = alone(nvidia, b), alone(nvidia, c)
    assert any(e.forced for e in b_alone)  # the barge-in happened
    _same(got[1], b_alone)
    _same(got[2], c_alone)


def _tool_call(target, model):
    tok = model.tokenizer
    start, end = tok.convert_tokens_to_ids(["<SPECIAL_20>", "<SPECIAL_21>"])
    for i in [start] + tok.encode(CALL, add_special_tokens=False) + [end]:
        target.force(function_id=i)


def test_eight_factory_conversations_each_equal_alone(tiny):
    scripts = [
        Script({"system_prompt": "Be brief.", "seed": 3}, _wave(1.6, 10), 10),
        Script({"system_prompt": "", "seed": 4}, _wave(1.2, 11), 11, join=1, actions={5: _cancel}),
        Script({"system_prompt": "Hi.", "seed": 5, "tools": [WEATHER]}, _wave(5.2, 12), 12, join=2,
               actions={3: _tool_call}),
        Script({"system_prompt": "Hello there friend.", "seed": 6}, _wave(1.0, 13), 13, join=2,
               leave_after=5),
        Script({"system_prompt": "Be brief.", "seed": 3}, _wave(0.8, 14), 14, join=4),
        Script({"prompt": [1, 45, 2], "seed": 8, "max_seconds": 0.64}, _wave(1.4, 15), 15, join=5),
        Script({"system_prompt": "A", "seed": 9}, _wave(1.1, 16), 16, join=6),
        Script({"system_prompt": "", "seed": 0}, _wave(0.9, 17), 17, join=9),
    ]
    got = together(tiny, scripts)
    for script, events in zip(scripts, got):
        _same(events, alone(tiny, script))
    assert [c.name for e in got[2] for c in e.tool_calls] == ["get_weather"]
    assert sum(e.forced for e in got[2]) > 55  # the call's ids, then the result's
    assert got[5][-1].end == "max_seconds"


def test_one_host_read_per_batched_frame(tiny, sync_count):
    batch = tiny.session_batch(max_sessions=3)
    handles = [batch.open("Hi.", seed=s) for s in range(3)]
    waves = [_wave(1.2, 20 + s) for s in range(3)]
    for h, w in zip(handles, waves):
        h.push(w[:2560])
    batch.step()  # the first frames, each alone, and one batched round
    sync_count[0] = 0
    rounds = 0
    for k in range(2, 10):
        for h, w in zip(handles, waves):
            h.push(w[1280 * k : 1280 * (k + 1)])
        out = batch.step()
        assert all(len(out[h]) == 1 for h in handles)
        rounds += 1
    assert sync_count[0] == rounds
    # several rounds in one step: one read each
    sync_count[0] = 0
    for h, w in zip(handles, waves):
        h.push(np.zeros(1280 * 4, np.float32))
    out = batch.step()
    assert all(len(out[h]) == 4 for h in handles) and sync_count[0] == 4


def test_a_session_is_a_batch_of_one(tiny, monkeypatch):
    steps = []
    real = SessionBatch.step
    monkeypatch.setattr(SessionBatch, "step", lambda self: steps.append(len(self)) or real(self))
    s = tiny.session("", seed=0)
    assert len(s.feed(_wave(0.4, 1))) == 5  # 1280 k + 199 <= 6400 samples
    assert steps == [1]


def test_bad_input_to_one_conversation_is_its_error_only(tiny):
    scripts = [
        Script({"system_prompt": "Be brief.", "seed": 1}, _wave(1.0, 30), 30),
        Script({"system_prompt": "", "seed": 2}, _wave(1.0, 31), 31),
    ]
    batch = tiny.session_batch(max_sessions=4)
    good = [batch.open(**s.kwargs) for s in scripts]
    bad = batch.open("", seed=3, max_seconds=0.16)
    tooled = batch.open("Hi.", seed=4, tools=[WEATHER])
    events = [[], []]
    for j in range(max(len(s.chunks) for s in scripts)):
        for h, s in zip(good, scripts):
            if j < len(s.chunks):
                h.push(s.chunks[j])
        if j == 1:
            with pytest.raises(SessionError, match="finite"):
                bad.push(np.array([0.0, np.nan], np.float32))
            with pytest.raises(SessionError, match="1-D"):
                bad.push(np.zeros((2, 3), np.float32))
            with pytest.raises(ToolError, match="no tool call has the id"):
                tooled.add_tool_result("call_x", "{}")
            bad.push(_wave(0.5, 32))  # past its max_seconds once stepped
        if j == 3:
            with pytest.raises(SessionError, match="max_seconds"):
                bad.push(_wave(0.1, 33))
            tooled.close()
            with pytest.raises(SessionError, match="closed"):
                tooled.push(_wave(0.1, 34))
        out = batch.step()
        for k, h in enumerate(good):
            events[k] += out.get(h, [])
    for k, (h, s) in enumerate(zip(good, scripts)):
        h.finish(s.extra)
    out = batch.step()
    for k, (h, s) in enumerate(zip(good, scripts)):
        _same(events[k] + out[h], alone(tiny, s))
    # unknown options: every one named, in one order whatever the hash seed
    with pytest.raises(SessionError, match=r"no option 'speed', 'temperature': it takes seed"):
        batch.open("", temperature=0.7, seed=0, speed=1.0)
    with pytest.raises(SessionError, match="holds its 4 sessions"):
        for _ in range(2):
            batch.open("", seed=0)

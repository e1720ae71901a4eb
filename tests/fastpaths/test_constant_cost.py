"""Constant cost per frame and memory per minute, on a long session of a tiny model: once the
encoder's left context and the TTS windows are full, a frame builds the same graph as any
later frame and the session's state grows only by the LLM's and the TTS global layers'
key / value rows, at the rate ``session.memory_per_minute()`` states.

What a session holds is found by walking its objects (weights excluded), not by naming its
attributes, so the test follows the state wherever it lives."""

import functools
import json
import re
import shutil
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlx_voicechat import load

WINDOW = 150  # TTS sliding window (frames): it fills after the encoder's 70-frame context
FILLING = (75, 100)  # frames between which the TTS windows are still filling
FULL = (115, 175)  # frames between which every window is full
FRAMES_PER_MINUTE = 750


def _state_bytes(root) -> dict:
    """Bytes of the arrays (MLX and numpy) reachable from ``root``: key / value caches by the
    positions they hold (mlx-lm's buffers grow in steps of 256), split into ``kv`` (KVCache),
    ``window`` (RotatingKVCache) and ``other``."""
    out = Counter()
    seen = set()
    stack = [root]
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (nn.Module, str, bytes, int, float, type(None))):
            continue
        seen.add(id(o))
        if isinstance(o, (mx.array, np.ndarray)):
            out["other"] += o.nbytes
        elif isinstance(o, (KVCache, RotatingKVCache)):
            if o.keys is not None:
                held = o.offset if isinstance(o, KVCache) else min(o.offset, o.max_size)
                per_position = (o.keys.nbytes + o.values.nbytes) // o.keys.shape[2]
                out["kv" if isinstance(o, KVCache) else "window"] += held * per_position
        elif isinstance(o, dict):
            stack += list(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack += list(o)
        elif hasattr(o, "__dict__"):
            stack += list(vars(o).values())
    return out


def _graph_ops(feed):
    """The operations of every graph ``feed()`` hands to ``mx.eval`` / ``mx.async_eval``
    (a Counter of their names), each graph evaluated before the next is built."""
    import tempfile

    ops = Counter()
    real_async, real_eval = mx.async_eval, mx.eval
    with tempfile.TemporaryDirectory() as d:
        dot = f"{d}/graph.dot"

        def counting(real):
            def f(*arrays):
                arrs = [a for a in arrays if isinstance(a, mx.array)]
                if arrs:
                    mx.export_to_dot(dot, *arrs)
                    with open(dot) as g:
                        ops.update(re.findall(r'label ="([^"]*)"', g.read()))
                real(*arrays)
                real_eval(*arrs)

            return f

        mx.synchronize()  # nothing of the earlier frames is left pending
        mx.async_eval, mx.eval = counting(real_async), counting(real_eval)
        try:
            events = feed()
        finally:
            mx.async_eval, mx.eval = real_async, real_eval
    return ops, events


@pytest.fixture(scope="module")
def long_session(tiny_checkpoints, tmp_path_factory):
    """A session of the tiny model (with a 150-frame TTS window) fed one frame at a time up
    to frame FULL[1]: its state bytes at the frames of FILLING and FULL, and the graphs of
    the frames of FULL."""
    folder = tmp_path_factory.mktemp("long") / "tiny"
    shutil.copytree(tiny_checkpoints["mlx-community"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["tts_config"]["sliding_window"] = WINDOW
    (folder / "config.json").write_text(json.dumps(config))
    model = load(folder)
    # The random RNNT would write a token every frame and fall behind without end; a blank
    # that wins keeps it caught up, as speech (about 0.3 tokens per frame) does.
    out = model.stt_model.rnnt_joint.joint_net[-1]
    out.bias = out.bias + 50.0 * (mx.arange(out.bias.shape[0]) == out.bias.shape[0] - 1)
    rng = np.random.default_rng(0)
    wave = (0.1 * rng.standard_normal(1280 * (FULL[1] + 2))).astype(np.float32)
    s = model.session("Hi there.", seed=0)
    assert len(s.feed(wave[:199])) == 1  # frame 0
    sizes, graphs = {}, {}
    for k in range(1, FULL[1] + 1):
        chunk = wave[1280 * k - 1081 : 1280 * k + 199]
        if k in FULL:
            graphs[k], events = _graph_ops(functools.partial(s.feed, chunk))
        else:
            events = s.feed(chunk)
        assert [e.index for e in events] == [k]
        if k in FILLING + FULL:
            sizes[k] = _state_bytes(s)
    return s, sizes, graphs


def test_memory_per_minute_is_what_the_caches_grow_by(long_session):
    s, sizes, _ = long_session
    per_minute = s.memory_per_minute()

    def growth(kind, frames):
        a, b = frames
        return (sizes[b][kind] - sizes[a][kind]) * FRAMES_PER_MINUTE / (b - a)

    for frames in (FILLING, FULL):  # the LLM's and the TTS global layers' rows: always
        assert growth("kv", frames) == per_minute["llm_kv"] + per_minute["tts_global_kv"]
    assert growth("kv", FULL) == per_minute["total_after_window"]
    assert growth("window", FILLING) == per_minute["tts_window_kv"]
    assert growth("window", FULL) == 0  # full: then nothing
    assert per_minute["tts_window_minutes"] == WINDOW / FRAMES_PER_MINUTE
    assert sizes[FULL[1]]["window"] == per_minute["tts_window_kv"] * WINDOW / FRAMES_PER_MINUTE
    for frames in (FILLING, FULL):  # the encoder's context, the RNNT, the codec, Mamba ...
        assert growth("other", frames) == 0


def test_a_frame_builds_the_same_graph_once_the_windows_are_full(long_session):
    _, _, graphs = long_session
    a, b = (graphs[k] for k in FULL)
    assert sum(a.values()) > 100  # the whole frame was seen
    assert a == b

"""Performance invariants of the offline loop that can be checked cheaply on tiny weights."""

import mlx.core as mx
import numpy as np

from mlx_voicechat.nemotron_voicechat.runtime.framestate import open_state
from mlx_voicechat.nemotron_voicechat.runtime.generate import run_frames
from mlx_voicechat.nemotron_voicechat.runtime.request import resolve
from mlx_voicechat.nemotron_voicechat.runtime.step import step


def _state(model, prompt, seed):
    return open_state(model, resolve(model, prompt, seed=seed))


def test_offline_loop_one_host_sync_per_frame(tiny, sync_count):
    frames = mx.random.normal((1, 12, tiny.config.text_args.hidden_size), key=mx.random.key(1))
    state = _state(tiny, "Hi there.", 0)
    mx.eval(state.arrays(), frames)
    sync_count[0] = 0
    ids, codes, _ = run_frames(tiny, state, frames)
    assert len(ids) == len(codes) == 12
    assert sync_count[0] == 12


def test_pipelined_loop_equals_step_by_step(tiny):
    frames = mx.random.normal((1, 10, tiny.config.text_args.hidden_size), key=mx.random.key(2))
    ids, codes, _ = run_frames(tiny, _state(tiny, "Hi there.", 3), frames)
    b = _state(tiny, "Hi there.", 3)
    steps = [step(tiny, b, frames[:, i : i + 1]) for i in range(10)]
    assert ids == [tuple(s.ids[0].tolist()) for s in steps]
    for c, s in zip(codes, steps):
        assert np.array_equal(np.array(c), np.array(s.codes))

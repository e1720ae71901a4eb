"""Performance invariants of the offline loop that can be checked cheaply on tiny weights."""

import mlx.core as mx
import numpy as np

from mlx_voicechat.runtime.duplex import duplex_step, prompt_ids, run_frames, start_session

def test_offline_loop_one_host_sync_per_frame(tiny, sync_count):
    frames = mx.random.normal((1, 12, tiny.config.text_args.hidden_size), key=mx.random.key(1))
    cache = start_session(tiny, prompt_ids(tiny, "Hi there."), seed=0)
    mx.eval(cache.previous_code, frames)
    sync_count[0] = 0
    outputs, _ = run_frames(tiny, cache, frames)
    assert len(outputs) == 12
    assert sync_count[0] == 12


def test_pipelined_loop_equals_step_by_step(tiny):
    frames = mx.random.normal((1, 10, tiny.config.text_args.hidden_size), key=mx.random.key(2))
    ids = prompt_ids(tiny, "Hi there.")
    a = start_session(tiny, ids, seed=3)
    outs, _ = run_frames(tiny, a, frames)
    b = start_session(tiny, ids, seed=3)
    steps = [duplex_step(tiny, b, frames[:, i : i + 1])[0] for i in range(10)]
    assert [o.text_id for o in outs] == [s.text_id for s in steps]
    assert [o.function_id for o in outs] == [s.function_id for s in steps]
    for o, s in zip(outs, steps):
        assert np.array_equal(np.array(o.codes), np.array(s.codes))

"""The frame state's caches and mlx-lm's batch protocol: a state split and merged again gives
the same next frames, bit for bit, whatever the order and the rounds."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_voicechat.runtime.framestate import FrameState, open_live, open_state
from mlx_voicechat.runtime.live import ReadLayout, queue_frame, read
from mlx_voicechat.runtime.request import resolve

SPECS = [("Be brief.", 3), ("", 5), ("Hello there friend.", 7)]


def _window(model, row, t):
    """A deterministic mel window for conversation ``row``'s frame ``t`` (as MelStream hands
    out: 8 t + 1 mel frames from 2 frames back)."""
    n_mels = model.config.audio_config.preprocessor.features
    s = max(t - 2, 0)
    mel = mx.random.normal((8 * t + 1 - 8 * s, n_mels), key=mx.random.key(1000 * row + t))
    return mel, t - s


def _fresh(model, frames=2):
    """The three conversations' states after ``frames`` frames each, alone."""
    layout = ReadLayout(model)
    states = []
    for row, (prompt, seed) in enumerate(SPECS):
        state = open_live(model, open_state(model, resolve(model, prompt, seed=seed)))
        for t in range(frames):
            read(queue_frame(model, state, [_window(model, row, t)], layout))
        states.append(state)
    return states, layout


def _run(model, state, rows, t0, n, layout):
    """``n`` frames of ``state`` whose rows are conversations ``rows``, from frame ``t0``."""
    out = []
    for t in range(t0, t0 + n):
        out.append(read(queue_frame(model, state, [_window(model, r, t) for r in rows], layout)))
    return out


@pytest.fixture(scope="module")
def alone(tiny):
    """Each conversation's frames 2..5 run alone: what every other order must give."""
    states, layout = _fresh(tiny)
    return [np.concatenate(_run(tiny, s, [r], 2, 4, layout)) for r, s in enumerate(states)]


def _rows(out, i):
    return np.stack([o[i] for o in out])


def test_merged_rows_equal_each_row_alone(tiny, alone):
    states, layout = _fresh(tiny)
    out = _run(tiny, FrameState.merge(states), [0, 1, 2], 2, 4, layout)
    for i in range(3):
        assert np.array_equal(_rows(out, i), alone[i])


def test_extract_after_batched_frames_goes_on_alone(tiny, alone):
    states, layout = _fresh(tiny)
    batch = FrameState.merge(states)
    first = _run(tiny, batch, [0, 1, 2], 2, 2, layout)
    for i in range(3):
        rest = _run(tiny, batch.extract(i), [i], 4, 2, layout)
        assert np.array_equal(np.concatenate([_rows(first, i), np.concatenate(rest)]), alone[i])


def test_filter_and_extend_reorder_rows(tiny, alone):
    states, layout = _fresh(tiny)
    batch = FrameState.merge(states)
    first = _run(tiny, batch, [0, 1, 2], 2, 1, layout)
    middle = batch.extract(1)
    batch.filter([0, 2])
    batch.extend(middle)
    assert batch.rows == 3
    rest = _run(tiny, batch, [0, 2, 1], 3, 3, layout)
    for i, j in ((0, 0), (1, 2), (2, 1)):
        assert np.array_equal(np.concatenate([_rows(first, i), _rows(rest, j)]), alone[i])


def test_rounds_of_some_rows_take_and_put_back(tiny, alone):
    """A round in which only rows 0 and 2 have a frame: gathered, stepped, written back; the
    row left out goes on from where it was."""
    states, layout = _fresh(tiny)
    batch = FrameState.merge(states)
    part = batch.take([0, 2])
    some = _run(tiny, part, [0, 2], 2, 1, layout)
    batch.put([0, 2], part)
    part = batch.take([1])  # row 1 catches up alone ...
    lag = _run(tiny, part, [1], 2, 1, layout)
    batch.put([1], part)
    rest = _run(tiny, batch, [0, 1, 2], 3, 3, layout)  # ... and all go on together
    assert np.array_equal(np.concatenate([_rows(some, 0), _rows(rest, 0)]), alone[0])
    assert np.array_equal(np.concatenate([_rows(lag, 0), _rows(rest, 1)]), alone[1])
    assert np.array_equal(np.concatenate([_rows(some, 1), _rows(rest, 2)]), alone[2])


def test_every_cache_round_trips_merge_and_extract(tiny):
    """Each cache of the tree: merging single rows and extracting them again gives back each
    row's arrays, and the batched cache has one row per conversation."""
    states, _ = _fresh(tiny)
    batch = FrameState.merge(states)
    assert len(batch.caches()) == len(states[0].caches())
    for i, s in enumerate(states):
        row = batch.extract(i)
        for mine, theirs in zip(row.caches(), s.caches()):
            a = [x for _, x in tree_flatten(mine.state) if isinstance(x, mx.array)]
            b = [x for _, x in tree_flatten(theirs.state) if isinstance(x, mx.array)]
            assert len(a) == len(b) > 0, type(theirs).__name__
            for x, y in zip(a, b):
                assert x.shape == y.shape and mx.array_equal(x, y).item(), type(theirs).__name__
    assert batch.meta_state == (
        tuple(p for s in states for p in s.position), tuple(f for s in states for f in s.frames)
    )

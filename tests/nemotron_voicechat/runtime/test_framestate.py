"""The frame state's caches and mlx-lm's batch protocol: a state split and merged again gives
the same next frames, bit for bit, whatever the order and the rounds; and each kind of cache
does so through its own ``filter`` / ``extend`` / ``merge`` / ``extract``."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from mlx_voicechat.caches import RowCaches
from mlx_voicechat.listen.fastconformer import EncoderCache
from mlx_voicechat.nemotron_voicechat.nets.codec_step import CodecDecodeCache
from mlx_voicechat.nemotron_voicechat.runtime.framestate import (
    Flags,
    FrameState,
    LastIds,
    RNNTState,
    open_live,
    open_state,
)
from mlx_voicechat.nemotron_voicechat.runtime.request import resolve
from mlx_voicechat.nemotron_voicechat.runtime.step import ReadLayout, read, step
from mlx_voicechat.noise import RowNoise

SPECS = [("Be brief.", 3), ("", 5), ("Hello there friend.", 7)]


def _window(model, row, t):
    """A deterministic mel window for conversation ``row``'s frame ``t`` (as MelStream hands
    out: 8 t + 1 mel frames from 2 frames back)."""
    n_mels = model.config.audio_config.preprocessor.features
    s = max(t - 2, 0)
    mel = mx.random.normal((8 * t + 1 - 8 * s, n_mels), key=mx.random.key(1000 * row + t))
    return mel, t - s


def _fresh(model, frames=2):
    """The three conversations' states after ``frames`` frames each, alone; then the second
    is in a barge-in and the third has ids forced on its next frame, and the RNNT of each has
    heard another token, so that no two rows' flags or RNNT states are alike."""
    layout = ReadLayout(model)
    states = []
    for row, (prompt, seed) in enumerate(SPECS):
        state = open_live(model, open_state(model, resolve(model, prompt, seed=seed)))
        for t in range(frames):
            read(step(model, state, [_window(model, row, t)], layout=layout, split_head=True).words)
        states.append(state)
    states[1].flags.quiet = mx.array([True])
    states[2].flags.force_text = mx.array([7], dtype=mx.int32)
    states[2].flags.force_function = mx.array([9], dtype=mx.int32)
    for token, state in enumerate(states):
        _hear(model, state, token)
    return states, layout


def _hear(model, state, token):
    """The RNNT's prediction state after ``token`` too (as if the frames had emitted it)."""
    rnnt = model.rnnt_frames
    out, (h, c) = rnnt.decoder(mx.array([[token]]), (state.rnnt.h, state.rnnt.c))
    state.rnnt.h, state.rnnt.c = h, c
    state.rnnt.pred = rnnt.joint.project_prediction(out[:, -1])


def _run(model, state, rows, t0, n, layout):
    """``n`` frames of ``state`` whose rows are conversations ``rows``, from frame ``t0``."""
    out = []
    for t in range(t0, t0 + n):
        windows = [_window(model, r, t) for r in rows]
        out.append(read(step(model, state, windows, layout=layout, split_head=True).words))
    return out


@pytest.fixture(scope="module")
def solo(tiny):
    """Each conversation's frames 2..5 run alone, and its state after them: what every other
    order must give."""
    states, layout = _fresh(tiny)
    return [np.concatenate(_run(tiny, s, [r], 2, 4, layout)) for r, s in enumerate(states)], states


@pytest.fixture(scope="module")
def alone(solo):
    return solo[0]


def _arrays(cache):
    return [x for _, x in tree_flatten(cache.state) if isinstance(x, mx.array)]


def _same_caches(mine, theirs):
    """The same arrays in every cache of two states of one row."""
    assert len(mine.caches()) == len(theirs.caches())
    for a, b in zip(mine.caches(), theirs.caches()):
        x, y = _arrays(a), _arrays(b)
        assert len(x) == len(y) > 0, type(b).__name__
        for u, v in zip(x, y):
            assert u.shape == v.shape and mx.array_equal(u, v).item(), type(b).__name__


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
        _same_caches(batch.extract(i), s)
    assert batch.meta_state == (
        tuple(p for s in states for p in s.position), tuple(f for s in states for f in s.frames)
    )


# -- each kind of cache, through its own methods ----------------------------------------------

#: kind -> (the frame state's field, which of its caches, the classes they are / hold)
KINDS = {
    "llm attention": ("llm", lambda c: isinstance(c, RowCaches), (KVCache,)),
    "llm mamba": ("llm", lambda c: isinstance(c, ArraysCache), (ArraysCache,)),
    "tts backbone": ("tts", None, (KVCache, RotatingKVCache)),
    "ids": ("last", None, (ArraysCache,)),
    "flags": ("flags", None, (ArraysCache,)),
    "noise": ("noise", None, (RowNoise,)),
    "encoder": ("encoder", None, (EncoderCache,)),
    "rnnt": ("rnnt", None, (ArraysCache,)),
    "codec": ("codec", None, (CodecDecodeCache,)),
}


def _split_and_join(c):
    """Rows 0, 1, 2 of ``c`` apart and together again, by the cache's own methods only."""
    parts = [c.extract(i) for i in (2, 0, 1)]
    joined = type(c).merge(parts)  # rows 2, 0, 1
    joined.filter([1, 2])  # rows 0, 1
    joined.extend(parts[0])  # rows 0, 1, 2
    return joined


def _of_kind(state, kind):
    """``(index or None, cache)`` of each cache of ``kind`` in ``state``."""
    name, pick, classes = KINDS[kind]
    value = getattr(state, name)
    found = [(None, value)] if not isinstance(value, list) else [
        (j, c) for j, c in enumerate(value) if pick is None or pick(c)
    ]
    assert found
    for _, c in found:  # the kind is the one named: the class, or the class of its rows
        assert isinstance(c.rows[0] if isinstance(c, RowCaches) else c, classes), kind
    return found


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_of_cache_split_and_joined_by_its_own_methods(tiny, solo, kind):
    """One kind of cache (every one of that kind in the state) split into rows by ``extract``,
    put together by ``merge`` in another order, then ``filter`` and ``extend`` back into the
    first order: the batch's next frames are each conversation's alone, bit for bit, and so
    is every row's state after them (the RNNT's shows in the frames only once it emits)."""
    alone, after = solo
    states, layout = _fresh(tiny)
    batch = FrameState.merge(states)
    name = KINDS[kind][0]
    for j, c in _of_kind(batch, kind):
        if j is None:
            setattr(batch, name, _split_and_join(c))
        else:
            getattr(batch, name)[j] = _split_and_join(c)
    out = _run(tiny, batch, [0, 1, 2], 2, 4, layout)
    for i in range(3):
        assert np.array_equal(_rows(out, i), alone[i]), (kind, i)
        _same_caches(batch.extract(i), after[i])


def test_every_kind_of_cache_has_the_protocol(tiny):
    """``state``, ``filter``, ``extend``, ``extract``, ``merge`` on each cache of the tree, and
    ``meta_state`` on ours (mlx-lm 0.32's own caches carry everything in ``state``)."""
    states, _ = _fresh(tiny)
    batch = FrameState.merge(states)
    named = {LastIds, Flags, RNNTState}  # ArraysCaches with named slots
    kinds = {RowCaches, ArraysCache, RowNoise, CodecDecodeCache} | named
    assert {type(c) for c in batch.caches()} == kinds
    for c in batch.caches() + batch.encoder.rows:
        for method in ("filter", "extend", "extract", "merge"):
            assert callable(getattr(c, method)), (type(c).__name__, method)
        assert tree_flatten(c.state)
        if not isinstance(c, ArraysCache):
            c.meta_state = c.meta_state  # a snapshot's non-array part restores
    assert batch.noise.meta_state == ["KeyNoise"] * 3
    assert batch.noise.state[1] is states[1].noise.sources[0].key
    assert batch.codec.meta_state == "2"
    assert batch.encoder.meta_state == [e.meta_state for s in states for e in s.encoder.rows]


def test_encoder_cache_rows_of_one_offset(tiny):
    """The encoder's context of several streams at one offset as one cache: streams run alone
    until just before their contexts are full, merged, split and joined again, then run
    together past that point give each stream's frames alone, bit for bit."""
    encoder = tiny.stt_model.perception.encoder
    left, n = encoder.left_context, 3
    x = mx.random.normal((n, left + 3, encoder.cfg.d_model), key=mx.random.key(11))
    alone, caches = [], []
    for b in range(n):
        cache, outs = encoder.make_cache(), []
        for t in range(left + 3):
            y, cache = encoder.step(x[b : b + 1, t : t + 1], cache)
            outs.append(y)
            if t == left - 2:
                caches.append(cache)
        alone.append(mx.concatenate(outs[left - 1 :], axis=1))
    batch = _split_and_join(EncoderCache.merge(caches))
    assert batch.batch_size == n and batch.offset == left - 1
    outs = []
    for t in range(left - 1, left + 3):
        y, batch = encoder.step(x[:, t : t + 1], batch)
        outs.append(y)
    together = mx.concatenate(outs, axis=1)
    for b in range(n):
        assert mx.array_equal(together[b : b + 1], alone[b]).item(), b
    with pytest.raises(ValueError, match="offsets"):
        EncoderCache.merge([caches[0], encoder.make_cache()])

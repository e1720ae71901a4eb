"""The codec's compiled one-frame ``decode_step`` gives the general path's bits: waves, caches
and the flush, after weight changes, from another thread and with bf16 weights."""

import copy
import threading

import mlx.core as mx
import numpy as np
import pytest
from fastpath_utils import set_fastpath
from mlx.utils import tree_map

from mlx_voicechat import load
from mlx_voicechat.derived import reset_derived
from mlx_voicechat.nemotron_voicechat.nets.codec import AudioCodec
from mlx_voicechat.threads import note_mlx_thread


@pytest.fixture
def codec(tiny_checkpoints):
    """A fresh tiny random codec per test (some tests change its weights)."""
    return load(tiny_checkpoints["mlx-community"]).tts_model.audio_codec


@pytest.fixture
def fast_calls(monkeypatch):
    """Counts the decode_step calls that took the fast step."""
    count = [0]
    orig = AudioCodec._fast_step

    def counting(self, codes, cache):
        count[0] += 1
        return orig(self, codes, cache)

    monkeypatch.setattr(AudioCodec, "_fast_step", counting)
    return count


def _codes(codec, frames, seed=0):
    cfg = codec.config
    rng = np.random.default_rng(seed)
    return mx.array(rng.integers(0, cfg.codebook_size, (1, frames, cfg.num_quantizers)), mx.int32)


def _state(wave, cache):
    return [wave, cache.ola_tail, cache.envelope_tail, *cache.conv_tails]


def _copy(cache):
    out = copy.copy(cache)
    out.conv_tails = list(cache.conv_tails)
    return out


def _step(codec, codes, cache, fast, monkeypatch):
    set_fastpath(monkeypatch, "codec.step", fast)
    wave, cache = codec.decode_step(codes, cache)
    mx.eval(_state(wave, cache))
    return wave


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(np.array(x.astype(mx.float32)), np.array(y.astype(mx.float32)))


def _stream(codec, codes, chunks, fast, monkeypatch):
    """Each step's (wave, caches), the final cache and the flush."""
    cache, states, t = codec.make_decode_cache(), [], 0
    for n in chunks:
        wave = _step(codec, codes[:, t : t + n], cache, fast, monkeypatch)
        states.append(_state(wave, cache))
        t += n
    flush = codec.decode_flush(cache)
    mx.eval(flush)  # here: a worker thread's stream is gone once it ends
    return states, cache, flush


def test_one_frame_steps_match_the_general_path(codec, fast_calls, monkeypatch):
    # One frame at a time, with a 3-frame chunk (general path) between them.
    chunks = [1] * 20 + [3] + [1] * 15
    codes = _codes(codec, sum(chunks))
    fast, fast_cache, fast_flush = _stream(codec, codes, chunks, True, monkeypatch)
    assert fast_calls[0] == len(chunks) - 2  # all but the first frame and the chunk
    ref, ref_cache, ref_flush = _stream(codec, codes, chunks, False, monkeypatch)
    assert fast_calls[0] == len(chunks) - 2
    for a, b in zip(fast, ref):
        _assert_same(a, b)
    _assert_same([fast_flush], [ref_flush])
    assert fast_cache.frames == ref_cache.frames == sum(chunks)
    # and the stream is still the offline decode, delayed
    d = codec.stream_delay
    stream = mx.concatenate([s[0] for s in fast] + [fast_flush], axis=1)[:, d:]
    np.testing.assert_allclose(np.array(stream), np.array(codec.decode(codes)), atol=1e-5)


def test_rows_take_the_fast_step_and_first_frames_the_general_path(codec, fast_calls, monkeypatch):
    """A batch of streams, one frame per row, takes the fast step; each row is what its stream
    gives alone on the general path, bit for bit. First frames and several frames per call
    take the general path."""
    a, b = _codes(codec, 4, seed=2), _codes(codec, 4, seed=3)
    both = mx.concatenate([a, b])
    cache = codec.make_decode_cache()
    _step(codec, both[:, :2], cache, True, monkeypatch)
    assert fast_calls[0] == 0
    waves = [_step(codec, both[:, t : t + 1], cache, True, monkeypatch) for t in (2, 3)]
    assert fast_calls[0] == 2
    for row, codes in enumerate((a, b)):
        alone = codec.make_decode_cache()
        _step(codec, codes[:, :2], alone, False, monkeypatch)
        for t, wave in zip((2, 3), waves):
            _assert_same([wave[row : row + 1]], [_step(codec, codes[:, t : t + 1], alone, False, monkeypatch)])
    codec.decode(a[:, :1])
    assert fast_calls[0] == 2


def test_fast_step_follows_weights_changed_after_first_use(codec, fast_calls, monkeypatch):
    codes = _codes(codec, 6, seed=1)
    cache = codec.make_decode_cache()
    for t in range(5):
        _step(codec, codes[:, t : t + 1], cache, True, monkeypatch)
    before = _copy(cache)
    old = _state(_step(codec, codes[:, 5:], before, True, monkeypatch), before)
    codec.decoder.update(tree_map(lambda a: 0.5 * a, codec.decoder.parameters()))
    codec.prvq.mus_list[3] = -codec.prvq.mus_list[3]
    reset_derived(codec)
    after, ref = _copy(cache), _copy(cache)
    new = _state(_step(codec, codes[:, 5:], after, True, monkeypatch), after)
    want = _state(_step(codec, codes[:, 5:], ref, False, monkeypatch), ref)
    assert fast_calls[0] == 6
    assert not np.array_equal(np.array(old[0]), np.array(new[0]))
    _assert_same(new, want)


def test_fast_step_from_another_thread(codec, fast_calls, monkeypatch):
    chunks = [1] * 8
    codes = _codes(codec, len(chunks), seed=2)
    ref = _stream(codec, codes, chunks, False, monkeypatch)
    box, errors = [], []

    def work():
        note_mlx_thread()
        try:
            box.append(_stream(codec, codes, chunks, True, monkeypatch))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    _stream(codec, codes, chunks, True, monkeypatch)  # compiled in this thread first
    t = threading.Thread(target=work)
    t.start()
    t.join(timeout=120)
    assert not errors, errors
    assert fast_calls[0] == 2 * (len(chunks) - 1)
    for a, b in zip(box[0][0], ref[0]):
        _assert_same(a, b)
    _assert_same([box[0][2]], [ref[2]])


def test_bf16_weights_match_their_general_path(codec, fast_calls, monkeypatch):
    codec.set_dtype(mx.bfloat16)
    chunks = [1] * 12
    codes = _codes(codec, len(chunks), seed=3)
    fast = _stream(codec, codes, chunks, True, monkeypatch)
    ref = _stream(codec, codes, chunks, False, monkeypatch)
    assert fast_calls[0] == len(chunks) - 1
    assert fast[1].conv_tails[0].dtype == mx.bfloat16
    for a, b in zip(fast[0], ref[0]):
        _assert_same(a, b)
    _assert_same([fast[2]], [ref[2]])

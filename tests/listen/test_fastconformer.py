"""A stream's compiled encoder frame (``FastConformer._frame``, a frame on a full left context)
gives the op-by-op bits: outputs and every cache array, after weights change, from another
thread, and the offline pass's."""

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest
from fastpath_utils import set_fastpath
from mlx.utils import tree_flatten, tree_unflatten
from tiny_configs import TINY_ENCODER

from mlx_voicechat.derived import reset_derived
from mlx_voicechat.fastpaths import layout
from mlx_voicechat.listen.fastconformer import PRE_ENCODE_CONTEXT, FastConformer
from mlx_voicechat.threads import note_mlx_thread

TINY = dataclasses.replace(TINY_ENCODER, n_layers=3)
FRAMES = 85


def _randomize(enc, seed):
    rng = np.random.default_rng(seed)
    flat = [
        (k, mx.array(0.3 * rng.standard_normal(v.shape), dtype=v.dtype))
        for k, v in tree_flatten(enc.parameters())
    ]
    enc.update(tree_unflatten(flat))
    mx.eval(enc.parameters())
    reset_derived(enc)


def _encoder(variant="float32", right=0, seed=7):
    cfg = dataclasses.replace(TINY, att_context_size=(TINY.att_context_size[0], right))
    enc = FastConformer(cfg)
    _randomize(enc, seed)
    if variant == "cpu-layout":  # column-major Linear weights, as a loaded model has them
        assert layout.use_cpu_layout(enc) > 0
    elif variant == "bfloat16":
        enc.set_dtype(mx.bfloat16)
    return enc


def _mel(n_frames=FRAMES, seed=1):
    return mx.random.normal((1, 8 * n_frames + 1, TINY.feat_in), key=mx.random.key(seed))


def _stream(enc, mel, compiled, monkeypatch=None):
    """Encoder frames one at a time, as ``StreamingPerception`` runs them: each frame's
    subsampling on its mel context, then one step. Returns every frame's output and cache."""
    if monkeypatch is not None:
        set_fastpath(monkeypatch, "encoder.frame", compiled)
    mel = mel.astype(enc.pre_encode.out.weight.dtype)
    factor = 2**enc.pre_encode.sampling_num
    cache, out = enc.make_cache(), []
    for k in range((mel.shape[1] - 1) // factor + 1):
        s = max(k - PRE_ENCODE_CONTEXT, 0)
        x, _ = enc.pre_encode(mel[:, s * factor : k * factor + 1])
        y, cache = enc.step(x[:, k - s :], cache)
        mx.eval(y, *cache.arrays())
        out.append([np.array(a.astype(mx.float32)) for a in [y, *cache.arrays()]])
    return out


def _assert_same(a, b):
    assert len(a) == len(b)
    for t, (fa, fb) in enumerate(zip(a, b)):
        assert len(fa) == len(fb), t
        for x, y in zip(fa, fb):
            assert x.shape == y.shape and np.array_equal(x, y), t


def _count_frames(monkeypatch):
    calls = []
    orig = FastConformer._frame
    monkeypatch.setattr(FastConformer, "_frame", lambda *a: calls.append(1) or orig(*a))
    return calls


@pytest.mark.parametrize(
    "variant,right",
    [("float32", 0), ("cpu-layout", 0), ("bfloat16", 0), ("float32", 1)],
)
def test_compiled_stream_equals_op_by_op(variant, right, monkeypatch):
    """Every frame once the left context is full runs compiled (with ``right`` > 0 in two
    phases of the chunk); outputs and caches are the op-by-op bits."""
    enc, mel = _encoder(variant, right), _mel()
    calls = _count_frames(monkeypatch)
    fast = _stream(enc, mel, True, monkeypatch)
    assert len(calls) == FRAMES + 1 - enc.left_context
    calls.clear()
    plain = _stream(enc, mel, False, monkeypatch)
    assert not calls
    _assert_same(fast, plain)


def test_compiled_stream_equals_offline_pass():
    """With ``PRE_ENCODE_CONTEXT`` frames of subsampling context too."""
    enc, mel = _encoder(), _mel()
    frames = _stream(enc, mel, True)
    offline, _ = enc(mel, chunk_size=10**6)
    assert np.array_equal(np.concatenate([f[0] for f in frames], axis=1), np.array(offline))


def test_compiled_step_follows_weights_changed_after_first_use(monkeypatch):
    """The compiled function reads the layers' current parameters: new weights (and a new
    position projection) after a first stream change the result, which stays the op-by-op one."""
    enc, mel = _encoder(), _mel(40)
    before = _stream(enc, mel, True, monkeypatch)
    _randomize(enc, seed=11)
    after, plain = _stream(enc, mel, True, monkeypatch), _stream(enc, mel, False, monkeypatch)
    assert not np.array_equal(before[-1][0], after[-1][0])
    _assert_same(after, plain)


def test_compiled_stream_on_another_thread(monkeypatch):
    """MLX keeps compiled functions and this module keeps position projections per thread: a
    stream on a second thread, after one on the main thread, gives the same bits."""
    enc, mel = _encoder(), _mel(40)
    main = _stream(enc, mel, True, monkeypatch)

    def run():
        note_mlx_thread()
        return _stream(enc, mel, True)

    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(run).result()
    _assert_same(other, main)
    _assert_same(_stream(enc, mel, True), main)  # and the main thread's state is intact

"""Live transcription: frame-exact to offline for any chunking, one read per frame, bounded."""

import numpy as np
import pytest
from fastpath_utils import set_fastpath

from mlx_voicechat import load
from mlx_voicechat.derived import reset_derived
from mlx_voicechat.nemotron_asr.factory import make_recognizer_checkpoint
from mlx_voicechat.nemotron_asr.session import TranscriptionError, open_transcription


@pytest.fixture(scope="module")
def asr(tmp_path_factory):
    root = tmp_path_factory.mktemp("asr-live")
    return load(make_recognizer_checkpoint(root / "m", "tiny", seed=3))


@pytest.fixture(scope="module")
def asr_scaled(tmp_path_factory):
    """The same tiny recognizer with ``xscaling`` (Transformers' ``scale_input``) on."""
    import json

    path = make_recognizer_checkpoint(tmp_path_factory.mktemp("asr-scaled") / "m", "tiny", seed=3)
    config = json.loads((path / "config.json").read_text())
    config["encoder"]["xscaling"] = True
    (path / "config.json").write_text(json.dumps(config))
    return load(path)


def noise(n, seed=0):
    return (0.1 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def run(session, x, chunks):
    events, i = [], 0
    for c in chunks:
        events += session.feed(x[i : i + c])
        i += c
    assert i >= len(x)
    return events + session.finish()


def chunking(n, size, seed=0):
    if size == "random":
        rng = np.random.default_rng(seed)
        sizes = []
        while sum(sizes) < n:
            sizes.append(int(rng.integers(0, 3000)))
        return sizes
    return [size] * (-(-n // size))


def check_exact(events, offline):
    tokens = [t for e in events for t in e.tokens]
    frames = [e.index for e in events for _ in e.tokens]
    assert tokens == offline.tokens and frames == offline.frames
    assert "".join(e.text for e in events) == offline.text
    assert [e.index for e in events] == list(range(offline.encoder_frames))
    assert events[-1].final and events[-1].language == offline.language


@pytest.mark.parametrize("size", [1, 160, 1280, "random"])
@pytest.mark.parametrize("edge", ["nemo", "mlx-audio"])
def test_frame_exact_to_offline(asr, size, edge, sync_count):
    n = 24321 if size == 1 else 61555
    x = noise(n, 4)
    for language in (None, "en-US") if size != 1 else (None,):
        offline = asr.transcribe(x, language=language, edge=edge)
        session = asr.session(language=language, edge=edge)
        sync_count[0] = 0
        events, i = [], 0
        for c in chunking(n, size, 7):
            events += session.feed(x[i : i + c])
            i += c
            # At most one host read per 80 ms frame of audio fed so far.
            assert sync_count[0] <= session.received // 1280
        events += session.finish()
        assert sync_count[0] == session.reads <= n // 1280 + 2
        check_exact(events, offline)
        assert session.tokens == offline.tokens and session.steps == offline.steps


def test_latency_in_samples(asr):
    """Frames come out with the feed that completes their chunk's last mel window."""
    s = asr.session()
    assert s.samples_needed(0) == s.samples_needed(13) == 1280 * 13 + 199
    assert s.samples_needed(14) == 1280 * 27 + 199
    assert s.latency_samples == 1280 * 12 + 199  # the first frame of a chunk, after its slot
    x = noise(1280 * 30, 2)
    need = s.samples_needed(0)
    assert s.feed(x[: need - 1]) == [] and s.frames == 0
    s.feed(x[need - 1 : need])
    assert s.frames == 14  # the whole first chunk, at once


def test_state_stays_bounded(asr):
    """Cache-aware: a long stream holds a window of samples, mel and encoder context only."""
    s = asr.session()
    x = noise(16000 * 30, 9)
    for i in range(0, len(x), 4000):
        s.feed(x[i : i + 4000])
    assert s.frames == 364 and len(s._mel._y) <= 14 * 1280 + 4000 + 512
    assert s._mel._mel.shape[0] <= 14 * 8 + 3 * 8
    assert all(c.keys.shape[2] <= 56 for c in s._cache.layers)
    assert s._decoder._frames.shape[1] <= 2 * 14


def test_bad_calls(asr):
    s = asr.session()
    with pytest.raises(TranscriptionError, match="mono samples"):
        s.feed(np.zeros((2, 100)))
    with pytest.raises(TranscriptionError, match="finite"):
        s.feed(np.array([np.nan], np.float32))
    s.finish()
    with pytest.raises(TranscriptionError, match="finished"):
        s.feed(noise(10))
    s.reset()
    assert s.feed(noise(1000)) == []


def test_resampled_input(asr):
    x = noise(48000, 3)
    a = asr.session()
    ev = run(a, x, [4800] * 10)
    b = asr.session()
    import soxr

    x24 = soxr.resample(x, 16000, 24000)
    ev24 = []
    for i in range(0, len(x24), 7200):
        ev24 += b.feed(x24[i : i + 7200], sample_rate=24000)
    ev24 += b.finish()
    assert abs(b.received - len(x)) < 64 and len(ev24) >= len(ev) - 1


def test_voicechat_checkpoint_transcribes_live(tiny):
    """A VoiceChat checkpoint's transcription session is its RNNT head, frame-exact too."""
    x = noise(30000, 1)
    offline = tiny.transcribe(x)
    s = open_transcription(tiny)
    events = run(s, x, [1000] * 30)
    assert [t for e in events for t in e.tokens] == offline.tokens
    assert [e.index for e in events for _ in e.tokens] == offline.frames
    assert "".join(e.text for e in events) == offline.text and events[-1].final
    with pytest.raises(TranscriptionError, match="no language prompt"):
        open_transcription(tiny, language="en-US")


@pytest.mark.parametrize("scaled", [False, True])
def test_compiled_chunk_step_equals_op_by_op(asr, asr_scaled, monkeypatch, scaled):
    """A stream's whole chunks on a full left context run as one compiled call (subsampling,
    its ``xscaling``, layers, prompt and the joint's projection): the same values as op by op,
    the cache too, and the same session events."""
    import mlx.core as mx

    asr = asr_scaled if scaled else asr
    assert asr.encoder.cfg.xscaling == scaled
    mel = mx.array(noise(8 * 14 * 7 * 128, 5).reshape(1, -1, 128))
    prompt = mx.array([asr.resolve_prompt(None)[0]], dtype=mx.int32)
    outs, caches = {}, {}
    for compiled in (True, False):
        set_fastpath(monkeypatch, "asr.chunk", compiled)
        cache, ys, steady = asr.encoder.make_cache(), [], 0
        for k0 in range(0, 14 * 7, 14):  # as the session cuts them: 2 frames of context
            s = max(k0 - 2, 0)
            steady += asr.encoder.steady(14, cache)
            y, cache = asr.encode_chunk(
                mel[:, 8 * s : 8 * (k0 + 13) + 1], 8 * s, slice(k0 - s, k0 + 14 - s), cache, prompt
            )
            ys.append(y)
        outs[compiled], caches[compiled] = mx.concatenate(ys, axis=1), cache.arrays()
        assert steady == (3 if compiled else 0)  # from the fifth chunk on (56 frames of context)
    set_fastpath(monkeypatch, "asr.chunk", True)
    for a, b in zip([outs[True], *caches[True]], [outs[False], *caches[False]]):
        assert np.array_equal(np.array(a), np.array(b))  # bit for bit
    audio = noise(16000 * 6, 3)
    events = {}
    for compiled in (True, False):
        set_fastpath(monkeypatch, "asr.chunk", compiled)
        events[compiled] = [(e.index, e.tokens) for e in run(asr.session(), audio, [1280] * 75)]
    set_fastpath(monkeypatch, "asr.chunk", True)
    assert events[True] == events[False]


@pytest.mark.parametrize("n", [100, 160, 1281])
@pytest.mark.parametrize("edge", ["nemo", "mlx-audio"])
def test_short_clips(asr, n, edge):
    """Under one encoder chunk (and under one mel hop) the session still equals offline."""
    x = noise(n, n)
    offline = asr.transcribe(x, edge=edge)
    s = asr.session(edge=edge)
    events = s.feed(x) + s.finish()
    assert [e.index for e in events] == list(range(offline.encoder_frames))
    assert [t for e in events for t in e.tokens] == offline.tokens


def test_live_rounds_stop_at_the_last_token(asr, monkeypatch):
    """With reads to spare, a live round is one call over the frames left, which ends at a
    token or at the last frame computed: no call runs past a chunk's last token. On a joint
    that never emits, a chunk takes one call; on the random one, a call per token and chunk
    at most, and the tokens are offline's."""
    import mlx.core as mx

    from mlx_voicechat.listen import greedy as asr_greedy

    calls = [0]

    def counted(fn):
        def call(*args):
            calls[0] += 1
            return fn(*args)

        return call

    step = asr_greedy.build_step

    def live(x):
        calls[0] = 0
        s, chunks = asr.session(), 0
        for i in range(0, len(x), 1280):
            frames = s.frames
            s.feed(x[i : i + 1280])
            chunks += s.frames > frames
        return s, chunks

    monkeypatch.setattr(asr_greedy, "build_step", lambda net: counted(step(net)))
    reset_derived(asr)  # the shared compiled step, rebuilt counting
    last = asr.joint.joint_net[-1]
    old = {"weight": last.weight, "bias": last.bias}
    n = len(asr.joint.joint_net)
    try:
        bias = mx.zeros_like(last.bias).at[asr.config.blank_id].add(5.0)
        never = {"weight": 0 * last.weight, "bias": bias}
        asr.joint.update({"joint_net": [{}] * (n - 1) + [never]})
        reset_derived(asr)
        s, chunks = live(noise(16000 * 8, 6))
        assert s.tokens == [] and chunks == 7 and calls[0] == s.reads == chunks
        asr.joint.update({"joint_net": [{}] * (n - 1) + [old]})
        reset_derived(asr)
        x = noise(16000 * 8, 7)  # its tokens come where the reads allow one call a round
        s, chunks = live(x)
        assert len(s.tokens) >= 3 and calls[0] == s.reads <= len(s.tokens) + chunks
        s.finish()
        assert s.tokens == asr.transcribe(x).tokens
    finally:
        asr.joint.update({"joint_net": [{}] * (n - 1) + [old]})
        reset_derived(asr)

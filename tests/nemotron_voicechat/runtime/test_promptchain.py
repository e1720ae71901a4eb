"""A new prompt's TTS state comes from the seed's prompt chain
(``nemotron_voicechat.runtime.promptchain``), bit
for bit the state of stepping the TTS over the prompt's positions: every cache, the previous
code, the noise key and the frames that follow (text, function, transcript ids and audio), for
prompts shorter than, as long as, and several times the TTS's sliding window."""

import gc

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlx_voicechat.nemotron_voicechat.nets.tts import EarTTS
from mlx_voicechat.nemotron_voicechat.runtime import framestate
from mlx_voicechat.nemotron_voicechat.runtime.promptchain import PromptChain, _layout, _layout_mlx
from mlx_voicechat.noise import KeyNoise

FRAMES = 40


def _wave(frames, seed=1):
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal((frames - 1) * 1280 + 199)).astype(np.float32)


def _leaves(state):
    """Every cache's state of a frame state (arrays and bookkeeping), in a fixed order."""
    return [x for _, x in tree_flatten([c.state for c in state.caches()] + [state.prefix])]


def assert_same_state(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb)
    for i, (x, y) in enumerate(zip(la, lb)):
        if isinstance(x, mx.array):
            assert isinstance(y, mx.array) and x.shape == y.shape and x.dtype == y.dtype, i
            assert mx.array_equal(x, y).item(), f"leaf {i} differs"
        else:
            assert x == y, f"leaf {i}: {x!r} != {y!r}"
    assert a.position == b.position and a.frames == b.frames


def _prompt(n, salt):
    return [5 + (7 * i + salt) % 50 for i in range(n)]


def _frames(session):
    events = session.feed(_wave(FRAMES))
    assert len(events) == FRAMES
    return events


def _same_frames(ea, eb, sa, sb):
    assert [e.text_id for e in ea] == [e.text_id for e in eb]
    assert [e.function_id for e in ea] == [e.function_id for e in eb]
    assert sa.transcript_tokens == sb.transcript_tokens
    for x, y in zip(ea, eb):
        assert np.array_equal(x.codes, y.codes)
        assert np.array_equal(x.audio, y.audio)


def _lengths(model):
    w = model.config.tts_config.sliding_window
    return [1, w - 1, w, w + 1, 3 * w + 5]


@pytest.mark.parametrize("which", range(5))
def test_chain_state_is_the_stepped_state_and_so_are_40_frames(tiny, which):
    n = _lengths(tiny)[which]
    prompt = _prompt(n, salt=which)
    chained = tiny.session(prompt=prompt, seed=2)
    stepped = tiny.session(prompt=prompt, noise=KeyNoise(2))  # a caller's source: the steps
    assert_same_state(chained.state, stepped.state)
    assert chained.state.noise.sources[0].key.shape == (2,)
    _same_frames(_frames(chained), _frames(stepped), chained, stepped)


def test_a_new_prompt_runs_no_tts_step_once_the_chain_is_long_enough(tiny, monkeypatch):
    tiny.session(prompt=_prompt(90, salt=11), seed=5)  # the chain grows to 89 steps (or more)
    steps = []
    real = EarTTS.step
    monkeypatch.setattr(EarTTS, "step", lambda *a, **k: steps.append(1) or real(*a, **k))
    s = tiny.session(prompt=_prompt(60, salt=12), seed=5)  # other words, shorter
    assert steps == []
    stepped = tiny.session(prompt=_prompt(60, salt=12), noise=KeyNoise(5))
    assert len(steps) == 59  # a caller's own source steps every spoken prompt position
    assert_same_state(s.state, stepped.state)


def test_two_prompts_of_one_length_share_the_tts_state_and_differ_in_llm_rows(tiny):
    a = tiny.session(prompt=_prompt(30, salt=1), seed=7).state
    b = tiny.session(prompt=_prompt(30, salt=2), seed=7).state
    for x, y in zip(_leaves(a)[:-1], _leaves(b)[:-1]):
        assert not isinstance(x, mx.array) or mx.array_equal(x, y).item()
    assert not mx.array_equal(a.prefix, b.prefix).item()


def test_past_its_memory_bound_the_chain_steps_the_rest(tiny):
    """A chain bounded to a few positions starts a longer prompt from its last one and steps
    the rest: still the stepped state."""
    speech, cfg = tiny.tts_model, tiny.config
    chain = PromptChain(
        speech.tts_model, speech.audio_prompt_latents[cfg.speaker], framestate.warmup_codes(tiny),
        speech.codec_silence_tokens, cfg.pad_token_id, 9, max_bytes=1,
    )
    per = chain.bytes_per_position()
    chain.max_bytes = (chain.warmup_positions + 20) * per
    assert chain.max_steps == 20
    previous, cache, noise = chain.state(37)
    assert chain.steps == 20 and chain.nbytes <= chain.max_bytes + 21 * (8 + previous.nbytes)
    tts = speech.tts_model
    ref_noise = KeyNoise(9)
    ref_prev, ref_cache = tts.warmup(
        speech.audio_prompt_latents[cfg.speaker], framestate.warmup_codes(tiny), tts.make_cache()
    )
    for _ in range(37):
        ref_prev, ref_cache = tts.step(
            cfg.pad_token_id, ref_prev, ref_cache, ref_noise, speech.codec_silence_tokens
        )
    assert mx.array_equal(previous, ref_prev).item()
    assert mx.array_equal(noise.key, ref_noise.key).item()
    for c, r in zip(cache, ref_cache):
        for (_, x), (_, y) in zip(tree_flatten(c.state), tree_flatten(r.state)):
            if isinstance(x, mx.array):
                assert x.shape == y.shape and mx.array_equal(x, y).item()
            else:
                assert x == y


def test_a_chain_leaves_no_cache_for_the_cyclic_collector(tiny):
    """Building and growing a chain records its throw-away caches' updates; once done, those
    caches (and what they recorded) are freed by reference counting, not left in a reference
    cycle for Python's cyclic collector (which would hold megabytes per chain until it ran)."""
    speech, cfg = tiny.tts_model, tiny.config
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        chain = PromptChain(
            speech.tts_model, speech.audio_prompt_latents[cfg.speaker],
            framestate.warmup_codes(tiny), speech.codec_silence_tokens, cfg.pad_token_id, 9,
        )
        chain.state(12)  # grows the chain
        del chain
        gc.collect()
        stranded = [o for o in gc.garbage if isinstance(o, (KVCache, RotatingKVCache))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert stranded == []


@pytest.mark.parametrize("template", [KVCache(), RotatingKVCache(16), RotatingKVCache(300)])
def test_the_layout_rules_are_mlx_lms_caches(template):
    """The chain rebuilds a cache's buffer by mlx-lm's update rules replayed in Python: the
    same slots and bookkeeping as the cache class run on position numbers."""
    for warm in (1, 5, 40, 300):
        for steps in (0, 1, 15, 16, 17, 53, 299, 300, 301, 600):
            sizes = [warm] + [1] * steps
            fast, slots = _layout(template, sizes)
            ref, ref_slots = _layout_mlx(template, sizes)
            assert slots.tolist() == ref_slots.tolist(), (warm, steps)
            for name in ("offset", "_idx", "keep", "max_size"):
                assert getattr(fast, name, None) == getattr(ref, name, None), (name, warm, steps)

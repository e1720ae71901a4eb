"""Offline generation is a loop over the one frame step (``nemotron_voicechat.runtime.step``); its
two registered fast paths (``fastpaths``: ``offline.encoder``, the whole-input encoder pass, and
``offline.codec``, the one-shot codec decode) against that loop with each part run per frame,
as a session runs it."""

import numpy as np
import pytest
from fastpath_utils import set_fastpath

from mlx_voicechat.audio.mel import MelStream
from mlx_voicechat.nemotron_voicechat.runtime import step as frame_step
from mlx_voicechat.nemotron_voicechat.runtime.framestate import open_live, open_state
from mlx_voicechat.nemotron_voicechat.runtime.request import resolve


def _wave(seconds, seed=0):
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(int(seconds * 16000))).astype(np.float32)


def _generate(model, wave, **kwargs):
    return model.generate(wave, prompt=[1, 45, 77, 2], extra_decoding_seconds=0.3, seed=4, **kwargs)


@pytest.fixture(scope="module")
def fast(tiny):
    return _generate(tiny, _wave(1.0))


def _same_texts_and_codes(a, b):
    assert a.frames == b.frames > 0
    assert a.text_ids == b.text_ids and a.function_ids == b.function_ids
    assert np.array_equal(a.codes, b.codes)
    assert a.user_transcript == b.user_transcript
    assert a.text == b.text and a.function_text == b.function_text


def test_whole_input_encoder_equals_the_step_listening_per_frame(tiny, fast, monkeypatch):
    set_fastpath(monkeypatch, "offline.encoder", False)
    per_frame = _generate(tiny, _wave(1.0))
    _same_texts_and_codes(fast, per_frame)
    assert np.array_equal(fast.audio, per_frame.audio)


def test_one_shot_codec_equals_the_step_codec_per_frame(tiny, fast, monkeypatch):
    set_fastpath(monkeypatch, "offline.codec", False)
    per_frame = _generate(tiny, _wave(1.0))
    _same_texts_and_codes(fast, per_frame)
    assert per_frame.audio.shape == fast.audio.shape
    # The codec's streaming form sums its overlap-add in other pieces (as tests/test_session.py
    # allows between a session and generate).
    assert np.max(np.abs(per_frame.audio - fast.audio)) <= 1e-6


def test_max_frames_per_frame_listening_keeps_the_first_frames(tiny, fast, monkeypatch):
    set_fastpath(monkeypatch, "offline.encoder", False)
    some = _generate(tiny, _wave(1.0), max_frames=5)
    assert some.frames == 5
    assert some.text_ids == fast.text_ids[:5] and np.array_equal(some.codes, fast.codes[:5])


def test_one_step_advances_every_cursor_of_a_live_frame(tiny):
    """The timeline position, the frames run, the encoder's offset and the codec's frames move
    together, in the one step."""
    state = open_live(tiny, open_state(tiny, resolve(tiny, prompt=[1, 45, 2], seed=2)))
    mel = MelStream(tiny.stt_model.perception)
    mel.push(_wave(0.5))
    layout = frame_step.ReadLayout(tiny)
    for k in range(1, 4):
        frame_step.read(frame_step.step(tiny, state, [mel.window()], layout=layout).words)
        assert state.position == [3 + k] and state.frames == [k]
        assert state.encoder.rows[0].offset == k and state.codec.frames == k

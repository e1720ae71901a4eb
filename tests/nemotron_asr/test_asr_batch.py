"""Batched transcription: clips of different lengths in one run, each equal to its solo run."""

import mlx.core as mx
import numpy as np
import pytest
from test_asr_session import asr, noise  # noqa: F401  (the live tests' recognizer, its noise)

LENGTHS = [8000, 36960, 65600, 27360, 1603]


@pytest.mark.parametrize("edge", ["nemo", "mlx-audio"])
@pytest.mark.parametrize("language", [None, "fr-FR"])
def test_each_clip_equals_its_solo_run(asr, edge, language):
    clips = [noise(n, i) for i, n in enumerate(LENGTHS)]
    batch = asr.transcribe(clips, language=language, edge=edge)
    assert len(batch) == len(clips) and batch[0].timings.clips == len(clips)
    for clip, got in zip(clips, batch):
        solo = asr.transcribe(clip, language=language, edge=edge)
        assert (got.tokens, got.frames, got.steps) == (solo.tokens, solo.frames, solo.steps)
        assert (got.text, got.language, got.encoder_frames) == (
            solo.text,
            solo.language,
            solo.encoder_frames,
        )
    assert sum(len(r.tokens) for r in batch) > 0


def encode(asr, mel, mel_len):
    T = int(mx.max(asr.encoder.output_lengths(mel_len)).item())
    return asr.encoder.encode(mel, mel_len, T), asr.encoder.output_lengths(mel_len).tolist()


@pytest.mark.parametrize("edge", ["nemo", "mlx-audio"])
def test_padding_does_not_leak(asr, edge):
    """A short clip's encoder frames in a batch are its solo frames, and stay so when its
    padding (mel frames past its length) or the other clip's frames change: neither the
    subsampling convs nor the lookahead attention reach them."""
    short, long = noise(21120, 1), noise(60000, 2)
    n = len(long)
    wave = np.zeros((2, n), np.float32)
    wave[0, : len(short)], wave[1] = short, long
    lengths = mx.array([len(short), n])
    mel, mel_len = asr.frontend(mx.array(wave), lengths, edge)
    solo_mel, solo_len = asr.frontend(mx.array(short)[None], lengths[:1], edge)
    solo, (t_short,) = encode(asr, solo_mel, solo_len)
    base, (t0, t1) = encode(asr, mel, mel_len)
    assert t0 == t_short < t1 and t_short % 14 != 0  # the last chunk is a partial one
    assert np.allclose(np.array(base[0, :t0]), np.array(solo[0]), atol=1e-5)
    # Garbage in the short clip's padding, then in the long clip: nothing of the short changes.
    m0 = int(mel_len[0].item())
    junk = mx.array(np.random.default_rng(3).normal(0, 30, mel.shape).astype(np.float32))
    rows = mx.arange(mel.shape[1])[None, :, None]
    padded = mx.where((rows >= m0) & (mx.arange(2)[:, None, None] == 0), junk, mel)
    other = mx.concatenate([mel[:1], junk[1:]])
    for changed in (padded, other):
        again, _ = encode(asr, changed, mel_len)
        assert mx.array_equal(again[0, :t0], base[0, :t0])

"""audio/mel.py on its own: the stream's mel frames and windows are the offline log-mel's, bit
for bit, however the samples arrive, eager or once per chunk, at either edge."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from mlx_voicechat.audio.mel import LogMel, MelStream, Resampler
from mlx_voicechat.audio.stream import AudioIn
from mlx_voicechat.config import PreprocessorConfig
from mlx_voicechat.errors import SessionError

FACTOR = 8  # three stride-2 subsampling stages


def _net(preemph=0.97):
    rng = np.random.default_rng(0)
    cfg = PreprocessorConfig(preemph=preemph)
    window = mx.array(np.hanning(cfg.win_length).astype(np.float32))
    fb = mx.array(rng.uniform(0, 1, (cfg.n_fft // 2 + 1, cfg.features)).astype(np.float32))

    def lengths(n):  # errata 3, per stage
        for _ in range(3):
            n = (n + 2 + 1 - 3) // 2 + 1
        return n

    encoder = SimpleNamespace(pre_encode=SimpleNamespace(sampling_num=3), output_lengths=lengths)
    return SimpleNamespace(frontend=LogMel(cfg, window, fb), encoder=encoder)


def _chunks(n, seed):
    rng = np.random.default_rng(seed)
    out = []
    while sum(out) < n:
        out.append(int(rng.choice([0, 1, 159, 160, 199, 1280, 3001])))
    return out


@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("edge", ["nemo", "mlx-audio"])
@pytest.mark.parametrize("preemph", [0.97, 0.0])
def test_stream_frames_equal_offline(eager, edge, preemph):
    net = _net(preemph)
    x = (0.1 * np.random.default_rng(1).standard_normal(9001)).astype(np.float32)
    offline, valid = net.frontend(mx.array(x), edge=edge)
    stream, i = MelStream(net, eager), 0
    for c in _chunks(len(x), 2):
        stream.push(x[i : i + c])
        i += c
        if not eager and stream.final > stream.frames + 2:
            stream.compute()
    assert stream.finish(edge) == int(valid[0])
    assert stream.mel_frames == offline.shape[1] == len(x) // 160 + 1
    assert np.array_equal(np.array(stream.arrays()[0]), np.array(offline[0]))


def test_windows_are_the_offline_mel_the_subsampling_reads():
    net = _net()
    x = (0.1 * np.random.default_rng(3).standard_normal(7000)).astype(np.float32)
    offline = np.array(net.frontend(mx.array(x))[0][0])
    stream, got = MelStream(net), []
    for i in range(0, len(x), 700):
        stream.push(x[i : i + 700])
        while stream.ready:
            got.append((stream.frames, *stream.window()))
    assert [k for k, _, _ in got] == list(range(stream.frames_final(len(x))))
    stream.finish()
    while stream.ready:
        got.append((stream.frames, *stream.window()))
    assert len(got) == net.encoder.output_lengths(len(x) // 160)
    for k, mel, j in got:
        s = max(k - 2, 0)
        assert j == k - s and mel.shape[0] == min(k * FACTOR + 1, len(offline)) - s * FACTOR
        assert np.array_equal(np.array(mel), offline[s * FACTOR : k * FACTOR + 1]), k
    assert stream.samples_needed(3) == 3 * 1280 + 199
    with pytest.raises(SessionError, match="ended"):
        stream.push(x[:10])


def test_audio_in_resamples_each_rate_statefully():
    x = (0.1 * np.random.default_rng(4).standard_normal(24000)).astype(np.float32)
    whole = Resampler(24000, 16000)(x, last=True)
    audio = AudioIn(_net(), 16000)
    for i in range(0, len(x), 999):
        audio.push(x[i : i + 999], sample_rate=24000)
    audio.drain_resamplers()
    assert audio.mel.received == len(whole)
    assert np.array_equal(Resampler(16000, 16000)(x), x)
    with pytest.raises(ValueError, match="sample_rate"):
        AudioIn(_net(), 16000, ValueError).push(x, sample_rate=1.5)

"""Audio in (files and arrays, any rate, any channel count, int or float) and PCM16 WAV out."""

import os

import mlx.core as mx
import numpy as np
import pytest
import soundfile as sf

from mlx_voicechat.audio.io import AudioError, load_audio, save_wav

RATE = 16000


def _tone(freq=440.0, seconds=0.5, rate=RATE, amp=0.5):
    t = np.arange(int(seconds * rate)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def _peak_hz(x, rate):
    spec = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return np.argmax(spec) * rate / len(x)


def test_int16_wav_is_scaled(tmp_path):
    pcm = (np.arange(-2000, 2000, dtype=np.int16) * 8).astype(np.int16)
    path = tmp_path / "a.wav"
    sf.write(path, pcm, RATE, subtype="PCM_16")
    out = load_audio(path)
    assert out.dtype == np.float32 and out.ndim == 1
    np.testing.assert_allclose(out, pcm / 32768.0, atol=1e-7)


def test_float_wav_and_flac(tmp_path):
    tone = _tone()
    sf.write(tmp_path / "f.wav", tone, RATE, subtype="FLOAT")
    np.testing.assert_allclose(load_audio(tmp_path / "f.wav"), tone, atol=1e-7)
    sf.write(tmp_path / "f.flac", tone, RATE, subtype="PCM_16")
    np.testing.assert_allclose(load_audio(str(tmp_path / "f.flac")), tone, atol=1e-4)


def test_mp3(tmp_path):
    tone = _tone(seconds=1.0)
    path = tmp_path / "t.mp3"
    sf.write(path, tone, RATE, format="MP3", subtype="MPEG_LAYER_III")
    out = load_audio(path)
    assert abs(len(out) - len(tone)) < 0.1 * RATE
    assert _peak_hz(out, RATE) == pytest.approx(440, abs=5)


def test_stereo_file_is_mixed_and_resampled(tmp_path):
    rate = 48000
    left, right = _tone(440, rate=rate), _tone(1000, rate=rate, amp=0.25)
    path = tmp_path / "s.wav"
    sf.write(path, np.stack([left, right], axis=1), rate, subtype="FLOAT")
    out = load_audio(path)
    assert len(out) == pytest.approx(0.5 * RATE, abs=2)
    direct = load_audio(np.stack([left, right], axis=1), source_rate=rate)
    np.testing.assert_allclose(out, direct, atol=1e-6)
    spec = np.abs(np.fft.rfft(out * np.hanning(len(out))))
    hz = np.fft.rfftfreq(len(out), 1 / RATE)
    assert spec[np.argmin(np.abs(hz - 440))] == pytest.approx(
        2 * spec[np.argmin(np.abs(hz - 1000))], rel=0.1
    )


def test_arrays_int_float_mx_and_channels_first():
    tone = _tone()
    np.testing.assert_allclose(load_audio(tone), tone)
    np.testing.assert_allclose(load_audio(mx.array(tone)), tone)
    np.testing.assert_allclose(load_audio(mx.array(tone).astype(mx.bfloat16)), tone, atol=4e-3)
    np.testing.assert_allclose(load_audio(tone.astype(np.float64)), tone, atol=1e-7)
    np.testing.assert_allclose(load_audio(np.array([-32768, 0, 16384], np.int16)), [-1, 0, 0.5])
    np.testing.assert_allclose(load_audio(np.array([-(2**31), 2**30], np.int32)), [-1, 0.5])
    np.testing.assert_allclose(load_audio(np.array([0, 128, 192], np.uint8)), [-1, 0, 0.5])
    stereo = np.stack([tone, np.zeros_like(tone)])  # [channels, samples]
    np.testing.assert_allclose(load_audio(stereo), tone / 2, atol=1e-7)
    np.testing.assert_allclose(load_audio(stereo.T), tone / 2, atol=1e-7)


def test_array_resampling_keeps_pitch():
    out = load_audio(_tone(440, seconds=1.0, rate=8000), source_rate=8000)
    assert len(out) == RATE
    assert _peak_hz(out, RATE) == pytest.approx(440, abs=2)
    assert len(load_audio(_tone(rate=RATE), sample_rate=24000, source_rate=RATE)) == 12000
    assert len(load_audio(_tone(rate=RATE), sample_rate=24000)) == 8000  # already at the rate


def test_empty_audio():
    with pytest.raises(AudioError, match="^audio is empty$"):
        load_audio(np.zeros(0, np.float32))


def test_empty_file(tmp_path):
    path = tmp_path / "empty.wav"
    sf.write(path, np.zeros(0, np.float32), RATE)
    with pytest.raises(AudioError, match=r"^audio file .*empty\.wav is empty$"):
        load_audio(path)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_samples(bad):
    x = _tone()
    x[100] = bad
    with pytest.raises(AudioError, match="^audio contains NaN or infinite samples$"):
        load_audio(x)


def test_missing_file(tmp_path):
    with pytest.raises(AudioError, match=r"^audio file not found: .*nope\.wav$"):
        load_audio(tmp_path / "nope.wav")


def test_unreadable_file(tmp_path):
    path = tmp_path / "junk.wav"
    path.write_bytes(b"this is not audio at all" * 10)
    with pytest.raises(AudioError, match=r"^cannot read audio file .*junk\.wav: "):
        load_audio(path)
    with pytest.raises(AudioError, match="is a folder"):
        load_audio(tmp_path)


def test_bad_array_kinds():
    with pytest.raises(AudioError, match="integer or float PCM"):
        load_audio(np.array(["a", "b"]))
    with pytest.raises(AudioError, match="1-D .* or 2-D"):
        load_audio(np.zeros((2, 3, 4), np.float32))
    with pytest.raises(AudioError, match="sample rate must be positive"):
        load_audio(_tone(), source_rate=0)


def test_save_wav_roundtrip_and_atomic(tmp_path):
    path = tmp_path / "reply.wav"
    path.write_bytes(b"old")
    x = np.clip(_tone(amp=0.9) * 1.2, -1.5, 1.5)  # clips beyond full scale
    save_wav(path, mx.array(x), 22050)
    info = sf.info(path)
    assert (info.samplerate, info.channels, info.subtype, info.format) == (
        22050,
        1,
        "PCM_16",
        "WAV",
    )
    back, _ = sf.read(path, dtype="int16")
    want = np.clip(np.round(x * 32768), -32768, 32767).astype(np.int16)
    np.testing.assert_array_equal(back, want)
    assert sorted(os.listdir(tmp_path)) == ["reply.wav"]  # no temporary file left behind


def test_save_wav_errors(tmp_path):
    with pytest.raises(AudioError, match=r"^cannot write .*: folder .*missing does not exist$"):
        save_wav(tmp_path / "missing" / "x.wav", _tone(), RATE)
    with pytest.raises(AudioError, match="NaN or infinite"):
        save_wav(tmp_path / "x.wav", np.array([0.0, np.nan], np.float32), RATE)
    with pytest.raises(AudioError, match="mono"):
        save_wav(tmp_path / "x.wav", np.zeros((2, 10), np.float32), RATE)
    assert os.listdir(tmp_path) == []

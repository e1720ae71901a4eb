"""Our two PCM16 encoders against values worked out by hand, not against themselves: the
server's base64 PCM16 (``encode_pcm16`` / ``decode_pcm16``, scale 32767 out and 32768 in) and
the WAV writer (``save_wav``, scale 32768); both round half to even, clip, and refuse NaN and
infinities (the model's speech is always finite: one that is not is a bug to report)."""

import base64

import numpy as np
import pytest
import soundfile as sf

from mlx_voicechat.audio.io import AudioError, save_wav
from mlx_voicechat.serve.wire import decode_pcm16, encode_pcm16


def _pcm(encoded: str) -> list:
    return np.frombuffer(base64.b64decode(encoded), "<i2").tolist()


# (sample, its PCM16 word): x * 32767 rounded to the nearest integer, then clipped
SERVER = [
    (0.0, 0),
    (0.5, 16384),  # 16383.5
    (-0.5, -16384),
    (0.25, 8192),  # 8191.75
    (0.1, 3277),  # 3276.7
    (-0.1, -3277),
    (1.0, 32767),
    (-1.0, -32767),  # the scale is symmetric: -1.0 is not -32768
    (1.0 + 2**-20, 32767),  # just over: 32767.03
    (-1.0 - 2**-20, -32767),  # -32767.03 rounds to -32767, inside the range
    (-1.0 - 2**-14, -32768),  # -32769.0: clipped
    (2.0, 32767),
    (-2.0, -32768),
    (1e300, 32767),  # far out, still finite: clipped
    (-1e300, -32768),
    (2.5 / 32767, 2),  # halves go to the even neighbour
    (-1.5 / 32767, -2),
    (0.4 / 32767, 0),
    (0.6 / 32767, 1),
    (-0.6 / 32767, -1),
]


def test_server_pcm16_rounds_and_clips():
    x = np.array([v for v, _ in SERVER])
    assert _pcm(encode_pcm16(x)) == [w for _, w in SERVER]
    assert _pcm(encode_pcm16(x[:7].astype(np.float32))) == [w for _, w in SERVER[:7]]
    # little-endian words: 1 is 01 00, -2 is fe ff
    assert base64.b64decode(encode_pcm16(np.array([1 / 32767, -2 / 32767]))) == b"\x01\x00\xfe\xff"
    assert encode_pcm16(np.zeros(0, np.float32)) == ""


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_server_pcm16_refuses_nan_and_infinities(bad):
    # Neither silence (NaN used to become 0) nor full scale (+-inf used to clip to
    # 32767 / -32768): an error that says what was wrong, with nothing encoded.
    x = np.array([0.0, 0.5, bad, bad, -0.5], np.float32)
    with pytest.raises(ValueError, match="2 NaN or infinite samples of 5"):
        encode_pcm16(x)
    with pytest.raises(ValueError, match="1 NaN or infinite samples of 1"):
        encode_pcm16(np.array([bad]))


def test_server_pcm16_decodes_by_32768():
    raw = np.array([-32768, -1, 0, 1, 16384, 32767], "<i2").tobytes()
    got = decode_pcm16(base64.b64encode(raw).decode())
    assert got.dtype == np.float32
    assert got.tolist() == [-1.0, -1 / 32768, 0.0, 1 / 32768, 0.5, 32767 / 32768]


# x * 32768 rounded half to even, then clipped to [-32768, 32767]
WAV = [
    (0.0, 0),
    (0.5, 16384),
    (-0.5, -16384),
    (1.0, 32767),  # 32768: clipped
    (-1.0, -32768),
    (1.001, 32767),
    (-1.001, -32768),
    (32767 / 32768, 32767),
    (1.5 / 32768, 2),  # halves go to the even neighbour
    (2.5 / 32768, 2),
    (-2.5 / 32768, -2),
    (3.5 / 32768, 4),
    (0.4 / 32768, 0),
]


def test_wav_writer_rounds_half_to_even_and_clips(tmp_path):
    path = tmp_path / "r.wav"
    save_wav(path, np.array([v for v, _ in WAV], np.float32), 22050)
    words, rate = sf.read(str(path), dtype="int16")
    assert rate == 22050 and sf.info(str(path)).subtype == "PCM_16"
    assert words.tolist() == [w for _, w in WAV]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_wav_writer_refuses_nan_and_infinities(tmp_path, bad):
    path = tmp_path / "r.wav"
    with pytest.raises(AudioError, match=f"cannot write {path}: audio contains NaN or infinite"):
        save_wav(path, np.array([0.0, bad, 0.5], np.float32), 22050)
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary file left

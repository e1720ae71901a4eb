"""The codec against NeMo's RVQVAEModel (oracle file 03, float32), and streaming against offline."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from oracle_utils import ORACLE

from mlx_voicechat.config import CodecConfig, VoiceChatConfig
from mlx_voicechat.nemotron_voicechat.nets.codec import AudioCodec, replace_control_codes
from mlx_voicechat.nemotron_voicechat.weights.sanitize import expected_shapes, sanitize_module

PREFIX = "tts_model.audio_codec."
TOL = 1e-4
STREAM_TOL = 1e-5


def _load(codec, path):
    weights = {k[len(PREFIX) :]: v for k, v in mx.load(str(path)).items() if k.startswith(PREFIX)}
    codec.load_weights(list(sanitize_module(codec, weights).items()), strict=True)
    mx.eval(codec.parameters())
    return codec


@pytest.fixture(scope="module")
def cfg():
    raw = json.loads((ORACLE / "nvidia-layout" / "config.json").read_text())
    return VoiceChatConfig.from_dict(raw).codec_config


@pytest.fixture(scope="module")
def codec(cfg):
    return _load(AudioCodec(cfg), ORACLE / "03_ear_tts_codec.safetensors")


@pytest.fixture(scope="module")
def io():
    return dict(np.load(ORACLE / "03_ear_tts_codec_io.npz"))


def _maxdiff(a, b):
    return float(np.abs(np.array(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())


def test_constants_and_real_parameter_tree():
    real = AudioCodec(CodecConfig())
    assert real.samples_per_frame == 1764
    assert real.stft_channels == 18
    assert real.stream_delay == 6
    shapes = expected_shapes(real)
    for part in ("encoder", "decoder"):
        layers = {int(k.split(".")[2]) for k in shapes if k.startswith(part + ".layers.")}
        assert layers == set(range(13))
    assert shapes["encoder.layers.0.weight"] == (384, 1, 18)
    assert shapes["encoder.layers.12.weight"] == (512, 9, 1536)
    assert shapes["encoder.layers.1.dwconv.weight"] == (384, 7, 1)
    assert shapes["decoder.layers.0.weight"] == (1536, 9, 512)  # ConvTranspose1d [out, k, in]
    assert shapes["decoder.layers.8.weight"] == (384, 7, 768)
    assert shapes["decoder.layers.12.weight"] == (18, 1, 384)
    assert shapes["prvq.mus_list.30"] == (1024, 512)
    assert shapes["prvq.variance_list.30.variance"] == ()
    assert len(shapes) == 2 * (1 + 9 * 8 + 3) + 31 * 2


def test_nvidia_layout_loads_strictly_and_decodes_file_04(cfg):
    # File 04's codec weights are not 03's (36 bias/norm tensors differ); the release equals 04.
    release = _load(AudioCodec(cfg), ORACLE / "nvidia-layout" / "model.safetensors")
    e2e = _load(AudioCodec(cfg), ORACLE / "04_voicechat_e2e.safetensors")
    a, b = dict(tree_flatten(release.parameters())), dict(tree_flatten(e2e.parameters()))
    assert a.keys() == b.keys()
    assert all(mx.array_equal(a[k], b[k]) for k in a)
    io4 = np.load(ORACLE / "04_voicechat_e2e_io.npz")
    audio = release.decode(mx.array(io4["gen_codes"]))
    assert audio.shape == io4["audio"].shape
    assert _maxdiff(audio, io4["audio"]) < TOL


def test_spectrogram(codec, io):
    feats = codec.spectrogram(mx.array(io["codec_wav_in"][:, 0]))
    ref = np.concatenate([io["codec_stft_complex_real"], io["codec_stft_complex_imag"]], axis=1)
    assert feats.shape == (1, 1323, codec.stft_channels)
    assert _maxdiff(feats, ref.transpose(0, 2, 1)) < TOL


def test_encoder_latents_and_codes(codec, io):
    wave = mx.array(io["codec_wav_in"][:, 0])
    z_e = codec.encode_latents(wave)
    assert _maxdiff(z_e, io["codec_z_e"]) < TOL
    codes = codec.encode(wave)
    assert codes.dtype == mx.int32 and codes.shape == (1, 3, 31)
    np.testing.assert_array_equal(np.array(codes), io["codec_codes"])
    np.testing.assert_array_equal(
        np.array(codec.quantize(mx.array(io["codec_z_e"]))), io["codec_codes"]
    )


def test_dequantize(codec, io):
    z_q = codec.dequantize(mx.array(io["codec_codes"]))
    assert _maxdiff(z_q, io["codec_z_q"]) < TOL


def test_decoder(codec, io):
    spec, _ = codec.decoder(mx.array(io["codec_z_q"]))
    assert _maxdiff(spec, io["codec_decoder_convout"].transpose(0, 2, 1)) < TOL
    wave = codec.decode(mx.array(io["codec_codes"]))
    assert wave.shape == (1, 3 * 1764)
    assert _maxdiff(wave, io["codec_wav_out"][:, 0]) < TOL
    audio = codec.decode(mx.array(io["gen_codes"]))
    assert _maxdiff(audio, io["tts_audio"][:, 0]) < TOL


def test_silence_codes_from_ten_seconds_of_zeros(codec, io):
    codes = np.array(codec.encode(mx.zeros((1, 125 * 1764))))[0]
    frames, counts = np.unique(codes, axis=0, return_counts=True)
    np.testing.assert_array_equal(frames[counts.argmax()], io["codec_silence_tokens"])


def test_batch_rows_are_independent(codec, io):
    wave = mx.array(io["codec_wav_in"][:, 0])
    batch = mx.concatenate([wave, 0.5 * wave[:, ::-1]])
    codes = codec.encode(batch)
    np.testing.assert_array_equal(np.array(codes[:1]), io["codec_codes"])
    np.testing.assert_array_equal(np.array(codes[1:]), np.array(codec.encode(batch[1:])))
    out = codec.decode(codes)
    assert _maxdiff(out[:1], io["codec_wav_out"][:, 0]) < TOL


@pytest.mark.parametrize("chunks", [[1] * 18, [2, 1, 3, 5, 7]])
def test_decode_step_equals_decode(codec, io, chunks):
    codes = mx.array(io["gen_codes"])
    offline = codec.decode(codes)
    cache = codec.make_decode_cache()
    parts, t = [], 0
    for n in chunks:
        wave, cache = codec.decode_step(codes[:, t : t + n], cache)
        assert wave.shape == (1, n * codec.samples_per_frame)
        mx.eval(wave)
        parts.append(wave)
        t += n
    stream = mx.concatenate(parts, axis=1)
    d = codec.stream_delay
    assert not np.any(np.array(stream[:, :d]))
    assert _maxdiff(stream[:, d:], offline[:, :-d]) < STREAM_TOL
    assert _maxdiff(codec.decode_flush(cache), offline[:, -d:]) < STREAM_TOL
    assert cache.frames == 18


def test_encode_rejects_partial_frames(codec):
    with pytest.raises(ValueError, match="multiple of 1764"):
        codec.encode(mx.zeros((1, 1000)))


def test_replace_control_codes():
    silence = mx.array([5, 6, 7])
    control = mx.array([66, 65, 64])
    codes = mx.array([[[1, 64, 2], [65, 3, 66], [9, 9, 9]]])
    out = replace_control_codes(codes, control, silence)
    np.testing.assert_array_equal(np.array(out), [[[1, 6, 2], [5, 3, 7], [9, 9, 9]]])

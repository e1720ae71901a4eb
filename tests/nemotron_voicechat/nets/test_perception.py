"""Listening path front half: log-mel, FastConformer, projection, chunked encoding (oracle 01)."""

import json

import mlx.core as mx
import numpy as np
import pytest
from oracle_utils import ORACLE, load_module, strip_prefix
from tiny_configs import TINY_ENCODER

from mlx_voicechat.config import AudioConfig, PreprocessorConfig, VoiceChatConfig
from mlx_voicechat.listen.fastconformer import FastConformer, context_mask
from mlx_voicechat.nemotron_voicechat.nets.perception import Perception


@pytest.fixture(scope="module")
def oracle01():
    cfg = json.loads((ORACLE / "01_perception_rnnt_config.json").read_text())
    pc = cfg["perception_cfg"]
    audio = AudioConfig.from_dict(
        {
            "preprocessor": pc["preprocessor"],
            "encoder": pc["encoder"],
            "output_dim": pc["output_dim"],
        }
    )
    weights = mx.load(str(ORACLE / "01_perception_rnnt.safetensors"))
    perception = load_module(Perception(audio), strip_prefix(weights, "perception."))
    return perception, dict(np.load(ORACLE / "01_perception_rnnt_io.npz"))


def _max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


def test_log_mel_matches_nemo(oracle01):
    perception, io = oracle01
    mel, mel_len = perception.log_mel(mx.array(io["wav"]))
    ref = io["mel"].transpose(0, 2, 1)
    n = int(io["mel_len"][0])
    assert mel.shape == ref.shape == (1, 131, 128)
    assert int(mel_len[0]) == n == 130  # floor(20837 / 160), errata 2
    assert _max_err(mel[:, :n], ref[:, :n]) < 2e-4
    assert np.all(np.asarray(mel[:, n:]) == 0.0)


def test_log_mel_pads_with_zeros_not_reflect(oracle01):
    perception, io = oracle01
    mel, _ = perception.log_mel(mx.array(io["wav"][0]))  # 1-D input gets a batch axis
    ref = io["mel"].transpose(0, 2, 1)
    # The first frame is centred on sample 0: half its window is padding (errata 1).
    assert _max_err(mel[:, 0], ref[:, 0]) < 2e-4


def test_subsampling_and_positional_table(oracle01):
    perception, io = oracle01
    mel = mx.array(io["mel"].transpose(0, 2, 1))
    enc = perception.encoder
    x, lengths = enc.pre_encode(mel, mx.array(io["mel_len"]))
    assert x.shape == io["pre_encode"].shape
    assert int(lengths[0]) == int(io["pre_encode_len"][0]) == 18
    assert _max_err(x, io["pre_encode"]) < 1e-4
    # 128 mel bins -> 65 -> 33 -> 17 (errata 3): out is Linear(17 * channels -> d_model).
    assert enc.pre_encode.out.weight.shape[1] == 17 * 32
    assert _max_err(enc.pos_enc.pos_emb_for(18), io["pos_emb"]) < 1e-4


def test_encoder_output_matches_nemo(oracle01):
    perception, io = oracle01
    mel = mx.array(io["mel"].transpose(0, 2, 1))
    encoded, lengths = perception.encode(mel, mx.array(io["mel_len"]))
    assert int(lengths[0]) == int(io["encoder_len"][0])
    assert _max_err(encoded, io["encoder_out_bdt"].transpose(0, 2, 1)) < 1e-4


def test_perception_from_wave_matches_nemo(oracle01):
    perception, io = oracle01
    projected, lengths, encoded = perception(mx.array(io["wav"]))
    assert int(lengths[0]) == int(io["proj_len"][0])
    assert _max_err(projected, io["proj_out"]) < 1e-4
    assert _max_err(encoded, io["encoder_out_bdt"].transpose(0, 2, 1)) < 1e-4
    # A mel input (3-D) takes the same path after the front-end.
    mel = mx.array(io["mel"].transpose(0, 2, 1))
    projected_mel, _, _ = perception(mel, mx.array(io["mel_len"]))
    assert _max_err(projected_mel, io["proj_out"]) < 1e-4


def test_chunk_sizes_reproduce_oracle(oracle01):
    perception, io = oracle01
    mel = mx.array(io["mel"].transpose(0, 2, 1))
    ref = io["encoder_out_bdt"].transpose(0, 2, 1)
    for chunk in (1, 4, 7):
        encoded, _ = perception.encode(mel, mx.array(io["mel_len"]), chunk_size=chunk)
        assert _max_err(encoded, ref) < 1e-4


def test_nvidia_layout_loads_strictly_and_matches_02():
    folder = ORACLE / "nvidia-layout"
    cfg = VoiceChatConfig.from_dict(json.loads((folder / "config.json").read_text()))
    weights = mx.load(str(folder / "model.safetensors"))
    perception = load_module(
        Perception(cfg.audio_config), strip_prefix(weights, "stt_model.perception.")
    )
    io = np.load(ORACLE / "02_stt_llm_io.npz")
    projected, lengths, encoded = perception(mx.array(io["wav"]))
    assert int(lengths[0]) == int(io["perception_len"][0])
    assert _max_err(encoded, io["encoder_btd"]) < 1e-4
    assert _max_err(projected, io["perception_proj"]) < 1e-4


# --- chunked encoding on a tiny random model ---------------------------------------------------

TINY = TINY_ENCODER


@pytest.fixture(scope="module")
def tiny_encoder():
    enc = FastConformer(TINY)
    params = enc.parameters()
    from mlx.utils import tree_flatten, tree_unflatten

    rng = np.random.default_rng(7)
    flat = [
        (k, mx.array(0.3 * rng.standard_normal(v.shape), dtype=mx.float32))
        for k, v in tree_flatten(params)
    ]
    enc.update(tree_unflatten(flat))
    mx.eval(enc.parameters())
    return enc


def test_chunked_encoding_equals_full_pass(tiny_encoder):
    n_mel = 8 * 60  # 61 encoder frames: many chunks, and much longer than the left context
    mel = mx.random.normal((1, n_mel, TINY.feat_in), key=mx.random.key(1))
    mel_len = mx.array([n_mel - 1])
    full, lengths = tiny_encoder(mel, mel_len, chunk_size=10**6)
    assert full.shape[1] == 61 and int(lengths[0]) == 61
    for chunk in (1, 5, 8, 16):
        chunked, _ = tiny_encoder(mel, mel_len, chunk_size=chunk)
        assert chunked.shape == full.shape
        assert _max_err(chunked, full) < 1e-5


def test_chunked_encoding_is_causal(tiny_encoder):
    # Attention sees no frame to the right: appending audio leaves earlier frames unchanged.
    mel = mx.random.normal((1, 8 * 40, TINY.feat_in), key=mx.random.key(2))
    short, _ = tiny_encoder(mel[:, : 8 * 20], chunk_size=6)
    long, _ = tiny_encoder(mel, chunk_size=6)
    assert _max_err(long[:, :19], short[:, :19]) < 1e-5
    assert _max_err(long[:, 25:30], 0.0) > 1e-3  # and the test input is not degenerate


def test_padded_frames_do_not_change_valid_frames(tiny_encoder):
    mel = mx.random.normal((2, 8 * 12 + 2, TINY.feat_in), key=mx.random.key(3))
    short_len = 8 * 7 + 1  # odd at every stage: the tensor then has one padded encoder frame
    mel = mx.concatenate(
        [mel[:1], mx.where(mx.arange(mel.shape[1])[:, None] < short_len, mel[1:], 0)]
    )
    batch, lengths = tiny_encoder(mel, mx.array([mel.shape[1] - 1, short_len]), chunk_size=4)
    alone, alone_len = tiny_encoder(mel[1:, : short_len + 1], mx.array([short_len]), chunk_size=4)
    n = int(alone_len[0])
    assert int(lengths[1]) == n == 8 and alone.shape[1] == n + 1
    assert _max_err(batch[1:, :n], alone[:, :n]) < 1e-5


def test_context_mask_70_0():
    m = np.asarray(context_mask(0, 100, 0, 100, 70, 0))
    visible = m[80] == 0
    assert np.array_equal(np.nonzero(visible)[0], np.arange(10, 81))
    # The same rows for a chunk whose keys start 70 frames before its queries.
    m2 = np.asarray(context_mask(80, 5, 10, 75, 70, 0))
    assert np.array_equal(m2, m[80:85, 10:85])


def test_preprocessor_rejects_unsupported_normalize():
    from mlx_voicechat.config import ConfigError

    with pytest.raises(ConfigError, match="normalize"):
        Perception(AudioConfig(preprocessor=PreprocessorConfig(normalize="per_feature")))


def test_bfloat16_weights_run_in_bfloat16(oracle01):
    perception, io = oracle01
    half = Perception(
        AudioConfig.from_dict(
            {
                "encoder": {
                    "d_model": 64,
                    "n_heads": 4,
                    "n_layers": 2,
                    "subsampling_conv_channels": 32,
                },
                "output_dim": 96,
            }
        )
    )
    half.update(perception.parameters())
    half.encoder.set_dtype(mx.bfloat16)
    half.proj.set_dtype(mx.bfloat16)
    _, _, encoded = half(mx.array(io["wav"]))
    assert encoded.dtype == mx.bfloat16
    ref = io["encoder_out_bdt"].transpose(0, 2, 1)
    # Measured against NeMo's float32 output (peak 2.92, on the CPU): every element within
    # 0.027 + 2% of its value (largest error 0.039, 1.3% of the peak; median relative error
    # 0.9%, bfloat16's 8 mantissa bits through two layers). Bound: 0.04 + 2%.
    np.testing.assert_allclose(np.array(encoded.astype(mx.float32)), ref, rtol=0.02, atol=0.04)

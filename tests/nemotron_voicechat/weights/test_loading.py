"""Checkpoint layouts, sanitize, strict loading, quantization and the bad inputs of loading."""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_voicechat import load
from mlx_voicechat.config import ConfigError, VoiceChatConfig
from mlx_voicechat.errors import CheckpointError
from mlx_voicechat.nemotron_voicechat import Model

LAYOUTS = ["mlx-community-f32", "mlx-community-4bit", "mlx-audio-f32", "mlx-audio-4bit"]


def params(model):
    return {
        k: np.array(v.astype(mx.float32) if v.dtype == mx.bfloat16 else v)
        for k, v in tree_flatten(model.parameters())
    }


def quantized_paths(model):
    return sorted(
        n
        for n, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    )


@pytest.fixture(scope="module")
def nvidia(oracle_dir):
    return load(oracle_dir / "nvidia-layout")


def test_nvidia_layout_loads_strictly(nvidia, oracle_dir):
    from safetensors.numpy import load_file

    raw = load_file(str(oracle_dir / "nvidia-layout" / "model.safetensors"))
    p = params(nvidia)
    # Every tensor of the release is a parameter, except the training-only projection; the
    # 8 LSTM tensors become 6 (Wx, Wh and one summed bias per layer).
    assert len(p) == len(raw) - 1 - 2
    np.testing.assert_array_equal(
        p["stt_model.rnnt_decoder.prediction.dec_rnn.lstm.0.bias"],
        raw["stt_model.rnnt_decoder.prediction.dec_rnn.lstm.bias_ih_l0"]
        + raw["stt_model.rnnt_decoder.prediction.dec_rnn.lstm.bias_hh_l0"],
    )
    np.testing.assert_array_equal(
        p["stt_model.perception.encoder.pre_encode.conv.0.weight"],
        raw["stt_model.perception.encoder.pre_encode.conv.0.weight"].transpose(0, 2, 3, 1),
    )
    np.testing.assert_array_equal(p["tts_model.control_codes"], raw["tts_model._control_codes"])
    assert nvidia.config.layout == "nvidia"
    assert nvidia.rnnt_vocabulary[:3] == ["<unk>", "he", "\u2581t"]
    assert nvidia.tokenizer is not None


@pytest.mark.parametrize("name", LAYOUTS)
def test_peer_layouts_load_to_the_same_parameters(name, nvidia, oracle_dir):
    folder = oracle_dir / "layouts" / name
    model = load(folder)
    want = params(nvidia)
    got = params(model)
    if name.endswith("4bit"):
        cfg = json.load(open(folder / "config.json"))["quantization"]
        listed = sorted(k for k, v in cfg.items() if isinstance(v, dict))
        q = quantized_paths(model)
        if listed:
            assert q == listed
        else:  # mlx-audio: global entry, the modules with scales
            assert q and all(k.startswith("stt_model.") for k in q)
        for path in q:
            for suffix in (".weight", ".scales", ".biases"):
                want.pop(path + suffix, None)
                got.pop(path + suffix, None)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_sanitize_twice_equals_once(oracle_dir):
    cfg = VoiceChatConfig.from_dict(json.load(open(oracle_dir / "nvidia-layout" / "config.json")))
    model = Model(cfg)
    raw = mx.load(str(oracle_dir / "nvidia-layout" / "model.safetensors"))
    once = model.sanitize(raw)
    twice = model.sanitize(once)
    assert once.keys() == twice.keys()
    for k in once:
        assert once[k].shape == twice[k].shape, k
        assert mx.array_equal(once[k], twice[k]).item(), k


def test_factory_layouts_load_to_identical_parameters(tiny_checkpoints):
    ref = params(load(tiny_checkpoints["mlx-community"]))
    for layout in ("nvidia", "mlx-audio"):
        got = params(load(tiny_checkpoints[layout]))
        assert got.keys() == ref.keys()
        for k in ref:
            np.testing.assert_array_equal(got[k], ref[k], err_msg=f"{layout}: {k}")


@pytest.mark.parametrize("layout", ["mlx-community-4bit", "mlx-audio-4bit"])
def test_factory_4bit_quantizes_exactly_the_map(tiny_checkpoints, layout):
    folder = tiny_checkpoints[layout]
    model = load(folder)
    q = quantized_paths(model)
    assert "stt_model.lm_head" in q and "stt_model.embed_tokens" in q
    assert all(
        k.startswith(
            (
                "stt_model.llm.",
                "stt_model.lm_head",
                "stt_model.embed_tokens",
                "stt_model.function_head",
            )
        )
        for k in q
    )
    cfg = json.load(open(folder / "config.json"))
    listed = sorted(k for k, v in cfg["quantization"].items() if isinstance(v, dict))
    if listed:
        assert q == listed


def test_factory_is_deterministic(tmp_path):
    from mlx_voicechat.factory import make_checkpoint

    a = make_checkpoint(tmp_path / "a", "tiny", "nvidia", seed=3)
    b = make_checkpoint(tmp_path / "b", "tiny", "nvidia", seed=3)
    c = make_checkpoint(tmp_path / "c", "tiny", "nvidia", seed=4)
    read = lambda d: (d / "model.safetensors").read_bytes()  # noqa: E731
    assert read(a) == read(b)
    assert read(a) != read(c)


def test_factory_tokenizer_has_256_single_characters(tiny_checkpoints):
    tok = json.load(open(tiny_checkpoints["mlx-community"] / "tokenizer.json"))
    vocab = tok["model"]["vocab"]
    singles = [p for p in vocab if len(p) == 1]
    assert len(singles) == 256
    assert vocab["<s>"] == 1 and vocab["</s>"] == 2 and vocab["<SPECIAL_12>"] == 12
    assert vocab["<SPECIAL_11>"] == 11


# --- bad input ---------------------------------------------------------------------------


def _copy(src, dst):
    shutil.copytree(src, dst)
    for p in dst.rglob("*"):
        p.chmod(0o644 if p.is_file() else 0o755)
    return dst


def test_folder_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="has no config.json"):
        load(tmp_path)


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load(tmp_path / "nope")


def test_other_model_type(tmp_path, tiny_checkpoints):
    d = _copy(tiny_checkpoints["mlx-community"], tmp_path / "m")
    cfg = json.load(open(d / "config.json"))
    cfg["model_type"] = "llama"
    json.dump(cfg, open(d / "config.json", "w"))
    with pytest.raises(ConfigError, match="model_type 'llama', not 'nemotron_voicechat'"):
        load(d)


def test_speaker_other_than_aria(tmp_path, tiny_checkpoints):
    d = _copy(tiny_checkpoints["mlx-community"], tmp_path / "m")
    cfg = json.load(open(d / "config.json"))
    cfg["speaker"] = "Bob"
    json.dump(cfg, open(d / "config.json", "w"))
    with pytest.raises(ConfigError, match="speaker 'Bob' is not supported"):
        load(d)


def test_truncated_safetensors(tmp_path, tiny_checkpoints):
    d = _copy(tiny_checkpoints["nvidia"], tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(
        CheckpointError, match=r"model.safetensors is not a readable safetensors file"
    ):
        load(d)


def _rewrite(d, fn):
    f = d / "model.safetensors"
    w = dict(mx.load(str(f)))
    fn(w)
    mx.save_safetensors(str(f), w, metadata={"format": "pt"})


def test_missing_tensor(tmp_path, tiny_checkpoints):
    d = _copy(tiny_checkpoints["nvidia"], tmp_path / "m")
    _rewrite(d, lambda w: w.pop("stt_model.lm_head.weight"))
    with pytest.raises(
        CheckpointError, match=r"missing tensor 'stt_model.lm_head.weight' with shape \[400, 64\]"
    ):
        load(d)


def test_wrong_shape(tmp_path, tiny_checkpoints):
    d = _copy(tiny_checkpoints["nvidia"], tmp_path / "m")
    _rewrite(d, lambda w: w.__setitem__("stt_model.lm_head.weight", mx.zeros((400, 63))))
    with pytest.raises(
        CheckpointError,
        match=r"'stt_model.lm_head.weight' has shape \[400, 63\] .* expects \[400, 64\]",
    ):
        load(d)


def test_unexpected_tensor(tmp_path, tiny_checkpoints):
    d = _copy(tiny_checkpoints["nvidia"], tmp_path / "m")
    _rewrite(d, lambda w: w.__setitem__("stt_model.extra.weight", mx.zeros((2,))))
    with pytest.raises(CheckpointError, match="unexpected tensor 'stt_model.extra.weight'"):
        load(d)


def test_nvidia_without_tokenizer(tmp_path, tiny_checkpoints):
    d = _copy(tiny_checkpoints["nvidia"], tmp_path / "m")
    (d / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="NVIDIA's raw release ships no tokenizer"):
        load(d)
    model = load(d, tokenizer=tiny_checkpoints["mlx-community"])
    assert model.tokenizer is not None


def test_hub_id_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="could not be downloaded from the Hugging Face hub"):
        load("mlx-community/NemotronLabs-VoiceChat-11B-4bit-does-not-exist")


def test_local_path_never_touches_the_network(monkeypatch, tiny_checkpoints):
    import huggingface_hub

    def boom(*a, **k):
        raise AssertionError("network used for a local path")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", boom)
    load(tiny_checkpoints["mlx-community"])


def test_att_context_size_forms():
    from mlx_voicechat.config import EncoderConfig

    assert EncoderConfig(att_context_size=[70, 0]).att_context_size == (70, 0)
    assert EncoderConfig(att_context_size=[[70, 0]]).att_context_size == (70, 0)
    with pytest.raises(ConfigError, match="att_context_size"):
        EncoderConfig(att_context_size=[70])


@pytest.mark.parametrize("count", [255, 257])
def test_tokenizer_without_256_single_characters(tmp_path, tiny_checkpoints, count):
    d = _copy(tiny_checkpoints["mlx-community"], tmp_path / "m")
    tok = json.load(open(d / "tokenizer.json"))
    vocab = tok["model"]["vocab"]
    singles = sorted((i, p) for p, i in vocab.items() if len(p) == 1)
    if count == 255:
        i, p = singles[-1]
        del vocab[p]
        vocab["\u0100\u0100"] = i
        tok["model"]["merges"] = [
            m for m in tok["model"]["merges"] if p not in (m if isinstance(m, list) else m.split())
        ]
    else:
        multi = max((i, p) for p, i in vocab.items() if len(p) > 1 and i > 300)
        del vocab[multi[1]]
        vocab["\u4e00"] = multi[0]
        tok["model"]["merges"] = [
            m
            for m in tok["model"]["merges"]
            if "".join(m if isinstance(m, list) else m.split()) != multi[1]
        ]
    json.dump(tok, open(d / "tokenizer.json", "w"))
    with pytest.raises(Exception, match=f"{count} single-character tokens"):
        load(d)


def test_factory_writes_the_release_key_set_and_layouts(tiny_checkpoints, oracle_dir):
    """The factory's tiny model has the oracle's dimensions: the mlx-community folder it writes
    must hold the same keys with the same (PyTorch) shapes as mlx-vlm's own conversion."""
    import glob

    from safetensors import safe_open

    def shapes(folder):
        out = {}
        for f in glob.glob(str(folder / "*.safetensors")):
            with safe_open(f, framework="numpy") as st:
                out.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
        return out

    ours = shapes(tiny_checkpoints["mlx-community"])
    ref = shapes(oracle_dir / "layouts" / "mlx-community-f32")
    assert ours.keys() == ref.keys()
    diff = {k: (ours[k], ref[k]) for k in ref if ours[k] != ref[k]}
    # Only vocabulary-sized tensors may differ (the factory's tokenizer is its own).
    assert all("embed_subword" in k or "rnnt" in k or "embed_tokens" in k or "head" in k
               for k in diff), diff


@pytest.mark.parametrize(
    "index",
    [[], {"metadata": {}}, {"weight_map": []}, {"weight_map": {}}, {"weight_map": {"a": 3}},
     {"weight_map": {"a": "../model.safetensors"}}, {"weight_map": {"a": ".."}}],
)
def test_a_malformed_safetensors_index_is_one_clear_error(tmp_path, tiny_checkpoints, index):
    d = _copy(tiny_checkpoints["nvidia"], tmp_path / "m")
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="is not a valid safetensors index: it needs"):
        load(d)

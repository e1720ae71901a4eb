"""`mlx-voicechat convert`: NVIDIA / mlx-community / mlx-audio sources to the mlx-community
layout, against mlx-vlm's own converter output (oracle layouts/) and file 04."""

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from oracle_utils import ORACLE, replay_04

from mlx_voicechat import load
from mlx_voicechat.cli import main
from mlx_voicechat.errors import VoiceChatError
from mlx_voicechat.factory import make_checkpoint
from mlx_voicechat.nemotron_voicechat.weights import writer
from mlx_voicechat.nemotron_voicechat.weights.convert import ConversionError, convert

LAYOUTS = ORACLE / "layouts"


def tensors(folder):
    out = {}
    for f in sorted(Path(folder).glob("model*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def quantized_paths(model):
    return sorted(
        n
        for n, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    )


def listed(folder):
    cfg = json.loads((Path(folder) / "config.json").read_text())
    assert cfg["quantization"] == cfg["quantization_config"]
    return sorted(k for k, v in cfg["quantization"].items() if isinstance(v, dict))


def key_paths(d, prefix=""):
    out = set()
    for k, v in d.items():
        out.add(prefix + k)
        if isinstance(v, dict) and k not in ("quantization", "quantization_config"):
            out |= key_paths(v, prefix + k + ".")
    return out


def file_set(folder):
    """Relative paths, with shard names reduced to their pattern."""
    names = set()
    for p in Path(folder).rglob("*"):
        if p.is_file():
            rel = str(p.relative_to(folder))
            names.add("model-SHARD.safetensors" if rel.startswith("model-0") else rel)
    return names


def wave(seconds=0.8, seed=1):
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(int(seconds * 16000))).astype(np.float32)


@pytest.fixture(scope="module")
def oracle_q4(tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "q4"
    return convert(
        ORACLE / "nvidia-layout",
        out,
        dtype="float32",
        quantize=4,
        group_size=64,
        max_shard_bytes=2_200_000,
        progress=False,
    )


@pytest.fixture(scope="module")
def oracle_f32(tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "f32"
    return convert(ORACLE / "nvidia-layout", out, dtype="float32", progress=False)


# --- NVIDIA raw layout ------------------------------------------------------------------


def test_factory_nvidia_converts_and_generates_the_same(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints["nvidia"]
    out = convert(src, tmp_path / "out", dtype="float32", max_shard_bytes=1 << 20, progress=False)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert (
        len(shards) >= 3
        and shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert all((out / s).stat().st_size <= (1 << 20) + 64 * 1024 for s in shards[:-1])
    got = load(out)  # strict
    assert got.config.layout == "mlx-community" and quantized_paths(got) == []
    ref = load(src)
    a = ref.generate(wave(), system_prompt="", extra_decoding_seconds=0.2, seed=5)
    b = got.generate(wave(), system_prompt="", extra_decoding_seconds=0.2, seed=5)
    assert b.text_ids == a.text_ids and b.function_ids == a.function_ids
    assert np.array_equal(b.codes, a.codes)
    assert np.array_equal(b.audio, a.audio)
    assert b.user_transcript == a.user_transcript


def test_oracle_nvidia_f32_equals_mlx_vlm_output_and_replays_04(oracle_f32):
    want = tensors(LAYOUTS / "mlx-community-f32")
    got = tensors(oracle_f32)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and mx.array_equal(got[k], want[k]).item(), k
    out, _, io = replay_04(load(oracle_f32))
    assert out.text_ids == io["tokens_text"][0].tolist()
    P = io["prompt_tokens"].shape[1]
    assert np.array_equal(out.codes, io["gen_codes"][0, P:])
    assert out.user_transcript == str(io["rnnt_text"])


def test_oracle_nvidia_q4_has_mlx_vlm_structure(oracle_q4):
    ref = LAYOUTS / "mlx-community-4bit"
    ours = json.loads((oracle_q4 / "config.json").read_text())
    theirs = json.loads((ref / "config.json").read_text())
    assert key_paths(ours) == key_paths(theirs)
    assert ours["quantization"] == theirs["quantization"]
    assert listed(oracle_q4) == listed(ref) and len(listed(ref)) == 15
    assert file_set(oracle_q4) == file_set(ref)
    assert len(list(oracle_q4.glob("model-*.safetensors"))) == 3
    assert (
        json.loads((oracle_q4 / "model.safetensors.index.json").read_text())["metadata"]
        == json.loads((ref / "model.safetensors.index.json").read_text())["metadata"]
    )
    want, got = tensors(ref), tensors(oracle_q4)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and mx.array_equal(got[k], want[k]).item(), k
    # the one value that differs on purpose: the blank is the joint's last output (errata 15)
    assert ours["rnnt_blank_id"] == len(ours["rnnt_vocabulary"]) == 40
    assert quantized_paths(load(oracle_q4)) == listed(ref)


def test_nvidia_without_tokenizer_needs_one(tmp_path, oracle_dir):
    src = make_checkpoint(tmp_path / "src", "tiny", "nvidia", with_tokenizer=False)
    with pytest.raises(ConversionError, match="--tokenizer"):
        convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    out = convert(src, tmp_path / "out", tokenizer=oracle_dir / "tiny-Nemotron-H", progress=False)
    assert (out / "tokenizer.json").exists()


# --- quantization -----------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_outputs_list_exactly_what_loading_quantizes(tiny_checkpoints, tmp_path, bits):
    out = convert(
        tiny_checkpoints["mlx-community"],
        tmp_path / "q",
        quantize=bits,
        dtype="bfloat16",
        progress=False,
    )
    names = listed(out)
    cfg = json.loads((out / "config.json").read_text())["quantization"]
    assert cfg["bits"] == bits and all(cfg[k] == {"group_size": 64, "bits": bits} for k in names)
    assert "stt_model.lm_head" in names and "stt_model.embed_tokens" in names
    assert all(k.startswith("stt_model.") for k in names)
    scaled = sorted(k[: -len(".scales")] for k in tensors(out) if k.endswith(".scales"))
    assert scaled == names
    model = load(out)
    assert quantized_paths(model) == names
    res = model.generate(wave(0.5), system_prompt="", extra_decoding_seconds=0.0, seed=0)
    assert np.all(np.isfinite(res.audio))


def test_requantize_mlx_community_4bit_to_8bit(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints["mlx-community-4bit"]
    out = convert(src, tmp_path / "q8", quantize=8, dtype="float32", progress=False)
    assert listed(out) == listed(src)
    model, ref = load(out), load(src)
    # 4-bit weights dequantized then re-quantized to 8 bits are (nearly) the 4-bit values
    for path in listed(src)[:3]:
        w8 = dict(model.named_modules())[path]
        w4 = dict(ref.named_modules())[path]
        d8 = mx.dequantize(w8.weight, w8.scales, w8.biases, group_size=64, bits=8)
        d4 = mx.dequantize(w4.weight, w4.scales, w4.biases, group_size=64, bits=4)
        assert mx.max(mx.abs(d8 - d4)).item() < 0.02 * mx.max(mx.abs(d4)).item()
    # and dequantizing to float32 with no --quantize gives an unquantized checkpoint
    f = convert(src, tmp_path / "f", dtype="float32", progress=False)
    assert "quantization" not in json.loads((f / "config.json").read_text())
    assert quantized_paths(load(f)) == []


def test_quantize_tts_cli_prints_code_agreement(tiny_checkpoints, tmp_path, capsys):
    out = tmp_path / "tts8"
    rc = main(
        [
            "convert",
            "--source",
            str(tiny_checkpoints["nvidia"]),
            "--output",
            str(out),
            "--quantize",
            "4",
            "--quantize-tts",
            "8",
            "--dtype",
            "float32",
            "--quiet",
        ]
    )
    assert rc == 0
    names = listed(out)
    tts = [k for k in names if k.startswith("tts_model.")]
    assert tts and all(
        k.startswith(("tts_model.tts_model.backbone.", "tts_model.tts_model.mog_head."))
        for k in tts
    )
    assert "tts_model.tts_model.mog_head.proj_mus" not in names
    cfg = json.loads((out / "config.json").read_text())["quantization"]
    assert all(cfg[k]["bits"] == 8 for k in tts) and cfg["stt_model.lm_head"]["bits"] == 4
    assert quantized_paths(load(out)) == names
    # The figure it prints, counted here: the same conversion without --quantize-tts is the
    # unquantized TTS (same 4-bit LLM), both run on the stated fixed input and seed.
    plain = convert(tiny_checkpoints["nvidia"], tmp_path / "plain", dtype="float32", quantize=4,
                    progress=False)
    rate = 16000
    t = np.arange(int(1.6 * rate)) / rate
    noise = 0.05 * np.random.default_rng(0).standard_normal(t.size)
    wave = (0.3 * np.sin(2 * np.pi * 220 * t) + noise).astype(np.float32)
    a, b = (load(m).generate(wave, system_prompt="", extra_decoding_seconds=0.0, seed=0)
            for m in (out, plain))
    same = int(np.sum(a.codes == b.codes))
    assert 0 < same < a.codes.size  # on random weights the 8-bit TTS drifts: a real figure
    assert (
        "8-bit TTS picks the same speech codes as the unquantized TTS for "
        f"{same / a.codes.size:.1%} of {a.codes.size} codes (fixed 1.6 s input, seed 0)"
    ) in capsys.readouterr().out


# --- mlx-audio source, streaming, failures ----------------------------------------------


def test_mlx_audio_source_converts_to_the_same_tensors(tiny_checkpoints, tmp_path):
    a = convert(tiny_checkpoints["mlx-audio"], tmp_path / "a", dtype="float32", progress=False)
    b = convert(tiny_checkpoints["nvidia"], tmp_path / "b", dtype="float32", progress=False)
    ta, tb = tensors(a), tensors(b)
    # mlx-audio keeps one summed LSTM bias and drops the training-only projection
    lstm = [k for k in tb if ".lstm.bias_" in k]
    assert {k for k in tb if k not in ta} == {"tts_model.tts_model.audio_prompt_projection_W"}
    for k in ta:
        if k in lstm:
            continue
        assert ta[k].dtype == tb[k].dtype and mx.array_equal(ta[k], tb[k]).item(), k
    ma, mb = load(a), load(b)
    x = wave(0.5)
    assert np.array_equal(
        ma.generate(x, system_prompt="", extra_decoding_seconds=0.0, seed=1).codes,
        mb.generate(x, system_prompt="", extra_decoding_seconds=0.0, seed=1).codes,
    )


def test_interrupt_leaves_no_output_folder(tiny_checkpoints, tmp_path, monkeypatch):
    calls = []
    real = writer.write_tensor

    def interrupted(f, spec, array):
        calls.append(spec.name)
        if len(calls) == 20:
            raise KeyboardInterrupt
        return real(f, spec, array)

    monkeypatch.setattr(writer, "write_tensor", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(
            tiny_checkpoints["nvidia"], tmp_path / "out", max_shard_bytes=1 << 20, progress=False
        )
    assert len(calls) == 20
    assert list(tmp_path.iterdir()) == []


def test_full_disk_is_one_clear_error(tiny_checkpoints, tmp_path, monkeypatch):
    def full(f, spec, array):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "write_tensor", full)
    with pytest.raises(VoiceChatError, match="No space left"):
        convert(tiny_checkpoints["nvidia"], tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_bad_sources_are_one_line_errors(tiny_checkpoints, tmp_path, capsys):
    with pytest.raises(VoiceChatError, match="does not exist"):
        convert(tmp_path / "nope", tmp_path / "out", progress=False)
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_checkpoints["nvidia"].iterdir():
        if f.is_file():
            (broken / f.name).write_bytes(f.read_bytes())
    raw = mx.load(str(broken / "model.safetensors"))
    raw.pop("stt_model.lm_head.weight")
    mx.save_safetensors(str(broken / "model.safetensors"), raw)
    with pytest.raises(ConversionError, match="missing tensor 'stt_model.lm_head.weight'"):
        convert(broken, tmp_path / "out", progress=False)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(VoiceChatError, match="not a readable safetensors"):
        convert(broken, tmp_path / "out", progress=False)
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "x").write_text("keep me")
    with pytest.raises(ConversionError, match="already exists"):
        convert(tiny_checkpoints["nvidia"], existing, progress=False)
    assert (existing / "x").read_text() == "keep me"
    rc = main(["convert", "--source", str(tmp_path / "nope"), "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "convert: error:" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "existing"]


# --- mlx-vlm interop --------------------------------------------------------------------


def _mlx_vlm_run(folder):
    from mlx_vlm.utils import load as vlm_load

    # mlx-vlm 0.7.10 sizes the subword-flag tables for a 131072-token vocabulary whatever the
    # config says, so a tiny model only loads non-strictly (as its own converter's output does).
    model, processor = vlm_load(str(folder), strict=False)
    io = np.load(ORACLE / "04_voicechat_e2e_io.npz")
    res = model.create_session(processor).generate(mx.array(io["wav"][0]), system_prompt="", seed=0)
    return model, res


@pytest.mark.parametrize("which", ["f32", "q4"])
def test_mlx_vlm_loads_and_runs_like_its_own_conversion(which, oracle_f32, oracle_q4):
    pytest.importorskip("mlx_vlm")
    from mlx.utils import tree_flatten

    ours = {"f32": oracle_f32, "q4": oracle_q4}[which]
    ref = LAYOUTS / {"f32": "mlx-community-f32", "q4": "mlx-community-4bit"}[which]
    model, got = _mlx_vlm_run(ours)
    params = dict(tree_flatten(model.parameters()))
    provided = model.sanitize(tensors(ours))
    assert set(provided) == set(params)  # every parameter came from our files
    for k, v in provided.items():
        assert params[k].shape == v.shape, k
    _, want = _mlx_vlm_run(ref)
    assert np.array_equal(np.array(got.text_tokens), np.array(want.text_tokens))
    assert np.array_equal(np.array(got.audio_codes), np.array(want.audio_codes))
    assert np.all(np.isfinite(np.array(got.audio)))
    if which == "q4":
        q = sorted(
            n
            for n, m in model.named_modules()
            if isinstance(m, nn.QuantizedLinear) or isinstance(m, nn.QuantizedEmbedding)
        )
        assert q == listed(ours)

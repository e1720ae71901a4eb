"""The layouts' rename tables (config/layouts.py NEMO, nemotron_asr/config_transformers.py
TRANSFORMERS / PROCESSOR) read back what they write, at every scale; atomic_folder leaves
nothing behind on failure; one shape checker words both models' errors."""

import json
import os
from pathlib import Path

import pytest

from mlx_voicechat.config import VoiceChatConfig
from mlx_voicechat.config.layouts import NEMO, nemo_config
from mlx_voicechat.config.sections import read_fields
from mlx_voicechat.errors import CheckpointError
from mlx_voicechat.files import atomic_folder
from mlx_voicechat.nemotron_asr.config import ASRConfig, transformers_config
from mlx_voicechat.nemotron_asr.factory import ASR_SCALES, _tokenizer_json, asr_scale_config
from mlx_voicechat.nemotron_voicechat.model import check_shapes
from mlx_voicechat.nemotron_voicechat.weights.scales import SCALES, scale_config
from mlx_voicechat.nemotron_voicechat.weights.writer import flat_config

SECTIONS = ("audio_config", "tts_config", "codec_config")


def _json(d):
    return json.loads(json.dumps(d))


@pytest.mark.parametrize("scale", SCALES)
def test_voicechat_layouts_read_back_what_they_write(scale):
    config = scale_config(scale)
    for written, layout in ((nemo_config(config), "nvidia"), (flat_config(config), None)):
        back = VoiceChatConfig.from_dict(_json(written))
        for name in SECTIONS + ("text_args", "rnnt_vocabulary", "speaker", "frame_duration"):
            assert getattr(back, name) == getattr(config, name), (layout, name)
        assert layout is None or back.layout == layout


def test_nemo_table_matches_nvidias_release(oracle_dir):
    """Read then written again, NVIDIA's config keeps every value the table names."""
    raw = json.loads((oracle_dir / "nvidia-layout" / "config.json").read_text())
    written = nemo_config(VoiceChatConfig.from_dict(raw))

    def walk(table, want, got, where):
        for key, spec in table.items():
            if key == "*" or key not in want:
                continue
            if isinstance(spec, dict):
                walk(spec, want[key], got[key], f"{where}.{key}")
            elif isinstance(spec, str) and spec.startswith("@"):
                assert got[key] == want[key], f"{where}.{key}"

    walk(NEMO, raw, written, "")
    encoder = raw["model"]["stt"]["model"]["perception"]["encoder"]
    assert written["model"]["stt"]["model"]["perception"]["encoder"]["n_layers"] == encoder[
        "n_layers"
    ]


def test_every_nemo_field_is_read_from_where_it_is_written():
    """Each "@field" leaf of the table, written from a config whose values are all distinct,
    is read back into the same field (a misplaced or swapped entry fails here)."""
    config = scale_config("tiny")
    c = config.codec_config
    c.n_fft, c.hop_length, c.latent_dim, c.base_channels = 18, 5, 34, 20
    config.tts_config.sliding_window_pattern = 5
    config.tts_config.rope_local_base_freq = 12345.0
    read = read_fields(NEMO, _json(nemo_config(config)))
    leaves = []

    def walk(node):
        for v in node.values():
            if isinstance(v, dict):
                walk(v)
            elif isinstance(v, str) and v.startswith("@"):
                leaves.extend(v[1:].split("|"))

    walk(NEMO)
    assert len(leaves) > 50
    for path in leaves:
        want, got = config, read
        for name in path.split("."):
            want, got = getattr(want, name), got[name]
        if hasattr(want, "to_dict"):  # a whole section
            got = type(want).from_dict(got)
        assert got == (list(want) if isinstance(want, tuple) else want), path


@pytest.mark.parametrize("scale", ASR_SCALES)
@pytest.mark.parametrize("prompt", [True, False])
def test_transformers_layout_reads_back_what_it_writes(scale, prompt):
    config = asr_scale_config(scale, prompt)
    config.encoder.att_context_size = (40, 6)
    config.max_symbols, config.mel_filters_dtype = 7, "bfloat16"
    config.decoder.pred_rnn_layers = 3
    config.encoder.xscaling, config.joint.activation = True, "tanh"
    cfg, processor = transformers_config(config)
    tokenizer = _tokenizer_json(config.vocabulary, config.blank_id)
    back = ASRConfig.from_dict(_json(cfg), tokenizer=tokenizer, processor=_json(processor))
    for name in ("preprocessor", "encoder", "decoder", "joint", "vocabulary", "max_symbols",
                 "lookaheads", "mel_filters_dtype", "zero_biases"):
        assert getattr(back, name) == getattr(config, name), name
    assert back.prompt.num_prompts == config.prompt.num_prompts
    if prompt:
        assert back.prompt == config.prompt


def test_atomic_folder_leaves_nothing_when_the_block_fails(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_folder(target) as tmp:
            (tmp / "half.bin").write_bytes(b"x")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_atomic_folder_replaces_only_once_the_new_folder_is_complete(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_folder(target, replace=True) as tmp:
            (tmp / "new.txt").write_text("new")
            raise RuntimeError("interrupted")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in target.iterdir()] == ["old.txt"]
    umask = os.umask(0o022)
    os.umask(umask)
    with atomic_folder(target, replace=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in target.iterdir()] == ["new.txt"]
    assert target.stat().st_mode & 0o777 == 0o777 & ~umask


def test_one_shape_checker_names_the_place_and_the_model(tmp_path):
    expected = {"a": (2, 3), "b": (4,)}
    with pytest.raises(CheckpointError, match=r"tensor 'a' has shape \[3, 2\] in the checkpoint"):
        check_shapes(expected, {"a": (3, 2), "b": None})
    with pytest.raises(CheckpointError, match=rf"tensor 'b' has shape \[5\] in {tmp_path} but"):
        check_shapes(expected, {"a": (2, 3), "b": (5,)}, Path(tmp_path))
    with pytest.raises(CheckpointError, match="not belong to a Nemotron-3.5-ASR recognizer"):
        check_shapes(expected, {**expected, "c": (1,)}, tmp_path, model="a Nemotron-3.5-ASR "
                     "recognizer")
    with pytest.raises(CheckpointError, match=r"source is missing tensor 'b' with shape \[4\]"):
        check_shapes(expected, {"a": (2, 3)}, "source")

"""Bad input (issue 11): every bad input is one clear error. Generation arguments, misshaped
tensors under mlx-audio's non-strict loading, the RNNT vocabulary, odd audio inputs, group
sizes, config.json and tokenizer oddities, the ecosystem entry points (mlx_lm.load,
mlx_audio.sts) and progress over the system prompt. Shared fixtures in
tests/support/safety_support.py."""

import json
import os
import shutil
import warnings

import mlx.core as mx
import numpy as np
import pytest
import soundfile as sf
from safety_support import (  # noqa: F401  (fixtures)
    NVIDIA,
    _child,
    _cli,
    _generate_args,
    _one_line_error,
    _unprivileged_cli,
    _wave,
    ckpt,
    copy_of,
    tiny,
)

from mlx_voicechat import load
from mlx_voicechat.errors import VoiceChatError
from mlx_voicechat.factory import make_checkpoint

# --- 4, 11, 12: generation arguments ---------------------------------------------------------


@pytest.mark.parametrize("prompt", [[1, 99999, 2], [1, -1, 2], [1, 400, 2], [1, 1.5, 2], [True]])
def test_prompt_ids_outside_the_embedding_table(tiny, prompt):
    with pytest.raises(VoiceChatError, match="is not a token id of this model: ids are integers"):
        tiny.generate(_wave(), prompt=prompt, extra_decoding_seconds=0.0)


@pytest.mark.parametrize("seed", [None, 1.5, "0", -1, 2**64, True])
def test_bad_seed_api(tiny, seed):
    with pytest.raises(VoiceChatError, match="seed must be an integer from 0 to 2\\*\\*64 - 1"):
        tiny.generate(_wave(), seed=seed, extra_decoding_seconds=0.0)


@pytest.mark.parametrize("seed", ["-1", "18446744073709551616"])
def test_bad_seed_cli(seed, ckpt, question, tmp_path, capsys):
    args = _generate_args(ckpt, question, tmp_path / "r.wav", "--seed", seed)
    _one_line_error(*_cli(args, capsys)[::2], "--seed must be an integer from 0 to 2**64 - 1")
    assert list(tmp_path.iterdir()) == []


def test_largest_seed_works(tiny):
    assert tiny.generate(_wave(), seed=2**64 - 1, extra_decoding_seconds=0.0).frames > 0


@pytest.mark.parametrize("seconds", ["3", None, float("nan"), float("inf"), -1.0, True])
def test_bad_extra_decoding_seconds_api(tiny, seconds):
    with pytest.raises(VoiceChatError, match="extra_decoding_seconds must be a finite number"):
        tiny.generate(_wave(), extra_decoding_seconds=seconds)


def test_huge_extra_decoding_seconds_is_bounded_before_allocating(tiny, ckpt, question, tmp_path,
                                                                  capsys, monkeypatch):
    """Refused before the silence is made: 1e9 s of it (58 TiB) would fail to allocate with
    another error, or run the encoder (counted here) on what could be allocated."""
    runs = []
    perception = type(tiny.stt_model.perception)
    real = perception.__call__
    monkeypatch.setattr(perception, "__call__", lambda *a, **k: runs.append(1) or real(*a, **k))
    with pytest.raises(VoiceChatError, match="the LLM's context is 4096"):
        tiny.generate(_wave(), extra_decoding_seconds=1e9)
    args = _generate_args(ckpt, question, tmp_path / "r.wav")
    args[-1] = "1e9"
    _one_line_error(*_cli(args, capsys)[::2], "extra_decoding_seconds (1e+09 s)",
                    "the LLM's context is 4096")
    assert runs == []
    assert not (tmp_path / "r.wav").exists()


# --- 6: mlx-audio's non-strict loading checks shapes -----------------------------------------


def test_post_load_hook_rejects_a_misshaped_tensor(ckpt, copy_of):
    import mlx_audio.sts as sts

    folder = copy_of(ckpt)
    (shard,) = folder.glob("model-*.safetensors")
    w = dict(mx.load(str(shard)))
    w["stt_model.lm_head.weight"] = w["stt_model.lm_head.weight"][:-1]
    mx.save_safetensors(str(shard), w, metadata={"format": "mlx"})
    message = "tensor 'stt_model.lm_head.weight' has shape [399, 64] in the checkpoint but the " \
              "model expects [400, 64]"
    with pytest.raises(VoiceChatError) as ours:
        load(folder)
    with pytest.raises(VoiceChatError) as theirs:
        sts.load_model(str(folder))
    assert str(ours.value) == str(theirs.value) == message


# --- 7: the RNNT vocabulary ------------------------------------------------------------------


def _edit_config(folder, edit):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


def test_checkpoint_without_rnnt_vocabulary(ckpt, copy_of, tmp_path, question, capsys):
    folder = copy_of(ckpt)
    _edit_config(folder, lambda c: c.pop("rnnt_vocabulary"))
    shutil.rmtree(folder / "rnnt_tokenizer")
    with pytest.raises(VoiceChatError, match="has no RNNT vocabulary"):
        load(folder)
    rc, _, err = _cli(["transcribe", "--model", folder, "--audio", question], capsys)
    _one_line_error(rc, err, "has no RNNT vocabulary")


def test_rnnt_vocabulary_shorter_than_the_joint(ckpt, copy_of):
    folder = copy_of(ckpt)
    _edit_config(folder, lambda c: c.update(rnnt_vocabulary=c["rnnt_vocabulary"][:10]))
    with pytest.raises(VoiceChatError, match="has 10 pieces but the transcript head has 40"):
        load(folder)


# --- 8, 10, 19: odd audio inputs -------------------------------------------------------------


def test_channel_layouts_by_shape(tiny):
    from mlx_voicechat.audio.io import load_audio

    tone = _wave(1.0)
    many = np.stack([tone] * 16)  # [16, N]: more channels than any layout allows
    with pytest.raises(VoiceChatError, match="ambiguous: time must be axis 0"):
        load_audio(many)
    with pytest.raises(VoiceChatError, match="ambiguous"):
        tiny.generate(many, extra_decoding_seconds=0.0)
    np.testing.assert_allclose(load_audio(np.stack([tone] * 3)), tone, atol=1e-6)  # [3, N]
    np.testing.assert_allclose(load_audio(np.stack([tone] * 3, axis=1)), tone, atol=1e-6)
    np.testing.assert_allclose(load_audio(tone[None]), tone)  # [1, N]
    np.testing.assert_allclose(load_audio(tone[:, None]), tone)  # [N, 1]
    with pytest.raises(VoiceChatError, match="ambiguous"):
        load_audio(np.ones((4, 6), np.float32))  # 4 samples of 6 channels, or 6 of 4?


def test_many_channel_file_is_mixed(tmp_path):
    from mlx_voicechat.audio.io import load_audio

    tone = _wave(0.5)
    sf.write(tmp_path / "m.wav", np.stack([tone] * 12, axis=1), 16000, subtype="FLOAT")
    np.testing.assert_allclose(load_audio(tmp_path / "m.wav"), tone, atol=1e-6)
    # A file's layout is never guessed: one frame of two channels is one sample.
    sf.write(tmp_path / "one.wav", np.array([[0.5, 0.25]], np.float32), 16000, subtype="FLOAT")
    np.testing.assert_allclose(load_audio(tmp_path / "one.wav"), [0.375])


def test_truncated_wav_warns_with_its_name(ckpt, tmp_path, capsys):
    from mlx_voicechat.audio.io import AudioWarning, load_audio

    full = tmp_path / "full.wav"
    sf.write(full, _wave(1.0), 16000, subtype="PCM_16")
    cut = tmp_path / "cut.wav"
    cut.write_bytes(full.read_bytes()[:20000])
    with pytest.warns(AudioWarning, match=f"audio file {cut} is truncated"):
        assert len(load_audio(cut)) == 9978
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_audio(full)  # an intact file: no warning
    rc, _, err = _cli(["transcribe", "--model", ckpt, "--audio", cut], capsys)
    assert rc == 0, err
    assert f"mlx-voicechat transcribe: warning: audio file {cut} is truncated" in err


def test_unreadable_audio_file(ckpt, question, tmp_path):
    audio = tmp_path / "q.wav"
    shutil.copy(question, audio)
    audio.chmod(0)
    rc, _, err = _unprivileged_cli(["transcribe", "--model", ckpt, "--audio", audio], audio)
    _one_line_error(rc, err, f"cannot read audio file {audio}: Permission denied")


def test_none_bytes_and_file_objects(tiny, question):
    with pytest.raises(VoiceChatError, match="no audio given"):
        tiny.generate(None)
    want = tiny.transcribe(str(question)).tokens
    assert tiny.transcribe(os.fsencode(str(question))).tokens == want
    with open(question, "rb") as f:
        assert tiny.transcribe(f).tokens == want
    with pytest.raises(VoiceChatError, match="a file path or an array .* got dict"):
        tiny.transcribe({"a": 1})


def test_info_on_quantized_weights_without_a_quantization_config(tmp_path, capsys):
    folder = make_checkpoint(tmp_path / "q", "tiny", quantize=4)
    _edit_config(folder, lambda c: [c.pop("quantization"), c.pop("quantization_config")])
    rc, out, err = _cli(["info", folder], capsys)
    assert rc == 0, err
    assert "None" not in out
    assert "4-bit, group 64, 15 modules (inferred from the weights" in out
    with pytest.raises(VoiceChatError, match="quantized but config.json has no quantization"):
        load(folder)


# --- 9, 15: group sizes ---------------------------------------------------------------------


@pytest.mark.parametrize("size", ["7", "0", "-64"])
def test_make_checkpoint_bad_group_size(size, tmp_path, capsys):
    args = ["make-checkpoint", tmp_path / "ck", "--quantize", "4", "--group-size", size]
    _one_line_error(*_cli(args, capsys)[::2], f"group size must be 32, 64 or 128, not {size}")
    assert list(tmp_path.iterdir()) == []


def test_convert_bad_group_size(ckpt, tmp_path, capsys):
    args = ["convert", "--source", ckpt, "--output", tmp_path / "o", "--quantize", "4",
            "--group-size", "0", "--quiet"]
    _one_line_error(*_cli(args, capsys)[::2], "--group-size must be 32, 64 or 128, not 0")


def test_config_group_size_mlx_cannot_use(tmp_path):
    folder = make_checkpoint(tmp_path / "q", "tiny", quantize=4)
    _edit_config(folder, lambda c: c["quantization"].update(group_size=7))
    with pytest.raises(VoiceChatError, match="group_size must be 32, 64 or 128, not 7"):
        load(folder)


# --- 14: config.json and tokenizer oddities ---------------------------------------------------


def test_config_json_that_is_a_list(ckpt, copy_of, capsys):
    folder = copy_of(ckpt)
    (folder / "config.json").write_text("[1, 2]")
    rc, _, err = _cli(["info", folder], capsys)
    _one_line_error(rc, err, "holds a JSON list; a checkpoint config is a JSON object")
    with pytest.raises(VoiceChatError, match="holds a JSON list"):
        load(folder)


def test_unreadable_config_json(ckpt, copy_of):
    folder = copy_of(ckpt)
    (folder / "config.json").chmod(0)
    rc, _, err = _unprivileged_cli(["info", folder], folder / "config.json")
    line = _one_line_error(rc, err, f"cannot read {folder / 'config.json'}: Permission denied")
    assert "JSON" not in line


def test_missing_tokenizer_folder(ckpt, question, tmp_path, capsys):
    missing = tmp_path / "no-tokenizer"
    args = _generate_args(ckpt, question, tmp_path / "r.wav", "--tokenizer", missing)
    _one_line_error(*_cli(args, capsys)[::2], f"tokenizer folder {missing} does not exist")
    with pytest.raises(VoiceChatError, match="^tokenizer folder .* does not exist$"):
        load(ckpt, tokenizer=str(missing))


# --- 17, 18: the ecosystem entry points ------------------------------------------------------


def test_mlx_lm_load(ckpt):
    # In a child whose start-up hook is this checkout's (an installed copy may be older).
    code = """
        import sys
        import numpy as np
        import mlx_lm
        from mlx_voicechat import load

        model, tokenizer = mlx_lm.load(sys.argv[1])
        wave = (0.1 * np.random.default_rng(0).standard_normal(12000)).astype(np.float32)
        kw = dict(system_prompt="Be brief.", extra_decoding_seconds=0.0, seed=1)
        got, want = model.generate(wave, **kw), load(sys.argv[1]).generate(wave, **kw)
        print("SAME", bool((got.codes == want.codes).all()), got.text == want.text,
              got.user_transcript == want.user_transcript)
        try:
            mlx_lm.load(sys.argv[2])
        except ValueError as e:
            print("NVIDIA", e)
    """
    r = _child(code, ckpt, NVIDIA)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "SAME True True True" in r.stdout
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("NVIDIA ")]
    assert "is NVIDIA's raw NemotronLabs VoiceChat release" in line
    assert "mlx_voicechat.load" in line and "mlx-voicechat convert" in line


def test_model_without_tokenizer_says_what_to_call(tiny):
    from mlx_voicechat.nemotron_voicechat import Model

    bare = Model(tiny.config)
    with pytest.raises(VoiceChatError, match=r"call model\.setup_tokenizer\(tokenizer\)"):
        bare.generate(_wave())


def test_mlx_audio_sts_generate_generic_flags(ckpt, question, tmp_path, capsys):
    from mlx_audio.sts.generate import main as sts_main

    out = tmp_path / "r.wav"
    with pytest.warns(UserWarning, match="ignores temperature, top_p"):
        sts_main(["--model", str(ckpt), "--audio", str(question), "--output-path", str(out),
                  "--sample-rate", "16000", "--temperature", "0.7", "--top-p", "0.9"])
    assert sf.info(str(out)).samplerate == 22050
    with pytest.raises(VoiceChatError, match="does not know: text"):
        sts_main(["--model", str(ckpt), "--audio", str(question), "--output-path", str(out),
                  "--text", "hello"])

def test_sample_rate_is_the_array_rate(tiny, question):
    wave = _wave(0.6)
    a = tiny.generate(wave[::2], sample_rate=8000, extra_decoding_seconds=0.0)
    b = tiny.generate(wave[::2], source_rate=8000, extra_decoding_seconds=0.0)
    np.testing.assert_array_equal(a.codes, b.codes)
    with pytest.raises(VoiceChatError, match="is at 16000 Hz, not the 8000 Hz given"):
        tiny.generate(str(question), sample_rate=8000)


# --- also: progress over the system prompt ---------------------------------------------------


def test_progress_for_the_prompt_phase(tiny):
    calls = []
    ids = [1] + [45] * 12 + [2]
    r = tiny.generate(_wave(), prompt=ids, extra_decoding_seconds=0.0,
                      prompt_progress=lambda d, t: calls.append((d, t)))
    # Each step the seed's prompt chain still had to run, then the end (the steps themselves
    # run once per seed: tests/test_promptchain.py).
    total = len(ids) - 1
    assert calls[-1] == (total, total) and all(t == total for _, t in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert r.frames > 0

"""`mlx-voicechat generate`, `python -m mlx_audio.sts.generate`, and bad inputs."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from mlx_voicechat.audio.io import AudioError
from mlx_voicechat.cli import main
from mlx_voicechat.errors import GenerationError, VoiceChatError

ROOT = Path(__file__).resolve().parents[2]
SPF = 1764


def _check_wav(path, frames=None):
    info = sf.info(str(path))
    assert info.samplerate == 22050 and info.channels == 1 and info.subtype == "PCM_16"
    assert info.frames % SPF == 0
    if frames is not None:
        assert info.frames == frames * SPF
    return info.frames // SPF


def test_mlx_voicechat_generate_subprocess(tiny_checkpoints, question, tmp_path):
    out = tmp_path / "reply.wav"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_voicechat",
            "generate",
            "--model",
            str(tiny_checkpoints["mlx-community"]),
            "--audio",
            str(question),
            "--output-audio",
            str(out),
            "-p",
            "Be brief.",
            "--extra-decoding-seconds",
            "0.5",
            "--seed",
            "1",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("[user] ")
    # 0.75 s + 0.5 s of silence = 20000 samples -> 125 mel frames -> 63 -> 32 -> 17 frames
    assert _check_wav(out) == 17


def test_mlx_audio_sts_generate_subprocess(tiny_checkpoints, question, tmp_path, capsys):
    out = tmp_path / "reply.wav"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_audio.sts.generate",
            "--model",
            str(tiny_checkpoints["mlx-community"]),
            "--audio",
            str(question),
            "--output-path",
            str(out),
            "--system-prompt",
            "Be brief.",
            "--seed",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    # The same run through our own command (mlx-audio's default: 3 s of trailing silence):
    # the same text, and audio within 2 LSB (mlx-audio's PCM16 writer rounds differently; a
    # code that differed would change whole frames by far more).
    ours = tmp_path / "ours.wav"
    rc = main(["generate", "--model", str(tiny_checkpoints["mlx-community"]), "--audio",
               str(question), "--output-audio", str(ours), "-p", "Be brief.", "--seed", "1",
               "--extra-decoding-seconds", "3", "--quiet"])
    assert rc == 0
    text = capsys.readouterr().out.splitlines()[1]
    assert out.with_suffix(".txt").read_text(encoding="utf-8") == text + "\n"
    assert _check_wav(out) == _check_wav(ours) == 48  # 0.75 s + 3 s: 60000 samples
    theirs, _ = sf.read(str(out), dtype="int16")
    mine, _ = sf.read(str(ours), dtype="int16")
    assert np.abs(theirs.astype(np.int32) - mine).max() <= 2
    assert np.abs(mine).max() > 100  # speech, not silence


def test_cli_in_process_prints_reply(tiny_checkpoints, question, tmp_path, capsys):
    out = tmp_path / "r.wav"
    rc = main(
        [
            "generate",
            "--model",
            str(tiny_checkpoints["mlx-community"]),
            "--audio",
            str(question),
            "--output-audio",
            str(out),
            "--extra-decoding-seconds",
            "0",
            "--quiet",
        ]
    )
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("[user] ")
    _check_wav(out)


# --- bad input -------------------------------------------------------------------------------


def _cli_error(args, capsys):
    rc = main(args)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1
    return err


def test_unreadable_audio(tiny_checkpoints, tmp_path, capsys):
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"not audio at all")
    out = tmp_path / "r.wav"
    err = _cli_error(
        [
            "generate",
            "--model",
            str(tiny_checkpoints["mlx-community"]),
            "--audio",
            str(bad),
            "--output-audio",
            str(out),
        ],
        capsys,
    )
    assert "cannot read audio file" in err
    assert not out.exists()


def test_empty_audio(tiny, tmp_path):
    empty = tmp_path / "empty.wav"
    sf.write(empty, np.zeros(0, dtype=np.float32), 16000)
    with pytest.raises(AudioError, match="is empty"):
        tiny.generate(str(empty))


def test_negative_extra_decoding_seconds(tiny, tiny_checkpoints, question, tmp_path, capsys):
    with pytest.raises(
        GenerationError, match="extra_decoding_seconds must be a finite number >= 0"
    ):
        tiny.generate(str(question), extra_decoding_seconds=-1.0)
    err = _cli_error(
        [
            "generate",
            "--model",
            str(tiny_checkpoints["mlx-community"]),
            "--audio",
            str(question),
            "--output-audio",
            str(tmp_path / "r.wav"),
            "--extra-decoding-seconds",
            "-1",
        ],
        capsys,
    )
    assert "--extra-decoding-seconds must be a finite number >= 0, got -1.0" in err


def test_prompt_longer_than_context(tiny, question):
    limit = tiny.config.text_args.max_position_embeddings
    with pytest.raises(GenerationError, match="LLM's context is"):
        tiny.generate(str(question), prompt=[1] + [45] * (limit - 2) + [2])
    assert issubclass(GenerationError, VoiceChatError)


def test_output_in_missing_folder(tiny_checkpoints, question, tmp_path, capsys):
    out = tmp_path / "missing" / "r.wav"
    err = _cli_error(
        [
            "generate",
            "--model",
            str(tiny_checkpoints["mlx-community"]),
            "--audio",
            str(question),
            "--output-audio",
            str(out),
        ],
        capsys,
    )
    assert "does not exist" in err
    assert not out.parent.exists()


def test_save_into_missing_folder_leaves_nothing(tiny, question, tmp_path):
    r = tiny.generate(str(question), system_prompt="", extra_decoding_seconds=0.0)
    with pytest.raises(AudioError, match="does not exist"):
        r.save(tmp_path / "nope" / "r.wav")
    assert list(tmp_path.iterdir()) == []


def test_system_prompt_string_longer_than_context(tiny, question):
    limit = tiny.config.text_args.max_position_embeddings
    with pytest.raises(GenerationError, match="LLM's context is"):
        tiny.generate(str(question), system_prompt="hello there " * limit)

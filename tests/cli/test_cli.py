"""The mlx-voicechat command line: verbs, output, and one-line errors with exit code 2."""

import json
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf


def cli(*args):
    r = subprocess.run(
        [sys.executable, "-m", "mlx_voicechat", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return r.returncode, r.stdout, r.stderr


def test_make_checkpoint_and_info(tmp_path):
    rc, out, err = cli("make-checkpoint", tmp_path / "ck", "--scale", "tiny", "--layout", "nvidia")
    assert rc == 0, err
    assert (tmp_path / "ck" / "model.safetensors").exists()
    rc, out, err = cli("info", tmp_path / "ck", "--json")
    assert rc == 0, err
    info = json.loads(out)
    assert info["layout"] == "nvidia" and info["quantization"] is None
    assert set(info["networks"]) == {"perception", "rnnt", "llm", "tts", "codec"}
    assert info["total_parameters"] == sum(n["parameters"] for n in info["networks"].values())


def test_info_quantized(oracle_dir):
    rc, out, err = cli("info", oracle_dir / "layouts" / "mlx-community-4bit")
    assert rc == 0, err
    assert "4-bit, group 64, 15 modules" in out
    # Quantized weights count as their unpacked parameters: same totals as float.
    rc2, out2, _ = cli("info", oracle_dir / "layouts" / "mlx-community-f32")
    assert out.splitlines()[-1] == out2.splitlines()[-1]


@pytest.mark.parametrize(
    "args, message",
    [
        (["info", "/nonexistent/ckpt"], "checkpoint folder /nonexistent/ckpt does not exist"),
        (
            ["make-checkpoint", "/tmp/x", "--layout", "nvidia", "--quantize", "4"],
            "NVIDIA's raw layout is float32 only",
        ),
    ],
)
def test_errors_are_one_line_exit_2(args, message):
    rc, out, err = cli(*args)
    assert rc == 2
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_transcribe(tmp_path, tiny_checkpoints):
    wav = tmp_path / "q.wav"
    sf.write(wav, (0.1 * np.random.default_rng(0).standard_normal(24000)).astype(np.float32), 16000)
    rc, out, err = cli(
        "transcribe", "--model", tiny_checkpoints["mlx-community"], "--audio", wav, "--benchmark"
    )
    assert rc == 0, err
    for field in ("mel:", "encoder:", "decode:", "RTF:"):
        assert field in out
    rc, out, err = cli(
        "transcribe",
        "--model",
        tiny_checkpoints["mlx-community"],
        "--audio",
        tmp_path / "missing.wav",
    )
    assert rc == 2 and "missing.wav" in err and "Traceback" not in err

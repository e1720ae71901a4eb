"""Entry-point registration: mlx-lm and mlx-audio find our model without importing it, for an
editable install (this checkout) and for a wheel."""

import os
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(code, env_extra=None, python=sys.executable, cwd=None, pythonpath=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_VOICECHAT")}
    # The editable-install tests import this checkout (a git worktree of the installed one
    # included); the wheel tests pass the wheel's dependency folder instead.
    env["PYTHONPATH"] = pythonpath or str(ROOT)
    env.update(env_extra or {})
    r = subprocess.run(
        [python, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd or "/",
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


MLX_LM = """
    import sys
    import mlx_lm
    model, tokenizer = mlx_lm.load({path!r})
    assert type(model).__module__ == "mlx_voicechat.nemotron_voicechat", type(model).__module__
    assert tokenizer.encode("hello")
    import mlx_lm.models.nemotron_voicechat as m
    print("OK", m.__name__, m.__spec__.name, sys.modules["mlx_lm.models.nemotron_voicechat"].__file__)
"""

MLX_AUDIO = """
    import mlx_audio.sts as sts
    model = sts.load_model({path!r})
    print("MODULE", type(model).__module__)
"""


def test_startup_does_not_import_mlx():
    out = run(
        "import sys; print('mlx' in sys.modules, [type(f).__name__ for f in sys.meta_path][0])"
    )
    assert out.split() == ["False", "PluginFinder"]


def test_disable_installs_no_finder():
    out = run(
        "import sys; print([type(f).__name__ for f in sys.meta_path])",
        {"MLX_VOICECHAT_DISABLE": "1"},
    )
    assert "PluginFinder" not in out


def test_mlx_lm_load_editable(tiny_checkpoints):
    out = run(MLX_LM.format(path=str(tiny_checkpoints["mlx-community"])))
    assert "OK mlx_voicechat.nemotron_voicechat mlx_voicechat.nemotron_voicechat" in out


def test_mlx_lm_text_generation_fails_clearly(tiny_checkpoints):
    code = f"""
        import mlx_lm
        model, tok = mlx_lm.load({str(tiny_checkpoints["mlx-community"])!r})
        try:
            mlx_lm.generate(model, tok, prompt="hi", max_tokens=2)
        except TypeError as e:
            print("ERR", e)
    """
    out = run(code)
    assert "ERR NemotronLabs VoiceChat is a speech-to-speech model" in out
    assert "mlx-voicechat generate" in out


def test_mlx_audio_load_model_uses_plugin(tiny_checkpoints):
    out = run(MLX_AUDIO.format(path=str(tiny_checkpoints["nvidia"])))
    assert "MODULE mlx_voicechat.nemotron_voicechat" in out


def test_override_off_lets_builtin_win(tiny_checkpoints):
    code = """
        import mlx_audio.sts.models.nemotron_voicechat as m
        print("FILE", m.__file__)
    """
    out = run(code, {"MLX_VOICECHAT_OVERRIDE": "0"})
    assert "mlx_audio/sts/models/nemotron_voicechat/__init__.py" in out
    out = run(code)
    assert "mlx_voicechat/nemotron_voicechat/__init__.py" in out


def test_submodule_alias():
    out = run("""
        import mlx_audio.sts.models.nemotron_voicechat.config as c
        import mlx_voicechat.config as ours
        print(c is ours)
        import mlx_lm.models.nemotron_voicechat.model as m
        import mlx_voicechat.nemotron_voicechat.model as own
        print(m is own)
    """)
    assert out.split() == ["True", "True"]


def test_post_load_hook_rejects_silently_missing_tensors(tmp_path, tiny_checkpoints):
    import shutil

    import mlx.core as mx

    d = tmp_path / "m"
    shutil.copytree(tiny_checkpoints["nvidia"], d)
    f = d / "model.safetensors"
    w = dict(mx.load(str(f)))
    w.pop("tts_model.tts_model.bos_emb")
    mx.save_safetensors(str(f), w)
    code = f"""
        import mlx_audio.sts as sts
        try:
            sts.load_model({str(d)!r})
        except Exception as e:
            print("ERR", type(e).__name__, e)
    """
    out = run(code)
    assert "ERR CheckpointError checkpoint is missing tensor 'tts_model.tts_model.bos_emb'" in out


@pytest.fixture(scope="module")
def wheel_python(tmp_path_factory):
    """A fresh venv with only our wheel in it; mlx and friends come from this interpreter's
    site-packages through PYTHONPATH (which runs no .pth files, so the editable install's
    finder stays out)."""
    root = tmp_path_factory.mktemp("wheel")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(root / "dist"),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    (wheel,) = (root / "dist").glob("mlx_voicechat-*.whl")
    venv.create(root / "venv", with_pip=False)
    py = root / "venv" / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import site; print(site.getsitepackages()[0])"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", site, str(wheel)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    import mlx

    deps = str(Path(mlx.__path__[0]).parent)
    return str(py), deps, site


def test_wheel_install_registers(wheel_python, tiny_checkpoints):
    py, deps, site = wheel_python
    out = run(
        MLX_LM.format(path=str(tiny_checkpoints["mlx-community"])), python=py, pythonpath=deps
    )
    assert f"{site}/mlx_voicechat/nemotron_voicechat/__init__.py" in out
    out = run(MLX_AUDIO.format(path=str(tiny_checkpoints["nvidia"])), python=py, pythonpath=deps)
    assert "MODULE mlx_voicechat.nemotron_voicechat" in out
    out = run("import sys; print('mlx' in sys.modules)", python=py, pythonpath=deps)
    assert out.strip() == "False"

"""MLX_VOICECHAT_BLAS: OpenBLAS in place of the mlx[cpu] wheel's reference BLAS, opt-in, and
what agrees under it (each check in a child process: the BLAS is chosen at interpreter start).

Under the wheel's BLAS a row of a batched product equals its one-row product bit for bit, so a
batched session equals its run alone exactly (tests/nemotron_voicechat/runtime/test_batch.py). OpenBLAS sums by blocks
that depend on the shapes: there the promise is agreement, ids and codes equal on the oracle
runs and audio within 1e-4."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import mlx_voicechat_boot  # noqa: E402  (the start-up hook's own module)

OPENBLAS = next((p for p in mlx_voicechat_boot.openblas_candidates() if os.path.exists(p)), None)
needs_openblas = pytest.mark.skipif(
    OPENBLAS is None, reason="OpenBLAS is not installed (Debian / Ubuntu: libopenblas0-pthread)"
)


def _child(code: str, blas: str = "", timeout: float = 600):
    env = dict(os.environ, MLX_VOICECHAT_BLAS=blas, PYTHONPATH=str(ROOT / "tests" / "support"))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
        timeout=timeout, cwd=str(ROOT),
    )


SYSTEM = """
    import json
    from mlx_voicechat.fastpaths.system import blas_in_effect
    import mlx.core as mx
    mx.eval(mx.ones((4, 4)) @ mx.ones((4, 4)))
    print(json.dumps(blas_in_effect()))
"""


def test_the_wheels_blas_by_default():
    r = _child(SYSTEM)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["blas"] == "the mlx[cpu] wheel's own reference BLAS", info
    assert r.stderr == ""


@needs_openblas
def test_openblas_when_asked_for():
    r = _child(SYSTEM, blas="openblas")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["blas"] == "OpenBLAS (loaded by MLX_VOICECHAT_BLAS)", info
    assert info["library"] == OPENBLAS and r.stderr == ""
    r = _child(SYSTEM, blas=OPENBLAS)  # a path works too
    assert json.loads(r.stdout)["library"] == OPENBLAS


def test_a_blas_that_cannot_be_loaded_is_one_line_and_changes_nothing(tmp_path):
    r = _child(SYSTEM, blas=str(tmp_path / "nope.so"))
    assert r.returncode == 0
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "cannot load it" in lines[0] and "MLX_VOICECHAT_BLAS" in lines[0]
    assert json.loads(r.stdout)["blas"] == "the mlx[cpu] wheel's own reference BLAS"
    not_a_library = tmp_path / "x.so"
    not_a_library.write_text("not a library")
    r = _child(SYSTEM, blas=str(not_a_library))
    assert len(r.stderr.splitlines()) == 1 and "cannot load it" in r.stderr


def test_mlx_imported_first_is_one_line():
    r = _child(
        """
        import mlx.core
        import mlx_voicechat_boot
        mlx_voicechat_boot.load_blas()
        print(mlx_voicechat_boot.BLAS[0])
        """,
        blas="openblas",
    )
    assert r.returncode == 0, r.stderr
    # the hook ran at start-up (before the import) or now, after it: either way one outcome
    assert r.stdout.strip() in ("not loaded", OPENBLAS or "not loaded")


def test_info_system_says_which_blas():
    r = _child("from mlx_voicechat.cli import main; raise SystemExit(main(['info', '--system', '--json']))")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["blas"] and "mlx" in info and "default_device" in info


AGREEMENT = """
    import json
    import numpy as np
    from oracle_utils import ORACLE
    from mlx_voicechat import load
    from mlx_voicechat.noise import ReplayNoise
    from mlx_voicechat.fastpaths.system import blas_in_effect

    io = dict(np.load(ORACLE / "04_voicechat_e2e_io.npz"))
    model = load(ORACLE / "nvidia-layout")
    prompt = io["prompt_tokens"][0].tolist()
    P = len(prompt)
    noise = lambda: ReplayNoise(io["noise_gumbel"], io["noise_randn"])
    out = model.generate(io["wav"][0], prompt=prompt, extra_decoding_seconds=0.0, noise=noise())
    s = model.session(prompt=prompt, noise=noise())
    events = s.feed(io["wav"][0]) + s.finish(0.0)
    frames = [e for e in events if not e.remainder]
    audio = np.concatenate([e.audio for e in events])[6:]
    # a batch of two: oracle 04 and another conversation alone
    wave2 = (0.1 * np.random.default_rng(2).standard_normal(16000)).astype(np.float32)
    alone = model.session(prompt=[1, 45, 2], seed=5)
    alone_events = alone.feed(wave2) + alone.finish(0.0)
    batch = model.session_batch(max_sessions=2)
    a, b = batch.open(prompt=prompt, noise=noise()), batch.open(prompt=[1, 45, 2], seed=5)
    a.push(io["wav"][0]); b.push(wave2)
    got = batch.step()
    a.finish(0.0); b.finish(0.0)
    more = batch.step()
    ea, eb = got[a] + more[a], got[b] + more[b]
    print(json.dumps({
        "blas": blas_in_effect()["blas"],
        "text_vs_nemo": out.text_ids == io["tokens_text"][0].tolist(),
        "codes_vs_nemo": bool(np.array_equal(out.codes, io["gen_codes"][0, P:])),
        "transcript_vs_nemo": out.user_transcript == str(io["rnnt_text"]),
        "session_ids": [e.text_id for e in frames] == out.text_ids,
        "session_codes": bool(np.array_equal(np.stack([e.codes for e in frames]), out.codes)),
        "session_audio": float(np.max(np.abs(audio - out.audio))),
        "batch_ids": [e.text_id for e in ea] == [e.text_id for e in events]
            and [e.text_id for e in eb] == [e.text_id for e in alone_events],
        "batch_codes": all(np.array_equal(x.codes, y.codes) for x, y in zip(ea + eb, events + alone_events)),
        "batch_audio": max(float(np.max(np.abs(x.audio - y.audio))) for x, y in zip(ea + eb, events + alone_events)),
    }))
"""


@pytest.mark.parametrize("blas", ["", pytest.param("openblas", marks=needs_openblas)])
def test_oracle_runs_agree_under_each_blas(blas):
    """The oracle 04 run against NeMo (ids, codes, transcript equal), a session against offline
    and a batch of two against each alone: exact with the wheel's BLAS, ids and codes equal and
    audio within 1e-4 under OpenBLAS."""
    r = _child(AGREEMENT, blas=blas)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.splitlines()[-1])
    assert ("OpenBLAS" in res["blas"]) == (blas == "openblas"), res
    for key in ("text_vs_nemo", "codes_vs_nemo", "transcript_vs_nemo", "session_ids",
                "session_codes", "batch_ids", "batch_codes"):
        assert res[key] is True, (key, res)
    bound = 1e-6 if not blas else 1e-4  # the session's claim with the wheel's BLAS is 1e-6
    assert res["session_audio"] <= bound, res
    if not blas:
        assert res["batch_audio"] == 0.0, res  # bit for bit
    else:
        assert res["batch_audio"] <= 1e-4, res

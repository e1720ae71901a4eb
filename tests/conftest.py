"""Fixtures local to this folder's tests (the shared ones are in the top-level conftest.py).

``MLX_VOICECHAT_TEST_DEVICE=gpu`` (or ``cpu``) runs the tests on that MLX device (its default
device for the whole run): how ``benchmarks/bench_device.py`` runs the oracle tests on a GPU."""

import os

import pytest

_TEST_DEVICE = os.environ.get("MLX_VOICECHAT_TEST_DEVICE", "").strip().lower()
if _TEST_DEVICE:
    import mlx.core as mx

    if _TEST_DEVICE not in ("cpu", "gpu"):
        raise pytest.UsageError(
            f"MLX_VOICECHAT_TEST_DEVICE must be cpu or gpu, not {_TEST_DEVICE!r}"
        )
    _device = mx.gpu if _TEST_DEVICE == "gpu" else mx.cpu
    if not mx.is_available(_device):
        raise pytest.UsageError(
            f"MLX_VOICECHAT_TEST_DEVICE={_TEST_DEVICE}: this MLX ({mx.__version__}) has no "
            f"{_TEST_DEVICE} backend (install mlx[cuda13] for NVIDIA GPUs)"
        )
    mx.set_default_device(_device)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    """The tiny mlx-community checkpoint, loaded once per test module."""
    from mlx_voicechat import load

    return load(tiny_checkpoints["mlx-community"])


@pytest.fixture(scope="module")
def question(tmp_path_factory):
    """0.75 s of quiet noise at 16 kHz as a WAV file (a stand-in for a spoken question)."""
    import numpy as np
    import soundfile as sf

    path = tmp_path_factory.mktemp("q") / "question.wav"
    rng = np.random.default_rng(0)
    sf.write(path, (0.1 * rng.standard_normal(12000)).astype(np.float32), 16000)
    return path


@pytest.fixture(scope="module")
def nvidia():
    """Oracle 04's weights in NVIDIA's raw layout, loaded once per test module."""
    from oracle_utils import ORACLE

    from mlx_voicechat import load

    return load(ORACLE / "nvidia-layout")


@pytest.fixture(scope="module")
def io04():
    """Oracle 04's recorded inputs and outputs."""
    import numpy as np
    from oracle_utils import ORACLE

    return dict(np.load(ORACLE / "04_voicechat_e2e_io.npz"))


SYNC_METHODS = ("item", "tolist", "__array__", "__int__", "__float__", "__bool__", "__index__")


@pytest.fixture
def sync_count(monkeypatch):
    """Counts host reads of array values and explicit evals."""
    import mlx.core as mx

    count = [0]

    def counting(orig):
        def f(*a, **k):
            count[0] += 1
            return orig(*a, **k)

        return f

    for name in SYNC_METHODS:
        monkeypatch.setattr(mx.array, name, counting(getattr(mx.array, name)))
    monkeypatch.setattr(mx, "eval", counting(mx.eval))
    return count

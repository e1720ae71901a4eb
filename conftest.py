"""What every test shares: the offline environment, the oracle fixtures' folder and the tiny
random-weight checkpoints. Local helpers live in ``tests/conftest.py``."""

import os
from pathlib import Path

import pytest

ORACLE = Path(__file__).parent / "tests" / "fixtures" / "oracle"

# No test reaches the network: hub lookups fail fast instead of waiting on a connection.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def oracle_dir():
    """The NeMo oracle fixtures (``tests/fixtures/oracle``, described in its README)."""
    return ORACLE


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Factory checkpoints of the same random weights in every layout, float and 4-bit."""
    from mlx_voicechat.factory import make_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for layout in ("mlx-community", "nvidia", "mlx-audio"):
        out[layout] = make_checkpoint(
            root / layout, "tiny", layout, seed=0, max_shard_bytes=1 << 20
        )
    for layout in ("mlx-community", "mlx-audio"):
        out[layout + "-4bit"] = make_checkpoint(
            root / (layout + "-4bit"), "tiny", layout, quantize=4, seed=0
        )
    return out

"""Fixtures local to this folder's tests (the shared ones are in the top-level conftest.py)."""

import pytest


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    """The tiny mlx-community checkpoint, loaded once per test module."""
    from mlx_voicechat import load

    return load(tiny_checkpoints["mlx-community"])

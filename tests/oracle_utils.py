"""Shared helpers for the tests that load oracle weights into single networks."""

from pathlib import Path

import mlx.core as mx

from mlx_voicechat.sanitize import sanitize_module

ORACLE = Path(__file__).parent / "fixtures" / "oracle"


def strip_prefix(weights, prefix):
    """The tensors under ``prefix``, with the prefix removed from their keys."""
    return {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}


def load_module(module, weights):
    """Load NeMo-layout ``weights`` (keys relative to ``module``) strictly into ``module``."""
    module.load_weights(list(sanitize_module(module, weights).items()), strict=True)
    mx.eval(module.parameters())
    return module

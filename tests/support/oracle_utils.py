"""Shared helpers for the tests that load oracle weights into single networks."""

from pathlib import Path

import mlx.core as mx

from mlx_voicechat.nemotron_voicechat.weights.sanitize import sanitize_module

ORACLE = Path(__file__).resolve().parents[1] / "fixtures" / "oracle"


def strip_prefix(weights, prefix):
    """The tensors under ``prefix``, with the prefix removed from their keys."""
    return {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}


def load_module(module, weights):
    """Load NeMo-layout ``weights`` (keys relative to ``module``) strictly into ``module``."""
    module.load_weights(list(sanitize_module(module, weights).items()), strict=True)
    mx.eval(module.parameters())
    return module


def replay_04(model):
    """Oracle 04's offline run on ``model``: its WAV and prompt ids, no extra decoding, the
    recorded draws replayed. Returns (result, noise source, io arrays)."""
    import numpy as np

    from mlx_voicechat.noise import ReplayNoise

    io = dict(np.load(ORACLE / "04_voicechat_e2e_io.npz"))
    noise = ReplayNoise(io["noise_gumbel"], io["noise_randn"])
    out = model.generate(
        io["wav"][0],
        prompt=io["prompt_tokens"][0].tolist(),
        extra_decoding_seconds=0.0,
        noise=noise,
    )
    return out, noise, io

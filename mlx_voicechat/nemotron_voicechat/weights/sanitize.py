"""Checkpoint key and layout rules: NeMo/PyTorch layouts to this package's MLX layout and back.

Every rule is gated on the key and on the shape the model expects, so MLX-layout tensors pass
untouched and sanitizing twice changes nothing (errata 13).
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, Mapping, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

# Tensors NVIDIA's release carries that no inference path reads. Dropped by name, so that a
# checkpoint without them (mlx-audio's converter omits them) loads just the same.
TRAINING_ONLY = (re.compile(r"(^|\.)audio_prompt_projection_W$"),)

# Key renames: (pattern, replacement). Torch names on the left, ours on the right.
RENAMES = (
    # MLX modules do not hold `_`-prefixed attributes as parameters.
    (re.compile(r"^(.*)\._control_codes$"), r"\1.control_codes"),
    (
        re.compile(r"^((?:.*\.)?prvq)\._variance_list\.(\d+)\.variance$"),
        r"\1.variance_list.\2.variance",
    ),
    # NeMo's RNNTJoint without dropout numbers its last Linear 1, with dropout 2 (the release).
    (re.compile(r"^(.*joint_net)\.1\.(weight|bias)$"), r"\1.2.\2"),
)

_LSTM = re.compile(
    r"^(?P<prefix>.*\.lstm)\.(?P<kind>weight_ih|weight_hh|bias_ih|bias_hh)_l(?P<layer>\d+)$"
)


def expected_shapes(model) -> Dict[str, Tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}


def conv_transpose_keys(model) -> frozenset:
    """Weight keys of the model's ConvTranspose1d layers (PyTorch stores them [I, O, K])."""
    return frozenset(
        f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.ConvTranspose1d)
    )


def _to_mlx_layout(v: mx.array, want: Tuple[int, ...], transposed: bool) -> Optional[mx.array]:
    """``v`` re-laid-out to ``want`` if it is a PyTorch conv kernel of that shape, else None."""
    shape = tuple(v.shape)
    if v.ndim == 3:
        if transposed:
            # ConvTranspose1d [I, O, K] -> [O, K, I]
            if (shape[1], shape[2], shape[0]) == want:
                return v.transpose(1, 2, 0)
            return None
        # Conv1d [O, I/g, K] -> [O, K, I/g]
        if (shape[0], shape[2], shape[1]) == want:
            return v.transpose(0, 2, 1)
    if v.ndim == 4 and (shape[0], shape[2], shape[3], shape[1]) == want:
        # Conv2d [O, I/g, kh, kw] -> [O, kh, kw, I/g]
        return v.transpose(0, 2, 3, 1)
    return None


def rename(key: str, rules=RENAMES) -> str:
    """``key`` through each (pattern, replacement) of ``rules`` in order."""
    for pattern, repl in rules:
        key = pattern.sub(repl, key)
    return key


def sanitize(
    weights: Mapping[str, mx.array],
    shapes: Mapping[str, Tuple[int, ...]],
    conv_transpose: Iterable[str] = (),
) -> Dict[str, mx.array]:
    """Map checkpoint tensors onto a model whose parameters have ``shapes``.

    Unknown keys are kept as they are (strict loading reports them); quantized tensors
    (with ``.scales`` beside them) are never re-laid-out.
    """
    out: Dict[str, mx.array] = {}
    lstm: Dict[Tuple[str, int], Dict[str, mx.array]] = {}
    quantized = {k[: -len(".scales")] for k in weights if k.endswith(".scales")}
    conv_transpose = frozenset(conv_transpose)
    for key, v in weights.items():
        if any(p.search(key) for p in TRAINING_ONLY):
            continue
        m = _LSTM.match(key)
        if m:
            lstm.setdefault((m["prefix"], int(m["layer"])), {})[m["kind"]] = v
            continue
        key = rename(key)
        want = shapes.get(key)
        module = key.rsplit(".", 1)[0]
        if want is not None and tuple(v.shape) != want and module not in quantized:
            relaid = _to_mlx_layout(v, want, key in conv_transpose)
            if relaid is not None:
                v = relaid
        if v.dtype == mx.int64:
            v = v.astype(mx.int32)
        out[key] = v
    for (prefix, layer), parts in lstm.items():
        base = f"{prefix}.{layer}"
        for kind, name in (("weight_ih", "Wx"), ("weight_hh", "Wh")):
            if kind in parts:
                out[f"{base}.{name}"] = parts[kind]
        biases = [parts[b] for b in ("bias_ih", "bias_hh") if b in parts]
        if biases:
            out[f"{base}.bias"] = sum(biases[1:], biases[0])
    return out


# --- back to PyTorch layouts ----------------------------------------------------------------

_TORCH_CONV1D = re.compile(
    r"(\.(depthwise_conv|pointwise_conv1|pointwise_conv2|dwconv|pwconv1|pwconv2|conv1d)\.weight$)"
    r"|(audio_codec\.(encoder|decoder)\.layers\.\d+\.weight$)"
)
_TORCH_CONV2D = re.compile(r"pre_encode\.conv\.\d+\.weight$")
_OUR_LSTM = re.compile(r"^(?P<prefix>.*\.lstm)\.(?P<layer>\d+)\.(?P<name>Wx|Wh|bias)$")


def to_torch_layout(
    weights: Mapping[str, mx.array], conv_transpose: Iterable[str] = ()
) -> Dict[str, mx.array]:
    """Inverse of :func:`sanitize` for MLX-layout weights: NeMo key names and PyTorch layouts,
    as NVIDIA and mlx-community checkpoints store them. ``conv_transpose`` lists the
    ConvTranspose1d weight keys (see :func:`conv_transpose_keys`)."""
    conv_t = frozenset(conv_transpose)
    out: Dict[str, mx.array] = {}
    for key, v in weights.items():
        m = _OUR_LSTM.match(key)
        if m:
            name = {"Wx": "weight_ih", "Wh": "weight_hh", "bias": "bias_ih"}[m["name"]]
            out[f"{m['prefix']}.{name}_l{m['layer']}"] = v
            if name == "bias_ih":  # ours is the sum of torch's two biases
                out[f"{m['prefix']}.bias_hh_l{m['layer']}"] = mx.zeros_like(v)
            continue
        if key in conv_t and v.ndim == 3:
            v = v.transpose(2, 0, 1)  # [O, K, I] -> [I, O, K]
        elif _TORCH_CONV1D.search(key) and v.ndim == 3:
            v = v.transpose(0, 2, 1)
        elif _TORCH_CONV2D.search(key) and v.ndim == 4:
            v = v.transpose(0, 3, 1, 2)
        if key.endswith(".control_codes"):
            key = key[: -len("control_codes")] + "_control_codes"
        key = re.sub(r"\.prvq\.variance_list\.", ".prvq._variance_list.", key)
        out[key] = v.astype(mx.int64) if v.dtype == mx.int32 else v
    return out


def sanitize_module(module, weights: Mapping[str, mx.array]) -> Dict[str, mx.array]:
    """Sanitize ``weights`` (keys relative to ``module``) for ``module``; handy in tests."""
    return sanitize(weights, expected_shapes(module), conv_transpose_keys(module))

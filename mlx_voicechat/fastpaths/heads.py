"""The LLM's greedy heads: one id per frame from a ``[vocab, hidden]`` projection.

On the CPU a big head is one BLAS call on one core, so :func:`greedy_id` can multiply the second
half of its rows on another stream (fast path ``heads.split``); each logit is the same dot
product either way, so the id is bit-identical, ties included. Only heads whose row slices are
views are split (quantized or half precision, not a column-major float32 one).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from .. import fastpaths
from . import on_cpu

#: Heads with fewer rows are not split: one call costs less than the second stream's hand-off.
SPLIT_MIN_ROWS = 16384


def _rows(linear: nn.Module, x: mx.array, lo: int, hi: int) -> mx.array:
    """``linear(x)`` for output rows ``lo:hi`` only, on row slices of the parameters."""
    if isinstance(linear, nn.QuantizedLinear):
        biases = linear.get("biases")
        out = mx.quantized_matmul(
            x,
            linear.weight[lo:hi],
            scales=linear.scales[lo:hi],
            biases=None if biases is None else biases[lo:hi],
            transpose=True,
            group_size=linear.group_size,
            bits=linear.bits,
            mode=getattr(linear, "mode", "affine"),
        )
        bias = linear.get("bias")
        return out if bias is None else out + bias[lo:hi]
    if "bias" in linear:  # as nn.Linear does
        return mx.addmm(linear.bias[lo:hi], x, linear.weight[lo:hi].T)
    return x @ linear.weight[lo:hi].T


def rows(linear: nn.Module) -> int:
    return linear.weight.shape[0]


def should_split(linear: nn.Module) -> bool:
    """Whether :func:`greedy_id` gains from splitting ``linear`` here (see the module)."""
    if not fastpaths.enabled("heads.split") or not on_cpu() or rows(linear) < SPLIT_MIN_ROWS:
        return False
    return isinstance(linear, nn.QuantizedLinear) or linear.weight.dtype != mx.float32


def greedy_id(linear: nn.Module, h: mx.array, split: Optional[mx.Stream] = None) -> mx.array:
    """The argmax of ``linear(h)`` over its rows, as int32 ``[B]`` for ``h`` ``[B, 1, H]``;
    with ``split``, the second half of the rows runs on that stream."""
    if split is None:
        logits = linear(h)
    else:
        half = rows(linear) // 2
        first = _rows(linear, h, 0, half)
        with mx.stream(split):
            second = _rows(linear, h, half, rows(linear))
        logits = mx.concatenate([first, second], axis=-1)
    return mx.argmax(logits, axis=-1).reshape(-1).astype(mx.int32)

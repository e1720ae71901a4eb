"""Where the weights' bytes lie: float32 ``Linear`` weights column-major on the CPU.

MLX's CPU backend multiplies float32 matrices with ``cblas_sgemm``, and the BLAS that the Linux
``mlx[cpu]`` wheel ships is the reference one. ``nn.Linear`` computes ``x @ W.T`` with ``W``
stored row-major ``[out, in]``: the transposed case, which that BLAS runs markedly slower than
the plain one (BENCHMARKS.md has the figures).

:func:`use_cpu_layout` stores such a weight's data as ``W.T`` made contiguous and keeps ``W`` as
its transposed view. The parameter keeps its shape, dtype and values, so saving, quantizing,
converting and comparing parameters are unaffected; only ``x @ W.T`` becomes the plain case.
The BLAS sums each output in the same order either way, so outputs are bit-identical (tested).

Pointwise convolutions marked with :func:`as_matrix` (their module multiplies them as
matrices, ``nets.conv_products``) are stored the same way: the data ``[in, out]`` contiguous, the
weight ``[out, 1.., in]`` a view of it.

Left alone: half-precision weights (MLX multiplies them without BLAS and the column-major
layout is slower there), quantized layers (MLX's own kernels), anything on a GPU, and
``Linear`` layers whose weight is read directly rather than multiplied (marked with
:func:`keep_row_major`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .derived import reset_derived

_FLAG = "_cpu_layout_done"
_KEEP = "_keep_row_major"
_MATRIX = "_cpu_layout_matrix"


def keep_row_major(linear: nn.Linear) -> nn.Linear:
    """Mark ``linear`` as read directly (``weight.reshape`` etc.): it keeps its row-major data."""
    setattr(linear, _KEEP, True)
    return linear


def as_matrix(conv: nn.Module) -> nn.Module:
    """Mark a pointwise ``conv`` as multiplied as a matrix: :func:`use_cpu_layout` moves it."""
    setattr(conv, _MATRIX, True)
    return conv


def _pointwise_view(w: mx.array):
    """A float32 pointwise conv weight ``[out, 1.., in]`` as a view of its ``[in, out]``
    contiguous transpose, or None for any other weight."""
    if w.dtype != mx.float32 or w.ndim < 3 or any(k != 1 for k in w.shape[1:-1]):
        return None
    data = mx.contiguous(w.reshape(w.shape[0], w.shape[-1]).T)
    return data.T.reshape(w.shape)


def on_cpu() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


def use_cpu_layout(model: nn.Module) -> int:
    """Store the float32 ``Linear`` weights of ``model`` column-major when MLX runs on the CPU
    (and the pointwise convolutions marked with :func:`as_matrix`).

    One tensor at a time (the extra memory is one weight), once per model; returns how many
    weights were moved. Does nothing on a GPU or when already done."""
    if getattr(model, _FLAG, False) or not on_cpu():
        return 0
    moved = 0
    for _, module in model.named_modules():
        if getattr(module, _MATRIX, False):
            w = _pointwise_view(module.weight)
            if w is None:
                continue
        elif type(module) is not nn.Linear or getattr(module, _KEEP, False):
            continue
        else:
            w = module.weight
            if w.dtype != mx.float32 or w.ndim != 2:
                continue
            w = mx.contiguous(w.T).T
        mx.eval(w)
        module.weight = w
        moved += 1
    setattr(model, _FLAG, True)
    if moved:
        reset_derived(model)
    return moved

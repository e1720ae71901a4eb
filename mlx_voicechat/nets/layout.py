"""Where the weights' bytes lie: float32 ``Linear`` weights column-major on the CPU.

MLX's CPU backend multiplies float32 matrices with ``cblas_sgemm``, and the BLAS that the Linux
``mlx[cpu]`` wheel ships is the reference one. ``nn.Linear`` computes ``x @ W.T`` with ``W``
stored row-major ``[out, in]``: the transposed case, which that BLAS runs markedly slower than
the plain one (BENCHMARKS.md has the figures).

:func:`use_cpu_layout` stores such a weight's data as ``W.T`` made contiguous and keeps ``W`` as
its transposed view. The parameter keeps its shape, dtype and values, so saving, quantizing,
converting and comparing parameters are unaffected; only ``x @ W.T`` becomes the plain case.
The BLAS sums each output in the same order either way, so outputs are bit-identical (tested).

Left alone: half-precision weights (MLX multiplies them without BLAS and the column-major
layout is slower there), quantized layers (MLX's own kernels), anything on a GPU, and
``Linear`` layers whose weight is read directly rather than multiplied (marked with
:func:`keep_row_major`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .version import bump

_FLAG = "_cpu_layout_done"
_KEEP = "_keep_row_major"


def keep_row_major(linear: nn.Linear) -> nn.Linear:
    """Mark ``linear`` as read directly (``weight.reshape`` etc.): it keeps its row-major data."""
    object.__setattr__(linear, _KEEP, True)
    return linear


def on_cpu() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


def use_cpu_layout(model: nn.Module) -> int:
    """Store the float32 ``Linear`` weights of ``model`` column-major when MLX runs on the CPU.

    One tensor at a time (the extra memory is one weight), once per model; returns how many
    weights were moved. Does nothing on a GPU or when already done."""
    if getattr(model, _FLAG, False) or not on_cpu():
        return 0
    moved = 0
    for _, module in model.named_modules():
        if type(module) is not nn.Linear or getattr(module, _KEEP, False):
            continue
        w = module.weight
        if w.dtype != mx.float32 or w.ndim != 2:
            continue
        w = mx.contiguous(w.T).T
        mx.eval(w)
        module.weight = w
        moved += 1
    object.__setattr__(model, _FLAG, True)
    if moved:
        bump(model)
    return moved

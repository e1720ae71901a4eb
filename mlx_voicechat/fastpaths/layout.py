"""Float32 weights stored column-major on the CPU (:func:`use_cpu_layout`), so that ``x @ W.T``
is BLAS's plain case, which the reference BLAS of the Linux ``mlx[cpu]`` wheel runs much faster
than the transposed one (BENCHMARKS.md). The parameter keeps its shape, dtype and values (a
transposed view of ``W.T`` made contiguous) and each output sums in the same order: bit-identical.

Moved: ``Linear`` weights (but those marked :func:`keep_row_major`), pointwise convs marked
:func:`as_matrix`, ``nn.LSTM`` weights (whose layers become :class:`ColumnLSTM`, fast path
``rnnt.lstm_step``); convs marked ``conv_products.products`` become product convs
(``encoder.convs``). Left alone: half precision (no BLAS there; column-major is slower),
quantized layers, any GPU.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .. import fastpaths
from ..derived import reset_derived
from . import on_cpu
from .conv_products import PRODUCT_CLASSES, PRODUCTS

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


class ColumnLSTM(nn.LSTM):
    """``nn.LSTM`` on column-major float32 weights. Its ``addmm`` would, in BLAS's plain case,
    add the product's terms to the bias (other bits than the transposed case), so each product
    is computed first and then added: ``nn.LSTM``'s bits on row-major weights (tested)."""

    def __call__(self, x, hidden=None, cell=None):
        if self.Wx.dtype != mx.float32 or not on_cpu():  # set_dtype or a device since load
            return super().__call__(x, hidden, cell)
        x = x @ self.Wx.T
        if self.bias is not None:
            x = x + self.bias
        all_hidden, all_cell = [], []
        for idx in range(x.shape[-2]):
            ifgo = x[..., idx, :]
            if hidden is not None:
                ifgo = hidden @ self.Wh.T + ifgo
            i, f, g, o = mx.split(ifgo, 4, axis=-1)
            i, f, g, o = mx.sigmoid(i), mx.sigmoid(f), mx.tanh(g), mx.sigmoid(o)
            cell = f * cell + i * g if cell is not None else i * g
            hidden = o * mx.tanh(cell)
            all_cell.append(cell)
            all_hidden.append(hidden)
        return mx.stack(all_hidden, axis=-2), mx.stack(all_cell, axis=-2)


def _move(module: nn.Module, name: str) -> int:
    """Store ``module``'s float32 matrix ``name`` column-major (its data ``W.T`` contiguous, the
    parameter a view of it); 1 when moved."""
    w = getattr(module, name)
    if w.dtype != mx.float32 or w.ndim != 2:
        return 0
    w = mx.contiguous(w.T).T
    mx.eval(w)
    setattr(module, name, w)
    return 1


def use_cpu_layout(model: nn.Module) -> int:
    """Move ``model``'s weights as the module docstring says, on the CPU, once per model, one
    tensor at a time (the extra memory is one weight); returns how many were moved."""
    if getattr(model, _FLAG, False) or not on_cpu():
        return 0
    moved = 0
    for _, module in model.named_modules():
        if getattr(module, _MATRIX, False):
            w = _pointwise_view(module.weight)
            if w is not None:
                mx.eval(w)
                module.weight = w
                moved += 1
        elif type(module) is nn.LSTM:
            if module.Wx.dtype == mx.float32 and fastpaths.enabled("rnnt.lstm_step"):
                moved += _move(module, "Wx") + _move(module, "Wh")
                module.__class__ = ColumnLSTM  # the same parameters, multiplied in this layout
        elif type(module) is nn.Linear and not getattr(module, _KEEP, False):
            moved += _move(module, "weight")
        if getattr(module, PRODUCTS, False) and type(module) in PRODUCT_CLASSES:
            module.__class__ = PRODUCT_CLASSES[type(module)]  # the same layer, run as products
    setattr(model, _FLAG, True)
    if moved:
        reset_derived(model)
    return moved

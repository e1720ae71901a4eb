"""The speech encoders' convolutions as matrix products and shifted sums (``encoder.convs``).

MLX's CPU convolution sums each output's window one term at a time in window order, then adds
the bias; these forms make the same sums in the same order (bit-identical, tested): a pointwise
conv as ``x @ W.T``, a one-input-channel 2-D conv as its windows times ``W.T``, a depthwise 2-D
conv as a sum of strided slices times their taps. Anything else (other convs, half precision,
quantized, other devices) runs the layer itself. A network marks its convs with
:func:`products`; ``layout.use_cpu_layout`` makes them :class:`ProductConv1d` /
:class:`ProductConv2d` (the same layer, called as :func:`conv`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .. import fastpaths
from . import on_cpu

PRODUCTS = "_cpu_products"


def _pair(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


def products(layer: nn.Module) -> nn.Module:
    """Mark a convolution as one that runs as products where they apply (see the module)."""
    setattr(layer, PRODUCTS, True)
    return layer


def plain(layer, x: mx.array) -> mx.array:
    """``layer(x)`` as MLX's own layer computes it (a product convolution's base class)."""
    for base in (nn.Conv2d, nn.Conv1d):
        if isinstance(layer, base):
            return base.__call__(layer, x)
    return layer(x)


def applies(layer) -> bool:
    """Whether ``layer`` (an ``nn.Conv1d`` / ``nn.Conv2d``) runs as products here."""
    if not isinstance(layer, (nn.Conv1d, nn.Conv2d)) or not fastpaths.enabled("encoder.convs"):
        return False
    w = layer.weight
    if w.dtype != mx.float32 or not on_cpu():
        return False
    if any(d != 1 for d in _pair(layer.dilation)) or any(p for p in _pair(layer.padding)):
        return False
    spatial = w.shape[1:-1]
    if all(k == 1 for k in spatial):
        return layer.groups == 1 and all(s == 1 for s in _pair(layer.stride))
    if w.ndim != 4 or w.shape[-1] != 1:  # 2-D, one input channel per group
        return False
    return layer.groups in (1, w.shape[0])


def conv(layer, x: mx.array) -> mx.array:
    """``layer(x)`` for a channels-last ``x``: as products where :func:`applies`, else the
    layer itself."""
    if not applies(layer):
        return plain(layer, x)
    w = layer.weight
    if all(k == 1 for k in w.shape[1:-1]):
        y = x @ _rows(w).T
    elif layer.groups == 1:
        y = _im2col(x, w, _pair(layer.stride))
    else:
        y = _depthwise(x, w, _pair(layer.stride))
    return y + layer.bias if "bias" in layer else y


def _rows(w: mx.array) -> mx.array:
    """A pointwise weight ``[O, 1.., I]`` as ``[O, I]`` (a view: column-major data stays so)."""
    return w[:, 0, :] if w.ndim == 3 else w[:, 0, 0, :]


def _windows(x: mx.array, kernel, stride) -> mx.array:
    """Every ``kernel`` window of ``x`` [B, H, W, C] at ``stride``: a view [B, Ho, Wo, kh, kw, C]
    (``as_strided`` reads ``x`` in its row-major order)."""
    B, H, W, C = x.shape
    Ho, Wo = (H - kernel[0]) // stride[0] + 1, (W - kernel[1]) // stride[1] + 1
    shape = (B, Ho, Wo, kernel[0], kernel[1], C)
    return mx.as_strided(x, shape, (H * W * C, stride[0] * W * C, stride[1] * C, W * C, C, 1))


def _im2col(x: mx.array, w: mx.array, stride) -> mx.array:
    """A one-input-channel conv's windows, taps in ``(kh, kw)`` order, times ``W.T``."""
    win = _windows(x, w.shape[1:3], stride)
    cols = win.reshape(*win.shape[:3], -1)
    return cols @ mx.contiguous(w.reshape(w.shape[0], -1).T)


def _depthwise(x: mx.array, w: mx.array, stride) -> mx.array:
    """Each tap's strided slice times the tap, summed in ``(kh, kw)`` order."""
    kh, kw = w.shape[1:3]
    terms = _windows(x, (kh, kw), stride) * w[..., 0].transpose(1, 2, 0)
    y = terms[:, :, :, 0, 0]
    for i in range(kh):
        for j in range(kw):
            if i or j:
                y = y + terms[:, :, :, i, j]
    return y


class ProductConv1d(nn.Conv1d):
    """``nn.Conv1d`` whose call is :func:`conv`: products where they apply, else its own."""

    def __call__(self, x):
        return conv(self, x)


class ProductConv2d(nn.Conv2d):
    """``nn.Conv2d`` whose call is :func:`conv`: products where they apply, else its own."""

    def __call__(self, x):
        return conv(self, x)


PRODUCT_CLASSES = {nn.Conv1d: ProductConv1d, nn.Conv2d: ProductConv2d}

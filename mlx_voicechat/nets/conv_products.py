"""The speech encoders' convolutions as matrix products and shifted sums (``encoder.convs``).

MLX's CPU convolution computes each output as a sum over its window, one term at a time in
window order, then adds the bias. These forms make the same sums in the same order with fewer,
larger operations (bit-identical on the CPU, tested in ``tests/test_fastpaths.py``):

* a pointwise conv (kernel 1, stride 1, one group): ``x @ W.T``, then the bias. BLAS sums each
  output over the input channels in order. Weights marked with :func:`layout.as_matrix` are
  stored column-major by ``layout.use_cpu_layout``, so the product is BLAS's plain case;
* a 2-D conv with one input channel (the first subsampling conv): the windows gathered in
  ``(kh, kw)`` order times ``W.T``, then the bias;
* a depthwise 2-D conv (one channel per group): the sum of ``kh * kw`` strided slices, each times
  its tap, in ``(kh, kw)`` order, then the bias.

Any other conv, half-precision or quantized weights, and other devices run the layer itself.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import fastpaths
from .layout import on_cpu


def _pair(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


def applies(layer) -> bool:
    """Whether ``layer`` (an ``nn.Conv1d`` / ``nn.Conv2d``) runs as products here."""
    if type(layer) not in (nn.Conv1d, nn.Conv2d) or not fastpaths.enabled("encoder.convs"):
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
        return layer(x)
    w = layer.weight
    if all(k == 1 for k in w.shape[1:-1]):
        y = x @ _rows(w).T
    elif layer.groups == 1:
        y = _windows(x[..., 0], w.shape[1:3], _pair(layer.stride)) @ mx.contiguous(
            w.reshape(w.shape[0], -1).T
        )
    else:
        y = _depthwise(x, w, _pair(layer.stride))
    return y + layer.bias if "bias" in layer else y


def _rows(w: mx.array) -> mx.array:
    """A pointwise weight ``[O, 1.., I]`` as ``[O, I]`` (a view: column-major data stays so)."""
    return w[:, 0, :] if w.ndim == 3 else w[:, 0, 0, :]


def _taps(size: int, kernel: int, stride: int):
    """Output count and the slice of tap ``i`` along one axis."""
    out = (size - kernel) // stride + 1
    return out, [slice(i, i + stride * (out - 1) + 1, stride) for i in range(kernel)]


def _windows(x: mx.array, kernel, stride) -> mx.array:
    """``x`` [B, H, W] -> every window [B, Ho, Wo, kh * kw], taps in ``(kh, kw)`` order."""
    _, rows = _taps(x.shape[1], kernel[0], stride[0])
    _, cols = _taps(x.shape[2], kernel[1], stride[1])
    return mx.stack([x[:, r, c] for r in rows for c in cols], axis=-1)


def _depthwise(x: mx.array, w: mx.array, stride) -> mx.array:
    _, rows = _taps(x.shape[1], w.shape[1], stride[0])
    _, cols = _taps(x.shape[2], w.shape[2], stride[1])
    y = None
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            term = x[:, r, c, :] * w[:, i, j, 0]
            y = term if y is None else y + term
    return y

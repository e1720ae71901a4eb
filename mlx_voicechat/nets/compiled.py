"""Compiled one-step paths whose weights are constants of the trace.

A live frame runs each network on one position, and on this kind of input MLX's CPU backend
spends much of its time dispatching small ops (about 25 us each on a 2-core CPU); one
``mx.compile``'d function fuses the elementwise chains between the matmuls. The weights are
not implicit inputs (``mx.compile(fn, inputs=modules)``): to trace, MLX swaps placeholders into
those modules, and it traces once per thread, so a session starting in one thread would hand
placeholders to another thread running the same modules. They are constants of the trace
instead, and the function is built again whenever the modules' parameter tree has changed
(weights loaded, cast or quantized, a module replaced), so it always reads the current weights.
"""

from __future__ import annotations

from typing import Any, Callable, List, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn


def _walk(tree, out: List[Tuple[Any, Any, Any]]) -> None:
    """Every edge of a parameter tree as ``(container, key, child)``, plus ``(container,
    None, size)`` per container: what ``Module.parameters()`` reaches (public keys; arrays,
    dicts / modules and lists), without building its dicts."""
    if isinstance(tree, dict):
        out.append((tree, None, len(tree)))
        edges = ((k, v) for k, v in tree.items() if not (isinstance(k, str) and k.startswith("_")))
    elif isinstance(tree, (list, tuple)):
        out.append((tree, None, len(tree)))
        edges = enumerate(tree)
    else:
        return
    for k, v in edges:
        if isinstance(v, (mx.array, dict, list, tuple)):
            out.append((tree, k, v))
            _walk(v, out)


class ParameterSnapshot:
    """The identity of every parameter array and container under ``modules``; ``current()``
    says whether none was replaced since (a dict lookup per edge: about 30x cheaper than
    comparing ``tree_flatten(module.parameters())``). An array written in place keeps its
    identity and is not noticed (MLX arrays are replaced, not written, by loading, casting and
    quantizing)."""

    def __init__(self, modules: Sequence[nn.Module]):
        self._edges: List[Tuple[Any, Any, Any]] = []
        for m in modules:
            _walk(m, self._edges)

    def current(self) -> bool:
        for container, key, value in self._edges:
            if key is None:
                if len(container) != value:
                    return False
            elif container[key] is not value:
                return False
        return True


class FrozenCompile:
    """What ``build()`` returns (compiled functions that read the weights of ``modules`` as
    constants), built again when those weights (or ``settings``) are not the ones it was built
    with: ``fn = frozen.get(settings)``."""

    def __init__(self, build: Callable[[], Any], modules: Callable[[], Sequence[nn.Module]]):
        self._build, self._modules = build, modules
        self._state = None  # (settings, snapshot, built)

    def get(self, settings: Any = None) -> Any:
        state = self._state
        if state is None or state[0] != settings or not state[1].current():
            snapshot = ParameterSnapshot(self._modules())
            state = self._state = (settings, snapshot, self._build())
        return state[2]

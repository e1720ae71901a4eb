"""Values made from a module's weights and kept for the next call: compiled functions that hold
the weights as trace constants (see :mod:`.fastpaths`) and tables laid out from them.

:func:`derived` builds one on first use and keeps it on the module; :func:`reset_derived` drops
all of a model's. ``VoiceChatModel.update`` / ``update_modules`` (so ``load_weights``,
``set_dtype``, ``nn.quantize``) and the CPU layout call it; after changing a part's weights
yourself, call ``reset_derived(model)``. Not ``mx.compile(fn, inputs=module.state)``: the tables
need dropping anyway, and the steps were no faster with their weights as inputs. Every function
of the package is compiled with :class:`compiled`, once per calling thread.
"""

import threading
from typing import Any, Callable, Dict, Hashable

import mlx.core as mx
import mlx.nn as nn


def derived(module: nn.Module, name: str, build: Callable[[], Any], key: Hashable = None) -> Any:
    """``module``'s value ``name``: what ``build()`` made for its current weights and ``key``
    (made again when ``key`` differs from the last call's, or after :func:`reset_derived`)."""
    store = module.__dict__.setdefault("_derived", {})
    entry = store.get(name)
    if entry is None or entry[0] != key:
        entry = store[name] = (key, build())
    return entry[1]


def reset_derived(model: nn.Module) -> None:
    """Drop every value derived from the weights of ``model`` and its sub-modules."""
    for m in model.modules():
        m.__dict__.pop("_derived", None)


class compiled:
    """``mx.compile(fn, **options)``, made once for each thread that calls it.

    MLX keeps traces per thread, keyed by the function's address, and a dying compiled function
    erases them only in the thread that called it last: a later function at the same address
    could be handed a stale trace holding dead weights (wrong results, no error;
    ml-explore/mlx#3940). One compiled function per thread always erases its own trace.
    """

    __slots__ = ("fn", "options", "_threads")

    def __init__(self, fn: Callable, **options):
        self.fn, self.options = fn, options
        self._threads: Dict[int, Callable] = {}

    def __call__(self, *args, **kwargs):
        thread = threading.get_ident()
        fn = self._threads.get(thread)
        if fn is None:
            fn = self._threads[thread] = mx.compile(self.fn, **self.options)
        return fn(*args, **kwargs)

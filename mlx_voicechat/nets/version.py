"""Which weights a memo was made from: one weights version per model, one memo helper keyed
on it.

Several pieces of the live path are made from the weights once and reused on every frame:
compiled one-step functions (whose weights are constants of the trace, see
:mod:`.fastpaths`), tables laid out for a step (the padded RVQ table, the codec's step
weights), per-token embeddings, a conversation's post-prompt snapshot. Each is a :class:`Memo`
of the module it is made from, rebuilt when that module's weights version has moved.

The version is a counter per tree of this package's modules (a model, or a network used on
its own): a child module shares its parent's counter from the moment it is attached. It is
bumped whenever a parameter is replaced through one of those modules: ``update``,
``update_modules`` (which ``nn.quantize`` uses), ``load_weights``, ``apply`` / ``set_dtype``,
assigning a public array or sub-module attribute, or moving weights to the CPU layout
(:func:`bump`). Writing into an array in place (``w[...] = v``), or setting an attribute of a
nested MLX layer directly (``linear.weight = w`` on an ``nn.Linear``), is not seen: update
through one of our modules (``head.update({"proj": {"weight": w}})``) or call :func:`bump` on
the model after such a change.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable, Optional

import mlx.core as mx
import mlx.nn as nn

_lock = threading.Lock()


class _Counter:
    """A tree's weights version; ``parent`` once the tree was attached to a bigger one."""

    __slots__ = ("parent", "count")

    def __init__(self):
        self.parent: Optional["_Counter"] = None
        self.count = 0


def _root(c: _Counter) -> _Counter:
    while c.parent is not None:
        if c.parent.parent is not None:
            c.parent = c.parent.parent  # path halving
        c = c.parent
    return c


def _counter(module) -> _Counter:
    c = module.__dict__.get("_weights_counter")
    if c is None:
        c = _Counter()
        object.__setattr__(module, "_weights_counter", c)
    return c


def weights_version(module) -> tuple:
    """``module``'s weights version (for this package's modules; others have none)."""
    if not isinstance(module, Versioned):
        return ()
    r = _root(_counter(module))
    return (id(r), r.count)


def bump(module) -> None:
    """Note that ``module``'s weights changed: its tree's memos are rebuilt on their next use."""
    if isinstance(module, Versioned):
        with _lock:
            _root(_counter(module)).count += 1


def _adopt(parent: "Versioned", value: Any) -> None:
    """Attach the trees of this package's modules found in ``value`` to ``parent``'s."""
    if isinstance(value, Versioned):
        with _lock:
            child, mine = _root(_counter(value)), _root(_counter(parent))
            if child is not mine:
                child.parent = mine
                mine.count += child.count + 1
    elif isinstance(value, dict):
        for v in value.values():
            _adopt(parent, v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _adopt(parent, v)


class Versioned(nn.Module):
    """Mixin for this package's modules: they share a weights version with the modules they
    are part of, and replacing a parameter through them bumps it."""

    def __setattr__(self, key: str, val: Any):
        super().__setattr__(key, val)
        if not key.startswith("_") and isinstance(val, (mx.array, dict, list, tuple)):
            _adopt(self, val)
            bump(self)

    def update(self, parameters: dict, strict: bool = True):
        out = super().update(parameters, strict)
        bump(self)
        return out

    def update_modules(self, modules: dict, strict: bool = True):
        out = super().update_modules(modules, strict)
        _adopt(self, modules)
        bump(self)
        return out


class Memo:
    """A value made from the weights of ``owners``: ``memo.get(build, key)`` returns what
    ``build()`` made for their current weights versions and ``key``, and builds it again once
    either changed.

    ``per_thread``: one value per thread, for values that hold unevaluated arrays (those belong
    to the streams of the thread that made them)."""

    def __init__(self, *owners, per_thread: bool = False):
        self._owners = owners
        self._local = threading.local() if per_thread else None
        self._entry: Optional[tuple] = None

    def get(self, build: Callable[[], Any], key: Hashable = None) -> Any:
        tag = (tuple(weights_version(o) for o in self._owners), key)
        holder = self._local.__dict__ if self._local is not None else self.__dict__
        entry = holder.get("_entry")
        if entry is None or entry[0] != tag:
            entry = (tag, build())
            holder["_entry"] = entry
        return entry[1]

    def clear(self) -> None:
        holder = self._local.__dict__ if self._local is not None else self.__dict__
        holder["_entry"] = None

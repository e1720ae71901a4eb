"""derived: values derived from weights, and ``compiled``, the package's ``mx.compile``.

MLX 0.32's compiled function erases its traces, when it dies, from the cache of the thread that
called it last only, so one called from two threads leaves a trace behind in the first, and a
function made later at the same address is handed that trace (the dead one's constants)."""

import gc
import queue
import re
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np

import mlx_voicechat
from mlx_voicechat import load
from mlx_voicechat.derived import compiled
from mlx_voicechat.factory import make_checkpoint


def on_thread(fn):
    """``fn()`` on a new thread (its own MLX compile cache), returned here."""
    out = queue.Queue()
    t = threading.Thread(target=lambda: out.put(fn()))
    t.start()
    t.join()
    return out.get()


def test_a_function_compiled_at_a_dead_ones_address_gets_its_own_trace():
    x = mx.ones((4,))

    def times(w):
        def f(a):
            return a * w

        return f

    reused, results = 0, []
    for _ in range(50):
        f = times(mx.array(2.0))
        address, fn = id(f), compiled(f)
        mx.eval(fn(x))  # traced on this thread,
        on_thread(lambda: mx.eval(fn(x)))  # called on another, then dropped here
        del f, fn
        g = times(mx.array(3.0))
        if id(g) == address:  # CPython hands the address on: MLX's cache key
            reused += 1
            results.append(compiled(g)(x).tolist())
        del g
    assert reused > 0, "no address was reused: the test checked nothing"
    assert results == [[3.0] * 4] * reused


def test_a_model_used_on_two_threads_leaves_no_trace_to_the_next(tiny_checkpoints, tmp_path):
    other = make_checkpoint(tmp_path / "other", "tiny", seed=1)
    rng = np.random.default_rng(1)
    wave = (0.1 * rng.standard_normal(12800)).astype(np.float32)

    def generate(model):
        r = model.generate(wave, system_prompt="", extra_decoding_seconds=0.2, seed=5)
        return r.text_ids, r.codes.tolist(), r.audio.tolist()

    want = on_thread(lambda: generate(load(other)))
    for _ in range(2):
        first = load(tiny_checkpoints["mlx-community"])
        generate(first)  # on this thread
        on_thread(lambda: generate(first))  # and on another (a server's worker)
        del first
        gc.collect()
        assert generate(load(other)) == want


def test_the_package_compiles_only_through_compiled():
    root = Path(mlx_voicechat.__file__).parent
    calls = [
        f"{p.relative_to(root)}:{n}"
        for p in sorted(root.rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"\bmx\.compile\(", line) and p.name != "derived.py"
    ]
    assert calls == []

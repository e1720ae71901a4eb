"""The host-read counter the one-read-per-frame tests rely on (``sync_count`` in conftest.py):
each way an array's value reaches the host counts exactly once, lazy work counts nothing."""

import io
import operator
import pickle

import mlx.core as mx
import numpy as np
import pytest


def _x():
    x = mx.arange(6, dtype=mx.float32).reshape(2, 3)
    mx.eval(x)
    return x


READS = {
    "tolist": lambda x: x.tolist(),
    "item": lambda x: x[0, 1].item(),
    "int": lambda x: int(x[0, 1]),
    "float": lambda x: float(x[0, 1]),
    "complex": lambda x: complex(x[0, 1]),
    "bool": lambda x: bool(x[0, 1]),
    "if": lambda x: 1 if x[0, 1] else 0,
    "index": lambda x: operator.index(x[0, 1].astype(mx.int32)),
    "list index": lambda x: [1, 2, 3][x[0, 1].astype(mx.int32)],
    "bytes": lambda x: bytes(x),
    "repr": lambda x: repr(x),
    "str": lambda x: str(x),
    "format": lambda x: f"{x[0, 1]:}",
    "pickle": lambda x: pickle.dumps(x),
    "np.array": lambda x: np.array(x),
    "np.asarray": lambda x: np.asarray(x),
    "np.asarray dtype": lambda x: np.asarray(x, dtype=np.float64),
    "np.ascontiguousarray": lambda x: np.ascontiguousarray(x),
    "np.frombuffer": lambda x: np.frombuffer(x, np.float32),
    "np.from_dlpack": lambda x: np.from_dlpack(x),
    "np.abs": lambda x: np.abs(x),
    "np.concatenate": lambda x: np.concatenate([x]),
    "numpy operand": lambda x: np.zeros(3, np.float32) + x,
    "memoryview": lambda x: memoryview(x),
    "bytearray": lambda x: bytearray(x),
    "file write": lambda x: io.BytesIO().write(x),
    "mx.eval": lambda x: mx.eval(x + 1),
    "mx.synchronize": lambda x: mx.synchronize(),
}


@pytest.mark.parametrize("way", list(READS))
def test_each_way_to_the_host_counts_once(sync_count, way):
    x = _x()
    sync_count[0] = 0
    READS[way](x)
    assert sync_count[0] == 1


def test_two_arrays_in_one_numpy_call_count_twice(sync_count):
    x = _x()
    sync_count[0] = 0
    np.stack([x, x + 1])
    assert sync_count[0] == 2


def test_lazy_work_counts_nothing(sync_count, tmp_path):
    x = _x()
    sync_count[0] = 0
    y = mx.concatenate([x.reshape(-1), mx.view(x, mx.int32).astype(mx.float32).reshape(-1)])
    mx.async_eval(y, x * 2)
    _ = (x.shape, x.dtype, x.size, len(x), list(x), x[0], np.float32(2.0) * 3, hash(x))
    assert sync_count[0] == 0


def test_reads_from_another_thread_count(sync_count):
    import threading

    x = _x()
    sync_count[0] = 0
    t = threading.Thread(target=lambda: (np.asarray(x), x.tolist()))
    t.start()
    t.join()
    assert sync_count[0] == 2


def test_the_counter_is_gone_after_the_test():
    """Runs after the tests above (same module, in order): the methods are the originals again
    and the buffer protocol, put back, still works."""
    x = _x()
    assert np.array_equal(np.asarray(x), np.arange(6, dtype=np.float32).reshape(2, 3))
    assert bytes(memoryview(x)) == np.arange(6, dtype=np.float32).tobytes()
    for f in (mx.array.tolist, mx.array.__int__, mx.eval):
        assert "sync_count" not in getattr(f, "__qualname__", "")


def test_a_refused_conversion_raises_as_without_the_counter(sync_count):
    x = mx.ones(3).astype(mx.bfloat16)  # numpy has no bfloat16: MLX's own error, unchanged
    with pytest.raises(ValueError, match="bfloat16"):
        np.array(x)
    assert len(bytes(memoryview(x))) == 6

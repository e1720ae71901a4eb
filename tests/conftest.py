"""Fixtures local to this folder's tests (the shared ones are in the top-level conftest.py).

``MLX_VOICECHAT_TEST_DEVICE=gpu`` (or ``cpu``) runs the tests on that MLX device (its default
device for the whole run): how ``benchmarks/bench_device.py`` runs the oracle tests on a GPU."""

import os

import pytest
from server_support import model, worker  # noqa: F401  (the server tests' shared fixtures)

_TEST_DEVICE = os.environ.get("MLX_VOICECHAT_TEST_DEVICE", "").strip().lower()
if _TEST_DEVICE:
    import mlx.core as mx

    if _TEST_DEVICE not in ("cpu", "gpu"):
        raise pytest.UsageError(
            f"MLX_VOICECHAT_TEST_DEVICE must be cpu or gpu, not {_TEST_DEVICE!r}"
        )
    _device = mx.gpu if _TEST_DEVICE == "gpu" else mx.cpu
    if not mx.is_available(_device):
        raise pytest.UsageError(
            f"MLX_VOICECHAT_TEST_DEVICE={_TEST_DEVICE}: this MLX ({mx.__version__}) has no "
            f"{_TEST_DEVICE} backend (install mlx[cuda13] for NVIDIA GPUs)"
        )
    mx.set_default_device(_device)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """The factory's tiny checkpoint (seed 0, mlx-community layout, one shard), written once per
    run: the checkpoint of the server, Ray, operating and data-safety tests."""
    from mlx_voicechat.factory import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    """The tiny mlx-community checkpoint, loaded once per test module."""
    from mlx_voicechat import load

    return load(tiny_checkpoints["mlx-community"])


@pytest.fixture(scope="module")
def question(tmp_path_factory):
    """0.75 s of quiet noise at 16 kHz as a WAV file (a stand-in for a spoken question)."""
    import numpy as np
    import soundfile as sf

    path = tmp_path_factory.mktemp("q") / "question.wav"
    rng = np.random.default_rng(0)
    sf.write(path, (0.1 * rng.standard_normal(12000)).astype(np.float32), 16000)
    return path


@pytest.fixture(scope="module")
def nvidia():
    """Oracle 04's weights in NVIDIA's raw layout, loaded once per test module."""
    from oracle_utils import ORACLE

    from mlx_voicechat import load

    return load(ORACLE / "nvidia-layout")


@pytest.fixture(scope="module")
def io04():
    """Oracle 04's recorded inputs and outputs."""
    import numpy as np
    from oracle_utils import ORACLE

    return dict(np.load(ORACLE / "04_voicechat_e2e_io.npz"))


#: mx.array methods through which a value reaches the host. The int() / float() / complex() /
#: bool() / operator.index() / bytes() / repr() / format() / pickle built-ins go through these
#: (the type's slots call them), so patching the methods counts those calls too.
HOST_METHODS = (
    "item", "tolist", "__array__", "__int__", "__float__", "__complex__", "__bool__", "__index__",
    "__bytes__", "__repr__", "__format__", "__dlpack__", "__getstate__",
)
#: mlx functions that make the host wait for the device: explicit evals, and the writers.
WAITING_FUNCTIONS = (
    "eval", "synchronize", "save", "savez", "savez_compressed", "save_safetensors", "save_gguf",
)
#: Py_bf_getbuffer in CPython's typeslots.h (a stable-ABI constant).
_PY_BF_GETBUFFER = 1


def _hook_buffer_protocol(on_request):
    """Make every granted buffer-protocol request on an mx.array (``np.array(x)``,
    ``np.asarray(x)``, ``np.frombuffer(x)``, ``memoryview(x)``, ``bytearray(x)``, a numpy ufunc
    or operator on ``x``, ``file.write(x)``...) call ``on_request()``; returns the function
    that undoes it. The C slot ``bf_getbuffer`` of mx.array's type is swapped for a ctypes
    callback that calls the original: no Python-level patch can reach it, and numpy converts
    inside C."""
    import ctypes

    import mlx.core as mx

    api = ctypes.pythonapi
    api.PyType_GetSlot.restype = ctypes.c_void_p
    api.PyType_GetSlot.argtypes = [ctypes.py_object, ctypes.c_int]
    original = api.PyType_GetSlot(mx.array, _PY_BF_GETBUFFER)
    # tp_as_buffer is the 21st pointer-sized word of a PyTypeObject (object header of 3 words,
    # then tp_name ... tp_setattro): the same from CPython 3.8 on. Checked, not trusted: the
    # first field of the PyBufferProcs it points to must be the slot PyType_GetSlot reports.
    procs = ctypes.c_void_p.from_address(id(mx.array) + 20 * ctypes.sizeof(ctypes.c_void_p))
    slot = ctypes.c_void_p.from_address(procs.value) if procs.value else None
    if not original or slot is None or slot.value != original:
        raise RuntimeError("sync_count: cannot find mx.array's bf_getbuffer slot on this Python")
    signature = (ctypes.c_int, ctypes.py_object, ctypes.c_void_p, ctypes.c_int)
    call_original = ctypes.PYFUNCTYPE(*signature)(original)  # keeps the GIL, like the caller

    def counting(obj, view, flags):
        status = call_original(obj, view, flags)
        if status == 0:
            on_request()
        return status

    callback = ctypes.CFUNCTYPE(*signature)(counting)
    slot.value = ctypes.cast(callback, ctypes.c_void_p).value

    def undo():
        slot.value = original
        undo.callback = None  # the callback lives as long as the slot points at it

    undo.callback = callback
    return undo


@pytest.fixture
def sync_count(monkeypatch):
    """Counts every way an MLX array's value reaches the host, and every explicit wait.

    A host read is any of: a reading method or the built-in behind it (``HOST_METHODS``:
    ``tolist``, ``item``, ``int(x)``, ``bool(x)``, ``bytes(x)``, ``repr(x)`` ...), a
    buffer-protocol request (``np.array(x)``, ``np.asarray(x)``, ``memoryview(x)``, any numpy
    function or operator given ``x``), or an mlx function that waits for the device
    (``WAITING_FUNCTIONS``: ``mx.eval``, ``mx.synchronize``, the writers). ``mx.async_eval``
    and lazy operations do not count.

    Why this way: the buffer protocol is a C slot of mx.array's type, which numpy, memoryview
    and the rest call from C, so patching Python names (``numpy.asarray``...) would miss
    the calls made inside numpy and any we did not think of; MLX has no hook on the waits
    themselves. So the fixture swaps the slot itself (see ``_hook_buffer_protocol``) and
    patches the methods, which the built-ins reach through the type's slots.
    ``tests/test_sync_counter.py`` checks that each way counts exactly once."""
    import mlx.core as mx

    count = [0]

    def bump():
        count[0] += 1

    def counting(orig):
        def f(*a, **k):
            out = orig(*a, **k)
            bump()  # after: a refused conversion (bytearray(x) tries __index__ first) reads nothing
            return out

        return f

    for name in HOST_METHODS:
        monkeypatch.setattr(mx.array, name, counting(getattr(mx.array, name)))
    for name in WAITING_FUNCTIONS:
        monkeypatch.setattr(mx, name, counting(getattr(mx, name)))
    undo = _hook_buffer_protocol(bump)
    yield count
    undo()

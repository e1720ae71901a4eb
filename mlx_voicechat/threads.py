"""MLX work outside the main thread, and a clean interpreter exit after it.

A thread releases MLX's per-thread compile cache after its Python part has ended; an
interpreter finalizing in that window aborts the process (exit 134). So threads that run MLX
work are noted, and at exit the interpreter waits (bounded, GIL released) until they are gone.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

EXIT_WAIT_SECONDS = 2.0  # the most the interpreter waits at exit for such threads
_POLL_SECONDS = 0.002

_lock = threading.Lock()
_threads: set = set()  # native ids of non-main threads that ran MLX work
_registered = False


def note_mlx_thread() -> None:
    """Record the calling thread as one that runs MLX work (the main thread needs nothing)."""
    global _registered
    if threading.current_thread() is threading.main_thread():
        return
    tid = threading.get_native_id()
    if tid in _threads:
        return
    with _lock:
        _threads.add(tid)
        if not _registered:
            atexit.register(_wait_for_threads)
            _registered = True


def _wait_for_threads() -> None:
    live = {t.native_id for t in threading.enumerate()}
    pending = [tid for tid in _threads if tid not in live]
    if not pending:
        return
    deadline = time.monotonic() + EXIT_WAIT_SECONDS
    if not sys.platform.startswith("linux"):
        time.sleep(min(0.05, EXIT_WAIT_SECONDS))  # no /proc: a short grace period
        return
    tasks = [f"/proc/self/task/{tid}" for tid in pending]  # gone with the thread
    while any(os.path.exists(t) for t in tasks) and time.monotonic() < deadline:
        time.sleep(_POLL_SECONDS)  # releases the GIL the exiting threads need

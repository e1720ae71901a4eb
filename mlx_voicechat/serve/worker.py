"""The one thread that runs a server process's MLX work."""

import asyncio
import ctypes
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional


class WorkerStopped(BaseException):
    """The worker was stopped (the server shuts down): the job did not run, or was cut short.
    A BaseException, so that no ``except Exception`` of the job's own keeps it going."""


class Worker:
    """One thread for MLX work; jobs run one at a time in submission order.

    :meth:`shared` is the process's one worker, which every app uses unless given another
    (MLX streams belong to the thread that made them; the TTS stream is made once per process).
    A process that exits with the thread alive first calls :meth:`stop`: an interpreter that
    finalizes while the thread is inside MLX aborts ("terminate called without an active
    exception")."""

    _shared: Optional["Worker"] = None
    _shared_lock = threading.Lock()

    def __init__(self, name: str = "mlx-voicechat-worker"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = False
        self._busy = False  # a job runs
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    @classmethod
    def shared(cls) -> "Worker":
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def _loop(self) -> None:
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                future, fn, args = job
                if self._stopping:
                    future.cancel()
                elif future.set_running_or_notify_cancel():  # (False: cancelled while it waited)
                    self._busy = True
                    try:
                        future.set_result(fn(*args))
                    except BaseException as e:  # handed to whoever waits on the future
                        future.set_exception(e)
                    finally:
                        self._busy = False
                del job, future, fn, args  # a parked thread holds no job's objects
        except WorkerStopped:  # stop()'s interruption, landed between two jobs
            return

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        if self._stopping:
            future.set_exception(WorkerStopped("the server is shutting down"))
            return future
        self._jobs.put((future, fn, args))
        return future

    async def run(self, fn: Callable, *args):
        return await asyncio.wrap_future(self.submit(fn, *args))

    def stop(self, timeout: float) -> bool:
        """End the thread within ``timeout`` seconds: jobs that wait are cancelled, the one
        that runs is cut short (:class:`WorkerStopped` raised in it at its next line of
        Python; MLX's own calls finish first), and the thread is joined. True once it ended."""
        self._stopping = True
        self._jobs.put(None)
        deadline = time.monotonic() + max(0.0, timeout)
        while self.thread.is_alive():
            if self._busy:
                _raise_in(self.thread, WorkerStopped)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.thread.join(min(left, 0.2))
        return not self.thread.is_alive()


def _raise_in(thread: threading.Thread, exc: type) -> None:
    """Raise ``exc`` in ``thread`` at its next line of Python (CPython's asynchronous
    exception; a no-op where the thread has ended)."""
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(thread.ident), ctypes.py_object(exc)
        )

"""The one thread that runs a server process's MLX work."""

import asyncio
import atexit
import queue
import threading
from concurrent.futures import Future
from typing import Callable, Optional


class Worker:
    """One thread for MLX work; jobs run one at a time in submission order.

    :meth:`shared` is the process's one worker, which every app uses unless given another:
    MLX streams belong to the thread that made them, and the TTS stream is made once per
    process. The thread never ends before the process does (an MLX thread that ends first can
    abort the process at exit: "terminate called without an active exception", MLX 0.32)."""

    _shared: Optional["Worker"] = None
    _shared_lock = threading.Lock()

    def __init__(self, name: str = "mlx-voicechat-worker"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closing = False
        self._parked = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        atexit.register(self._park, 5.0)

    @classmethod
    def shared(cls) -> "Worker":
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None or self._closing:
                self._parked.set()
                threading.Event().wait()  # parked until the process ends (see the class doc)
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while it waited
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to whoever waits on the future
                future.set_exception(e)
            del future, fn, args  # a parked thread holds no job's objects

    def _park(self, timeout: float) -> None:
        """At interpreter exit: the job running finishes and no other starts (an MLX
        computation still running when the interpreter finalizes aborts the process)."""
        self._closing = True
        self._jobs.put(None)
        self._parked.wait(timeout)

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    async def run(self, fn: Callable, *args):
        return await asyncio.wrap_future(self.submit(fn, *args))

    @property
    def thread(self) -> threading.Thread:
        return self._thread

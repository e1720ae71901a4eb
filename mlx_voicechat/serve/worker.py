"""The one thread that runs a server process's MLX work."""

import asyncio
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
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @classmethod
    def shared(cls) -> "Worker":
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def _loop(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while it waited
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to whoever waits on the future
                future.set_exception(e)
            del future, fn, args  # a parked thread holds no job's objects

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    async def run(self, fn: Callable, *args):
        return await asyncio.wrap_future(self.submit(fn, *args))

    @property
    def thread(self) -> threading.Thread:
        return self._thread

"""A few threads running a worker's transfer jobs, most urgent first.

Priorities: expedited loads (vLLM waits for them inside the step) before ordinary loads
(a request is waiting for them) before stores (nobody waits; the bytes are already staged).
The block I/O inside a job fans out further over the store's own I/O threads.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

EXPEDITED = 0
LOAD = 1
STORE = 2

_Item = tuple[int, int, Callable[[], Any] | None, Future[Any] | None]


class PriorityExecutor:
    """``submit(priority, fn) -> Future``; lower priority values run first, FIFO within one."""

    def __init__(self, threads: int, name: str) -> None:
        self._queue: queue.PriorityQueue[_Item] = queue.PriorityQueue()
        self._counter = itertools.count()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, priority: int, fn: Callable[[], Any]) -> Future[Any]:
        if self._closed:
            raise RuntimeError("executor is shut down")
        future: Future[Any] = Future()
        self._queue.put((priority, next(self._counter), fn, future))
        return future

    def shutdown(self, wait: bool = True) -> None:
        """Run what is queued, then stop the threads; with ``wait``, wait for them. Without,
        threads blocked in a hung file system are left behind (they are daemons)."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._queue.put((1 << 30, next(self._counter), None, None))
        if wait:
            for thread in self._threads:
                thread.join()

    def _run(self) -> None:
        while True:
            _, _, fn, future = self._queue.get()
            if fn is None or future is None:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # reported through the future, never lost
                future.set_exception(exc)

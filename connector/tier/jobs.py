"""The tier's job threads: loads and stores on separate pools, results polled without blocking.

vLLM calls ``submit_store`` / ``submit_load`` on its scheduler thread and polls
``get_finished_jobs`` once per step; neither may block. :class:`JobRunner` runs each job's
function on a pool of its kind (promotions never wait behind a backlog of writes), and queues
its outcome for :meth:`JobRunner.finished`. A job function never raises into vLLM: an
exception is logged once with the job and becomes a failed outcome.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

log = logging.getLogger("kvstore.connector")


@dataclass(frozen=True)
class Outcome:
    """What a job function reports: which of its keys succeeded, and the bytes moved."""

    ok_keys: frozenset[bytes]
    nbytes: int


@dataclass(frozen=True)
class Finished:
    """A finished job: its id, its outcome (None: the function raised) and its run time."""

    job_id: int
    outcome: Outcome | None
    seconds: float


class JobRunner:
    """Runs load and store job functions on their pools; collects their outcomes."""

    def __init__(self, load_threads: int, store_threads: int) -> None:
        self._loads = ThreadPoolExecutor(load_threads, thread_name_prefix="kvstore-tier-load")
        self._stores = ThreadPoolExecutor(store_threads, thread_name_prefix="kvstore-tier-store")
        self._done: queue.SimpleQueue[Finished] = queue.SimpleQueue()
        self._in_flight = 0
        self._idle = threading.Condition()

    def submit(self, job_id: int, is_load: bool, work: Callable[[], Outcome]) -> None:
        """Run ``work`` on the pool of its kind (non-blocking)."""
        with self._idle:
            self._in_flight += 1
        pool = self._loads if is_load else self._stores
        pool.submit(self._run, job_id, work)

    def _run(self, job_id: int, work: Callable[[], Outcome]) -> None:
        start = time.monotonic()
        outcome: Outcome | None
        try:
            outcome = work()
        except Exception:
            log.exception("kvstore tier: job %d failed", job_id)
            outcome = None
        self._done.put(Finished(job_id, outcome, time.monotonic() - start))
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()

    def finished(self) -> list[Finished]:
        """Jobs finished since the last call (non-blocking)."""
        out: list[Finished] = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def wait_idle(self) -> None:
        """Block until every submitted job has finished (its outcome is queued)."""
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0)

    def shutdown(self) -> None:
        """Finish the jobs in flight and stop the threads."""
        self._loads.shutdown(wait=True)
        self._stores.shutdown(wait=True)

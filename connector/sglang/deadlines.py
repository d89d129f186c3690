"""Deadlines for the backend's store calls: SGLang's threads never wait on a hung file system.

SGLang calls the backend synchronously from its cache controller's threads (prefetch, its
I/O helper, backup). A ``stat`` or ``read`` on a hung mount blocks without an error for as
long as the mount stays hung, and a blocked thread cannot be interrupted. So every store call
runs on a thread of the backend's own (:class:`~kvstore.io.deadline.DaemonWorkers`, a fixed
few) while SGLang's thread waits at most the call's deadline
(:class:`kvstore.io.deadline.Deadline`: the setting's seconds plus an allowance for the call's
bytes at ``deadline_min_mb_per_s``).

The workers only move bytes between files and staging rows; SGLang's thread itself gathers
pages from its pool into the rows before a write and scatters read rows into its pool after
the read came back in time (:mod:`connector.sglang.pool_store`). A :class:`DeliveryGate` per
step decides, once, between "the worker hands its result over" and "the caller stopped
waiting": a step the caller gave up on keeps its staging rows (held, counted) until the file
system returns it, and nothing of it reaches SGLang's memory. A step still queued when its
caller gave up does no I/O at all.

Past a deadline the store is *unresponsive* (:class:`kvstore.io.deadline.Responsiveness`: one
warning per episode); until a call returns, new calls fail at once without touching the store,
but for one trial call at a time, at most one per ``unresponsive_retry_s``, so the few workers are
never all filled behind the hung mount.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Generic, Literal, TypeVar

from connector.sglang.config import SGLangBackendConfig
from connector.sglang.stats import BackendStats
from kvstore.io.deadline import DaemonWorkers, Deadline, DeliveryGate, Responsiveness

logger = logging.getLogger("kvstore.sglang")

# SGLang 0.5.23's controller calls a backend from at most three threads at once (prefetch,
# prefetch I/O, backup); one more is the trial call of an unresponsive episode. While the mount
# hangs, at most these many threads are stuck in it: the pool never grows, and work queued
# behind them times out like any other call (and does no I/O when it finally runs).
WORKER_THREADS = 4

Kind = Literal["lookup", "load", "store"]
T = TypeVar("T")


class StoreCalls:
    """The backend's deadlines, its workers and the store's responsiveness (thread-safe)."""

    def __init__(
        self,
        config: SGLangBackendConfig,
        where: str,
        stats: BackendStats,
        threads: int = WORKER_THREADS,
    ) -> None:
        rate = config.deadline_min_mb_per_s * 1e6
        self._deadlines: dict[Kind, tuple[Deadline, str]] = {
            "lookup": (Deadline(config.lookup_deadline_s), "lookup_deadline_s"),
            "load": (Deadline(config.load_deadline_s, rate), "load_deadline_s"),
            "store": (Deadline(config.store_deadline_s, rate), "store_deadline_s"),
        }
        self.responsiveness = Responsiveness(
            where=where, retry_interval_s=config.unresponsive_retry_s, logger=logger
        )
        self.stats = stats
        self.workers = DaemonWorkers(threads, "kvstore-sglang")
        self._lock = threading.Lock()
        self._held_calls = 0
        self._held_bytes = 0

    def begin(self, kind: Kind, nbytes: int = 0) -> Call:
        """A new engine-facing call moving ``nbytes``: its deadline starts now."""
        deadline, setting = self._deadlines[kind]
        return Call(self, kind, setting, deadline.seconds(nbytes))

    def hold(self, nbytes: int, delta: int) -> None:
        """A step given up on starts (``delta`` 1) or stops (-1) holding a worker or a place in
        its queue, and ``nbytes`` of staging rows."""
        with self._lock:
            self._held_calls += delta
            self._held_bytes += delta * nbytes

    def snapshot(self) -> dict[str, float]:
        """Gauges for ``get_stats``: what the calls given up on still hold, and the episodes."""
        with self._lock:
            held_calls, held_bytes = self._held_calls, self._held_bytes
        r = self.responsiveness
        return {
            "held_calls": held_calls,
            "held_buffer_bytes": held_bytes,
            "unresponsive": int(r.hung),
            "unresponsive_episodes": r.episodes,
            "unresponsive_seconds": r.hung_seconds(),
        }

    def close(self) -> None:
        self.workers.close()


class Call:
    """One engine-facing call: its steps run one after another on the workers, all within
    the call's deadline. Used by one thread (SGLang's, that made the call)."""

    def __init__(self, calls: StoreCalls, kind: Kind, setting: str, seconds: float) -> None:
        self._calls = calls
        self._kind = kind
        self._setting = setting
        self._start = time.monotonic()
        self._end = self._start + seconds
        self._admitted: bool | None = None  # not asked yet
        self._stepped = False
        self.given_up = False  # a step was refused or not answered: later steps do nothing

    def admit(self) -> bool:
        """Whether the call may go to the store: asked once, of the store's state (during an
        unresponsive episode only a trial call may). Ask it before preparing the first step
        (a write's gather); :meth:`run` asks it too. A trial call stays in flight until a
        step returns; one admitted and never run leaves the episode to end when the call
        that started it returns."""
        if self._admitted is None:
            self._admitted = self._calls.responsiveness.admit()
            if not self._admitted:
                self._refuse()
        return self._admitted

    def run(self, step: Callable[[], T], held_bytes: int = 0) -> T | None:
        """``step``'s result (its exception raised here), or None when the store did not
        answer it before the deadline, or the call was refused (the store is unresponsive).
        ``held_bytes``: the staging rows the step keeps while it is stuck."""
        if self.given_up or not self.admit():
            return None
        remaining = self._end - time.monotonic()
        if remaining <= 0:  # earlier steps used the time up: the store is slow, not silent
            self.given_up = True
            return None
        if self._stepped and self._calls.responsiveness.hung:
            self._refuse()  # another call found the store unresponsive since the first step
            return None
        self._stepped = True
        task = _Task(step, self._calls, held_bytes)
        self._calls.workers.submit(task.run)
        try:
            return task.future.result(timeout=remaining)
        except FutureTimeout:
            self._calls.hold(held_bytes, 1)  # before abandoning: the worker may drop it at once
            if not task.gate.abandon():  # handed over just now: its result is set
                self._calls.hold(held_bytes, -1)
                return task.future.result()
        self.given_up = True
        waited = time.monotonic() - self._start
        self._calls.responsiveness.timed_out(self._kind, waited, self._setting)
        return None

    def _refuse(self) -> None:
        self.given_up = True
        self._calls.stats.add(failed_fast=1)


class _Task(Generic[T]):
    """One step on a worker, and the gate that hands its result over (or not)."""

    def __init__(self, step: Callable[[], T], calls: StoreCalls, held_bytes: int) -> None:
        self._step = step
        self._calls = calls
        self._held_bytes = held_bytes
        self.gate = DeliveryGate()
        self.future: Future[T] = Future()

    def run(self) -> None:
        if self.gate.abandoned:  # given up while queued behind stuck workers: no I/O
            self._calls.hold(self._held_bytes, -1)
            return
        try:
            result = self._step()
        except Exception as exc:  # raised in the caller's thread, if it still waits
            error: Exception | None = exc
        else:
            error = None
        finally:
            self._calls.responsiveness.answered()  # returned, in time or late: it answers
        if not self.gate.claim():  # the caller gave up: the result and the rows are dropped
            self._calls.hold(self._held_bytes, -1)
            return
        if error is None:
            self.future.set_result(result)
        else:
            self.future.set_exception(error)
        self.gate.release()

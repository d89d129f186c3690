"""Deadlines for engine-facing store calls on a file system that may hang.

A ``read`` or ``stat`` on a hung mount (an NFS server that stopped answering under a hard
mount, a frozen brick, a wedged FUSE daemon) blocks its thread without an error, for as long
as the mount stays hung, and that thread cannot be interrupted from Python. An engine must
never wait on it. Three pieces, shared by every integration (vLLM's connector and tier,
SGLang's backend):

* :class:`Deadline`: how long one call may take: a fixed allowance plus time for its bytes at
  a floor rate, so a large load on slow but working storage is not cut short.
* :class:`DeliveryGate`: the single decision between "the caller stopped waiting" and "the I/O
  writes into the caller's memory". I/O reads into buffers of its own (staging rows); only
  once it has claimed the gate does it copy into the engine's pages. A caller that gave up
  first has abandoned the gate, and the late I/O then never touches the engine's memory; its
  own buffers stay with the stuck thread until the call returns.
* :class:`DaemonWorkers`: the fixed few threads that make those calls, so that a thread stuck
  in the kernel never holds up the interpreter's exit and no pool grows behind a hung mount.
* :class:`Responsiveness`: the store's state as calls see it. A call past its deadline starts
  an *unresponsive episode* (one warning); during it new calls fail fast (:meth:`admit`
  says no) except one trial call at a time, at most one per ``retry_interval_s``, so no
  pool of threads fills up behind the hung mount; the first call that returns (a late one or
  a trial) ends the episode (one more line, its length counted).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.errors import ConfigError, StoreTimeoutError

__all__ = ["DaemonWorkers", "Deadline", "DeliveryGate", "Responsiveness", "StoreTimeoutError"]

Clock = Callable[[], float]


@dataclass(frozen=True)
class Deadline:
    """How long a call moving ``nbytes`` may take: ``base_s + nbytes / min_bytes_per_s``.

    ``min_bytes_per_s`` 0 means no allowance for size (``base_s`` for any call)."""

    base_s: float
    min_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        if not _is_seconds(self.base_s) or self.base_s <= 0:
            raise ConfigError(f"deadline: expected seconds > 0, got {self.base_s!r}")
        rate = self.min_bytes_per_s
        if not isinstance(rate, int | float) or isinstance(rate, bool) or not 0 <= rate < math.inf:
            raise ConfigError(f"deadline rate: expected bytes/s >= 0, got {rate!r}")

    def seconds(self, nbytes: int = 0) -> float:
        """The deadline of a call moving ``nbytes``."""
        if nbytes < 0:
            raise ValueError(f"nbytes: expected >= 0, got {nbytes}")
        if not self.min_bytes_per_s:
            return self.base_s
        return self.base_s + nbytes / self.min_bytes_per_s


class DeliveryGate:
    """Decides, once, whether a call's result reaches the caller's memory.

    The I/O side calls :meth:`claim` when its data is ready (after the file reads, before
    the copy into the caller's pages) and :meth:`release` after the copy; the caller calls
    :meth:`abandon` when it stops waiting. Whichever comes first wins: a claimed gate cannot
    be abandoned (the copy is in memory and short: the caller waits for it), an abandoned gate
    cannot be claimed (the late I/O drops what it read). Thread-safe.
    """

    _OPEN, _CLAIMED, _DONE, _ABANDONED = range(4)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = self._OPEN

    def claim(self) -> bool:
        """(I/O side) True: deliver now, then :meth:`release`. False: the caller gave up."""
        with self._lock:
            if self._state != self._OPEN:
                return False
            self._state = self._CLAIMED
            return True

    def release(self) -> None:
        """(I/O side) The copy into the caller's memory is done."""
        with self._lock:
            if self._state == self._CLAIMED:
                self._state = self._DONE

    def abandon(self) -> bool:
        """(caller side) Stop waiting. True: the I/O will never write into the caller's
        memory (it had not claimed the gate). False: it claimed it first: wait for the call
        (its copy is under way or done)."""
        with self._lock:
            if self._state == self._OPEN:
                self._state = self._ABANDONED
            return self._state == self._ABANDONED

    @property
    def abandoned(self) -> bool:
        """Whether the caller gave up (the I/O may skip its remaining work)."""
        return self._state == self._ABANDONED

    @property
    def delivering(self) -> bool:
        """Whether the I/O holds the claim now: its copy into the caller's memory is under
        way. After a refused :meth:`abandon` it tells a copy in progress (wait for it) from
        one already done (nothing more will be written)."""
        return self._state == self._CLAIMED


class Responsiveness:
    """Whether the store answers, as its calls see it; one log line per episode.

    ``where`` names the store in log lines (its root); ``what`` names the setting that sets
    the deadline, so the line tells an operator what to change. Thread-safe: calls report
    from I/O threads, the engine asks from its own.
    """

    def __init__(
        self,
        *,
        where: str,
        retry_interval_s: float,
        logger: logging.Logger,
        clock: Clock = time.monotonic,
    ) -> None:
        if not _is_seconds(retry_interval_s) or retry_interval_s <= 0:
            raise ConfigError(f"retry_interval_s: expected seconds > 0, got {retry_interval_s!r}")
        self.where = where
        self.retry_interval_s = float(retry_interval_s)
        self._log = logger
        self._clock = clock
        self._lock = threading.Lock()
        self._since: float | None = None  # start of the current episode
        self._last_trial = -math.inf
        # A trial call admitted during the episode has not returned yet. It stays in flight
        # until it returns, past its deadline too: a mount that swallows every call then
        # holds one stuck trial, not one more per interval.
        self._trial_in_flight = False
        self._episodes = 0
        self._hung_seconds = 0.0  # of the episodes that ended

    @property
    def hung(self) -> bool:
        """True during an unresponsive episode."""
        return self._since is not None

    @property
    def episodes(self) -> int:
        """Episodes started so far."""
        return self._episodes

    def hung_seconds(self) -> float:
        """Seconds unresponsive: ended episodes, plus the current one so far."""
        with self._lock:
            current = 0.0 if self._since is None else self._clock() - self._since
            return self._hung_seconds + current

    def admit(self) -> bool:
        """Whether a new call may go to the store now. Always outside an episode; during
        one, a single trial call at a time, at most one per ``retry_interval_s``; the caller
        reports its return through :meth:`answered`, as for any call."""
        with self._lock:
            if self._since is None:
                return True
            now = self._clock()
            if self._trial_in_flight or now - self._last_trial < self.retry_interval_s:
                return False
            self._trial_in_flight = True
            self._last_trial = now
            return True

    def timed_out(self, what: str, waited_s: float, setting: str) -> None:
        """A call (``what``: "load", "lookup", ...) was not answered after ``waited_s``
        seconds, past the deadline ``setting`` sets. Starts an episode (one warning) unless
        one is on."""
        with self._lock:
            if self._since is not None:
                return
            now = self._clock()
            self._since = now - waited_s
            self._last_trial = now
            self._episodes += 1
        self._log.warning(
            "kvstore: the store at %s did not answer a %s within %.1f s (%s): the file "
            "system is slow or hung; calls fail fast (the engine recomputes, stores are "
            "dropped) and one is retried every %g s until it answers",
            self.where,
            what,
            waited_s,
            setting,
            self.retry_interval_s,
        )

    def answered(self) -> float:
        """A call returned (in time or late, with any result): the store answers. Ends an
        episode (one line); returns its length in seconds (0 outside an episode)."""
        with self._lock:
            self._trial_in_flight = False
            if self._since is None:
                return 0.0
            length = max(0.0, self._clock() - self._since)
            self._since = None
            self._hung_seconds += length
        self._log.warning(
            "kvstore: the store at %s answers again after %.1f s unresponsive; calls go to it "
            "as before",
            self.where,
            length,
        )
        return length


# How long DaemonWorkers.close waits for its threads to end (a stuck one is left behind).
CLOSE_WAIT_S = 0.5


class DaemonWorkers:
    """A fixed set of daemon threads running submitted functions in order of submission.

    Daemon threads, not a ``ThreadPoolExecutor``: that one joins its threads at interpreter
    exit, so a thread stuck in a hung mount would hold up the process's exit. The count never
    grows: work queued behind stuck threads waits, and its caller's deadline covers it. The
    threads start at the first :meth:`submit` (a store opened and never used costs none)."""

    def __init__(self, count: int, name: str) -> None:
        if count < 1:
            raise ConfigError(f"{name}: expected at least 1 thread, got {count}")
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True)
            for i in range(count)
        ]
        self._start_lock = threading.Lock()
        self._started = False
        self._closed = False

    def submit(self, work: Callable[[], None]) -> None:
        """Run ``work`` on the next free thread (it must not raise: report through state)."""
        if not self._started:
            with self._start_lock:
                if not self._started and not self._closed:
                    for thread in self._threads:
                        thread.start()
                    self._started = True
        self._queue.put(work)

    def close(self) -> None:
        """Idle threads exit now, busy ones after their work (a stuck one once its call
        returns); work queued before runs first. Waits up to :data:`CLOSE_WAIT_S` for the
        threads to end, then leaves the ones still busy (stuck in a hung mount) behind."""
        with self._start_lock:
            self._closed = True
            if not self._started:
                return
        for _ in self._threads:
            self._queue.put(None)
        # A process often exits right after closing its store. A daemon thread still running
        # at interpreter shutdown is ended by pthread_exit when it next takes the GIL, and a
        # forced unwind through C++ frames aborts the whole process ("terminate called without
        # an active exception", seen once in CI at a rank writer's exit). Idle threads end in
        # microseconds: wait for them, never for long.
        end = time.monotonic() + CLOSE_WAIT_S
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, end - time.monotonic()))

    def _serve(self) -> None:
        while (work := self._queue.get()) is not None:
            work()


def _is_seconds(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < math.inf

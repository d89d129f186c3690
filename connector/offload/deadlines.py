"""The worker's transfer jobs on a store whose file system may hang (issue 35).

A load or store job runs on one of the worker's few threads (:mod:`.executor`); on a hung
mount its file I/O blocks that thread, uninterruptibly, for as long as the mount hangs. The
worker (:class:`connector.offload.worker.KVStoreWorker`) never waits for it past the job's
deadline (:class:`JobDeadlines`), and gives it up instead:

* a load's reads go into staging rows of the store's own and reach the KV cache only through
  a :class:`~kvstore.io.deadline.DeliveryGate` (:class:`Gates`: one per offloaded group, as
  ``RankIO.load`` delivers each group once). A load given up before its copy began never
  touches the engine's pages; one whose copy is under way is waited for (a memory copy);
* a store's GPU pages are free once its snapshot is taken; given up, its blocks are reported
  failed and never published, and its staging rows stay with the blocked thread until the
  write returns. Its single gate is never claimed: it only tells a job still queued behind
  blocked threads that it was given up, so it runs no I/O when its turn comes;
* :class:`StoreWatch` holds the worker's :class:`~kvstore.io.deadline.Responsiveness` (an
  unresponsive episode per hang: one warning, jobs fail at once but for one trial at a time)
  and the jobs given up whose threads have not returned yet, and reports both to the
  scheduler as :class:`WorkerHealth` (the metrics ``worker_unresponsive*``, ``late_*``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from connector.config import ConnectorConfig
from kvstore.io.deadline import Clock, Deadline, DeliveryGate, Responsiveness

MB = 1_000_000


@dataclass(frozen=True)
class JobDeadlines:
    """How long the worker waits for its jobs, and how often it retries a hung store."""

    load: Deadline
    store: Deadline
    retry_interval_s: float

    @classmethod
    def of(cls, options: ConnectorConfig) -> JobDeadlines:
        """From ``load_deadline_s``, ``store_deadline_s``, ``deadline_min_mb_per_s`` and
        ``unresponsive_retry_s``."""
        rate = options.deadline_min_mb_per_s * MB
        return cls(
            Deadline(options.load_deadline_s, rate),
            Deadline(options.store_deadline_s, rate),
            options.unresponsive_retry_s,
        )


class Gates:
    """The delivery gates of one job (``count`` of them, at least one)."""

    def __init__(self, count: int) -> None:
        self.gates = tuple(DeliveryGate() for _ in range(max(1, count)))

    def abandon(self) -> bool:
        """Stop waiting for the job. True: its I/O writes into the engine's pages no more
        (what a group already delivered stays, complete). False: a group's copy into them is
        under way; wait for the job (a memory copy, not file I/O)."""
        refused = [gate for gate in self.gates if not gate.abandon()]
        return not any(gate.delivering for gate in refused)

    @property
    def abandoned(self) -> bool:
        """Whether the job was given up (any gate abandoned): it is reported failed."""
        return any(gate.abandoned for gate in self.gates)


@dataclass
class WorkerHealth:
    """A worker's changes since its last report, carried in its per-step metadata and summed
    over workers (:meth:`plus`): jobs and bytes held by late I/O and workers in an
    unresponsive episode (changes of gauges, so sums of them stay right), seconds
    unresponsive (a counter)."""

    late_loads: int = 0
    late_stores: int = 0
    late_bytes: int = 0
    unresponsive: int = 0
    unresponsive_seconds: float = 0.0

    def __bool__(self) -> bool:
        return any(dataclasses.astuple(self))

    def plus(self, other: WorkerHealth) -> WorkerHealth:
        return WorkerHealth(
            *(
                a + b
                for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)
            )
        )


@dataclass(frozen=True)
class _Late:
    future: Future[Any]
    is_load: bool
    nbytes: int


class StoreWatch:
    """One worker's view of its store: unresponsive episodes and late jobs.

    ``responsiveness`` is shared with the job threads (they report their returns); the rest
    is the engine thread's (``get_finished``, the metadata)."""

    def __init__(
        self,
        *,
        where: str,
        retry_interval_s: float,
        logger: logging.Logger,
        clock: Clock = time.monotonic,
    ) -> None:
        self.responsiveness = Responsiveness(
            where=where, retry_interval_s=retry_interval_s, logger=logger, clock=clock
        )
        self._late: list[_Late] = []
        self._changes = WorkerHealth()
        self._reported_hung = False
        self._reported_seconds = 0.0

    def hold(self, future: Future[Any], is_load: bool, nbytes: int) -> None:
        """A job given up at its deadline whose thread has not returned yet."""
        self._late.append(_Late(future, is_load, nbytes))
        self._count(is_load, nbytes, 1)

    def poll(self) -> None:
        """Forget the late jobs whose threads returned (they released their buffers)."""
        returned = [late for late in self._late if late.future.done()]
        if returned:
            self._late = [late for late in self._late if not late.future.done()]
        for late in returned:
            self._count(late.is_load, late.nbytes, -1)

    @property
    def late(self) -> int:
        """Late jobs whose threads have not returned."""
        return len(self._late)

    def take(self) -> WorkerHealth:
        """The changes since the last call."""
        self.poll()
        hung = self.responsiveness.hung
        seconds = self.responsiveness.hung_seconds()
        out = dataclasses.replace(
            self._changes,
            unresponsive=int(hung) - int(self._reported_hung),
            unresponsive_seconds=seconds - self._reported_seconds,
        )
        self._changes = WorkerHealth()
        self._reported_hung, self._reported_seconds = hung, seconds
        return out

    def _count(self, is_load: bool, nbytes: int, sign: int) -> None:
        changes = self._changes
        if is_load:
            changes.late_loads += sign
        else:
            changes.late_stores += sign
        changes.late_bytes += sign * nbytes

"""The scheduler's background publishes: pending blocks committed or aborted, each job with its
deadline.

:class:`connector.offload.manager.KVStoreManager` hands a job the blocks every worker wrote
(``commit``: :meth:`kvstore.GroupStore.commit_blocks`, i.e. checks, rename, directory fsync)
and those it must drop (``abort``: their temporary files removed). A job has
``store_deadline_s`` plus its blocks' bytes at ``deadline_min_mb_per_s`` from its submission;
one past it is *late*: the manager counts its blocks failed and starts an unresponsive episode,
and applies what it did once it returns. A block is published by one rename or not at all.
Everything here runs on the scheduler thread except :meth:`Publishes.run`.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from connector.offload.executor import PriorityExecutor
from kvstore import Namespace, PendingBlock, WriteStatus
from kvstore.io.deadline import Deadline

log = logging.getLogger("kvstore.connector")

# What a background publish returns per key: status and error text.
Published = list[tuple[bytes, WriteStatus, str]]
# Pending blocks of a job by array: (key, pending block) each.
ByArray = Mapping[int, Sequence[tuple[bytes, PendingBlock]]]


@dataclass
class PublishJob:
    """A background publish: the blocks it publishes (``commit``) and those whose temporary
    files it removes (``abort``)."""

    future: Future[Published]
    started: float  # when submitted: its deadline counts from here
    deadline_s: float
    offered: float | None  # when its oldest block to publish was offered (store_seconds)
    commit: list[bytes]
    abort: list[bytes]
    # Its blocks are counted already: given up at its deadline, or aborts whose blocks were
    # counted when they were dropped. Its result only tells what became present.
    counted: bool = False

    def results(self) -> Published:
        """What the returned job did; a job that raised published nothing."""
        error = self.future.exception()
        if error is None:
            return self.future.result()
        log.error(
            "kvstore: publishing %d blocks failed: %s", len(self.commit) + len(self.abort), error
        )
        return [(k, WriteStatus.FAILED, str(error)) for k in [*self.commit, *self.abort]]


class Publishes:
    """Publish jobs in flight (``in_time``) and past their deadline (``late``)."""

    def __init__(  # noqa: PLR0913 - keyword-only: the manager's collaborators a publish needs
        self,
        *,
        pool: PriorityExecutor,
        namespace: Namespace,
        commit_chunks: Mapping[int, tuple[int, ...]],
        deadline: Deadline,
        bytes_of: Callable[[bytes], int],
        now: Callable[[], float],
    ) -> None:
        self._pool = pool
        self._namespace = namespace
        self._commit_chunks = commit_chunks  # inner chunks whose checksums commit computes
        self._deadline = deadline
        self._bytes_of = bytes_of
        self._now = now
        self.in_time: list[PublishJob] = []
        self.late: list[PublishJob] = []

    def submit(
        self, commit: ByArray, abort: ByArray, offered: float | None, *, counted: bool = False
    ) -> None:
        """Start a job; its deadline covers the bytes it publishes."""
        publish = [k for items in commit.values() for k, _ in items]
        deadline = self._deadline.seconds(sum(self._bytes_of(k) for k in publish))
        future = self._pool.submit(0, functools.partial(self.run, commit, abort))
        removed = [k for items in abort.values() for k, _ in items]
        self.in_time.append(
            PublishJob(future, self._now(), deadline, offered, publish, removed, counted)
        )

    def run(self, commit: ByArray, abort: ByArray) -> Published:
        """(background) Publish blocks every worker wrote; drop the others' temporary files."""
        out: Published = []
        for array, items in abort.items():
            self._namespace.group(array).abort_blocks([p for _, p in items])
            out.extend((k, WriteStatus.FAILED, "") for k, _ in items)
        for array, items in commit.items():
            pendings = [p for _, p in items]
            try:
                results = self._namespace.group(array).commit_blocks(
                    pendings, [self._commit_chunks[array]] * len(pendings)
                )
                outcomes = [(r.status, r.error) for r in results]
            except Exception as exc:
                log.exception("kvstore: publishing %d blocks failed", len(items))
                self._namespace.group(array).abort_blocks(pendings)
                outcomes = [(WriteStatus.FAILED, str(exc))] * len(items)
            out.extend((k, st, err) for (k, _), (st, err) in zip(items, outcomes, strict=True))
        return out

    def collect(self) -> tuple[list[PublishJob], list[tuple[PublishJob, float]]]:
        """The jobs that returned in time, and those that just passed their deadline (moved
        to ``late``) with how long they waited."""
        returned: list[PublishJob] = []
        went_late: list[tuple[PublishJob, float]] = []
        waiting: list[PublishJob] = []
        now = self._now()
        for job in self.in_time:
            if job.future.done():
                returned.append(job)
            elif now - job.started > job.deadline_s:
                went_late.append((job, now - job.started))
                self.late.append(job)
            else:
                waiting.append(job)
        self.in_time = waiting
        return returned, went_late

    def collect_late(self) -> list[PublishJob]:
        """The late jobs that returned (the store answered)."""
        returned = [j for j in self.late if j.future.done()]
        if returned:
            self.late = [j for j in self.late if not j.future.done()]
        return returned

    @property
    def pending(self) -> bool:
        """Jobs running within their deadline (work the engine steps for)."""
        return bool(self.in_time)

    def futures(self) -> list[Future[Published]]:
        """Every job not yet applied, late ones included."""
        return [j.future for j in self.in_time + self.late]


def by_array(
    blocks: Iterable[tuple[bytes, PendingBlock]],
) -> dict[int, list[tuple[bytes, PendingBlock]]]:
    """Pending blocks grouped by their array, as :meth:`Publishes.submit` takes them."""
    grouped: dict[int, list[tuple[bytes, PendingBlock]]] = defaultdict(list)
    for key, pending in blocks:
        grouped[pending.group].append((key, pending))
    return dict(grouped)

"""The scheduler's ledger of the blocks handed to the store, and whether the store answers.

:class:`connector.offload.manager.KVStoreManager` hands :class:`PublishLedger` the blocks of
every completed store job (``complete_store``: those every worker wrote to publish, the others
to abort) and the blocks pending at a cache reset (``abort_orphans``: to abort). The ledger
runs them as background jobs (:class:`connector.offload.publishes.Publishes`), applies what
those return, and counts each block once: published, present already (another server was
first), failed with its cause, or dropped. Until then the block's bytes count against
``max_pending_store_bytes`` (:attr:`PublishLedger.pending_bytes`, which the manager raises when
it offers a block), and a block being published is HIT_PENDING to lookups
(:attr:`PublishLedger.publishing`).

**A hung store never stalls scheduling.** An existence probe not answered within
``lookup_deadline_s`` (:mod:`connector.offload.probes`) or a publish past its deadline
(``store_deadline_s`` plus the blocks' bytes at ``deadline_min_mb_per_s``) starts an
*unresponsive* episode (:meth:`PublishLedger.began`): one warning,
``vllm:kvstore_store_unresponsive`` 1. While it lasts (:attr:`PublishLedger.hung`) the manager
answers every new lookup MISS at once, starts no probe and offers no store, and the blocks
handed here are not submitted: counted at once (dropped, or failed with their worker's cause),
their temporary files removed once the store answers, so nothing new joins the threads stuck
in the file system.

A publish job (commits, aborts or both) past its deadline is *late*: no longer pending work
(vLLM does not step for it), its blocks counted failed (cause ``timeout``) and no longer
believed present or being published (a lookup answers MISS, a store skips them, nothing probes
them: :attr:`PublishLedger.late_keys`) until its result comes back; then what it published is
remembered and announced, as it would have been in time. A block is published by one rename or
not at all, never half. The late jobs, probes and publishes alike, tell when the store answers
again (:meth:`PublishLedger.collect_late`): the first that returns ends the episode with one
more line (its seconds counted), and lookups probe and stores go to the store as before.
Everything here runs on the scheduler thread.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from connector.offload import metrics as m
from connector.offload.events import StoreEvents
from connector.offload.metrics import StoreMetrics
from connector.offload.publishes import Published, Publishes, PublishJob, by_array
from kvstore import PendingBlock, WriteStatus

log = logging.getLogger("kvstore.connector")

# Pending blocks of a completed job by array: (key, pending block) each.
Blocks = Mapping[int, list[tuple[bytes, PendingBlock]]]


class PublishLedger:
    """The blocks handed to the store until each is counted, and the store's episodes."""

    def __init__(  # noqa: PLR0913 - keyword-only: the manager's collaborators a publish's result updates
        self,
        *,
        root: object,
        now: Callable[[], float],
        metrics: StoreMetrics,
        events: StoreEvents,
        counters: Counter[str],
        publishes: Publishes,
        remember: Callable[[bytes], None],
        bytes_of: Callable[[bytes], int],
    ) -> None:
        self._root = root  # the store's, for the lines
        self._now = now
        self._metrics = metrics
        self._events = events
        self._counters = counters
        self._publishes = publishes
        self._remember = remember  # a key the store holds: the manager's present view
        self._bytes_of = bytes_of
        self.since: float | None = None  # when the store stopped answering; None: it answers
        self.publishing: set[bytes] = set()
        # Keys of blocks late publishes (past store_deadline_s: no longer pending work, their
        # blocks counted failed) publish: not believed present until their result comes back.
        self.late_keys: set[bytes] = set()
        # Pending blocks dropped while the store is unresponsive: their temporary files are
        # removed once it answers (at most the blocks pending when it stopped answering).
        self.deferred_aborts: list[tuple[bytes, PendingBlock]] = []
        self.abort_causes: dict[bytes, str] = {}  # key -> why its pending block is aborted
        self.pending_bytes = 0  # whole blocks offered and not yet published or aborted

    @property
    def hung(self) -> bool:
        """Whether the store is unresponsive: a job past its deadline, none returned since."""
        return self.since is not None

    # -- handing blocks over -------------------------------------------------------------------

    def submit(self, commit: Blocks, abort: Blocks, offered: float | None) -> None:
        """Publish ``commit`` and abort ``abort`` (a completed store job; ``offered``: when
        its oldest block to publish was offered), or, while the store is unresponsive, drop
        them."""
        if self.since is not None:
            self._drop_while_unresponsive(commit, abort)
            return
        for items in commit.values():
            self.publishing.update(k for k, _ in items)
        self._publishes.submit(dict(commit), dict(abort), offered)

    def _drop_while_unresponsive(self, commit: Blocks, abort: Blocks) -> None:
        """Blocks a job completed while the store is unresponsive: not published (nobody
        waits for a store; a rename would only join the threads stuck in the file system).
        Counted now, dropped (or failed with their worker's cause); their temporary files are
        removed once the store answers."""
        for items in commit.values():
            for k, pending in items:
                self._release(k)
                self._count_unpublished(k, m.UNRESPONSIVE_REASON)
                self.deferred_aborts.append((k, pending))
        for items in abort.values():
            for k, pending in items:
                self._release(k)
                self._count_unpublished(k, self.abort_causes.pop(k, m.IO_ERROR))
                self.deferred_aborts.append((k, pending))

    def abort_orphans(self, orphans: Sequence[tuple[bytes, PendingBlock]]) -> None:
        """Abort blocks pending at a cache reset; while the store is unresponsive they are
        counted now and their temporary files removed once it answers."""
        if self.since is not None:
            for key, _ in orphans:
                self._release(key)
                self._count_unpublished(key, self.abort_causes.pop(key, m.CACHE_RESET))
            self.deferred_aborts.extend(orphans)
            return
        self._publishes.submit({}, by_array(orphans), None)

    def take_deferred(self) -> list[tuple[bytes, PendingBlock]]:
        """The dropped blocks whose temporary files are not removed yet (shutdown)."""
        deferred, self.deferred_aborts = self.deferred_aborts, []
        return deferred

    # -- what the publishes returned -----------------------------------------------------------

    def collect(self) -> None:
        """Apply the publishes that returned in time; give up those past their deadline."""
        returned, went_late = self._publishes.collect()
        for job in returned:
            self._apply_job(job)
        for job, waited in went_late:
            self._give_up_publish(job, waited)

    def _apply_job(self, job: PublishJob) -> None:
        """A publish that returned in time."""
        results = job.results()
        if job.counted:
            return
        self._apply_publish(results)
        if job.offered is not None:
            self._metrics.observe(m.STORE_SECONDS, self._now() - job.offered)

    def _give_up_publish(self, job: PublishJob, waited_s: float) -> None:
        """A publish past its deadline: counted now (its blocks failed, cause timeout; the
        blocks it aborts with their own cause), no longer pending work. The keys it publishes
        are not believed present until its result comes back (:meth:`_apply_late_publish`)."""
        if not job.counted:
            for k in job.commit:
                self.publishing.discard(k)
                self.late_keys.add(k)
                self._release(k)
                self._count_unpublished(k, m.TIMEOUT)
            for k in job.abort:
                self._release(k)
                self._count_unpublished(k, self.abort_causes.pop(k, m.IO_ERROR))
            job.counted = True
        self.began("a publish", job.deadline_s, "store_deadline_s", waited_s)

    def _apply_late_publish(self, job: PublishJob) -> None:
        """A late publish returned: what it published is present after all (announced as
        if in time; counted already, at its deadline)."""
        self.late_keys.difference_update(job.commit)
        commit = set(job.commit)
        written: list[bytes] = []
        for key, status, _error in job.results():
            if key in commit and status in (WriteStatus.WRITTEN, WriteStatus.EXISTS):
                self._remember(key)
                if status is WriteStatus.WRITTEN:
                    written.append(key)
        self._counters["blocks_published_late"] += len(written)
        self._events.stored(written)

    def _release(self, key: bytes) -> None:
        """A block offered to the store is published or given up: its bytes are no longer
        pending (backpressure)."""
        self.pending_bytes = max(0, self.pending_bytes - self._bytes_of(key))

    def _count_unpublished(self, key: bytes, cause: str) -> None:
        self._counters["blocks_not_published"] += 1
        if cause in (m.CACHE_RESET, m.UNRESPONSIVE_REASON):
            self._metrics.count(m.STORE_DROPPED_BLOCKS, 1, cause)
        else:
            self._metrics.count(m.FAILED_BLOCKS, 1, m.STORE, cause)

    def _apply_publish(self, results: Published) -> None:
        written: list[bytes] = []
        for key, status, error in results:
            self.publishing.discard(key)
            self._release(key)
            if status in (WriteStatus.WRITTEN, WriteStatus.EXISTS):
                self._remember(key)
                if status is WriteStatus.WRITTEN:
                    self._counters["blocks_published"] += 1
                    self._metrics.count(m.STORED_BLOCKS)
                    self._metrics.count(m.STORED_BYTES, self._bytes_of(key))
                    written.append(key)
                else:  # another server published it first
                    self._metrics.count(m.STORE_SKIPPED_BLOCKS, 1, m.PRESENT)
                continue
            cause = self.abort_causes.pop(key, None)
            self._count_unpublished(key, cause or m.write_cause(error))
        self._events.stored(written)

    # -- the unresponsive episode --------------------------------------------------------------

    def began(self, what: str, deadline_s: float, setting: str, waited_s: float) -> None:
        """``what`` waited ``waited_s`` s, past ``deadline_s`` (``setting``): the store is
        unresponsive from then on (one warning per episode)."""
        if self.since is not None:
            return
        self.since = self._now() - waited_s
        log.warning(
            "kvstore: the store at %s did not answer %s within %.1f s (%s); lookups answer "
            "miss (recompute) and stores are dropped until it answers again",
            self._root,
            what,
            deadline_s,
            setting,
        )

    def collect_late(self, *, probes_answered: bool) -> None:
        """Apply late publishes that returned; the first of them, or a late probe that
        returned (``probes_answered``), ends an unresponsive episode."""
        returned = self._publishes.collect_late()
        for job in returned:
            self._apply_late_publish(job)
        answered = probes_answered or bool(returned)
        if answered:
            self._store_answered()

    def _store_answered(self) -> None:
        """A late job returned: the store answers again. Ends the episode (one line) and
        removes the temporary files of the blocks dropped meanwhile."""
        if self.since is None:
            return
        hung = self._now() - self.since
        self.since = None
        self._metrics.count(m.UNRESPONSIVE_SECONDS, hung)
        log.warning(
            "kvstore: the store at %s answered again after %.1f s unresponsive; lookups "
            "probe it and stores go to it again",
            self._root,
            hung,
        )
        if self.deferred_aborts:
            deferred, self.deferred_aborts = self.deferred_aborts, []
            self._publishes.submit({}, by_array(deferred), None, counted=True)

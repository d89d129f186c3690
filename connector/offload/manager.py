"""The scheduler side: which blocks the store holds, and publishing what the workers wrote.

vLLM calls every method on its scheduler thread (0.33 holds ``lock``, vLLM's default no-op
here; 0.32 has no lock: the background threads never touch this object's state, they only
return futures, which the scheduler thread applies at its next call).

* ``lookup`` answers from an in-memory view: HIT for a key known present (LRU of
  ``index_capacity`` keys), HIT_PENDING while its publish is running, MISS for a key probed
  absent less than ``miss_ttl_s`` ago or being stored by another request, otherwise RETRY:
  the key joins a batched existence probe of the shared store
  (:mod:`connector.offload.probes`), and vLLM asks again next step.
* **A hung store never stalls scheduling** (:mod:`connector.offload.publish_ledger`). A probe
  not answered within ``lookup_deadline_s`` (a frozen NFS server, a wedged FUSE daemon) answers
  its keys MISS (vLLM recomputes them); a publish or abort past ``store_deadline_s`` (plus the
  blocks' bytes at ``deadline_min_mb_per_s``: a compressed namespace rewrites them) is *late*:
  its blocks counted failed (cause ``timeout``), not believed present until its result comes
  back. Either starts an *unresponsive* episode (one warning): every new lookup a MISS at once,
  no new probe, new stores dropped, until a late job returns. The probe pool is fixed:
  ``probe_threads`` daemon threads (:class:`connector.offload.executor.PriorityExecutor`), and
  only jobs submitted before an episode began can queue behind a stuck one (bounded by the
  keys looked up in ``lookup_deadline_s`` and by ``max_pending_store_bytes``). ``drain`` and
  ``shutdown`` wait for a job no longer than its deadline; threads still stuck at shutdown are
  left behind (one line) and the store is not closed (closing it would join them).
* ``prepare_load`` pins the keys, ``complete_load`` unpins them (the connector itself never
  evicts; ``kvstore gc`` runs outside the engine, and a block it removes during a load is a
  load error like any vanished file).
* ``prepare_store`` skips keys already present, being published or being stored, opens a
  pending block for each other key (:meth:`kvstore.GroupStore.begin_blocks`, with its parent:
  the key ending one block earlier in the same request) and returns a small picklable spec.
* ``complete_store`` (vLLM calls it once every worker reported the job) hands the blocks to
  :class:`connector.offload.publish_ledger.PublishLedger`, which publishes them in the
  background (:meth:`GroupStore.commit_blocks`: checks, rename, directory fsync); the
  blocks some worker failed to write are aborted instead (temporary files removed) and, for
  ``write_backoff_s`` seconds, no new stores are offered (a full disk does not fill the log).
* :meth:`KVStoreManager.note_worker_failures` (from the connector) records those store
  failures, and forgets keys whose load failed (quarantined or vanished files). A store a
  worker gave up at its deadline is such a failure: aborted, never published; its late
  write only ever fills the block's temporary file, which the abort removes, or, written
  after it, ``kvstore gc`` and ``kvstore verify --fix`` (orphan temporaries). Stores a
  worker dropped while it found the store unresponsive count as dropped, not failed.
  :meth:`KVStoreManager.note_worker_health` keeps the workers' late jobs and unresponsive
  time for the metrics; while a worker finds the store unresponsive every lookup is a miss
  (its loads would fail at once, and vLLM would schedule them again and again).
* ``reset_cache`` drops the in-memory view only: the store is persistent and shared. Blocks
  pending at a reset are aborted once the workers reported their jobs (``abort_orphans``).

Operating it (docs/metrics.md): ``get_stats`` reports :mod:`connector.offload.metrics` (each
block counted once, here, whatever the TP size: the workers' failure reports of one block are
merged into one cause before the job completes), ``take_events`` the blocks published and found
gone (:mod:`connector.offload.events`), ``config_info`` (vLLM 0.33) the static settings.
``prepare_store`` applies admission (``admit_after``, :mod:`connector.offload.admission`) and
backpressure: blocks whose bytes would take the blocks offered and not yet published past
``max_pending_store_bytes`` are dropped (with the rest of that request's batch: a block without
its parent is not found by prefix lookups), never waited for.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

from connector.config import ConnectorConfig
from connector.identity import KeyMap
from connector.keys import parent_key
from connector.offload import metrics as m
from connector.offload.admission import Admission
from connector.offload.deadlines import MB, WorkerHealth
from connector.offload.events import StoreEvents
from connector.offload.executor import PriorityExecutor
from connector.offload.metrics import StoreMetrics
from connector.offload.probes import ExistenceProbes
from connector.offload.publish_ledger import PublishLedger
from connector.offload.publishes import Publishes, by_array
from connector.offload.transfer_specs import KVStoreLoadSpec, KVStoreStoreSpec
from kvstore import KVStore, Namespace, PendingBlock
from kvstore.checksum import checksum_id
from kvstore.io.deadline import Deadline

log = logging.getLogger("kvstore.connector")


# Load failures after which no engine can load the block: announced as removed.
_GONE = frozenset({m.MISSING, m.CORRUPT, m.IDENTITY_MISMATCH})


@dataclass
class _Looked:
    """Per request: keys whose lookup answer was counted."""

    keys: set[bytes] = field(default_factory=set)


class KVStoreManager(OffloadingManager):  # type: ignore[misc, unused-ignore]  # Any w/o vLLM
    """Scheduler-side index and publisher of one engine's namespace."""

    def __init__(  # noqa: PLR0913 - keyword-only: the store, namespace, key map and options KVStoreSpec built, the commit-checksum switch, and the clock tests replace
        self,
        *,
        store: KVStore,
        namespace: Namespace,
        key_map: KeyMap,
        options: ConnectorConfig,
        commit_checksum_all: bool,
        events_enabled: bool = False,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.namespace = namespace
        self.key_map = key_map
        self.options = options
        self.tokens_per_block = namespace.identity.tokens_per_block
        # DCP writers fill inner chunks by byte ranges: their checksums are computed at commit.
        self._commit_chunks = {
            g.index: tuple(range(g.layout.num_chunks)) if commit_checksum_all else ()
            for g in namespace.groups
        }
        self._checksum_algo = checksum_id(store.checksum)
        self._now = monotonic
        # Fixed daemon threads: one stuck in a hung file system never holds up the process's
        # exit, and nothing is submitted while the store is known hung (see the module doc).
        self._pool = PriorityExecutor(options.probe_threads, "kvstore-probe")
        self._present: OrderedDict[bytes, None] = OrderedDict()
        self._pending: dict[bytes, PendingBlock] = {}  # prepared stores, not yet completed
        self._failed_stores: dict[bytes, str] = {}  # key -> cause, reported by a worker
        self._pins: Counter[bytes] = Counter()
        # pending at a cache reset, aborted when flushed
        self._orphans: list[tuple[bytes, PendingBlock]] = []
        self._backoff_until = 0.0
        self.counters: Counter[str] = Counter()
        # operating: metrics, events, admission, backpressure (docs/metrics.md)
        self.metrics = StoreMetrics()
        self.probes = ExistenceProbes(
            pool=self._pool,
            namespace=namespace,
            key_map=key_map,
            options=options,
            metrics=self.metrics,
            now=monotonic,
            remember=self._remember,
        )
        self.events = StoreEvents(enabled=events_enabled, locality=options.kv_events_locality)
        self.admission = Admission(options.admit_after, options.index_capacity)
        self._block_bytes = {g.index: g.layout.block_nbytes for g in namespace.groups}
        self.publishes = Publishes(
            pool=self._pool,
            namespace=namespace,
            commit_chunks=self._commit_chunks,
            deadline=Deadline(options.store_deadline_s, options.deadline_min_mb_per_s * MB),
            bytes_of=self._bytes_of,
            now=monotonic,
        )
        self.ledger = PublishLedger(
            root=store.root,
            now=monotonic,
            metrics=self.metrics,
            events=self.events,
            counters=self.counters,
            publishes=self.publishes,
            remember=self._remember,
            bytes_of=self._bytes_of,
        )
        self._offered_at: dict[bytes, float] = {}  # key -> when prepare_store took it
        self._load_started: dict[bytes, float] = {}  # key -> when prepare_load pinned it
        self._load_failed: dict[bytes, str] = {}  # key -> cause, reported by a worker
        self._worker_health = WorkerHealth()  # summed over workers and steps: gauges

    # -- lookup --------------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:  # noqa: PLR0911 - one answer per state of the store and the key, in order
        self._drain()
        k = bytes(key)
        self.admission.see(k, req_context)
        if self._worker_health.unresponsive > 0:
            # A worker finds the store hung: its loads fail at once, and vLLM would schedule
            # the request's load again and again. Recompute until the worker says otherwise.
            self.metrics.count(m.LOOKUP_TIMEOUTS)
            return self._answer(k, req_context, LookupResult.MISS)
        if k in self._present:
            self._present.move_to_end(k)
            return self._answer(k, req_context, LookupResult.HIT)
        if k in self.ledger.publishing:
            return LookupResult.HIT_PENDING
        if k in self._pending:  # another request is storing it; recompute meanwhile
            return self._answer(k, req_context, LookupResult.MISS)
        if k in self.ledger.late_keys:  # its publish is late: not present until its result says so
            return self._answer(k, req_context, LookupResult.MISS)
        if self.probes.known_absent(k):
            return self._answer(k, req_context, LookupResult.MISS)
        if self.ledger.hung:  # a hung store: answer now, probe nothing
            self.metrics.count(m.LOOKUP_TIMEOUTS)
            return self._answer(k, req_context, LookupResult.MISS)
        self.probes.ask(k)
        return LookupResult.RETRY

    def _answer(self, key: bytes, req_context: ReqContext, result: LookupResult) -> LookupResult:
        """Count a final lookup answer, once per request and key (vLLM asks again while an
        earlier key of the request is being probed)."""
        looked = req_context.get_state(_Looked)
        if looked is None:
            looked = _Looked()
            req_context.set_state(looked)
        if key not in looked.keys:
            looked.keys.add(key)
            label = m.HIT if result is LookupResult.HIT else m.MISS
            self.metrics.count(m.LOOKUP_BLOCKS, 1, label)
            self.metrics.count(m.LOOKUP_TOKENS, self.tokens_per_block, label)
        return result

    def on_schedule_end(self, context: object) -> None:
        # keys queued before the store hung are answered missing
        self.probes.flush(unresponsive=self.ledger.hung)
        self._drain()

    # -- loads ---------------------------------------------------------------------------------

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> KVStoreLoadSpec:
        ordered = [bytes(k) for k in keys]
        self._pins.update(ordered)
        self.counters["blocks_loaded"] += len(ordered)
        now = self._now()
        for k in ordered:
            self._load_started.setdefault(k, now)
        return KVStoreLoadSpec(ordered, req_context.req_id)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Every worker reported the load job (and, before it, the blocks that failed)."""
        started: list[float] = []
        gone: list[bytes] = []
        for key in keys:
            k = bytes(key)
            self._pins[k] -= 1
            if self._pins[k] <= 0:
                del self._pins[k]
                if (t := self._load_started.pop(k, None)) is not None:
                    started.append(t)
            cause = self._load_failed.pop(k, None)
            if cause is None:
                self.metrics.count(m.LOADED_BLOCKS)
                self.metrics.count(m.LOADED_BYTES, self._bytes_of(k))
                continue
            self.metrics.count(m.FAILED_BLOCKS, 1, m.LOAD, cause)
            if cause in _GONE:
                gone.append(k)
        self.events.removed(gone)
        if started:
            self.metrics.observe(m.LOAD_SECONDS, self._now() - min(started))

    # -- stores --------------------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput:
        self._drain()
        offered = list(dict.fromkeys(bytes(k) for k in keys))
        present = {
            k
            for k in offered
            if k in self._present
            or k in self.ledger.publishing
            or k in self._pending
            or k in self.ledger.late_keys
        }
        self.metrics.count(m.STORE_SKIPPED_BLOCKS, len(present), m.PRESENT)
        candidates = [k for k in offered if k not in present]
        if self.ledger.hung:  # workers would only block on the mount
            self.metrics.count(m.STORE_DROPPED_BLOCKS, len(candidates), m.UNRESPONSIVE_REASON)
            return _empty_store(self.namespace.name, self._checksum_algo)
        if self._now() < self._backoff_until:
            self.metrics.count(m.STORE_DROPPED_BLOCKS, len(candidates), m.WRITE_BACKOFF_REASON)
            return _empty_store(self.namespace.name, self._checksum_algo)
        todo = self._admit(candidates, req_context)
        if not todo:
            return _empty_store(self.namespace.name, self._checksum_algo)
        by_array: dict[int, list[bytes]] = defaultdict(list)
        for k in todo:
            by_array[self.key_map.split(k)[0]].append(k)
        for array, group_keys in by_array.items():
            hashes = [self.key_map.split(k)[1] for k in group_keys]
            parents = [self._parent(k, req_context) for k in group_keys]
            pendings = self.namespace.group(array).begin_blocks(hashes, parents)
            self._pending.update(zip(group_keys, pendings, strict=True))
        now = self._now()
        for k in todo:
            self._offered_at[k] = now
        spec = KVStoreStoreSpec(
            self.namespace.name, self._checksum_algo, todo, [self._pending[k] for k in todo]
        )
        self.counters["blocks_prepared"] += len(todo)
        return PrepareStoreOutput(
            keys_to_store=[OffloadKey(k) for k in todo], store_spec=spec, evicted_keys=[]
        )

    def _admit(self, candidates: Sequence[bytes], req_context: ReqContext) -> list[bytes]:
        """The candidates admission lets through and the pending-bytes bound has room for."""
        todo: list[bytes] = []
        dropping = False
        for k in candidates:
            if not self.admission.admit(k, req_context):
                self.metrics.count(m.STORE_SKIPPED_BLOCKS, 1, m.NOT_ADMITTED)
                continue
            nbytes = self._bytes_of(k)
            # Once one block is dropped, its descendants in this batch go too.
            dropping = dropping or (
                self.ledger.pending_bytes + nbytes > self.options.max_pending_store_bytes
            )
            if dropping:
                self.metrics.count(m.STORE_DROPPED_BLOCKS, 1, m.BACKPRESSURE)
                continue
            self.ledger.pending_bytes += nbytes
            todo.append(k)
        return todo

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self._drain()
        commit: dict[int, list[tuple[bytes, PendingBlock]]] = defaultdict(list)
        abort: dict[int, list[tuple[bytes, PendingBlock]]] = defaultdict(list)
        for key in keys:
            k = bytes(key)
            pending = self._pending.pop(k, None)
            if pending is None:
                continue
            cause = self._failed_stores.pop(k, None)
            if cause is None and not success:
                cause = m.IO_ERROR  # vLLM says the job failed (no worker said why)
            if cause is not None:
                self.ledger.abort_causes[k] = cause
            (abort if cause is not None else commit)[pending.group].append((k, pending))
        if not commit and not abort:
            return
        times = [self._offered_at.pop(k, None) for items in commit.values() for k, _ in items]
        for items in abort.values():
            for k, _ in items:
                self._offered_at.pop(k, None)
        offered = min((t for t in times if t is not None), default=None)
        self.ledger.submit(commit, abort, offered)

    def note_worker_failures(
        self,
        failed_store_keys: Iterable[bytes],
        failed_load_keys: Iterable[bytes],
        causes: Mapping[bytes, str] | None = None,
    ) -> None:
        """Worker reports (before ``complete_store`` / ``complete_load`` of their job): what
        must not be published, and keys whose file turned out missing or corrupt. ``causes``
        (:mod:`connector.offload.metrics` cause per key, merged over the ranks) says why; a key
        without one counts as an I/O error."""
        causes = causes or {}
        stores = {bytes(k) for k in failed_store_keys} & self._pending.keys()
        if stores:
            m.merge_causes(self._failed_stores, {k: causes.get(k, m.IO_ERROR) for k in stores})
            if self.options.write_backoff_s > 0:
                if self._now() >= self._backoff_until:
                    log.warning(
                        "kvstore: %d block writes failed; no new blocks are offered to the "
                        "store for %.0f s",
                        len(stores),
                        self.options.write_backoff_s,
                    )
                self._backoff_until = self._now() + self.options.write_backoff_s
        for key in failed_load_keys:
            k = bytes(key)
            self._present.pop(k, None)
            self.probes.absent.pop(k, None)
            self.counters["load_failures"] += 1
            cause = causes.get(k, m.IO_ERROR)
            if k in self._pins:  # counted once, when the job completes on every rank
                m.merge_causes(self._load_failed, {k: cause})
            else:  # pragma: no cover - vLLM completes a load only after every report
                self.metrics.count(m.FAILED_BLOCKS, 1, m.LOAD, cause)

    def note_worker_health(self, health: WorkerHealth) -> None:
        """Workers' changes since their last report (summed over ranks): late jobs and bytes,
        workers unresponsive (kept as gauges), seconds unresponsive (counted)."""
        self._worker_health = self._worker_health.plus(
            dataclasses.replace(health, unresponsive_seconds=0.0)
        )
        self.metrics.count(m.WORKER_UNRESPONSIVE_SECONDS, health.unresponsive_seconds)

    # -- bookkeeping ---------------------------------------------------------------------------

    def _drain(self) -> None:
        """Apply the results of finished background probes and publishes."""
        self.ledger.collect_late(probes_answered=self.probes.collect_late())
        waited = self.probes.collect()
        if waited is not None:
            self.ledger.began(
                "an existence probe", self.options.lookup_deadline_s, "lookup_deadline_s", waited
            )
        self.ledger.collect()

    def _remember(self, key: bytes) -> None:
        self._present[key] = None
        self._present.move_to_end(key)
        while len(self._present) > self.options.index_capacity:
            self._present.popitem(last=False)

    def _bytes_of(self, key: bytes) -> int:
        """Bytes of the whole block ``key`` names (every rank's share)."""
        return self._block_bytes.get(self.key_map.split(key)[0], 0)

    def _parent(self, key: bytes, req_context: ReqContext) -> bytes | None:
        """Block hash of the key that ends one block before ``key`` in this request."""
        parent = parent_key(key, req_context, self.tokens_per_block)
        return None if parent is None else self.key_map.split(parent)[1]

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def has_pending_work(self) -> bool:
        # Orphans keep the engine stepping until the workers' reports of the jobs flushed by
        # a reset come back (vLLM 0.32 stops stepping otherwise; see connector.compat). Jobs
        # past their deadline (late) do not: an idle engine does not spin on a hung mount.
        return bool(self.probes.pending or self.publishes.pending or self._orphans)

    def reset_cache(self) -> None:
        """Forget the in-memory view (the store itself is persistent and shared).

        vLLM drops the jobs in flight: their ``complete_store`` / ``complete_load`` never
        come, and pins of loads in flight are dropped here. Their pending blocks are aborted
        (temporary files removed) once every worker reported those jobs
        (:meth:`abort_orphans`), since until then a worker may still be writing: vLLM 0.33
        says so with :meth:`on_reset_flushed`; under 0.32, which never calls it,
        :class:`connector.offload.vllm_connector.KVStoreConnector` counts the reports itself.
        """
        self._present.clear()
        self.probes.absent.clear()
        self._pins.clear()
        self._orphans.extend(self._pending.items())
        self.ledger.abort_causes.update(dict.fromkeys(self._pending, m.CACHE_RESET))
        self._pending.clear()
        self._failed_stores.clear()
        self._offered_at.clear()
        self._load_started.clear()
        self._load_failed.clear()

    def on_reset_flushed(self) -> None:
        """vLLM 0.33: every worker reported the jobs in flight at the last reset."""
        self.abort_orphans()

    def abort_orphans(self) -> None:
        """Abort the blocks pending at past resets (no worker writes them any more)."""
        orphans, self._orphans = self._orphans, []
        if not orphans:
            return
        self.ledger.abort_orphans(orphans)

    # -- operating: metrics and events (docs/metrics.md) ----------------------------------------

    def get_stats(self) -> OffloadingConnectorStats | None:
        """The metrics since the last call (vLLM calls it every step it logs stats)."""
        self._drain()
        backoff = 1 if self._now() < self._backoff_until else 0
        self.metrics.gauge(m.WRITE_BACKOFF, backoff)
        self.metrics.gauge(m.PENDING_STORE_BYTES, self.ledger.pending_bytes)
        self.metrics.gauge(m.PENDING_STORE_BLOCKS, len(self._pending) + len(self.ledger.publishing))
        probes = self.probes
        self.metrics.gauge(m.PENDING_JOBS, len(probes.in_flight) + len(probes.late), m.PROBE)
        self.metrics.gauge(m.UNRESPONSIVE, 0 if self.ledger.since is None else 1)
        self.metrics.gauge(
            m.PENDING_JOBS, len(self.publishes.in_time) + len(self.publishes.late), m.PUBLISH
        )
        self.metrics.gauge(m.LATE_JOBS, len(probes.late), m.PROBE)
        self.metrics.gauge(m.LATE_JOBS, len(self.publishes.late), m.PUBLISH)
        health = self._worker_health
        self.metrics.gauge(m.WORKER_UNRESPONSIVE, health.unresponsive)
        self.metrics.gauge(m.LATE_JOBS, health.late_loads, m.LOAD)
        self.metrics.gauge(m.LATE_JOBS, health.late_stores, m.STORE)
        self.metrics.gauge(m.LATE_BYTES, health.late_bytes)
        stats = OffloadingConnectorStats()
        return stats if self.metrics.take(stats) else None

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Blocks published by this engine and blocks found gone
        (:mod:`connector.offload.events`)."""
        return self.events.take()

    def config_info(self) -> Sequence[Mapping[str, str | int | float | bool]]:
        """vLLM 0.33's ``vllm:kv_offload_config_info`` labels (:data:`m.CONFIG_INFO_KEYS`)."""
        values = (
            str(self.store.root),
            self.namespace.name,
            self.options.admit_after,
            self.options.max_pending_store_bytes,
            self.options.kv_events_locality,
        )
        return [dict(zip(m.CONFIG_INFO_KEYS, values, strict=True))]

    def drain(self, timeout: float | None = None) -> None:
        """Wait for the queued probes and publishes, each no longer than until its deadline
        (and all of them no longer than ``timeout`` seconds), and apply them (tests,
        shutdown). Jobs already late are not waited for: the store did not answer them."""
        self.probes.flush(unresponsive=self.ledger.hung)
        now, start = self._now(), time.monotonic()
        # Each job's deadline on the real clock (the manager's clock may be a test's).
        ends: dict[Future[Any], float] = {
            f: start + max(0.0, t + self.options.lookup_deadline_s - now)
            for _, f, t in self.probes.in_flight
        }
        ends.update(
            (j.future, start + max(0.0, j.started + j.deadline_s - now))
            for j in self.publishes.in_time
        )
        give_up = math.inf if timeout is None else start + timeout
        while True:
            clock = time.monotonic()
            ends = {f: end for f, end in ends.items() if not f.done() and end > clock}
            if not ends or clock >= give_up:
                break
            first = min(*ends.values(), give_up)
            wait_futures(list(ends), timeout=first - clock, return_when=FIRST_COMPLETED)
        self._drain()

    def shutdown(self) -> None:
        """Remove the temporary files nobody will publish, wait for the jobs in flight (each
        until its deadline) and stop. Threads still blocked in a hung store are left behind
        (one line; they are daemons), and the store is not closed (that would join them)."""
        self.probes.queue.clear()  # nobody will ask again
        self._drain()
        # The workers are stopped by now: blocks of unfinished jobs, and of jobs flushed by a
        # reset whose reports never came, are nobody's any more.
        leftovers = [*self._pending.items(), *self._orphans, *self.ledger.take_deferred()]
        self._pending.clear()
        self._orphans.clear()
        left_behind = 0
        if leftovers and self.ledger.since is None:
            self.publishes.submit({}, by_array(leftovers), None, counted=True)
        else:  # a hung store: kvstore gc and verify --fix remove orphan temporaries
            left_behind = len(leftovers)
        self.drain()
        probes = self.probes.futures()
        publishes = self.publishes.futures()
        stuck_probes = sum(not f.done() for f in probes)
        stuck_publishes = sum(not f.done() for f in publishes)
        if stuck_probes or stuck_publishes:
            log.warning(
                "kvstore: %d existence probes and %d publishes are still blocked in the store "
                "at %s at shutdown; their threads are left behind (%d temporary block files "
                "left for kvstore gc)",
                stuck_probes,
                stuck_publishes,
                self.store.root,
                left_behind,
            )
            self._pool.shutdown(wait=False)
            return
        if left_behind:
            log.warning(
                "kvstore: the store at %s was unresponsive at shutdown: %d temporary block "
                "files left for kvstore gc",
                self.store.root,
                left_behind,
            )
        self._pool.shutdown(wait=True)
        self.store.close()


def _empty_store(namespace: str, checksum_algo: int) -> PrepareStoreOutput:
    return PrepareStoreOutput(
        keys_to_store=[],
        store_spec=KVStoreStoreSpec(namespace, checksum_algo, [], []),
        evicted_keys=[],
    )

"""``KVStoreTier``: kvstore as a secondary tier behind vLLM's CPU tier (``TieringOffloadingSpec``).

vLLM (0.33) stores a block GPU -> CPU tier -> every secondary tier (a "cascade", once the CPU
copy is complete) and loads it secondary tier -> CPU tier -> GPU (a "promotion", after a tier
lookup answered HIT). This tier keeps those blocks in a kvstore namespace, in the format and
namespace the direct connector uses, so one store serves both integrations, the admin CLI and
``kvstore-inspect``, at any parallel layout (:mod:`connector.tier.chunks` maps the CPU tier's
rows to canonical blocks).

Every method runs on vLLM's scheduler thread under the tiering manager's lock and returns at
once (tiering/base.py):

* ``lookup``: HIT for a key this process stored or loaded (an LRU of ``index_capacity`` keys),
  otherwise vLLM's async lookup (:class:`connector.tier.lookup.StoreProbe`): RETRY while the
  batched existence probe runs, then its verdict;
* ``submit_store`` / ``submit_load``: queue the job on the store / load threads
  (:class:`connector.tier.jobs.JobRunner`) in parts of :data:`JOB_BATCH` blocks, each a call
  of :class:`connector.tier.transfers.BlockTransfers`: a store copies the chunks out of the
  rows into its thread's staging buffer (a contiguous copy of each row's span, written as
  pieces, where the canonical chunks are whole runs of the row: :meth:`ChunkMap.source_views`;
  otherwise a gather into canonical blocks) and publishes their canonical blocks
  (:meth:`kvstore.GroupStore.write_blocks`: checksums, atomic rename, fsync per
  ``durability``); a load reads and verifies them (:meth:`kvstore.GroupStore.read_blocks`)
  into a staging buffer, then scatters the hits into the rows, or, on vLLM 0.34, straight into
  the rows where each canonical byte has one place there (:data:`LOAD_INTO_ROWS`);
* ``get_finished_jobs``: the outcomes. A block that is missing, corrupt (quarantined by the
  store), or unreadable fails its promotion, and only that key becomes a miss
  (``successful_keys`` keeps the others); a failed write fails its store job. On vLLM 0.34 a
  failed promotion is reported as soon as every part before its first failed one has ended
  (:class:`connector.tier.jobs.JobRunner`, early failures). Nothing raises into vLLM: vLLM
  recomputes, and its backpressure detector (``on_store_failed``, store latency) drops stores
  while the store is slow or full (see ``default_backpressure`` in
  :mod:`connector.tier.config`).

**A slow or hung file system never stalls the engine** (:mod:`connector.tier.health`). vLLM
waits for a lookup's verdict and a promotion's outcome; both are bounded:

* a probe not answered within ``lookup_deadline_s`` answers its keys miss and starts an
  *unresponsive* episode (one warning); during it every lookup is a miss at once (keys this
  tier knows present too: their promotion would fail) and no probe is started;
* a job not done within ``load_deadline_s`` / ``store_deadline_s`` (plus its bytes at
  ``deadline_min_mb_per_s``) from its submission is reported failed (vLLM recomputes; the
  backpressure detector counts the failed store), a call of it still in the file system past
  the deadline of its own bytes starts an episode; during an episode new jobs fail at once
  (stores are dropped) but for one trial job every ``unresponsive_retry_s``; the first call that
  returns ends it (one more line);
* vLLM reuses a chunk once its job is reported, so no I/O of a job reported failed may touch
  the rows: each part copies into or out of them only under its gate
  (:class:`kvstore.io.deadline.DeliveryGate`, see :mod:`connector.tier.jobs`). Stores copy
  the rows before their I/O, so a late write reads only the tier's copy. Loads on vLLM 0.33
  read into the tier's staging buffer and copy into the rows only once the gate is claimed:
  a late read is dropped. On vLLM 0.34 a load reads straight into the rows where it can, and a
  promotion reported failed while such a read hangs carries ``JobResult.deferred_release``:
  vLLM keeps those chunks out of its free pool until the read has ended (``drain_jobs``, at a
  cache reset, waits for it);
* the threads never grow: a fixed few per kind, and a job queued behind stuck ones fails at
  its deadline and does no I/O when it finally runs.

Counters and gauges (``vllm:kvstore_tier_*``, :func:`connector.tier.health.metric_definitions`)
go out through vLLM's ``get_stats`` of the tier; :meth:`KVStoreTier.stats` has them as a dict.

The engine facts the namespace identity needs (hash algorithm, KV heads, group kinds) come from
:class:`connector.KVStoreConnector`, as for the direct connector: load the
tiering spec through it (docs/vllm.md).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.backpressure import (
    BackpressureDetector,
    EMABackpressureDetector,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

import connector.store
from connector import compat
from connector.config import ConnectorConfig
from connector.facts import current
from connector.identity import GROUP_ID_BYTES, derive_identity
from connector.keys import parent_key
from connector.tier.chunks import ChunkGeometry, ChunkMap, build_chunk_map, rows_of
from connector.tier.config import TierConfig
from connector.tier.health import (
    DEADLINE,
    UNRESPONSIVE,
    LateIO,
    Op,
    TierHealth,
    metric_definitions,
)
from connector.tier.jobs import LOAD, STORE, Finished, JobRunner, Outcome, Part
from connector.tier.lookup import StoreProbe, split_key
from connector.tier.transfers import BlockTransfers
from kvstore import ConfigError, GroupStore
from kvstore.io.deadline import DeliveryGate

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

log = logging.getLogger("kvstore.connector")

# Blocks per part of a job (a store / read call): parts of one job run concurrently on the
# job threads (vLLM batches a whole request's promotions into one job), and each bounds its
# thread's staging buffer.
JOB_BATCH = 32

# Stores hand the store strided views (pieces, no gather) of a contiguous copy of each row's
# span where they apply (:func:`_in_place`); the bytes on disk are the gathered ones
# (tests/connector/test_tier_chunks.py). The copy is the price of the store deadline: a store
# reported failed may still be writing, and vLLM reuses its chunks (there is no deferred
# release for cascades). llama-3.1-8b 16-token blocks through vLLM's TieringOffloadingManager
# (the tier suite's store phase), 0.25 GiB on tmpfs, 2-core VM under load, two runs of 6
# rounds alternating in one process (first round dropped: fresh buffers fault): median store
# CPU 0.90 / 0.99 s/GB writing from the rows themselves (the path before deadlines), 1.23 /
# 1.17 from the copy, 1.45 gathered (first run); store GB/s moved 0.3-2.2 between rounds.

# Promotions read and verify blocks straight into the rows where the load plan allows it
# (:func:`_loads_in_place`) and vLLM can hold the chunks of a promotion that failed while such
# a read still runs (0.34's deferred release); otherwise (vLLM 0.33, or off: kept for A/B
# runs) every load is staged, then scattered under its gate, so a late read never reaches
# the rows.
LOAD_INTO_ROWS = True


class KVStoreTier(SecondaryTierManager):  # type: ignore[misc, unused-ignore]  # Any w/o vLLM
    """A kvstore namespace as one of vLLM's secondary offloading tiers."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **options: Any,
    ) -> None:
        self.options = TierConfig.from_options(options)
        facts = current()
        if facts is None:
            raise ConfigError(
                "KVStoreTier must be loaded by connector.KVStoreConnector (it reads the engine "
                'facts the namespace identity needs): set "kv_connector": "KVStoreConnector" '
                'and "kv_connector_module_path": "connector" in --kv-transfer-config, with '
                '"spec_name": "TieringOffloadingSpec" in kv_connector_extra_config'
            )
        if backpressure_detector is None and self.options.default_backpressure:
            locality = self.options.locality or None
            backpressure_detector = EMABackpressureDetector(
                **EMABackpressureDetector.default_config("fs", locality=locality)
            )
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(self.options.locality.upper()) if self.options.locality else None
        config = offloading_spec.config
        naming = ConnectorConfig(
            store=self.options.store,
            model_name=self.options.model_name,
            model_revision=self.options.model_revision,
        )
        self.identity, self.key_map = derive_identity(config, facts, naming)
        self.facts = facts
        self.geometry = ChunkGeometry(
            row_bytes=self.block_size_bytes,
            cell_bytes=int(getattr(offloading_spec, "cpu_page_size_per_worker", 0)),
            world_size=int(config.parallel.world_size),
            canonical_layout=bool(config.canonical_layout),
            replicated_layout=bool(getattr(offloading_spec, "replicated_layout", False)),
            blocks_per_chunk=int(offloading_spec.blocks_per_chunk),
        )
        self.chunks = build_chunk_map(rows_of(primary_kv_view), self.identity, facts, self.geometry)
        try:
            self.store = connector.store.open_store(self.options.store)  # tests inject faults
        except BaseException:
            self.chunks.release()  # vLLM releases the CPU tier's view after a failed start
            raise
        try:
            self.namespace = self.store.namespace(self.identity)
            arrays = range(len(self.chunks.groups))
            in_place = [_in_place(self.chunks, self.namespace.group(a), a) for a in arrays]
            loads_in_place = [
                _loads_in_place(self.chunks, self.namespace.group(a), a) for a in arrays
            ]
        except BaseException:
            self.chunks.release()
            self.store.close()
            raise
        self.tokens_per_block = self.identity.tokens_per_block
        # a key's group id suffix -> the bytes of its canonical block (deadlines by size)
        self._block_bytes = {
            g.to_bytes(GROUP_ID_BYTES, "big"): self.chunks.groups[a].block_bytes
            for a, g in enumerate(self.key_map.group_ids)
        }
        self._present: OrderedDict[bytes, None] = OrderedDict()
        self._jobs_keys: dict[int, tuple[list[bytes], bool]] = {}  # job id -> (keys, is_load)
        self._health = TierHealth(self.options, str(self.store.root))
        self._probe = StoreProbe(self.namespace, self.key_map, tier_type, self._health)
        self._runner = JobRunner(
            self.options.load_threads,
            self.options.store_threads,
            defers_release=compat.TIER_DEFERS_RELEASE,
        )
        self._transfers = BlockTransfers(
            chunks=self.chunks,
            namespace=self.namespace,
            key_map=self.key_map,
            block_bytes=self._block_bytes,
            present=self._present,
            health=self._health,
            in_place=in_place,
            loads_in_place=loads_in_place,
        )
        # (release event, chunks) of promotions reported failed while a read into their
        # chunks still ran (vLLM 0.34): what vLLM holds for late reads
        self._held: list[tuple[threading.Event, int]] = []
        self._events: list[OffloadingEvent] | None = None
        if self.options.enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self._events = []
            else:
                log.warning(
                    "kvstore tier: enable_kv_events is set but vLLM's KV cache events are "
                    "off (--kv-events-config); the tier emits no events"
                )
        log.info(
            "kvstore tier: namespace %s in %s (durability=%s, %d KV groups)",
            self.namespace.name,
            self.store.root,
            self.options.store.durability,
            len(self.namespace.groups),
        )

    # -- lookup --------------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        k = bytes(key)
        if k[-GROUP_ID_BYTES:] not in self._block_bytes:  # a group this namespace lacks
            return LookupResult.MISS
        if self._hung():  # even a key known present: its promotion would fail
            self._health.count("lookup", UNRESPONSIVE, 1)
            return LookupResult.MISS
        if k in self._present:
            self._present.move_to_end(k)
            return LookupResult.HIT
        found = self._probe.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._probe.cleanup(req_context.req_id)

    def on_schedule_end(self, context: object) -> None:
        self._probe.flush()

    # -- jobs ----------------------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = [bytes(k) for k in job_metadata.keys]
        chunk_ids = [int(c) for c in job_metadata.chunk_ids]
        job_id = job_metadata.job_id
        self._jobs_keys[job_id] = (keys, False)
        writes = any(k not in self._present for k in keys)  # else it needs no call
        if writes and not self._admit():
            self._refuse(job_id, "store", keys)
            return
        parents = self._parents(keys, job_metadata.req_context)
        parts = [
            self._part(
                functools.partial(self._transfers.store, keys[b], chunk_ids[b], parents[b]), keys[b]
            )
            for b in _slices(len(keys))
        ]
        self._runner.submit(job_id, STORE, parts, self._health.deadlines["store"])

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = [bytes(k) for k in job_metadata.keys]
        chunk_ids = [int(c) for c in job_metadata.chunk_ids]
        job_id = job_metadata.job_id
        self._jobs_keys[job_id] = (keys, True)
        if not self._admit():
            self._refuse(job_id, "load", keys)
            return
        parts = [
            self._part(functools.partial(self._transfers.load, keys[b], chunk_ids[b]), keys[b])
            for b in _slices(len(keys))
        ]
        self._runner.submit(job_id, LOAD, parts, self._health.deadlines["load"])

    def _part(self, run: Callable[[DeliveryGate], Outcome], keys: Sequence[bytes]) -> Part:
        return Part(run, frozenset(keys), self._transfers.nbytes(keys))

    def _refuse(self, job_id: int, op: Op, keys: Sequence[bytes]) -> None:
        """Fail a job at once, without a call: the store is unresponsive (a store is dropped,
        a promotion recomputed; vLLM's backpressure counts a failed store)."""
        self._health.count(op, UNRESPONSIVE, len(keys))
        self._runner.refuse(job_id, keys)

    def _hung(self) -> bool:
        """Whether the store is unresponsive. A job's call in the file system past the
        deadline of its bytes starts the episode here, whenever the tier is next asked:
        vLLM polls no job while it idles, once the job itself was reported."""
        for kind, waited in self._runner.overdue_calls():
            self._health.timed_out(kind, waited)
        return self._health.hung

    def _admit(self) -> bool:
        """Whether a new job may go to the store (during an episode: a trial)."""
        self._hung()
        return self._health.responsiveness.admit()

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._hung()
        self._held = [(event, n) for event, n in self._held if not event.is_set()]
        return [self._result(finished) for finished in self._runner.finished()]

    def _result(self, finished: Finished) -> JobResult:
        """vLLM's result of a finished job; what it tells about its keys is remembered."""
        keys, is_load = self._jobs_keys.pop(finished.job_id)
        outcome = finished.outcome
        ok, cut_short = outcome.ok_keys, finished.cut_short
        failed = [k for k in keys if k not in ok]
        for k in keys:
            if k in ok:
                self._remember(k)
            elif k not in cut_short:  # found bad; a key cut short may well be there
                self._present.pop(k, None)
        if finished.timed_out:
            self._health.count("load" if is_load else "store", DEADLINE, len(failed))
        partial = None
        if not is_load and self._events is not None and ok:
            stored = [OffloadKey(k) for k in keys if k in ok]
            self._events.append(
                OffloadingEvent(
                    keys=stored, medium=self.medium, removed=False, locality=self.locality
                )
            )
        if is_load and failed:
            self._probe.mark_miss([OffloadKey(k) for k in failed if k not in cut_short])
            kept = [OffloadKey(k) for k in keys if k in ok]
            partial = tuple(kept) if kept else None
        # vLLM 0.34: chunks of a failed promotion stay held until the reads into them end.
        release = {}
        if finished.release is not None:
            release = {"deferred_release": finished.release}
            self._held.append((finished.release, len(failed)))
        return JobResult(
            job_id=finished.job_id,
            success=not failed,
            successful_keys=partial,
            transfer_time=finished.seconds,
            transfer_bytes=outcome.nbytes or None,
            **release,
        )

    def take_events(self) -> Iterable[OffloadingEvent]:
        """BlockStored events of finished store jobs (``enable_kv_events``)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def drain_jobs(self) -> None:
        """Block until every job is reported and no I/O touches the rows any more: bounded
        by the deadlines, except (vLLM 0.34) a read into the rows of a promotion reported
        failed, which vLLM's contract makes this wait for (its release set)."""
        self._runner.wait_idle()

    def stats(self) -> dict[str, float]:
        """The tier's deadline counters and what late I/O holds (the values of
        :meth:`get_stats`' series, as totals since start)."""
        self._hung()
        return self._health.snapshot(self._late_io())

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """The ``vllm:kvstore_tier_*`` series (:mod:`connector.tier.health`)."""
        return metric_definitions()

    def get_stats(self) -> OffloadingConnectorStats | None:
        """What changed since the last call (vLLM merges it into the tiering manager's)."""
        self._hung()
        stats = OffloadingConnectorStats()
        return stats if self._health.take_stats(stats, self._late_io()) else None

    def _late_io(self) -> LateIO:
        """(any thread) What the I/O of jobs already reported still holds."""
        parts, nbytes = self._runner.late()
        return LateIO(parts, nbytes, sum(n for event, n in self._held if not event.is_set()))

    def shutdown(self) -> None:
        self._probe.shutdown()
        self._runner.shutdown()
        self.chunks.release()
        self.store.close()

    # -- bookkeeping ---------------------------------------------------------------------------

    def _remember(self, key: bytes) -> None:
        self._present[key] = None
        self._present.move_to_end(key)
        while len(self._present) > self.options.index_capacity:
            self._present.popitem(last=False)

    def _parents(self, keys: Sequence[bytes], req_context: ReqContext) -> list[bytes | None]:
        """Block hash of the key ending one block earlier in the request (header field)."""
        out: list[bytes | None] = []
        for k in keys:
            parent = parent_key(k, req_context, self.tokens_per_block)
            where = None if parent is None else split_key(self.key_map, parent)
            out.append(None if where is None else where[1])
        return out


def _in_place(chunks: ChunkMap, group: GroupStore, array: int) -> bool:
    """Whether stores of ``array`` hand the store strided views of row copies (pieces: no
    gather into canonical order). Only for raw dense arrays, which write pieces from where
    they are: compressed and padded ones would join the pieces into fresh memory, a copy no
    cheaper than the gather."""
    layout = group.layout
    if not layout.dense or group.compression != "none":
        return False
    return chunks.stores_in_place(array, layout.chunk_nbytes)


def _loads_in_place(chunks: ChunkMap, group: GroupStore, array: int) -> bool:
    """Whether promotions of ``array`` read blocks straight into the rows (no staging buffer,
    no scatter copy): only where vLLM holds the chunks of a promotion reported failed while
    such a read runs (0.34's deferred release); there, where the load plan puts each
    canonical byte in one place of the row (:meth:`ChunkMap.loads_in_place`) and that place
    is one contiguous run of the row (MLA: any array) or pieces of whole chunks of a raw dense
    array (the store reads pieces only for those). Replicas, uneven pipeline splits, and
    pieces of padded or compressed arrays are staged and scattered."""
    if not LOAD_INTO_ROWS or not compat.TIER_DEFERS_RELEASE:
        return False
    layout = group.layout
    pieces = layout.dense and group.compression == "none"
    return chunks.loads_in_place(array, layout.chunk_nbytes if pieces else None)


def _slices(n: int) -> list[slice]:
    """A job's ``n`` blocks as parts of at most :data:`JOB_BATCH` blocks."""
    return [slice(i, i + JOB_BATCH) for i in range(0, n, JOB_BATCH)]

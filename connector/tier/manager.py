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
  (:class:`connector.tier.jobs.JobRunner`); a store publishes the chunks' canonical blocks
  (:meth:`kvstore.GroupStore.write_blocks`: checksums, atomic rename, fsync per
  ``durability``), as strided views of the rows where their runs are whole inner chunks of
  a raw dense array (:data:`STORE_FROM_ROWS`: no gather), otherwise gathered; a load reads
  and verifies them (:meth:`kvstore.GroupStore.read_blocks`) straight into the chunk rows
  where each canonical byte has one place there (:data:`LOAD_INTO_ROWS`), otherwise into a
  staging buffer, then scatters the hits into the rows;
* ``get_finished_jobs``: the outcomes. A block that is missing, corrupt (quarantined by the
  store), or unreadable fails its promotion, and only that key becomes a miss
  (``successful_keys`` keeps the others); a failed write fails its store job. On vLLM 0.34 a
  failed promotion is reported as soon as every part before its first failed one has ended
  (:class:`connector.tier.jobs.JobRunner`, ``early_failures``); the parts still reading are
  cut short, and ``JobResult.deferred_release`` is set once they have ended, so vLLM keeps
  their CPU chunks out of its free pool until kvstore no longer writes into them. Nothing raises
  into vLLM: vLLM recomputes, and its backpressure detector (``on_store_failed``, store
  latency) drops stores while the store is slow or full (see ``default_backpressure`` in
  :mod:`connector.tier.config`).

The engine facts the namespace identity needs (hash algorithm, KV heads, group kinds) come from
:class:`connector.KVStoreConnector`, as for the direct connector: load the
tiering spec through it (docs/vllm.md).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
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
from connector.tier.jobs import JobRunner, Outcome
from connector.tier.lookup import StoreProbe, split_key
from kvstore import BlockRead, BlockWrite, ConfigError, GroupStore, WriteStatus
from kvstore.io.buffers import aligned_buffer

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

log = logging.getLogger("kvstore.connector")

# Blocks per part of a job (a store / read call): parts of one job run concurrently on the
# job threads (vLLM batches a whole request's promotions into one job), and each bounds its
# thread's staging buffer.
JOB_BATCH = 32

# Stores hand the store strided views of the rows (pieces, no gather) where they apply
# (:func:`_in_place`); the bytes on disk are the gathered ones (tests/connector/
# test_tier_chunks.py). On since the pieces' geometry is cached per view shape (a block costs
# a lookup, one span and one zip of cached offsets and slices, ~35 us for llama-8B's 256
# pieces, was ~95). llama-3.1-8b 16-token blocks through vLLM's TieringOffloadingManager,
# store on tmpfs, three runs of 5 rounds alternating fs / gathered / from the rows: median
# store CPU s/GB 0.94-1.05 from the rows vs 1.08-1.11 gathered, GB/s 1.65-1.83 vs 1.64-1.68.
# Off: every store is gathered (kept for A/B runs).
STORE_FROM_ROWS = True

# Promotions read and verify blocks straight into the rows where the load plan allows it
# (:func:`_loads_in_place`); off: every load is staged, then scattered (kept for A/B runs).
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
            self._in_place = [_in_place(self.chunks, self.namespace.group(a), a) for a in arrays]
            self._loads_in_place = [
                _loads_in_place(self.chunks, self.namespace.group(a), a) for a in arrays
            ]
        except BaseException:
            self.chunks.release()
            self.store.close()
            raise
        self.tokens_per_block = self.identity.tokens_per_block
        self._group_suffixes = frozenset(
            g.to_bytes(GROUP_ID_BYTES, "big") for g in self.key_map.group_ids
        )
        self._present: OrderedDict[bytes, None] = OrderedDict()
        self._jobs_keys: dict[int, tuple[list[bytes], bool]] = {}  # job id -> (keys, is_load)
        self._probe = StoreProbe(self.namespace, self.key_map, tier_type)
        self._runner = JobRunner(
            self.options.load_threads,
            self.options.store_threads,
            early_failures=compat.TIER_DEFERS_RELEASE,
        )
        self._staging = threading.local()  # per job thread: a reused block buffer
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
        if k[-GROUP_ID_BYTES:] not in self._group_suffixes:  # a group this namespace lacks
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
        parents = self._parents(keys, job_metadata.req_context)
        self._jobs_keys[job_metadata.job_id] = (keys, False)
        parts = [
            functools.partial(self._store_blocks, keys[b], chunk_ids[b], parents[b])
            for b in _slices(len(keys))
        ]
        self._runner.submit(job_metadata.job_id, False, parts)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = [bytes(k) for k in job_metadata.keys]
        chunk_ids = [int(c) for c in job_metadata.chunk_ids]
        self._jobs_keys[job_metadata.job_id] = (keys, True)
        slices = _slices(len(keys))
        parts = [functools.partial(self._load_blocks, keys[b], chunk_ids[b]) for b in slices]
        part_keys = [frozenset(keys[b]) for b in slices]
        self._runner.submit(job_metadata.job_id, True, parts, part_keys)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for finished in self._runner.finished():
            keys, is_load = self._jobs_keys.pop(finished.job_id)
            outcome = finished.outcome
            ok, cut_short = outcome.ok_keys, finished.cut_short
            failed = [k for k in keys if k not in ok]
            for k in keys:
                if k in ok:
                    self._remember(k)
                elif k not in cut_short:  # found bad; a key cut short may well be there
                    self._present.pop(k, None)
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
            # vLLM 0.34: chunks of a failed promotion stay held until the reads cut short end.
            release = {"deferred_release": finished.release} if finished.release else {}
            results.append(
                JobResult(
                    job_id=finished.job_id,
                    success=not failed,
                    successful_keys=partial,
                    transfer_time=finished.seconds,
                    transfer_bytes=outcome.nbytes or None,
                    **release,
                )
            )
        return results

    def take_events(self) -> Iterable[OffloadingEvent]:
        """BlockStored events of finished store jobs (``enable_kv_events``)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def drain_jobs(self) -> None:
        self._runner.wait_idle()

    def shutdown(self) -> None:
        self._probe.shutdown()
        self._runner.shutdown()
        self.chunks.release()
        self.store.close()

    # -- the job functions (job threads) -------------------------------------------------------

    def _store_blocks(
        self, keys: Sequence[bytes], chunk_ids: Sequence[int], parents: Sequence[bytes | None]
    ) -> Outcome:
        """(one part of a store job) Publish the canonical blocks of the chunks; the keys
        written or already present.

        A failed write is logged by the store (one line per batch, with the first error) and
        leaves the key out: the job fails, and vLLM's backpressure counts it."""
        ok: set[bytes] = set()
        nbytes = 0
        for array, items in _by_array(self.key_map, keys).items():
            ok.update(keys[i] for i, _ in items if keys[i] in self._present)
            todo = [(i, h) for i, h in items if keys[i] not in self._present]
            if not todo:
                continue
            ids = [chunk_ids[i] for i, _ in todo]
            blocks: Sequence[np.ndarray]
            if self._in_place[array]:
                blocks = self.chunks.source_views(array, ids)
            else:
                copies = self.chunks.copies_on_store(array)
                staging = self._buffer(len(todo), array) if copies else None
                blocks = self.chunks.to_blocks(array, ids, staging)
            writes = [BlockWrite(h, blocks[j], parents[i]) for j, (i, h) in enumerate(todo)]
            results = self.namespace.group(array).write_blocks(writes)
            for (i, _), result in zip(todo, results, strict=True):
                if result.status in (WriteStatus.WRITTEN, WriteStatus.EXISTS):
                    ok.add(keys[i])
                    nbytes += self.chunks.groups[array].block_bytes
        return Outcome(frozenset(ok), nbytes)

    def _load_blocks(self, keys: Sequence[bytes], chunk_ids: Sequence[int]) -> Outcome:
        """(one part of a promotion job) Read and verify the blocks into their chunk rows;
        the keys that arrived."""
        ok: set[bytes] = set()
        nbytes = 0
        for array, items in _by_array(self.key_map, keys).items():
            block_bytes = self.chunks.groups[array].block_bytes
            if self._loads_in_place[array]:
                # Straight into the rows: a block that fails leaves its row partly written,
                # which nothing reads: vLLM frees the chunks of failed promotion keys
                # (TieringOffloadingManager._complete_promotion: complete_write(..., False)).
                views = self.chunks.destination_views(array, [chunk_ids[i] for i, _ in items])
                reads = [BlockRead(h, views[j]) for j, (_, h) in enumerate(items)]
                results = self.namespace.group(array).read_blocks(reads)
                arrived = [keys[items[j][0]] for j, r in enumerate(results) if r.ok]
                ok.update(arrived)
                nbytes += len(arrived) * block_bytes
                continue
            blocks = self._buffer(len(items), array)[: len(items) * block_bytes]
            blocks = blocks.view(len(items), block_bytes)
            reads = [BlockRead(h, blocks[j].numpy()) for j, (_, h) in enumerate(items)]
            results = self.namespace.group(array).read_blocks(reads)
            hits = [j for j, r in enumerate(results) if r.ok]
            if not hits:
                continue
            rows = [chunk_ids[items[j][0]] for j in hits]
            self.chunks.from_blocks(array, blocks[hits] if len(hits) < len(items) else blocks, rows)
            ok.update(keys[items[j][0]] for j in hits)
            nbytes += len(hits) * block_bytes
        return Outcome(frozenset(ok), nbytes)

    def _buffer(self, count: int, array: int) -> torch.Tensor:
        """This job thread's staging buffer for ``count`` blocks of ``array`` (grown, kept)."""
        need = count * self.chunks.groups[array].block_bytes
        buffer: torch.Tensor | None = getattr(self._staging, "buffer", None)
        if buffer is None or buffer.numel() < need:
            # page-aligned, so O_DIRECT reads (direct_reads) land in it without a bounce
            buffer = torch.from_numpy(aligned_buffer(need))
            self._staging.buffer = buffer
        return buffer

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
    """Whether stores of ``array`` hand the store strided views of the rows (pieces: no
    gather copy into a staging buffer). Only for raw dense arrays, which write pieces from
    where they are: compressed and padded ones would join the pieces into fresh memory, a copy
    no cheaper than the gather into this tier's reused buffer."""
    layout = group.layout
    if not STORE_FROM_ROWS or not layout.dense or group.compression != "none":
        return False
    return chunks.stores_in_place(array, layout.chunk_nbytes)


def _loads_in_place(chunks: ChunkMap, group: GroupStore, array: int) -> bool:
    """Whether promotions of ``array`` read blocks straight into the rows (no staging buffer,
    no scatter copy): where the load plan puts each canonical byte in one place of the row
    (:meth:`ChunkMap.loads_in_place`) and that place is one contiguous run of the row (MLA:
    any array) or pieces of whole chunks of a raw dense array (the store reads pieces only
    for those). Replicas, uneven pipeline splits, and pieces of padded or compressed arrays
    are staged and scattered."""
    if not LOAD_INTO_ROWS:
        return False
    layout = group.layout
    pieces = layout.dense and group.compression == "none"
    return chunks.loads_in_place(array, layout.chunk_nbytes if pieces else None)


def _slices(n: int) -> list[slice]:
    """A job's ``n`` blocks as parts of at most :data:`JOB_BATCH` blocks."""
    return [slice(i, i + JOB_BATCH) for i in range(0, n, JOB_BATCH)]


def _by_array(key_map: Any, keys: Sequence[bytes]) -> dict[int, list[tuple[int, bytes]]]:
    """Keys grouped by array: ``array -> [(position in keys, block hash)]``."""
    out: dict[int, list[tuple[int, bytes]]] = defaultdict(list)
    for i, key in enumerate(keys):
        where = split_key(key_map, key)
        if where is not None:
            out[where[0]].append((i, where[1]))
    return out

"""The worker side (one per GPU process): moves this rank's share of blocks, never blocks vLLM.

* ``submit_store``: for the blocks this rank is elected to write
  (:meth:`kvstore.rank_io.RankIO.elected`), snapshot its share of them into the store engine's
  staging (:meth:`RankIO.stage`, after the compute stream, on a side stream on GPUs: pooled
  pinned host rows for the pinned engine, device rows for the GDS engine, host rows for the
  host engine), then, on a job thread, write the staged shares into each block's pending file
  (:meth:`RankIO.write_staged`). The scheduler publishes the blocks once every rank reported the
  job. ``wait`` on a store returns as soon as the snapshot is taken: the GPU blocks may be
  reused from then on.
* ``submit_load``: on a job thread, read and verify the chunks this rank holds and scatter
  them into its pages (:meth:`RankIO.load`); ``wait`` returns only when the bytes are on the
  device.
* The job's GPU side comes as vLLM's ``GPULoadStoreSpec`` (0.32, 0.33) or its resolved
  ``DevicePointers`` (0.34); :class:`connector.offload.job_blocks.BlockResolver` names the rows
  of the registered KV tensors either way, and refuses pointers that are not this worker's
  pages.
* Every job is reported by ``get_finished``, empty ones included. vLLM 0.32 and 0.33 assert
  that transfers succeed, so there every job is a success and what failed is kept for the
  connector (:class:`connector.offload.vllm_connector.KVStoreConnector`) to report: GPU block ids of
  failed loads (``get_block_ids_with_load_errors``), requests whose load failed (multi-group
  models). vLLM 0.34 takes failed jobs: a load whose blocks all failed, or any failed load of
  a multi-group model, is reported ``success=False`` and vLLM recomputes the request
  (:meth:`KVStoreWorker._fails_in_vllm`); a partial failure stays block-level. The keys of
  failed stores and loads go to the scheduler on every version (it then does not publish
  those blocks and forgets those it believed present). One log line per failed job
  (:class:`connector.offload.outcomes.FailureReports` keeps what failed).
* **A hung store never stalls the engine** (:mod:`.deadlines`). A job not done within its
  deadline (``load_deadline_s``, ``store_deadline_s``, plus its bytes at
  ``deadline_min_mb_per_s``; counted from its submission, so a job queued behind blocked
  threads counts too) is given up: reported finished and failed as above, cause ``timeout``
  (a load: vLLM recomputes, the late read never reaches the KV cache; a store: not
  published). ``wait`` on a load returns by its deadline too. The store is then unresponsive
  for this worker: one warning, every new load fails and every new store is dropped at once
  (cause and reason ``unresponsive``), no thread used, but for one trial job at a time at
  most every ``unresponsive_retry_s``; the first job that returns ends it. Late jobs keep
  their staging buffers until their threads return; they are counted, never waited for.

Layout: per offloaded group, the local tensors and the certified
:class:`kvstore.layout.RankMapping` come from :mod:`connector.rank`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.v1.kv_offload.base import LoadStoreSpec, OffloadingWorker, TransferResult

from connector import compat
from connector.facts import EngineFacts
from connector.identity import KeyMap
from connector.offload import metrics as m
from connector.offload.deadlines import Gates, JobDeadlines, StoreWatch, WorkerHealth
from connector.offload.executor import EXPEDITED, LOAD, STORE, PriorityExecutor
from connector.offload.job_blocks import BlockResolver, JobBlocks
from connector.offload.metrics import read_cause
from connector.offload.outcomes import (
    FailureReports,
    Outcome,
    fail,
    failed,
    read_reason,
    unresponsive,
)
from connector.offload.streams import PASSED, AllOf, EventFence, Fence, Streams, streams_for
from connector.offload.transfer_specs import KVStoreLoadSpec, KVStoreStoreSpec
from connector.rank import RankContext, certify, check_mapping, family_of, group_tensors
from kvstore import Identity, KVStore, LayoutError, Namespace, StoreTimeoutError
from kvstore.io.deadline import DeliveryGate
from kvstore.rank_io import RankIO, StagedShares
from kvstore.store.types import PendingBlock

if TYPE_CHECKING:
    from collections.abc import Mapping

    from vllm.v1.kv_offload.base import CanonicalKVCaches

log = logging.getLogger("kvstore.connector")

# Test-only hook, never set in production: loaded pages are zeroed after verification (the
# e2e tier's negative control shows that the engine's output then changes).
PERTURB_LOADS_ENV = "KVTEST_PERTURB_LOADS"


@dataclass(frozen=True)
class WorkerGroup:
    """One offloaded KV-cache group on this rank."""

    position: int  # index in vLLM's offloaded-group order (a job's group sizes)
    array: int  # store array g<array>
    rank_io: RankIO  # this rank's mapping joined to the group's store
    tensors: tuple[torch.Tensor, ...]  # local tensors in the mapping's form
    packed: bool = False  # one packed-row tensor (else one tensor per layer)
    offset: int = 0  # packed: byte offset of the group's first layer in each row


@dataclass
class _Job:
    job_id: int
    is_load: bool
    keys: Sequence[bytes]  # stores: the keys this rank writes, once known
    blocks: Sequence[int]  # GPU block ids (loads: what to report if the job itself fails)
    started: float
    fence: Fence  # store: snapshot taken
    future: Future[Outcome]
    req_id: str = ""
    expedited: bool = False
    gates: Gates = field(default_factory=lambda: Gates(1))
    deadline: float = math.inf  # monotonic time it is given up at if not done
    nbytes: int = 0  # this rank's bytes of the job (its staging buffers)


# (group, indices into the job's keys, GPU block ids), one per offloaded group
_Part = tuple[WorkerGroup, list[int], list[int]]
# (group, pending blocks this rank writes, their keys, their GPU block ids)
_Work = tuple[WorkerGroup, list[PendingBlock], list[bytes], list[int]]
_S = TypeVar("_S", bound=LoadStoreSpec)


class KVStoreWorker(OffloadingWorker):  # type: ignore[misc, unused-ignore]  # Any w/o vLLM
    """Transfers between this rank's KV tensors and the store (one vLLM worker process)."""

    def __init__(  # noqa: PLR0913 - keyword-only: the store, key map, groups, streams, pool size, block resolver and deadlines are distinct collaborators build_worker assembles
        self,
        *,
        store: KVStore,
        key_map: KeyMap,
        groups: Sequence[WorkerGroup],
        streams: Streams,
        threads: int,
        resolver: BlockResolver,
        deadlines: JobDeadlines,
    ) -> None:
        self.store = store
        self.resolver = resolver
        self.key_map = key_map
        self.groups = tuple(groups)
        self.streams = streams
        self.deadlines = deadlines
        self.watch = StoreWatch(
            where=str(store.root), retry_interval_s=deadlines.retry_interval_s, logger=log
        )
        self._executor = PriorityExecutor(threads, "kvstore-worker")
        self._jobs: dict[int, _Job] = {}
        self.reports = FailureReports()  # failed jobs, drained by the connector
        # TEST ONLY (tests/e2e negative control): zero every verified page after loading it,
        # to show that the loaded bytes are what the engine computes with.
        self._perturb_loads = os.environ.get(PERTURB_LOADS_ENV) == "1"
        if self._perturb_loads:
            log.warning("kvstore: %s=1: loaded pages are zeroed (a test hook)", PERTURB_LOADS_ENV)

    # -- vLLM's OffloadingWorker ---------------------------------------------------------------

    def submit_store(self, job_id: int, src: Any, dst_spec: LoadStoreSpec) -> bool:
        """``src``: the job's GPU blocks as vLLM gives them (:mod:`.job_blocks`)."""
        job = _Job(
            job_id, False, getattr(dst_spec, "keys", ()), (), time.monotonic(), PASSED, _done()
        )
        try:
            work = self._elected_work(
                _expect(KVStoreStoreSpec, dst_spec), self.resolver.resolve(src)
            )
            job.keys = [key for _, _, keys, _ in work for key in keys]
            job.nbytes = sum(len(p) * g.rank_io.mapping.share_bytes for g, p, _, _ in work)
            if work:
                self._start_store(job, work)
        except Exception as exc:
            log.exception("kvstore: store job %d could not start; its blocks are skipped", job_id)
            job.future = _failed_future(exc)
            job.fence = PASSED
        self._jobs[job_id] = job
        return True

    def _start_store(self, job: _Job, work: list[_Work]) -> None:
        """Snapshot this rank's share and queue the write, or, while the store is
        unresponsive and this is no trial, drop the job (no snapshot, no thread)."""
        if not self.watch.responsiveness.admit():
            job.future = _done(unresponsive(job.keys, []))
            return
        snapshot, stream_fence = self.streams.snapshot(
            lambda: [
                group.rank_io.stage(group.tensors, pendings, ids)
                for group, pendings, _, ids in work
            ]
        )
        # The pages may be reused once the snapshot stream and every staged batch's own
        # event (the engine's side stream) have passed.
        job.fence = AllOf([stream_fence, *(EventFence(s.ready) for s in snapshot)])
        job.deadline = job.started + self.deadlines.store.seconds(job.nbytes)
        fence, gate = job.fence, job.gates.gates[0]
        job.future = self._executor.submit(STORE, lambda: self._write(fence, work, snapshot, gate))

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst: Any,
        expedited: bool = False,
    ) -> bool:
        """``dst``: the job's GPU blocks as vLLM gives them (:mod:`.job_blocks`)."""
        keys: Sequence[bytes] = getattr(src_spec, "keys", ())
        req_id = str(getattr(src_spec, "req_id", ""))
        job = _Job(job_id, True, keys, (), time.monotonic(), PASSED, _done(), req_id, expedited)
        try:
            load_keys = _expect(KVStoreLoadSpec, src_spec).keys
            job_blocks = self.resolver.resolve(dst)
            job.blocks = job_blocks.block_ids
            parts = self._split(load_keys, job_blocks)
            job.nbytes = sum(len(indices) * g.rank_io.read_nbytes for g, indices, _ in parts)
            if any(indices for _, indices, _ in parts):
                self._start_load(job, parts, load_keys)
        except Exception as exc:
            log.exception("kvstore: load job %d could not start; the engine recomputes", job_id)
            job.future = _failed_future(exc)
            if not job.blocks:
                job.blocks = self.resolver.rows_touched(dst)
        self._jobs[job_id] = job
        return True

    def _start_load(self, job: _Job, parts: list[_Part], keys: Sequence[bytes]) -> None:
        """Queue the reads, or, while the store is unresponsive and this is no trial, fail
        the job at once (no thread)."""
        if not self.watch.responsiveness.admit():
            job.future = _done(unresponsive(job.keys, job.blocks))
            return
        job.gates = Gates(len(parts))
        job.deadline = job.started + self.deadlines.load.seconds(job.nbytes)
        fence, gates = self.streams.mark(), job.gates
        job.future = self._executor.submit(
            EXPEDITED if job.expedited else LOAD, lambda: self._read(fence, parts, keys, gates)
        )

    def get_finished(self) -> list[TransferResult]:
        results: list[TransferResult] = []
        self.watch.poll()
        now = time.monotonic()
        for job_id, job in list(self._jobs.items()):
            if not job.future.done() and not (now >= job.deadline and self._give_up(job)):
                continue
            del self._jobs[job_id]
            outcome = self._outcome(job)
            success = not self._fails_in_vllm(job, outcome)
            self.reports.record(job, outcome, vllm_recomputes_request=not success)
            results.append(
                TransferResult(
                    job_id=job_id,
                    success=success,
                    transfer_size=outcome.nbytes,
                    transfer_time=time.monotonic() - job.started,
                )
            )
        return results

    def _outcome(self, job: _Job) -> Outcome:
        """What a finished or given-up job reports. A job given up fails as a whole (cause
        timeout) whatever its thread returns, if it ever does (it is then held as late)."""
        blocks = job.blocks if job.is_load else []
        if job.gates.abandoned:
            if not job.future.done():
                self.watch.hold(job.future, job.is_load, job.nbytes)
            setting = "load_deadline_s" if job.is_load else "store_deadline_s"
            error = StoreTimeoutError(f"not done within its deadline ({setting})")
            return failed(job.keys, blocks, error, m.TIMEOUT)
        try:
            return job.future.result()
        except Exception as exc:  # the whole job failed: all of its blocks did
            return failed(job.keys, blocks, exc)

    def _give_up(self, job: _Job) -> bool:
        """(past its deadline, not done) Stop waiting for ``job``; the store is unresponsive
        from now on (one warning per episode). False while its copy into the engine's pages
        is under way: a memory copy, waited for."""
        what, setting = (
            ("load", "load_deadline_s") if job.is_load else ("store", "store_deadline_s")
        )
        # Before the abandon: a thread returning after it then ends the episode it started.
        self.watch.responsiveness.timed_out(what, time.monotonic() - job.started, setting)
        return job.gates.abandon()

    def _fails_in_vllm(self, job: _Job, outcome: Outcome) -> bool:
        """Whether a load is reported to vLLM as a failed job (``success=False``).

        Only where vLLM takes failed jobs (0.34, :data:`compat.VLLM_REPORTS_FAILED_JOBS`); it
        then recomputes the request and no longer loads it from the store. That is how a
        job fails whose blocks all failed, and any failed load of a multi-group model (vLLM
        takes block-level reports from single-group models only). A partial failure of a
        single-group model stays block-level (the good blocks before it are kept), as do
        expedited loads: vLLM stops the engine on a failed one, its request already ran.
        The exception: an expedited job whose GPU blocks could not even be named, as then no
        block-level report could keep the engine from computing on pages never loaded."""
        if not (job.is_load and outcome.failed_keys and compat.VLLM_REPORTS_FAILED_JOBS):
            return False
        if job.expedited:
            return outcome.whole_job and not job.blocks
        return outcome.whole_job or len(self.groups) > 1

    def wait(self, job_ids: set[int]) -> None:
        """Stores: until their snapshot is taken (the file writes go on in the background).
        Loads: until done or given up at their deadline (then reported failed by
        ``get_finished``), past it only while a copy into the pages is under way."""
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is None:
                continue
            if not job.is_load:
                job.fence.wait()
                continue
            _wait_until_deadline(job)
            if not job.future.done() and not self._give_up(job):
                wait_futures([job.future])

    def shutdown(self) -> None:
        """Wait for the jobs in flight, each until its deadline. Jobs still blocked in a hung
        store then are left to their (daemon) threads, and the store is not closed (closing
        it joins its I/O threads, blocked too)."""
        for job in self._jobs.values():
            _wait_until_deadline(job)
        blocked = [job for job in self._jobs.values() if not job.future.done()]
        for job in blocked:
            job.gates.abandon()
        self.watch.poll()
        if blocked or self.watch.late:
            log.warning(
                "kvstore: %d transfer jobs are still blocked in the store at %s at shutdown; "
                "their threads are left behind",
                len(blocked) + self.watch.late,
                self.store.root,
            )
            self._executor.shutdown(wait=False)
            return
        self._executor.shutdown()
        self.store.close()

    @property
    def jobs_in_flight(self) -> int:
        """Jobs submitted and not yet returned by ``get_finished``."""
        return len(self._jobs)

    # -- failure reports, drained by the connector ---------------------------------------------

    def take_load_error_blocks(self) -> set[int]:
        """GPU block ids whose load failed since the last call."""
        return self.reports.take_load_error_blocks()

    def take_failed_load_requests(self) -> set[str]:
        """Requests with a failed load since the last call."""
        return self.reports.take_failed_load_requests()

    def take_failed_keys(self) -> tuple[list[bytes], list[bytes]]:
        """(keys of failed stores, keys of failed loads) since the last call."""
        return self.reports.take_failed_keys()

    def take_failure_causes(self) -> dict[bytes, str]:
        """Why each key of :meth:`take_failed_keys` failed (:mod:`.metrics` causes)."""
        return self.reports.take_failure_causes()

    def take_health(self) -> WorkerHealth:
        """Late jobs and unresponsive time since the last call (:class:`.deadlines.StoreWatch`)."""
        return self.watch.take()

    # -- stores --------------------------------------------------------------------------------

    def _elected_work(self, spec: KVStoreStoreSpec, src: JobBlocks) -> list[_Work]:
        work = []
        for group, indices, block_ids in self._split(spec.keys, src):
            pendings = [spec.pending(i) for i in indices]
            mine = [j for j, e in enumerate(group.rank_io.elected(pendings)) if e]
            if mine and group.rank_io.mapping.share_bytes:
                work.append(
                    (
                        group,
                        [pendings[j] for j in mine],
                        [spec.keys[indices[j]] for j in mine],
                        [block_ids[j] for j in mine],
                    )
                )
        return work

    def _write(
        self,
        fence: Fence,
        work: list[_Work],
        snapshot: list[StagedShares],
        gate: DeliveryGate,
    ) -> Outcome:
        """(job thread) Write the staged shares. Given up (``gate`` abandoned: reported
        failed, never published), the shares not yet written go back unwritten."""
        outcome = Outcome()
        try:
            fence.wait()
        except Exception as exc:
            for (_, _, keys, _), shares in zip(work, snapshot, strict=True):
                shares.release()
                fail(outcome, keys, [], exc)
            return outcome
        wrote = False
        try:
            for (group, pendings, keys, _), shares in zip(work, snapshot, strict=True):
                if gate.abandoned:
                    shares.release()
                    continue
                wrote = True
                try:
                    errors: Sequence[BaseException | None] = group.rank_io.write_staged(shares)
                except Exception as exc:
                    errors = [exc] * len(pendings)
                for key, error in zip(keys, errors, strict=True):
                    if error is None:
                        outcome.nbytes += group.rank_io.mapping.share_bytes
                    else:
                        fail(outcome, [key], [], error)
        finally:
            if wrote:  # the store answered (a job given up while queued learned nothing)
                self.watch.responsiveness.answered()
        return outcome

    # -- loads ---------------------------------------------------------------------------------

    def _read(
        self, fence: Fence, parts: list[_Part], keys: Sequence[bytes], gates: Gates
    ) -> Outcome:
        """(job thread) Read and deliver the parts, each through its gate. A job given up
        while it was queued reads nothing (it was reported failed)."""
        outcome = Outcome()
        if gates.abandoned:
            return outcome
        try:
            self.streams.run_after(fence, lambda: self._read_now(parts, keys, outcome, gates))
        except Exception as exc:  # e.g. the device copy failed: nothing can be trusted
            outcome = Outcome()
            for _, indices, block_ids in parts:
                fail(outcome, [keys[i] for i in indices], block_ids, exc)
        finally:
            self.watch.responsiveness.answered()
        return outcome

    def _read_now(
        self, parts: list[_Part], keys: Sequence[bytes], outcome: Outcome, gates: Gates
    ) -> None:
        for (group, indices, block_ids), gate in zip(parts, gates.gates, strict=True):
            if not indices:
                continue
            hashes = [self.key_map.split(keys[i])[1] for i in indices]
            try:
                results = group.rank_io.load(group.tensors, hashes, block_ids, gate)
            except Exception as exc:
                fail(outcome, [keys[i] for i in indices], block_ids, exc)
                continue
            loaded = []
            for i, block_id, result in zip(indices, block_ids, results, strict=True):
                if result.ok:
                    outcome.nbytes += group.rank_io.read_nbytes
                    loaded.append(block_id)
                else:
                    outcome.failed_keys.append(keys[i])
                    outcome.failed_blocks.append(block_id)
                    outcome.reasons[read_reason(result.status)] += 1
                    outcome.causes[keys[i]] = read_cause(result.status, result.error)
            if self._perturb_loads and loaded:
                _perturb_pages(group, loaded)

    # -- shared --------------------------------------------------------------------------------

    def _split(self, keys: Sequence[bytes], gpu: JobBlocks) -> list[_Part]:
        """Pair each group's keys with its GPU blocks (one GPU block per stored block)."""
        by_array: dict[int, list[int]] = defaultdict(list)
        for i, key in enumerate(keys):
            by_array[self.key_map.split(key)[0]].append(i)
        block_ids = list(gpu.block_ids)
        sizes = list(gpu.group_sizes)
        if len(sizes) != len(self.groups):
            raise LayoutError(f"job lists {len(sizes)} KV groups, worker has {len(self.groups)}")
        parts: list[_Part] = []
        offset = 0
        for group, size in zip(self.groups, sizes, strict=True):
            indices = by_array.pop(group.array, [])
            if len(indices) != size:
                raise LayoutError(
                    f"group g{group.array}: {len(indices)} keys for {size} GPU blocks (expected "
                    "one GPU block per stored block)"
                )
            parts.append((group, indices, block_ids[offset : offset + size]))
            offset += size
        if by_array:
            raise LayoutError(f"job has keys of arrays {sorted(by_array)} it lists no blocks for")
        return parts


def build_worker(  # noqa: PLR0913 - keyword-only: each a distinct object KVStoreSpec.get_worker holds (vLLM's caches and layer views, identity, key map, facts, rank, store); a bundle would only rename the spec
    *,
    kv_caches: CanonicalKVCaches,
    group_ids: Sequence[int],
    identity: Identity,
    key_map: KeyMap,
    facts: EngineFacts,
    context: RankContext,
    store: KVStore,
    namespace: Namespace,
    threads: int,
    deadlines: JobDeadlines,
    layer_views: Mapping[str, torch.Tensor] | None,
) -> KVStoreWorker:
    """Certify every offloaded group's layout for this rank and build the worker.

    ``group_ids`` are vLLM's offloaded group ids in the order of ``kv_caches.group_data_refs``.
    """
    family = family_of(facts.kv_cache_layout)
    groups = []
    for position, group_id in enumerate(group_ids):
        array = key_map.array_of(group_id)
        group_facts = facts.group(group_id)
        local = group_tensors(kv_caches, position, group_facts, family, layer_views)
        mapping = certify(identity, array, context, local.form)
        where = f"KV-cache group {group_id} on rank {context.global_rank}"
        check_mapping(mapping, local, group_facts.page_bytes, where)
        rank_io = RankIO(namespace.group(array), mapping)
        packed = local.form.packing == "packed"
        groups.append(
            WorkerGroup(position, array, rank_io, local.tensors, packed, local.form.group_offset)
        )
    if not kv_caches.tensors:
        raise LayoutError("no KV cache tensors to offload")
    device = kv_caches.tensors[0].tensor.device
    return KVStoreWorker(
        store=store,
        key_map=key_map,
        groups=groups,
        streams=streams_for(device),
        threads=threads,
        resolver=BlockResolver(kv_caches),
        deadlines=deadlines,
    )


def _perturb_pages(group: WorkerGroup, block_ids: Sequence[int]) -> None:
    """Zero this rank's pages of ``block_ids`` (the :data:`PERTURB_LOADS_ENV` test hook)."""
    mapping = group.rank_io.mapping
    rows = torch.tensor(list(block_ids), dtype=torch.long, device=group.tensors[0].device)
    if group.packed:  # one row per block, the group's layers back to back from its offset
        group.tensors[0][rows, group.offset : group.offset + mapping.share_bytes] = 0
    else:  # one (num_blocks, page) view per layer
        for tensor in group.tensors:
            tensor[rows, : mapping.page_bytes] = 0


def _expect(kind: type[_S], spec: LoadStoreSpec) -> _S:
    if not isinstance(spec, kind):
        raise TypeError(f"expected a {kind.__name__}, got {type(spec).__name__}")
    return spec


def _failed_future(exc: BaseException) -> Future[Outcome]:
    future: Future[Outcome] = Future()
    future.set_exception(exc)
    return future


def _wait_until_deadline(job: _Job) -> None:
    """Wait for ``job`` until it is done or its deadline passed."""
    timeout = None if math.isinf(job.deadline) else max(0.0, job.deadline - time.monotonic())
    wait_futures([job.future], timeout=timeout)


def _done(outcome: Outcome | None = None) -> Future[Outcome]:
    """A finished job (nothing for this rank to move, or failed at once)."""
    future: Future[Outcome] = Future()
    future.set_result(outcome if outcome is not None else Outcome())
    return future

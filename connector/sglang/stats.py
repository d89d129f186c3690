"""Counters of the SGLang backend, and its error log that speaks once per episode.

Nothing the backend does may raise into SGLang's prefetch and backup threads: every failure
becomes a miss or a failed set, is counted here, and is logged - once for the first failure of
a kind, then at most once a minute with the count of those not logged.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

LOG_INTERVAL_S = 60.0

logger = logging.getLogger("kvstore.sglang")


@dataclass
class BackendStats:
    """Cumulative counters (pages and bytes of this rank), safe across SGLang's threads."""

    lookups: int = 0  # keys asked for by exists / batch_exists(_v2)
    lookup_hits: int = 0  # of those, found
    hits: int = 0  # pages read into the host pool
    misses: int = 0  # pages asked for and not served (absent, corrupt, failed)
    corrupt: int = 0  # of the misses: damaged, short or foreign data (quarantined)
    bytes_read: int = 0
    pages_written: int = 0  # pages whose share this rank wrote (or found already stored)
    write_failures: int = 0
    bytes_written: int = 0
    errors: int = 0  # calls that failed as a whole (counted once per call)
    # Not answered within the call's deadline, or refused at once while the store is
    # unresponsive (connector/sglang/deadlines.py); each also counted as a miss (a failed
    # write): keys of lookups, pages of reads and of writes.
    lookup_timeouts: int = 0
    read_timeouts: int = 0
    write_timeouts: int = 0
    failed_fast: int = 0  # calls refused without touching the store (unresponsive)
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    # Per call since the last get_stats (SGLang's StorageMetrics): pages and GB/s.
    recent_reads: list[tuple[int, float]] = field(default_factory=list)
    recent_writes: list[tuple[int, float]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def record_io(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        """One read or write call: its pages and bandwidth, for SGLang's histograms."""
        rate = nbytes / seconds / 1e9 if seconds > 0 else 0.0
        with self._lock:
            recent = self.recent_reads if kind == "read" else self.recent_writes
            if len(recent) < 10_000:  # bounded if nobody collects them
                recent.append((pages, rate))

    def drain_recent(self) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
        with self._lock:
            reads, writes = self.recent_reads, self.recent_writes
            self.recent_reads, self.recent_writes = [], []
        return reads, writes

    def snapshot(self) -> dict[str, float]:
        """The counters as a plain dict (for get_stats, logs and tests)."""
        with self._lock:
            return {
                name: getattr(self, name)
                for name in self.__dataclass_fields__
                if not name.startswith("_") and not name.startswith("recent")
            }


class EpisodeLog:
    """Logs the first failure of each kind, then a summary at most every minute."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def failure(self, kind: str, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self._interval_s:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return
            suppressed = self._suppressed.pop(kind, 0)
            self._last[kind] = now
        more = f" ({suppressed} more since the last report)" if suppressed else ""
        logger.warning("kvstore HiCache %s: %s%s", kind, message, more)

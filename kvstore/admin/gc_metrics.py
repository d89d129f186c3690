"""What ``kvstore gc --metrics FILE`` exposes: gc's pass documents as Prometheus families.

:class:`GcMetrics` keeps the counters of one gc process (``*_total``: monotonic across the
passes of the process, reset when it restarts, which Prometheus' ``rate``/``increase`` handle)
and the gauges of its last successful pass. The gauges are what that pass's scan found, at the
start of the pass (before it emptied trash and evicted), except ``usage_after_pass_bytes`` and
``over_budget``. Names, meanings and alert thresholds: docs/operating.md.

In a dry run (``kvstore_gc_dry_run 1``) the eviction and unlink counters count what would
have gone; nothing did.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from kvstore.admin.textfile import Family

PREFIX = "kvstore_gc_"
# The categories of bytes counted against --max-bytes (their sum is the usage): pass document key.
USAGE_KINDS = {
    "blocks": "block_bytes",
    "temp": "temp_bytes",
    "quarantine": "quarantine_bytes",
    "foreign": "foreign_bytes",
    "unusable": "unusable_bytes",
}
# What a pass could not read or had to work around (gc's finding kinds).
FINDING_KINDS = ("unreadable", "bad-namespace", "trash-unusable", "undeletable")
# Process-wide counters without labels: name (without prefix and _total) -> help.
_COUNTERS = {
    "passes": "gc passes completed by this process",
    "pass_errors": "gc passes that failed (the error is on stderr; the next interval retries)",
    "metrics_write_errors": "times this metrics file could not be written",
    "trash_unlinked_entries": "expired trash entries unlinked (blocks evicted a grace period "
    "earlier, removed namespaces)",
    "trash_unlinked_bytes": "bytes of the expired trash entries unlinked",
    "temps_removed_files": "orphan temporary files (crashed writers) deleted",
    "temps_removed_bytes": "bytes of the orphan temporary files deleted",
    "kept_recently_used_blocks": "eviction victims kept because a reader used them during the pass",
}


class GcMetrics:
    """Counters of one gc process and gauges of its last pass, as Prometheus families."""

    def __init__(self, *, interval_s: float | None = None) -> None:
        self.interval_s = interval_s
        self.counters = dict.fromkeys(_COUNTERS, 0)
        # namespace -> [blocks, bytes] evicted by this process (kept once seen: monotonic).
        self.evicted: dict[str, list[int]] = {}
        self.last: dict[str, Any] | None = None
        self.last_end_s: float | None = None

    def record_pass(self, doc: Mapping[str, Any], *, end_s: float | None = None) -> None:
        """Count one successful pass from its document (:func:`kvstore.admin.gc.gc_pass`)."""
        self.last = dict(doc)
        self.last_end_s = time.time() if end_s is None else end_s
        c = self.counters
        c["passes"] += 1
        c["trash_unlinked_entries"] += doc["trash_emptied"]["entries"]
        c["trash_unlinked_bytes"] += doc["trash_emptied"]["bytes"]
        c["temps_removed_files"] += doc["temps_removed"]["files"]
        c["temps_removed_bytes"] += doc["temps_removed"]["bytes"]
        c["kept_recently_used_blocks"] += doc["evicted"]["kept_recently_used"]
        for ns in doc["by_namespace"]:
            self.evicted.setdefault(ns, [0, 0])
        for ns, row in doc["evicted"]["by_namespace"].items():
            total = self.evicted.setdefault(ns, [0, 0])
            total[0] += row["blocks"]
            total[1] += row["bytes"]

    def record_pass_error(self) -> None:
        self.counters["pass_errors"] += 1

    def record_write_error(self) -> None:
        self.counters["metrics_write_errors"] += 1

    def families(self) -> list[Family]:
        """Every family, the last pass's gauges first (none before a pass succeeded)."""
        return [*self._gauges(), *self._counter_families()]

    def _counter_families(self) -> list[Family]:
        out = [
            Family(f"{PREFIX}{name}_total", "counter", help_, [({}, self.counters[name])])
            for name, help_ in _COUNTERS.items()
        ]
        by_ns = sorted(self.evicted.items())
        out.append(
            Family(
                f"{PREFIX}evicted_blocks_total",
                "counter",
                "blocks evicted (renamed into trash, or deleted where trash is unusable)",
                [({"namespace": ns}, v[0]) for ns, v in by_ns],
            )
        )
        out.append(
            Family(
                f"{PREFIX}evicted_bytes_total",
                "counter",
                "bytes of the blocks evicted",
                [({"namespace": ns}, v[1]) for ns, v in by_ns],
            )
        )
        return out

    def _gauges(self) -> list[Family]:
        doc = self.last
        if doc is None:
            return []
        before, policy = doc["before"], doc["policy"]
        by_ns = sorted(doc["by_namespace"].items())

        def per_ns(key: str) -> list[tuple[Mapping[str, str], float]]:
            return [({"namespace": ns}, row[key]) for ns, row in by_ns]

        def one(name: str, help_: str, value: float | None) -> Family:
            return Family(PREFIX + name, "gauge", help_, [] if value is None else [({}, value)])

        findings = dict.fromkeys(FINDING_KINDS, 0)
        for f in doc["findings"]:
            findings[f["kind"]] = findings.get(f["kind"], 0) + 1
        fs = doc.get("filesystem") or {}
        return [
            Family(
                PREFIX + "usage_bytes",
                "gauge",
                "bytes counted against --max-bytes, by kind, as scanned at the start of the last "
                "pass (sum: the usage; a lower bound when usage_complete is 0)",
                [({"kind": k}, before[key]) for k, key in USAGE_KINDS.items()],
            ),
            one(
                "usage_after_pass_bytes",
                "usage after the last pass evicted and swept (lower bound if incomplete)",
                doc["after"]["usage"],
            ),
            one(
                "usage_complete",
                "1 if the last pass could list every directory, 0 if usage figures are lower "
                "bounds (see kvstore_gc_findings)",
                int(doc["usage_complete"]),
            ),
            one(
                "max_bytes",
                "the size budget (--max-bytes): gc evicts down to it",
                policy["max_bytes"],
            ),
            one("max_age_seconds", "the age limit (--max-age)", policy["max_age_s"]),
            one("grace_seconds", "trash is unlinked after this long (--grace)", policy["grace_s"]),
            one(
                "interval_seconds",
                "time between --watch passes (--interval)",
                self.interval_s,
            ),
            one(
                "over_budget",
                "1 if usage after the last pass still exceeds --max-bytes (nothing left to evict: "
                "only non-block bytes remain)",
                int(doc["over_budget"]),
            ),
            one("dry_run", "1 if gc runs with --dry-run (nothing is evicted)", int(doc["dry_run"])),
            one(
                "filesystem_size_bytes",
                "size of the file system holding the store (statvfs)",
                fs.get("size_bytes"),
            ),
            one(
                "filesystem_avail_bytes",
                "bytes available to unprivileged users on that file system (statvfs)",
                fs.get("avail_bytes"),
            ),
            Family(PREFIX + "blocks", "gauge", "published blocks per namespace", per_ns("blocks")),
            Family(
                PREFIX + "block_bytes",
                "gauge",
                "bytes of published blocks per namespace",
                per_ns("block_bytes"),
            ),
            Family(
                PREFIX + "quarantine_entries",
                "gauge",
                "files in quarantine per namespace (blocks found corrupt, foreign entries)",
                per_ns("quarantine_entries"),
            ),
            Family(
                PREFIX + "quarantine_bytes",
                "gauge",
                "bytes in quarantine per namespace",
                per_ns("quarantine_bytes"),
            ),
            one(
                "trash_entries",
                "trash entries waiting for their grace period (evicted blocks, removed namespaces)",
                before["trash_entries"],
            ),
            one("trash_bytes", "bytes of those trash entries", before["trash_bytes"]),
            Family(
                PREFIX + "findings",
                "gauge",
                "what the last pass could not read or had to work around, by kind",
                [({"kind": k}, n) for k, n in sorted(findings.items())],
            ),
            one("last_pass_duration_seconds", "wall time of the last pass", doc["seconds"]),
            one(
                "last_pass_timestamp_seconds",
                "Unix time the last pass ended",
                self.last_end_s,
            ),
        ]

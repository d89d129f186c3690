"""``kvstore gc``: bound a store by size or age while servers keep using it.

**Which blocks go** (last use = mtime, leaves of the prefix trees first, least recently used
first) is :mod:`kvstore.admin.eviction`'s policy; this module runs it.

* ``--max-bytes N``: evict until the store's usage is at most N. Usage = what everything under
  the root except trash and removed namespaces holds on the disk (allocated bytes, at least
  each file's size; every byte figure of the report is allocated): published blocks of all
  namespaces and groups, temporary files (writes in flight: they are about to be blocks),
  quarantine and foreign files. Trash is not counted: it is already unpublished and is
  unlinked one grace period later, so the disk can hold at most N plus what was evicted
  during the last grace period.
  Only blocks are evicted; if the rest alone exceeds N, gc reports it and exits 1.
* ``--max-age D``: evict leaves whose last use is older than now - D (repeatedly: a parent
  that becomes a leaf and is old goes too). An old block with a recent descendant stays.
* Both may be given: the union of what each would evict goes.
* ``--dry-run``: report what would go; nothing is renamed, deleted or touched.

**Deletion** follows :mod:`kvstore.admin.trash`: a victim is renamed into ``<ns>/trash/`` (a
reader opening it afterwards misses; one that opened it before reads it whole), and trash
older than ``--grace`` is unlinked at the start of every run. Just before renaming a victim gc
stats it again and keeps it if a reader used it since the scan. Temporary files older than
``--tmp-age`` (crashed writers) are deleted too.

**Hostile trees** (docs/reliability.md). What gc cannot read it reports, and it carries on
with the rest: a directory that cannot be listed (its blocks are neither counted nor evicted),
a namespace whose ``zarr.json`` cannot be read (what can be listed of it is counted against
the budget, nothing of it is evicted), a trash entry that cannot be deleted. Then the usage
figure is a lower bound: the report says ``usage_complete: false``; gc still evicts from the
readable part (a store that is over budget must not grow because one directory is unreadable)
and exits 1 ("findings") even when within budget. A ``<ns>/trash`` that is not a real
directory (a symbolic link, a file) is never moved into: gc deletes that namespace's victims
directly (phase 1 and 2 at once: a reader that opened the file keeps reading it on a local
file system; on NFS its read may fail, which is a miss, never a wrong page) and reports it;
``kvstore verify --fix`` removes the bad entry.

**Clock jumps.** A block whose mtime is in the future (written while the clock was ahead)
would never be older than ``--max-age`` and would sort as the most recently used forever: gc
sets such an mtime to now (not in a dry run), after which it ages like any other. Trash named
with a future time is renamed with the current time (:func:`kvstore.admin.trash.restamp_future`)
and expires one grace period later.

**Memory and passes.** A pass holds no entry per block (:mod:`kvstore.admin.eviction_pass`):
its first scan is ``stat`` only (usage, oldest last use, temps, trash); only when something
must go does it read every header (parent links, into a filter of fixed size) and scan again
to pick and evict the victims. Victims are least recently used to the resolution of a
histogram of last use (the store's age span / 65,536).

**--watch** repeats a pass (scan, empty expired trash, sweep orphan temps, evict to budget)
every ``--interval`` seconds until SIGINT/SIGTERM (or ``--max-passes``). It evicts ahead: a
pass aims below ``--max-bytes`` by what the writers were seen to add in the time until the next
pass's evictions land (:class:`EvictAhead`; the report's ``evict_ahead_bytes``), so a busy store
stays within its budget between passes. Because it scans the file system it counts the
blocks of every server writing to the store, on any machine.

**--metrics FILE** writes, after every pass, the Prometheus textfile of
:mod:`kvstore.admin.gc_metrics` (usage, evictions, trash, quarantine, findings, pass duration;
counters monotonic over the process) atomically through :mod:`kvstore.admin.textfile`. A path
that cannot be written is an error before the first pass; a later write failure is warned
about and counted, and the passes go on.
"""

from __future__ import annotations

import os
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from kvstore.admin.du import gc_usage
from kvstore.admin.eviction import Block, Evicted, EvictFn
from kvstore.admin.eviction_pass import Budget, EvictionRun
from kvstore.admin.gc_metrics import GcMetrics
from kvstore.admin.progress import Progress
from kvstore.admin.report import print_json, print_lines, table, warn
from kvstore.admin.scan import Entry, StoreScan, fanout_dirs, open_root, scan_store
from kvstore.admin.sizes import format_duration, format_size, iso_time
from kvstore.admin.textfile import Textfile, exposition
from kvstore.admin.trash import (
    DEFAULT_GRACE_S,
    HeldDirectoryError,
    delete_held,
    expired,
    restamp_future,
    trash_block,
)
from kvstore.admin.verify import DEFAULT_TMP_AGE_S
from kvstore.errors import ConfigError, KvstoreError
from kvstore.io import stall
from kvstore.io.entries import describe_kind
from kvstore.store.paths import TRASH
from kvstore.store.view import StoreView


@dataclass(frozen=True)
class Policy:
    """What one gc pass enforces."""

    max_bytes: int | None = None
    max_age_s: float | None = None
    grace_s: float = DEFAULT_GRACE_S
    tmp_age_s: float = DEFAULT_TMP_AGE_S
    dry_run: bool = False
    # Whether the report lists every victim (``--list-victims``); else it summarises them
    # (count, bytes, per namespace, last-use range): a pass may evict millions of blocks.
    list_victims: bool = False
    # --watch: evict below max_bytes by what writers add until the next pass (EvictAhead).
    evict_ahead: bool = True


def _remove_for_real(store: StoreView, findings: list[dict[str, str]]) -> EvictFn:
    """Evict by renaming into ``<ns>/trash``; where that is not a real directory, unlink the
    victim directly and add one finding per namespace to ``findings``."""
    paths = {ns.name: ns.path for ns in store.namespaces}
    no_trash: set[str] = set()

    def remove(block: Block) -> Evicted | int:
        try:
            st = os.lstat(block.path)
            stall.beat()
        except FileNotFoundError:
            return Evicted.GONE
        if not stat.S_ISREG(st.st_mode):
            return Evicted.GONE  # replaced by something else since the scan: not a block
        if block.ino not in (-1, st.st_ino) or st.st_mtime_ns > block.mtime_ns:
            return max(st.st_mtime_ns, block.mtime_ns + 1)
        if block.namespace not in no_trash:
            try:
                moved = trash_block(
                    paths[block.namespace], block.group, block.hash_hi, block.hash_lo, block.path
                )
            except HeldDirectoryError as exc:
                no_trash.add(block.namespace)
                trash_path = str(paths[block.namespace] / TRASH)
                if all(f["path"] != trash_path for f in findings):  # else reported by the scan
                    findings.append(
                        {
                            "kind": "trash-unusable",
                            "path": trash_path,
                            "detail": f"{exc}; evicted blocks of this namespace are deleted "
                            "directly (kvstore verify --fix removes the entry)",
                        }
                    )
            else:
                return Evicted.REMOVED if moved else Evicted.GONE
        try:
            Path(block.path).unlink()
        except FileNotFoundError:
            return Evicted.GONE
        return Evicted.REMOVED

    return remove


class _FutureMtimes:
    """Sets block mtimes later than the clock (a clock that was ahead) to the clock's time as
    the scan finds them (not in a dry run: the eviction then treats them as used now).

    "Later" is judged when the batch is handed over, not at the pass's start: a block written
    while the scan runs is not from the future."""

    def __init__(self, now_ns: int | None, dry_run: bool) -> None:
        self.now_ns = now_ns  # a fixed clock (tests); None: the real one
        self.dry_run = dry_run
        self.count = 0

    def __call__(self, batch: Sequence[Entry]) -> None:
        now = time.time_ns() if self.now_ns is None else self.now_ns
        for entry in batch:
            if entry.mtime_ns <= now:
                continue
            self.count += 1
            if not self.dry_run:
                try:
                    os.utime(entry.path, ns=(now, now), follow_symlinks=False)
                except OSError:
                    continue  # gone, or read-only: this pass still treats it as used now


def _findings(scan: StoreScan, store: StoreView) -> list[dict[str, str]]:
    """What this pass could not read: it makes the usage figure a lower bound."""
    out = [
        {"kind": "bad-namespace", "path": str(p.path), "detail": p.detail} for p in store.problems
    ]
    out += [
        {"kind": "unreadable", "path": str(p.path), "detail": p.detail} for p in scan.unreadable
    ]
    for entry in scan.foreign:
        name = Path(entry.path).name
        if entry.namespace is not None and entry.group is None and name == TRASH:
            out.append(
                {
                    "kind": "trash-unusable",
                    "path": entry.path,
                    "detail": f"expected a directory, got {describe_kind(entry.mode)} (never "
                    "entered; evicted blocks of this namespace are deleted directly)",
                }
            )
    return out


def _by_namespace(scan: StoreScan) -> dict[str, dict[str, int]]:
    """Blocks and quarantine of each namespace, as scanned (every namespace, even empty)."""
    fields = ("blocks", "block_bytes", "quarantine_entries", "quarantine_bytes")
    rows = {ns.name: dict.fromkeys(fields, 0) for ns in scan.store.namespaces}
    for (name, _group), tally in scan.tallies.items():
        row = rows.setdefault(name, dict.fromkeys(fields, 0))
        row["blocks"] += tally.blocks
        row["block_bytes"] += tally.allocated
    for q in scan.quarantine:
        row = rows.setdefault(q.namespace or "", dict.fromkeys(fields, 0))
        row["quarantine_entries"] += 1
        row["quarantine_bytes"] += q.allocated
    return rows


def _filesystem(root: Path) -> dict[str, int] | None:
    """Size and space available to unprivileged users of the file system holding ``root``
    (``statvfs``); None where it cannot be asked."""
    try:
        st = os.statvfs(root)
    except OSError:
        return None
    return {"size_bytes": st.f_blocks * st.f_frsize, "avail_bytes": st.f_bavail * st.f_frsize}


def _pretend(block: Block) -> Evicted | int:
    return Evicted.REMOVED


def gc_pass(
    root: Path,
    policy: Policy,
    *,
    progress: bool = False,
    now_ns: int | None = None,
    headroom_bytes: int = 0,
) -> dict[str, Any]:
    """One gc pass; its report (the JSON document of ``kvstore gc``, one per --watch pass).

    ``headroom_bytes``: evict that much below ``max_bytes`` (``--watch`` evicting ahead of
    what the writers add before the next pass ends); the report's ``over_budget`` is judged
    against ``max_bytes`` itself."""
    started = time.perf_counter()
    store = open_root(root)
    future = _FutureMtimes(now_ns, policy.dry_run)
    with Progress(fanout_dirs(store.namespaces), "scanning", enabled=progress) as bar:
        scan = scan_store(store, on_dir=bar.update, on_blocks=future)
    now = time.time_ns() if now_ns is None else now_ns
    usage_before = gc_usage(scan)
    blocks_before = scan.tally()
    findings = _findings(scan, store)
    trash_bytes = sum(t.allocated for t in scan.trash) + sum(r.allocated for r in scan.removed)
    held = [*scan.trash, *scan.removed]
    if not policy.dry_run:
        held = restamp_future(held, now)
    # Phase 2 of earlier deletions, and crashed writers' files.
    emptied = delete_held(expired(held, policy.grace_s, now), dry_run=policy.dry_run)
    findings += [
        {"kind": "undeletable", "path": f.split(": ", 1)[0], "detail": f} for f in emptied.failed
    ]
    orphans = [t for t in scan.temps if t.mtime_ns <= now - int(policy.tmp_age_s * 1e9)]
    swept = swept_bytes = 0
    for temp in orphans:
        if not policy.dry_run:
            try:
                Path(temp.path).unlink()
            except FileNotFoundError:
                continue
        swept += 1
        swept_bytes += temp.allocated
    target = None if policy.max_bytes is None else max(0, policy.max_bytes - headroom_bytes)
    cutoff = now - int(policy.max_age_s * 1e9) if policy.max_age_s is not None else None
    budget = Budget(usage_before - swept_bytes, target, cutoff, now)
    run = EvictionRun(
        store,
        budget,
        _pretend if policy.dry_run else _remove_for_real(store, findings),
        list_victims=policy.list_victims,
        progress=progress,
    )
    run.run(blocks_before.oldest_ns)
    victims = run.victims
    over = policy.max_bytes is not None and budget.usage > policy.max_bytes
    return {
        "root": str(store.root),
        "dry_run": policy.dry_run,
        "time": iso_time(now),
        "policy": {
            "max_bytes": policy.max_bytes,
            "max_age_s": policy.max_age_s,
            "grace_s": policy.grace_s,
            "tmp_age_s": policy.tmp_age_s,
        },
        "before": {
            "blocks": blocks_before.blocks,
            "block_bytes": blocks_before.allocated,
            "temp_bytes": sum(t.allocated for t in scan.temps),
            "quarantine_bytes": sum(q.allocated for q in scan.quarantine),
            "foreign_bytes": sum(f.allocated for f in scan.foreign),
            "trash_bytes": trash_bytes,
            "unusable_bytes": sum(u.allocated for u in scan.unusable),
            "usage": usage_before,
            "quarantine_entries": len(scan.quarantine),
            "trash_entries": len(scan.trash) + len(scan.removed),
        },
        "by_namespace": _by_namespace(scan),
        "filesystem": _filesystem(store.root),
        "usage_complete": scan.complete,
        "future_mtimes_reset": future.count,
        "findings": findings,
        "trash_emptied": {
            "entries": emptied.entries,
            "files": emptied.files,
            "bytes": emptied.allocated,
        },
        "temps_removed": {"files": swept, "bytes": swept_bytes},
        "evict_ahead_bytes": headroom_bytes if policy.max_bytes is not None else 0,
        "evicted": {
            "blocks": victims.blocks,
            "bytes": victims.bytes,
            "by_namespace": victims.by_namespace or {},
            "kept_recently_used": victims.refreshed,
            "already_gone": victims.gone,
            "last_use": _last_use(victims.oldest_ns, victims.newest_ns),
            **(
                {"victims": [b.to_json() for b in victims.listed]}
                if victims.listed is not None
                else {}
            ),
        },
        "selection": run.report(),
        "after": {
            "blocks": blocks_before.blocks - victims.blocks - victims.gone,
            "usage": budget.usage,
        },
        "over_budget": over,
        "headers_read": run.headers_read,
        "seconds": time.perf_counter() - started,
    }


def _last_use(oldest: int | None, newest: int | None) -> dict[str, Any]:
    """The range of the victims' last use (None when nothing was evicted)."""
    return {
        "oldest_ns": oldest,
        "newest_ns": newest,
        "oldest": iso_time(oldest),
        "newest": iso_time(newest),
    }


def render(doc: dict[str, Any]) -> list[str]:
    """The table of one gc run."""
    pol, before, ev = doc["policy"], doc["before"], doc["evicted"]
    budget = []
    if pol["max_bytes"] is not None:
        budget.append(f"max {format_size(pol['max_bytes'])}")
    if pol["max_age_s"] is not None:
        budget.append(f"max age {format_duration(pol['max_age_s'])}")
    verb = "would evict" if doc["dry_run"] else "evicted"
    dry = " (dry run: nothing changed)" if doc["dry_run"] else ""
    kept = ev["kept_recently_used"]
    lines = [
        f"store {doc['root']}: {', '.join(budget)}{dry}",
        f"  usage {format_size(before['usage'])}: {before['blocks']} blocks "
        f"{format_size(before['block_bytes'])}, temp {format_size(before['temp_bytes'])}, "
        f"quarantine {format_size(before['quarantine_bytes'])}, "
        f"foreign {format_size(before['foreign_bytes'])} "
        f"(trash {format_size(before['trash_bytes'])} not counted)",
        f"  {verb} {ev['blocks']} blocks ({format_size(ev['bytes'])}), leaves first, least "
        "recently used first" + (f"; kept {kept} used since the scan" if kept else ""),
    ]
    if ev["by_namespace"]:
        rows = [
            [ns, v["blocks"], format_size(v["bytes"])]
            for ns, v in sorted(ev["by_namespace"].items())
        ]
        lines += table(["namespace", "blocks", "size"], rows, indent="    ")
    te, tr = doc["trash_emptied"], doc["temps_removed"]
    verb2 = "would unlink" if doc["dry_run"] else "unlinked"
    lines.append(
        f"  {verb2} {te['entries']} expired trash entries ({format_size(te['bytes'])}) and "
        f"{tr['files']} orphan temporary files ({format_size(tr['bytes'])})"
    )
    state = "OVER BUDGET (only non-block bytes left)" if doc["over_budget"] else "within budget"
    bound = "" if doc["usage_complete"] else " at least (some directories could not be read)"
    lines.append(f"  usage after: {format_size(doc['after']['usage'])}{bound}, {state}")
    if doc["future_mtimes_reset"]:
        lines.append(
            f"  {doc['future_mtimes_reset']} block(s) had a last use in the future: set to now"
        )
    if doc["findings"]:
        lines.append(f"  {len(doc['findings'])} finding(s):")
        lines += table(
            ["kind", "path", "detail"],
            [[f["kind"], f["path"], f["detail"]] for f in doc["findings"]],
            indent="    ",
        )
    return lines


def render_pass_line(doc: dict[str, Any], number: int) -> str:
    """One line per --watch pass."""
    ev, te = doc["evicted"], doc["trash_emptied"]
    return (
        f"{doc['time']} pass {number}: usage {format_size(doc['before']['usage'])} -> "
        f"{format_size(doc['after']['usage'])}, evicted {ev['blocks']} "
        f"({format_size(ev['bytes'])}), unlinked {te['entries']} trash, "
        f"{doc['seconds'] * 1e3:.0f} ms"
        + (" OVER BUDGET" if doc["over_budget"] else "")
        + (f", {len(doc['findings'])} finding(s)" if doc["findings"] else "")
    )


class EvictAhead:
    """How far below ``--max-bytes`` a ``--watch`` pass evicts: what the writers are seen to
    add between passes (bytes/s, smoothed) times the time until the next pass's evictions
    land (the interval plus the last pass's duration), at most half the budget. Without it a
    busy store exceeds its budget by that much before every pass."""

    SMOOTHING = 0.5  # weight of the latest observation

    def __init__(self, interval_s: float, max_bytes: int | None) -> None:
        self.interval_s = interval_s
        self.max_bytes = max_bytes
        self.rate = 0.0  # bytes/s added by writers
        self._last: tuple[float, int, float] | None = None  # (end, usage after, seconds)

    def headroom(self) -> int:
        if self.max_bytes is None or self._last is None:
            return 0
        ahead = self.rate * (self.interval_s + self._last[2])
        return int(min(ahead, self.max_bytes / 2))

    def observe(self, doc: dict[str, Any], started: float, ended: float) -> None:
        """Learn from a finished pass: usage it found against what the previous one left."""
        if self._last is not None:
            previous_end, previous_after, _ = self._last
            elapsed = max(started - previous_end, 1e-3)
            # Usage found at the start of this pass over what the last one left: the scan
            # runs during the pass, so the window is from the last end to this pass's middle.
            window = elapsed + (ended - started) / 2
            added = max(0, doc["before"]["usage"] - previous_after)
            latest = added / window
            self.rate = self.SMOOTHING * latest + (1 - self.SMOOTHING) * self.rate
        self._last = (ended, doc["after"]["usage"], ended - started)


@contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """Set ``stop`` on SIGINT/SIGTERM for the duration (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def watch(  # noqa: PLR0913 - root, policy and the watch loop's keyword-only controls (interval, pass limit, callback, stop event), each documented
    root: Path,
    policy: Policy,
    *,
    interval_s: float,
    max_passes: int | None,
    on_pass: Callable[[dict[str, Any], int], None],
    on_error: Callable[[Exception], None] | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Run passes until a signal (or ``stop``), or ``max_passes``; exit code 0. A failing
    first pass raises; a later one is warned about, given to ``on_error`` and retried."""
    stop = stop or threading.Event()
    ahead = EvictAhead(interval_s, policy.max_bytes if policy.evict_ahead else None)
    passes = 0
    with _stop_on_signals(stop):
        while not stop.is_set():
            try:
                started = time.monotonic()
                doc = gc_pass(root, policy, headroom_bytes=ahead.headroom())
                ahead.observe(doc, started, time.monotonic())
            except (OSError, KvstoreError) as exc:
                if passes == 0:
                    raise
                warn(f"gc pass failed, retrying next interval: {exc}")
                if on_error is not None:
                    on_error(exc)
            else:
                passes += 1
                on_pass(doc, passes)
            if max_passes is not None and passes >= max_passes:
                break
            with stall.paused():  # waiting for the next pass is not the mount hanging
                stop.wait(interval_s)
    return 0


def _outside_store(metrics_path: Path, root: Path) -> None:
    """Refuse a metrics file inside the store: it would be a foreign entry there (counted
    against the budget, quarantined by ``verify --fix``)."""
    directory = metrics_path.parent.resolve()
    store = root.resolve()
    if directory == store or store in directory.parents:
        raise ConfigError(
            f"--metrics {str(metrics_path)!r}: expected a file outside the store, "
            f"got one inside {str(root)!r}"
        )


def run(  # noqa: PLR0913 - root, policy and the output options of the command line, keyword-only
    root: Path,
    policy: Policy,
    *,
    as_json: bool,
    watch_interval_s: float | None = None,
    max_passes: int | None = None,
    metrics_path: Path | None = None,
) -> int:
    """``kvstore gc``: exit 0 within budget, 1 over budget (nothing left to evict) or findings
    (something could not be read or had to be worked around; the findings say what).

    ``metrics_path``: after every pass (and every failed --watch pass) write the Prometheus
    textfile of :mod:`kvstore.admin.gc_metrics` there; a path that cannot be written is an
    error (exit 2) before the first pass."""
    if policy.max_bytes is None and policy.max_age_s is None:
        raise ValueError("gc: expected --max-bytes or --max-age (or both), got neither")
    textfile = Textfile(metrics_path) if metrics_path is not None else None
    if textfile is not None:
        _outside_store(textfile.path, root)
        textfile.check()
    metrics = GcMetrics(interval_s=watch_interval_s)
    if watch_interval_s is None:
        doc = gc_pass(root, policy, progress=True)
        if as_json:
            print_json(doc)
        else:
            print_lines(render(doc))
        for f in doc["findings"]:
            warn(f"{f['kind']}: {f['path']}: {f['detail']}")
        if textfile is not None:
            metrics.record_pass(doc)
            try:
                textfile.write(exposition(metrics.families()))
            except OSError as exc:
                raise KvstoreError(f"cannot write --metrics {str(metrics_path)!r}: {exc}") from None
        return 1 if doc["over_budget"] or doc["findings"] else 0

    def publish() -> None:
        if textfile is None:
            return
        try:
            textfile.write(exposition(metrics.families()))
        except OSError as exc:
            metrics.record_write_error()  # shown by the next write that succeeds
            warn(f"cannot write --metrics {str(metrics_path)!r}: {exc}")

    def on_pass(doc: dict[str, Any], number: int) -> None:
        if as_json:
            print_json(doc, lines=True)
        else:
            print(render_pass_line(doc, number), flush=True)
        metrics.record_pass(doc)
        publish()

    def on_error(exc: Exception) -> None:
        metrics.record_pass_error()
        publish()

    return watch(
        root,
        policy,
        interval_s=watch_interval_s,
        max_passes=max_passes,
        on_pass=on_pass,
        on_error=on_error,
    )

"""``kvstore verify``: is the store intact?

Checks, per namespace:

* every block file (or a random ``--sample`` fraction of them): size, header (magic, version,
  crc), hash coordinates in the header = the path's ``<hi>/<lo>`` (else **mis-keyed**: a shard
  copied under another hash's name), namespace digest and group = where it lies (else
  **misplaced**), geometry = the array's, the sharding index, every inner chunk's checksum and
  zero padding (else **corrupt**); a short file is **truncated**, a long one **oversized**;
* temporary files: older than ``--tmp-age`` (default 1 h) they are **orphan-temp** (a writer
  that crashed); younger ones may be writes in flight and are only listed, never touched;
* **foreign** entries: anything in a fan-out directory that is neither a block name nor a
  temporary file, any unknown entry of a namespace, array or ``c/`` tree, and of the root;
* the array documents (``g<k>/zarr.json``) against format v1 for the namespace's identity
  (**metadata**), and namespaces whose ``zarr.json`` cannot be read (**bad-namespace**).

Hostile entries (docs/reliability.md) are findings of their own: **symlink** (a symbolic link
anywhere in the store, with where it points and whether that is outside the root; never
followed; ``--fix`` unlinks the link itself, never its target), **special-file** (a FIFO,
socket or device where a file or directory belongs; never opened; ``--fix`` moves it to
quarantine, a rename that opens nothing), **unreadable** (a directory that cannot be listed:
reported, left alone, the rest is checked), and ``trash`` / ``quarantine`` entries that are not
real directories (nothing is moved into them; ``--fix`` removes a link, quarantines a file;
a ``quarantine`` that is not a directory is left for a person).

The temp, foreign and metadata checks always cover the whole store; ``--sample`` only thins
the block checks. Read-only unless ``--fix``: then bad blocks and foreign entries of a
namespace move to ``<ns>/quarantine/`` and orphan temporary files are deleted; entries of the
root and metadata problems are reported, never changed. Exit code 1 when anything was found,
fixed or not (0: clean; young temporary files are not findings); 130 when a Ctrl-C stopped it.

**Streaming.** A store may hold 10^8 blocks: none of the block entries is kept. The scan hands
them over in batches (``scan_store(on_blocks=...)``); ``--sample`` is a seeded draw per block;
the chosen ones are checked (and, with ``--fix``, quarantined) on ``--threads`` reader threads
with a bounded window of tasks in flight (:class:`_BlockChecker`), and only counts and the
first :data:`MAX_LISTED_BLOCK_FINDINGS` block findings are kept. Temporary, foreign and
unreadable entries are still collected by the scan (a store has few) and all listed. A Ctrl-C
lets the checks and fixes in flight finish, then raises :class:`VerifyInterrupted` with how far
the run got.
"""

from __future__ import annotations

import json
import os
import random
import stat
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.admin.blockfile import BlockFault, judge_block_file
from kvstore.admin.progress import Progress
from kvstore.admin.scan import Entry, StoreScan, fanout_dirs, open_root, scan_store
from kvstore.admin.sizes import format_duration, format_size
from kvstore.admin.trash import HeldDirectoryError, ReplacedError, quarantine_file
from kvstore.errors import StoreFormatError
from kvstore.io.entries import FileId, kind_noun, remove_if_same
from kvstore.io.native_fileio import DEFAULT_FILEIO
from kvstore.store import metadata
from kvstore.store.batch_check import RawBatchCheck
from kvstore.store.check import ShardSpec
from kvstore.store.codec import Codec
from kvstore.store.paths import QUARANTINE, TRASH, ZARR_JSON
from kvstore.store.view import NamespaceView, read_document

DEFAULT_TMP_AGE_S = 3600.0
ORPHAN_TEMP = "orphan-temp"
FOREIGN = "foreign"
METADATA = "metadata"
BAD_NAMESPACE = "bad-namespace"
SYMLINK = "symlink"
SPECIAL_FILE = "special-file"
UNREADABLE = "unreadable"
QUARANTINED_AS = "quarantined as "
# Block findings listed in the document; every one is counted (``counts``) and fixed
# (``--fix``) all the same. A store can hold millions of bad blocks (a disk that failed): the
# list, and the table printed from it, must not grow with them.
MAX_LISTED_BLOCK_FINDINGS = 10_000
# Blocks one task checks on a reader thread: enough to amortise a future, its hand-over and
# the batch check's two native calls (a tiny block on tmpfs: 10.6 us a block in tasks of 64,
# 9.1 in tasks of 256, of which 8.7 reading), few enough to spread a scan batch (1024) over
# the threads.
TASK_BLOCKS = 256
# Tasks queued or running per reader thread: every thread has its next task ready while the
# calling thread records results, and at most threads * TASKS_AHEAD * TASK_BLOCKS entries wait.
TASKS_AHEAD = 2
# Longest wait for a result before the calling thread looks for a Ctrl-C again.
WAIT_SLICE_S = 0.1
# How often the progress bar's "checked" note is rewritten.
NOTE_INTERVAL_S = 0.25


@dataclass(frozen=True)
class Finding:
    """One problem found: its kind, where, why, and what ``--fix`` did about it."""

    kind: str
    path: str
    namespace: str | None
    group: int | None
    detail: str
    action: str | None = None  # None: read-only run; else "quarantined as …", "deleted", "left …"

    def to_json(self, root: Path) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "path": _rel(self.path, root),
            "namespace": self.namespace,
            "group": self.group,
            "detail": self.detail,
            "action": self.action,
        }


@dataclass(frozen=True)
class VerifyOptions:
    fix: bool = False
    sample: float = 1.0  # fraction of blocks whose contents are checked, 0 < sample <= 1
    tmp_age_s: float = DEFAULT_TMP_AGE_S
    threads: int = 4
    seed: int | None = None  # of the sample; None: a different sample each run
    progress: bool = True


def verify_store(root: Path, options: VerifyOptions) -> dict[str, Any]:
    """Run every check (and the fixes); the JSON document of ``kvstore verify``.

    Memory is bounded whatever the number of blocks (module doc, *Streaming*). A Ctrl-C
    (KeyboardInterrupt) stops the run with :class:`VerifyInterrupted` once every check and
    fix in flight has finished."""
    if not 0 < options.sample <= 1:
        raise ValueError(f"--sample: expected a fraction in (0, 1], got {options.sample}")
    store = open_root(root)
    by_name = {ns.name: ns for ns in store.namespaces}
    findings: list[Finding] = [
        Finding(BAD_NAMESPACE, str(p.path), p.path.name, None, p.detail, _left(options))
        for p in store.problems
    ]
    findings += _check_metadata(store.namespaces, options)
    total_dirs = fanout_dirs(store.namespaces)
    with (
        Progress(total_dirs, "verifying", enabled=options.progress) as bar,
        ThreadPoolExecutor(max(1, options.threads), thread_name_prefix="kvstore-verify") as pool,
    ):
        checker = _BlockChecker(by_name, options, pool, bar)
        try:
            scan = scan_store(store, on_dir=checker.dir_done, on_blocks=checker.feed)
            checker.finish()
        except KeyboardInterrupt:
            checker.interrupt()  # before the pool's exit: tasks not begun are dropped
            raise VerifyInterrupted(checker.partial(total_dirs, blocks_done=False)) from None
    try:
        findings += _sweep(scan, by_name, store.root, options)
    except KeyboardInterrupt:
        # Between two fixes (each one rename or unlink): what the sweep found is not counted.
        raise VerifyInterrupted(checker.partial(total_dirs, blocks_done=True)) from None
    now = time.time_ns()
    in_flight = [t for t in scan.temps if t.mtime_ns > now - int(options.tmp_age_s * 1e9)]
    counts = dict(checker.counts)
    for f in findings:
        counts[f.kind] = counts.get(f.kind, 0) + 1
    findings += checker.findings
    findings.sort(key=lambda f: (f.kind, f.path))
    return {
        "root": str(store.root),
        "fix": options.fix,
        "sample": options.sample,
        "blocks": {
            "found": checker.found,
            "chosen": checker.chosen,
            "checked": checker.checked,
            "checked_bytes": checker.checked_bytes,
            "vanished": checker.vanished,
        },
        "in_flight_temps": [
            {"path": _rel(t.path, store.root), "bytes": t.size, "age_s": (now - t.mtime_ns) / 1e9}
            for t in in_flight
        ],
        "counts": dict(sorted(counts.items())),
        "findings": [f.to_json(store.root) for f in findings],
        "findings_omitted": checker.omitted,
    }


class VerifyInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped ``kvstore verify``: every check and fix in flight finished first (a
    quarantine is one atomic rename, a temp deletion one unlink: nothing is half-done).
    :attr:`partial` says how far the run got (:func:`render_partial`)."""

    def __init__(self, partial: dict[str, Any]) -> None:
        super().__init__("verify interrupted")
        self.partial = partial


def _sweep(
    scan: StoreScan, by_name: dict[str, NamespaceView], root: Path, options: VerifyOptions
) -> list[Finding]:
    """Findings (and fixes) of the temporary, foreign and unreadable entries of a scan."""
    findings: list[Finding] = []
    now = time.time_ns()
    orphan_limit = now - int(options.tmp_age_s * 1e9)
    for temp in scan.temps:
        if temp.mtime_ns <= orphan_limit:
            age = (now - temp.mtime_ns) / 1e9
            detail = (
                f"temporary file {format_duration(age)} old, expected none older than "
                f"{format_duration(options.tmp_age_s)} (a writer crashed)"
            )
            findings.append(_fix_temp(temp, detail, options))
    findings += [_fix_foreign(entry, by_name, root, options) for entry in scan.foreign]
    findings += [
        Finding(UNREADABLE, str(p.path), None, None, p.detail, _left(options))
        for p in scan.unreadable
    ]
    return findings


class _Sampler:
    """``--sample p``: one independent Bernoulli(p) draw per block, in scan order, from a
    generator seeded with ``--seed``. The same seed over the same listing chooses the same
    blocks, and nothing needs the number of blocks in advance (a streamed scan does not know
    it); how many were chosen is in the report (``blocks.chosen``)."""

    def __init__(self, fraction: float, seed: int | None) -> None:
        self._fraction = fraction
        self._rng = random.Random(seed)  # None: seeded from the OS, a new sample each run

    def choose(self, blocks: Sequence[Entry]) -> Sequence[Entry]:
        if self._fraction >= 1:
            return blocks
        draw, fraction = self._rng.random, self._fraction
        return [b for b in blocks if draw() < fraction]


@dataclass
class _TaskResult:
    """What one task of :class:`_BlockChecker` did with its blocks."""

    checked: int = 0
    checked_bytes: int = 0
    vanished: int = 0
    fixed: int = 0
    faults: list[Finding] = field(default_factory=list)


class _BlockChecker:
    """The block checks of one run, fed batch by batch by the scan (``on_blocks``).

    Chosen blocks go to the reader threads in tasks of :data:`TASK_BLOCKS`; at most
    ``threads * TASKS_AHEAD`` tasks are queued or running, and the scan waits (on the calling
    thread) for the oldest to finish before submitting another, so the entries held stay
    bounded. Results are taken in submission order: the findings listed are the first ones in
    scan order, the same from run to run over the same listing. Each task judges a block and,
    with ``--fix``, quarantines it at once (the file judged, by identity): a fix never waits
    behind the rest of the scan, and an interrupted run has fixed every bad block it reported.
    """

    def __init__(
        self,
        namespaces: dict[str, NamespaceView],
        options: VerifyOptions,
        pool: ThreadPoolExecutor,
        bar: Progress,
    ) -> None:
        self._namespaces = namespaces
        self._options = options
        self._pool = pool
        self._bar = bar
        self._sampler = _Sampler(options.sample, options.seed)
        self._specs: dict[tuple[str, int], ShardSpec] = {}
        self._batches: dict[tuple[str, int], RawBatchCheck] = {}
        self._window: deque[Future[_TaskResult]] = deque()
        self._limit = max(1, options.threads) * TASKS_AHEAD
        self._stop = threading.Event()
        self._noted = 0.0
        self.dirs = 0
        self.found = self.chosen = self.checked = self.checked_bytes = 0
        self.vanished = self.fixed = self.omitted = 0
        self.counts: dict[str, int] = {}
        self.findings: list[Finding] = []  # the first MAX_LISTED_BLOCK_FINDINGS, scan order

    def dir_done(self) -> None:
        self.dirs += 1
        self._bar.update()

    def feed(self, batch: Sequence[Entry]) -> None:
        """The scan's ``on_blocks``: draw the sample, submit the chosen blocks."""
        self.found += len(batch)
        chosen = self._sampler.choose(batch)
        self.chosen += len(chosen)
        for i in range(0, len(chosen), TASK_BLOCKS):
            while len(self._window) >= self._limit:
                self._take_oldest()
            self._window.append(self._pool.submit(self._check, chosen[i : i + TASK_BLOCKS]))

    def finish(self) -> None:
        while self._window:
            self._take_oldest()

    def interrupt(self) -> None:
        """Ctrl-C: submit nothing more, drop the tasks not begun, let the running ones stop
        after the block each is on (its check and fix complete), and count what they did."""
        self._stop.set()
        for task in self._window:
            task.cancel()
        while self._window:
            self._take_oldest()

    def partial(self, total_dirs: int, *, blocks_done: bool) -> dict[str, Any]:
        """How far an interrupted run got (:func:`render_partial`)."""
        return {
            "fanout_dirs": {"scanned": self.dirs, "total": total_dirs},
            "blocks": {
                "found": self.found,
                "chosen": self.chosen,
                "checked": self.checked,
                "checked_bytes": self.checked_bytes,
                "vanished": self.vanished,
            },
            "counts": dict(sorted(self.counts.items())),
            "fixed": self.fixed,
            "fix": self._options.fix,
            "blocks_done": blocks_done,
        }

    def _take_oldest(self) -> None:
        oldest = self._window[0]  # a Ctrl-C while waiting leaves it in the window
        while True:
            # In slices: a SIGINT that lands just before a lock wait does not wake it, and
            # the Ctrl-C would wait for the task to end (seconds, on a slow file system).
            try:
                result = oldest.result(timeout=WAIT_SLICE_S)
            except TimeoutError:
                continue
            except CancelledError:
                result = _TaskResult()
            break
        self._window.popleft()
        self.checked += result.checked
        self.checked_bytes += result.checked_bytes
        self.vanished += result.vanished
        self.fixed += result.fixed
        for finding in result.faults:
            self.counts[finding.kind] = self.counts.get(finding.kind, 0) + 1
            if len(self.findings) < MAX_LISTED_BLOCK_FINDINGS:
                self.findings.append(finding)
            else:
                self.omitted += 1
        now = time.monotonic()
        if now - self._noted >= NOTE_INTERVAL_S:
            self._noted = now
            self._bar.note(
                f"{self.checked} blocks, {format_size(self.checked_bytes)} checked, "
                f"{sum(self.counts.values())} bad"
            )

    def _spec(self, namespace: str, group: int) -> ShardSpec:
        # Built once per array (threads may race to build the same one: the same value).
        key = (namespace, group)
        spec = self._specs.get(key)
        if spec is None:
            ns = self._namespaces[namespace]
            g = ns.groups[group]
            codec = Codec.for_name(g.compression, g.layout.itemsize)
            spec = self._specs[key] = ShardSpec(g.layout, ns.digest, g.index, codec)
        return spec

    def _intact(self, blocks: Sequence[Entry]) -> list[bool]:
        """Which of ``blocks`` (raw ones) the batch check finds intact: those need nothing
        more; the others are judged one by one, and that verdict is the finding."""
        by_array: dict[tuple[str, int], list[int]] = {}
        for i, block in enumerate(blocks):
            assert block.group is not None
            by_array.setdefault((block.namespace or "", block.group), []).append(i)
        intact = [False] * len(blocks)
        for key, at in by_array.items():
            batch = self._batch(key)
            if batch is None:
                continue
            chosen = [blocks[i] for i in at]
            found = batch.intact(
                [b.path for b in chosen], [b.hash_hi for b in chosen], [b.hash_lo for b in chosen]
            )
            for i, ok in zip(at, found, strict=True):
                intact[i] = ok
        return intact

    def _batch(self, key: tuple[str, int]) -> RawBatchCheck | None:
        """The batch check of an array; None for a compressed one (each block judged alone)."""
        batch = self._batches.get(key)
        if batch is None:
            spec = self._spec(*key)
            if spec.codec is not None:
                return None
            batch = self._batches[key] = RawBatchCheck(spec)
        return batch

    def _check(self, blocks: Sequence[Entry]) -> _TaskResult:
        """On a reader thread: judge ``blocks`` (and fix the bad ones): the batch check
        first, then one by one those it does not find intact."""
        out = _TaskResult()
        if self._stop.is_set():
            return out  # Ctrl-C before the task began: its blocks stay unchecked
        intact = self._intact(blocks)
        suspects = [block for block, ok in zip(blocks, intact, strict=True) if not ok]
        out.checked = len(blocks) - len(suspects)
        out.checked_bytes = sum(b.size for b, ok in zip(blocks, intact, strict=True) if ok)
        for block in suspects:
            if self._stop.is_set():
                break  # Ctrl-C: the blocks not begun stay unchecked (the summary says so)
            self._judge(block, out)
        return out

    def _judge(self, block: Entry, out: _TaskResult) -> None:
        """The full check of one block the batch did not find intact (and its fix)."""
        namespace = block.namespace or ""
        assert block.group is not None
        spec = self._spec(namespace, block.group)
        try:
            fault, identity = judge_block_file(block.path, spec, block.hash_hi, block.hash_lo)
        except FileNotFoundError:
            out.vanished += 1  # evicted or quarantined while we looked: not a finding
            return
        except OSError as exc:
            fault, identity = BlockFault("unreadable", f"{type(exc).__name__}: {exc}"), None
        out.checked += 1
        out.checked_bytes += block.size
        if fault is None:
            return
        action = None
        if self._options.fix:
            # The file judged (identity), never a copy re-published under the name since.
            ns = self._namespaces[namespace]
            name = f"g{block.group}-{block.hash_hi}-{block.hash_lo}"
            action = _quarantine(ns, name, block.path, identity)
            out.fixed += action.startswith(QUARANTINED_AS)
        out.faults.append(
            Finding(fault.kind, block.path, block.namespace, block.group, fault.detail, action)
        )


def _check_metadata(namespaces: Sequence[NamespaceView], options: VerifyOptions) -> list[Finding]:
    findings = []
    for ns in namespaces:
        for group in ns.groups:
            expected = json.loads(
                metadata.array_document(ns.identity, group.index, group.compression)
            )
            try:
                got = read_document(group.path)
            except StoreFormatError as exc:
                detail = str(exc)
            else:
                if got == expected:
                    continue
                detail = (
                    f"{group.path}/{ZARR_JSON}: expected the format v1 array document "
                    f"of this identity, got {'none' if got is None else 'a different one'}"
                )
            findings.append(
                Finding(
                    METADATA,
                    str(group.path / ZARR_JSON),
                    ns.name,
                    group.index,
                    detail,
                    _left(options),
                )
            )
    return findings


def _fix_temp(temp: Entry, detail: str, options: VerifyOptions) -> Finding:
    action = None
    if options.fix:
        # The file judged old, never one that took its name since (a by-name unlink would).
        try:
            outcome = remove_if_same(DEFAULT_FILEIO, None, temp.path, (temp.dev, temp.ino))
        except OSError as exc:
            action = f"left in place (cannot delete: {exc.strerror or exc})"
        else:
            action = {
                "removed": "deleted",
                "gone": "vanished before the fix",
                "replaced": "left in place (the name holds another file since the check)",
            }[outcome]
    return Finding(ORPHAN_TEMP, temp.path, temp.namespace, temp.group, detail, action)


def _fix_foreign(
    entry: Entry, namespaces: dict[str, NamespaceView], root: Path, options: VerifyOptions
) -> Finding:
    kind, detail = _describe_foreign(entry, root)
    action = None
    if options.fix:
        name = Path(entry.path).name
        held_dir = entry.namespace is not None and entry.group is None
        if kind == SYMLINK:
            action = _unlink_link(entry.path)  # inside the root: the link, never its target
        elif entry.namespace is None:
            action = "left in place (outside any namespace)"
        elif held_dir and name == QUARANTINE:
            action = "left in place (fix by hand: quarantine/ must be a directory)"
        else:
            ns = namespaces[entry.namespace]
            quarantined = "foreign-" + os.path.relpath(entry.path, ns.path).replace(os.sep, "-")
            action = _quarantine(ns, quarantined, entry.path, (entry.dev, entry.ino))
    return Finding(kind, entry.path, entry.namespace, entry.group, detail, action)


def _describe_foreign(entry: Entry, root: Path) -> tuple[str, str]:
    """(kind, detail) of a foreign entry: symlink, special-file or foreign."""
    what = kind_noun(entry.mode) if entry.mode else ("directory" if entry.is_dir else "file")
    held_dir = entry.namespace is not None and entry.group is None
    name = Path(entry.path).name
    role = ""
    if held_dir and name in (TRASH, QUARANTINE):
        role = (
            f"{name}/ must be a real directory; nothing is moved into this one"
            + ("; gc deletes evicted blocks directly meanwhile" if name == TRASH else "")
            + ". "
        )
    if stat.S_ISLNK(entry.mode):
        try:
            target = str(Path(entry.path).readlink())
        except OSError:
            target = "?"
        # realpath only lstats and readlinks along the way: nothing is opened.
        resolved = os.path.realpath(Path(entry.path).parent / target)
        where = "inside" if _inside(resolved, root) else "OUTSIDE"
        return SYMLINK, (
            f"{role}symbolic link to {target!r} ({where} the root): never followed, not part of "
            "format v1"
        )
    if entry.mode and not (stat.S_ISREG(entry.mode) or stat.S_ISDIR(entry.mode)):
        return SPECIAL_FILE, f"{role}unexpected {what}: never opened, not part of format v1"
    return FOREIGN, f"{role}unexpected {what} ({format_size(entry.size)}): not part of format v1"


def _inside(path: str, root: Path) -> bool:
    real_root = os.path.realpath(root)
    return path == real_root or path.startswith(real_root + os.sep)


def _unlink_link(path: str) -> str:
    try:
        Path(path).unlink()  # unlink never follows a link: the target is untouched
    except FileNotFoundError:
        return "vanished before the fix"
    except OSError as exc:
        return f"left in place (cannot unlink: {exc.strerror})"
    return "unlinked (the link only)"


def _quarantine(ns: NamespaceView, name: str, path: str, identity: FileId | None) -> str:
    """Move the file judged (``identity``; None: a non-regular entry, moved by name) into
    quarantine; the action taken, in words."""
    try:
        moved = quarantine_file(ns.path, name, path, identity)
    except ReplacedError:
        return "left in place (the name holds another file since the check: re-published)"
    except HeldDirectoryError as exc:
        return f"left in place ({exc})"
    except OSError as exc:
        return f"left in place (cannot move: {exc.strerror or exc})"
    return _quarantined(moved, ns)


def _quarantined(moved: str | None, ns: NamespaceView) -> str:
    if moved is None:
        return "vanished before the fix"
    return f"{QUARANTINED_AS}{os.path.relpath(moved, ns.path.parent)}"


def _left(options: VerifyOptions) -> str | None:
    return "left in place (fix by hand)" if options.fix else None


def _rel(path: str, root: Path) -> str:
    try:
        return os.path.relpath(path, root)
    except ValueError:
        return path

"""The eviction of one gc pass: streaming scans of the store, in memory of fixed size.

:mod:`kvstore.admin.eviction` says which blocks go; this module finds them. After gc's first
scan (usage, oldest last use) decided that something must go, :class:`EvictionRun` makes

1. a **parents** scan: every block's header is read (on threads) and the key of the parent it
   names is added to the :class:`~kvstore.admin.eviction.ParentCounts` filter;
2. rounds of a **last-use** scan (a :class:`~kvstore.admin.eviction.LastUseHistogram` of the
   leaves: ``stat`` only) and an **evict** scan: leaves older than the cut-off go, and each
   victim's parent whose last child that was is exposed (one ``lstat`` by its full hash) and
   goes too when it is as old; a round only when the budget is still exceeded (the previous
   one could not expose enough), the last by last use alone when no leaf was left.

A pass within budget and with nothing older than ``--max-age`` makes none of these scans.
Every scan hands blocks over in batches (:func:`kvstore.admin.scan.scan_store`'s
``on_blocks``): memory is the two filters and the histogram, whatever the store's size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvstore.admin.eviction import (
    DEFAULT_FILTER_COUNTERS,
    Block,
    Cut,
    Evicted,
    EvictFn,
    KeySet,
    LastUseHistogram,
    ParentCounts,
    VictimTally,
    bloom_false_positive_rate,
    parent_key,
)
from kvstore.admin.progress import Progress
from kvstore.admin.scan import Entry, fanout_dirs, scan_store
from kvstore.errors import CorruptBlockError, KvstoreError
from kvstore.store.full_check import read_header
from kvstore.store.view import StoreView

# Rounds of leaf evictions one pass may make before the last-use-only round.
MAX_ROUNDS = 8
HEADER_THREADS = 8
HEADERS_PER_TASK = 64


@dataclass
class Budget:
    """What the pass must reach: usage at most ``max_bytes``, nothing used before ``cutoff_ns``."""

    usage: int  # bytes counted against max_bytes, updated as victims go
    max_bytes: int | None
    cutoff_ns: int | None
    now_ns: int

    @property
    def excess(self) -> int:
        return 0 if self.max_bytes is None else self.usage - self.max_bytes


def _by_group(
    batch: Sequence[Entry],
) -> Iterator[tuple[str, int, list[Entry], np.ndarray, np.ndarray]]:
    """The batch's entries per (namespace, group), with their coordinates as uint64 arrays
    (a batch comes from one fan-out directory: one group, but nothing here relies on it)."""
    parts: dict[tuple[str, int], list[Entry]] = {}
    for entry in batch:
        assert entry.namespace is not None and entry.group is not None
        parts.setdefault((entry.namespace, entry.group), []).append(entry)
    for (namespace, group), entries in parts.items():
        hi = np.fromiter((e.hash_hi for e in entries), np.uint64, len(entries))
        lo = np.fromiter((e.hash_lo for e in entries), np.uint64, len(entries))
        yield namespace, group, entries, hi, lo


def _read_parents(paths: Sequence[str]) -> list[tuple[bytes | None, bytes | None] | None]:
    """:func:`_read_parent` of each path (one task per chunk: a task per header would cost
    more than reading it on a fast file system)."""
    return [_read_parent(path) for path in paths]


def _read_parent(path: str) -> tuple[bytes | None, bytes | None] | None:
    """(block hash, parent hash) from the header of the block file at ``path``; None if it
    vanished, (None, None) if the header cannot be used (a leaf to gc; verify reports it)."""
    try:
        header, _size = read_header(path)
    except FileNotFoundError:
        return None
    except (CorruptBlockError, OSError):
        return None, None
    return header.block_hash, header.parent_hash


def _block(entry: Entry) -> Block:
    assert entry.namespace is not None and entry.group is not None
    return Block(
        entry.path,
        entry.namespace,
        entry.group,
        entry.hash_hi,
        entry.hash_lo,
        entry.allocated,  # gc counts what blocks hold on the disk
        entry.mtime_ns,
        entry.ino,
    )


class EvictionRun:
    """The scans and evictions of one pass (module doc); results in :attr:`victims`."""

    def __init__(  # noqa: PLR0913 - the store, the budget, the eviction callback and keyword-only reporting controls
        self,
        store: StoreView,
        budget: Budget,
        remove: EvictFn,
        *,
        list_victims: bool = False,
        counters: int = DEFAULT_FILTER_COUNTERS,
        progress: bool = False,
    ) -> None:
        self.store = store
        self.budget = budget
        self.remove = remove
        self.victims = VictimTally(listed=[] if list_victims else None)
        self.headers_read = 0
        self.rounds = 0
        self.lru_fallback = False
        self._counters = counters
        self._progress = progress
        self.parents: ParentCounts | None = None
        self._evicted = KeySet(max(64, counters))

    # -- what the pass must do ------------------------------------------------------------

    def wanted(self, oldest_ns: int | None) -> bool:
        """Whether anything must go: over budget, or a block used before the age cut-off."""
        b = self.budget
        old = b.cutoff_ns is not None and oldest_ns is not None and oldest_ns < b.cutoff_ns
        return b.excess > 0 or old

    def run(self, oldest_ns: int | None) -> None:
        if not self.wanted(oldest_ns) or oldest_ns is None:
            return
        self.parents = parents = self._count_parents()
        leaves_only = True
        while True:
            self.rounds += 1
            cut = self._histogram(parents, leaves_only, oldest_ns).cut(self.budget.excess)
            taken = self.victims.blocks + self.victims.gone
            self._evict(parents, cut, leaves_only)
            if self.budget.excess <= 0 or not leaves_only:
                return
            if self.victims.blocks + self.victims.gone == taken or self.rounds >= MAX_ROUNDS:
                # No leaf could go (a cycle of damaged parent links, a saturated filter):
                # one last round by last use alone.
                leaves_only = False
                self.lru_fallback = True

    def report(self) -> dict[str, object]:
        parents = self.parents
        return {
            "rounds": self.rounds,
            "lru_fallback": self.lru_fallback,
            "parents": parents.added if parents else 0,
            "parent_filter_bytes": parents.nbytes if parents else 0,
            "false_positive_rate": (
                bloom_false_positive_rate(parents.added, self._counters) if parents else 0.0
            ),
        }

    # -- the scans -----------------------------------------------------------------------

    def _scan(self, label: str, on_blocks: Callable[[Sequence[Entry]], None]) -> None:
        store = self.store
        with Progress(fanout_dirs(store.namespaces), label, enabled=self._progress) as bar:
            scan_store(store, on_dir=bar.update, on_blocks=on_blocks)

    def _count_parents(self) -> ParentCounts:
        parents = ParentCounts(self._counters)
        with ThreadPoolExecutor(HEADER_THREADS, thread_name_prefix="kvstore-gc") as pool:

            def take(batch: Sequence[Entry]) -> None:
                paths = [e.path for e in batch]
                chunks = [
                    paths[i : i + HEADERS_PER_TASK] for i in range(0, len(paths), HEADERS_PER_TASK)
                ]
                reads = [r for chunk in pool.map(_read_parents, chunks) for r in chunk]
                named: dict[tuple[str, int], tuple[list[int], list[int]]] = {}
                for entry, read in zip(batch, reads, strict=True):
                    if read is None:
                        continue
                    self.headers_read += 1
                    assert entry.namespace is not None and entry.group is not None
                    own = (entry.namespace, entry.group, entry.hash_hi, entry.hash_lo)
                    pk = parent_key(entry.namespace, entry.group, read[1], own)
                    if pk is not None:
                        his, los = named.setdefault((pk[0], pk[1]), ([], []))
                        his.append(pk[2])
                        los.append(pk[3])
                for (namespace, group), (his, los) in named.items():
                    parents.add_many(
                        namespace,
                        group,
                        np.array(his, dtype=np.uint64),
                        np.array(los, dtype=np.uint64),
                    )

            self._scan("parents", take)
        return parents

    def _candidates(
        self, batch: Sequence[Entry], parents: ParentCounts, leaves_only: bool
    ) -> Iterator[Entry]:
        """The entries of ``batch`` this round may evict: not evicted yet this pass and, in a
        leaf round, certainly nobody's parent."""
        for namespace, group, entries, hi, lo in _by_group(batch):
            keep = ~self._evicted.contains_many(namespace, group, hi, lo)
            if leaves_only:
                keep &= ~parents.may_be_parent_many(namespace, group, hi, lo)
            for entry, wanted in zip(entries, keep.tolist(), strict=True):
                if wanted:
                    yield entry

    def _histogram(
        self, parents: ParentCounts, leaves_only: bool, oldest_ns: int
    ) -> LastUseHistogram:
        histogram = LastUseHistogram(oldest_ns, self.budget.now_ns)
        if self.budget.excess <= 0:
            return histogram  # age only: the cut-off is known, no need to count

        def take(batch: Sequence[Entry]) -> None:
            for entry in self._candidates(batch, parents, leaves_only):
                histogram.add(entry.mtime_ns, entry.allocated)

        self._scan("last use", take)
        return histogram

    def _evict(self, parents: ParentCounts, cut: Cut | None, leaves_only: bool) -> None:
        below = [cut.below_bytes if cut else 0]

        def goes(mtime_ns: int) -> bool:
            b = self.budget
            if b.cutoff_ns is not None and mtime_ns < b.cutoff_ns:
                return True
            if cut is None or b.excess <= 0:
                return False
            if mtime_ns < cut.before_ns:
                return True
            # The boundary interval: only while the older blocks still to come cannot cover
            # the excess (so that none of them outlives a newer victim by more than it).
            return mtime_ns < cut.boundary_end_ns and b.excess > below[0]

        def take(batch: Sequence[Entry]) -> None:
            for entry in self._candidates(batch, parents, leaves_only):
                if not goes(entry.mtime_ns):
                    continue
                victim = _block(entry)
                if victim.key in self._evicted:
                    continue  # taken through its child earlier in this batch (last-use round)
                if cut is not None and entry.mtime_ns < cut.before_ns:
                    below[0] = max(0, below[0] - entry.allocated)
                self._take(victim, parents, goes)

        self._scan("evicting", take)

    def _take(self, block: Block, parents: ParentCounts, goes: Callable[[int], bool]) -> None:
        """Evict ``block``, then each ancestor it was the last child of, while they are old."""
        current: Block | None = block
        while current is not None:
            read = _read_parent(current.path)
            if read is not None:
                self.headers_read += 1
                current.block_hash, current.parent_hash = read
            outcome = self.remove(current)
            if isinstance(outcome, int):  # used since the scan: stays
                self.victims.refreshed += 1
                return
            self._evicted.add(current.key)
            self.budget.usage -= current.size
            if outcome is Evicted.GONE:
                self.victims.gone += 1
            else:
                self.victims.record(current)
            current = self._exposed(current, parents, goes)

    def _exposed(
        self, child: Block, parents: ParentCounts, goes: Callable[[int], bool]
    ) -> Block | None:
        """``child``'s parent if ``child`` was its last child and it is old enough to go."""
        pk = parent_key(child.namespace, child.group, child.parent_hash, child.key)
        if pk is None or child.parent_hash is None:
            return None
        parents.remove(pk)
        if parents.may_be_parent(pk) or pk in self._evicted:
            return None
        try:
            group = self.store.namespace(child.namespace).groups[child.group]
        except (KvstoreError, IndexError):
            return None
        found = group.paths.block_file(child.parent_hash, root=self.store.root)
        if found is None or not goes(found.mtime_ns):
            return None
        return Block(
            str(found.path),
            child.namespace,
            child.group,
            found.hash_hi,
            found.hash_lo,
            found.allocated,
            found.mtime_ns,
            -1,  # not seen by the scan: the eviction checks the mtime only
        )

"""gc's eviction policy: which published blocks go, in which order.

**Last use.** Published block files are immutable, so their mtime is free to mean "last use":
a writer creates the file (mtime = creation) and a reader sets it to now after a read when it
is older than ``access_granularity_s`` (``StoreConfig``, default 60 s: at most one ``utime``
per block per minute, whatever the read rate). atime is not used: relatime/noatime mounts do
not keep it. gc orders by mtime.

**Eviction order.** Blocks of a group form prefix trees (each header names its parent's hash).
A block is a *leaf* if no present block of the same namespace and group names it as parent.
gc evicts leaves only, least recently used first (one heap over the whole store, all
namespaces and groups); evicting a leaf may make its parent a leaf, which then joins the heap
with its own mtime. Lookups (``longest_prefix``) therefore keep finding prefix-closed chains.
(A parent graph with a cycle - only possible with damaged headers - has no leaf; when nothing
else is left to evict its blocks go in LRU order.)

:class:`BlockIndex` is what gc knows about every block file (path, size, last use, inode, hash
and parent hash from the header, read once per file); :func:`evict` picks the victims.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.admin.scan import Entry
from kvstore.admin.sizes import iso_time
from kvstore.errors import CorruptBlockError
from kvstore.keys import hash_coords
from kvstore.store.full_check import read_header

BlockKey = tuple[str, int, int, int]  # (namespace, group, hash_hi, hash_lo)


@dataclass
class Block:
    """What gc knows about one published block file (its index entry)."""

    path: str
    namespace: str
    group: int
    hash_hi: int
    hash_lo: int
    size: int
    mtime_ns: int  # last use
    ino: int
    block_hash: bytes | None  # from the header; None if the header is unreadable
    parent_hash: bytes | None

    @property
    def key(self) -> BlockKey:
        return (self.namespace, self.group, self.hash_hi, self.hash_lo)

    def parent_key(self) -> BlockKey | None:
        if self.parent_hash is None:
            return None
        hi, lo = hash_coords(self.parent_hash)
        return (self.namespace, self.group, hi, lo)

    def to_json(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "group": self.group,
            "hash": self.block_hash.hex() if self.block_hash else None,
            "hash_hi": self.hash_hi,
            "hash_lo": self.hash_lo,
            "bytes": self.size,
            "last_access_ns": self.mtime_ns,
            "last_access": iso_time(self.mtime_ns),
        }


class BlockIndex:
    """path → :class:`Block`, refreshed from each scan; headers are read once per file."""

    def __init__(self) -> None:
        self._by_path: dict[str, Block] = {}
        self.headers_read = 0  # cumulative, for reports and tests

    def refresh(
        self, entries: Sequence[Entry], on_entry: Callable[[], None] | None = None
    ) -> list[Block]:
        """The blocks of this scan; a header is read only for a path (or inode) not seen."""
        fresh: dict[str, Block] = {}
        for e in entries:
            if on_entry is not None:
                on_entry()
            assert e.namespace is not None and e.group is not None
            known = self._by_path.get(e.path)
            if known is not None and known.ino == e.ino:
                known.size, known.mtime_ns = e.size, e.mtime_ns
                fresh[e.path] = known
                continue
            block_hash: bytes | None = None
            parent: bytes | None = None
            try:
                header, _size = read_header(e.path)
                block_hash, parent = header.block_hash, header.parent_hash
            except FileNotFoundError:
                continue  # evicted or quarantined since the scan
            except (CorruptBlockError, OSError):
                pass  # unreadable header: still evictable (as a leaf); verify reports it
            self.headers_read += 1
            fresh[e.path] = Block(
                e.path,
                e.namespace,
                e.group,
                e.hash_hi,
                e.hash_lo,
                e.size,
                e.mtime_ns,
                e.ino,
                block_hash,
                parent,
            )
        self._by_path = fresh
        return list(fresh.values())


class Evicted(enum.Enum):
    REMOVED = "removed"  # this gc renamed it into the trash
    GONE = "gone"  # someone else removed it first


# An eviction callback returns Evicted, or the block's newer mtime if it was used since the scan.
EvictFn = Callable[[Block], "Evicted | int"]


@dataclass
class Selection:
    """Outcome of :func:`evict`."""

    evicted: list[Block] = field(default_factory=list)
    gone: list[Block] = field(default_factory=list)
    refreshed: int = 0  # victims kept because a reader used them since the scan
    usage: int = 0  # after


def evict(
    blocks: Sequence[Block],
    *,
    usage: int,
    max_bytes: int | None,
    cutoff_ns: int | None,
    remove: EvictFn,
) -> Selection:
    """Evict LRU leaves (per group) until ``usage <= max_bytes`` and no leaf is older than
    ``cutoff_ns``; ``remove`` does (or, in a dry run, pretends) each eviction."""
    present: dict[BlockKey, Block] = {b.key: b for b in blocks}
    children: dict[BlockKey, int] = dict.fromkeys(present, 0)
    parent_of: dict[BlockKey, BlockKey] = {}
    for b in blocks:
        pk = b.parent_key()
        if pk is None or pk == b.key:
            continue
        parent = present.get(pk)
        if parent is not None and parent.block_hash == b.parent_hash:
            children[pk] += 1
            parent_of[b.key] = pk
    heap: list[tuple[int, str, BlockKey]] = [
        (b.mtime_ns, b.path, b.key) for b in blocks if children[b.key] == 0
    ]
    heapq.heapify(heap)
    out = Selection(usage=usage)
    done: set[BlockKey] = set()

    def wanted(mtime_ns: int) -> bool:
        over = max_bytes is not None and out.usage > max_bytes
        old = cutoff_ns is not None and mtime_ns < cutoff_ns
        return over or old

    while True:
        if not heap:
            # Only a cycle of damaged parent links can leave blocks without a leaf.
            rest = [b for k, b in present.items() if k not in done]
            if not rest or not (max_bytes is not None and out.usage > max_bytes):
                break
            heap = [(b.mtime_ns, b.path, b.key) for b in rest]
            heapq.heapify(heap)
            parent_of.clear()
        mtime, _path, key = heap[0]
        if not wanted(mtime):
            break
        heapq.heappop(heap)
        block = present[key]
        outcome = remove(block)
        if isinstance(outcome, int):  # used since the scan: back into the heap, newer
            block.mtime_ns = outcome
            out.refreshed += 1
            heapq.heappush(heap, (block.mtime_ns, block.path, key))
            continue
        done.add(key)
        out.usage -= block.size
        (out.evicted if outcome is Evicted.REMOVED else out.gone).append(block)
        pk = parent_of.get(key)
        if pk is not None and pk not in done:
            children[pk] -= 1
            if children[pk] == 0:
                parent = present[pk]
                heapq.heappush(heap, (parent.mtime_ns, parent.path, pk))
    return out

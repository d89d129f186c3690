"""gc's eviction policy: which published blocks go, in which order, in bounded memory.

**Last use.** Published block files are immutable, so their mtime is free to mean "last use":
a writer creates the file (mtime = creation) and a reader sets it to now after a read when it
is older than ``access_granularity_s`` (``StoreConfig``, default 60 s: at most one ``utime``
per block per minute, whatever the read rate). atime is not used: relatime/noatime mounts do
not keep it. gc orders by mtime.

**Leaves first.** Blocks of a group form prefix trees (each header names its parent's hash).
A block is a *leaf* if no present block of the same namespace and group names it as parent.
gc evicts leaves only; evicting a leaf may make its parent a leaf, which then goes too if it
is old enough. Lookups (``longest_prefix``) therefore keep finding prefix-closed chains: a
shared prefix that an engine keeps in its own GPU cache (and so never reads from the store)
stays as long as any block below it is in use.

**Bounded memory.** Nothing here holds an entry per block. Two structures of fixed size do:

* :class:`ParentCounts`, a counting Bloom filter over the (namespace, group, hash) of every
  block that some block names as its parent. A key whose counters are all zero is certainly
  not a parent (a leaf); a non-zero one is a parent, or a false positive (a leaf kept one more
  pass: an error on the safe side). Evicting a block decrements its parent's key, which
  exposes the parent once its last child has gone.
* :class:`LastUseHistogram`, bytes and blocks per interval of last use (:data:`BUCKETS`
  intervals between the oldest block and now): the cut-off below which evicting the leaves
  frees what the budget asks for. Victims are chosen to that interval's resolution (the
  store's age span / BUCKETS): the blocks of the oldest intervals all go, those of the
  boundary interval in scan order until the budget is met.

If a round of leaf evictions cannot meet the budget (parents of parents need exposing, or
false positives protect the rest), gc runs another; when a round finds no leaf to evict (a
damaged cycle of parent links, or a filter saturated by a store far bigger than it was sized
for) the last round evicts by last use alone. :func:`bloom_false_positive_rate` says what a
given size means at a given store size (docs/admin.md has the figures).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.admin.sizes import iso_time
from kvstore.keys import hash_coords

BlockKey = tuple[str, int, int, int]  # (namespace, group, hash_hi, hash_lo)

# Counters of the parent filter (one byte each) and how many each key sets: 64 Mi counters
# (64 MiB) keep false positives below 0.1 % up to ~10^7 parents, ~5 % at 3 * 10^7 and ~40 % at
# 10^8 (see bloom_false_positive_rate); a false positive only keeps a leaf one pass longer.
DEFAULT_FILTER_COUNTERS = 1 << 26
FILTER_HASHES = 3
_SATURATED = 255  # a counter that reached this is never decremented again (safe: it protects)
# Intervals of last use the victims are chosen to.
BUCKETS = 1 << 16

_MASK64 = (1 << 64) - 1
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _mix(x: int) -> int:
    """splitmix64's finaliser: spreads any 64-bit input over all 64 bits."""
    x = (x ^ (x >> 30)) * _M1 & _MASK64
    x = (x ^ (x >> 27)) * _M2 & _MASK64
    return x ^ (x >> 31)


def _mix_many(x: np.ndarray) -> np.ndarray:
    """:func:`_mix` of every element of a uint64 array (numpy wraps like ``& _MASK64``)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(_M1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(_M2)
    mixed: np.ndarray = x ^ (x >> np.uint64(31))
    return mixed


class KeyHasher:
    """Slots of block keys in a table of ``size``: ``hashes`` per key, one key at a time or
    a batch of one group's keys at once (numpy), the same slots either way."""

    def __init__(self, size: int, hashes: int, seed: int) -> None:
        self.size = size
        self.hashes = hashes
        self._seed = seed
        self._salts: dict[tuple[str, int], int] = {}

    def salt(self, namespace: str, group: int) -> int:
        salt = self._salts.get((namespace, group))
        if salt is None:
            salt = self._salts[(namespace, group)] = _mix(
                (hash((namespace, group)) ^ self._seed) & _MASK64
            )
        return salt

    def slots(self, key: BlockKey) -> list[int]:
        ns, group, hi, lo = key
        h1 = _mix(self.salt(ns, group) ^ (hi << 56) ^ lo)
        h2 = _mix(h1) | 1
        return [((h1 + i * h2) & _MASK64) % self.size for i in range(self.hashes)]

    def slots_many(self, namespace: str, group: int, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
        """Shape (hashes, len(hi)): the slots of keys (namespace, group, hi[j], lo[j])."""
        x = np.uint64(self.salt(namespace, group)) ^ (hi << np.uint64(56)) ^ lo
        h1 = _mix_many(x)
        h2 = _mix_many(h1) | np.uint64(1)
        size = np.uint64(self.size)
        slots: np.ndarray = np.stack([(h1 + np.uint64(i) * h2) % size for i in range(self.hashes)])
        return slots


def bloom_false_positive_rate(parents: int, counters: int = DEFAULT_FILTER_COUNTERS) -> float:
    """The chance that a leaf looks like a parent with ``parents`` keys in ``counters``."""
    return (1.0 - math.exp(-FILTER_HASHES * parents / counters)) ** FILTER_HASHES


class ParentCounts:
    """A counting Bloom filter of block keys named as parent (module doc)."""

    def __init__(self, counters: int = DEFAULT_FILTER_COUNTERS) -> None:
        if counters < 64:
            raise ValueError(f"parent filter: expected at least 64 counters, got {counters}")
        self._counts = np.zeros(counters, dtype=np.uint8)
        self._hasher = KeyHasher(counters, FILTER_HASHES, seed=0)
        self.added = 0

    def add(self, key: BlockKey) -> None:
        counts = self._counts
        for slot in self._hasher.slots(key):
            if counts[slot] < _SATURATED:
                counts[slot] += 1
        self.added += 1

    def add_many(self, namespace: str, group: int, hi: np.ndarray, lo: np.ndarray) -> None:
        """:meth:`add` of every key (namespace, group, hi[j], lo[j]) at once."""
        if not len(hi):
            return
        slots, repeats = np.unique(
            self._hasher.slots_many(namespace, group, hi, lo), return_counts=True
        )
        counts = self._counts
        counts[slots] = np.minimum(counts[slots].astype(np.int64) + repeats, _SATURATED)
        self.added += len(hi)

    def remove(self, key: BlockKey) -> None:
        """One child of ``key`` went (only keys that were added; a saturated counter stays)."""
        counts = self._counts
        for slot in self._hasher.slots(key):
            if 0 < counts[slot] < _SATURATED:
                counts[slot] -= 1

    def may_be_parent(self, key: BlockKey) -> bool:
        counts = self._counts
        return all(counts[slot] for slot in self._hasher.slots(key))

    def may_be_parent_many(
        self, namespace: str, group: int, hi: np.ndarray, lo: np.ndarray
    ) -> np.ndarray:
        """:meth:`may_be_parent` of every key at once (a bool array)."""
        found: np.ndarray = self._counts[self._hasher.slots_many(namespace, group, hi, lo)]
        return np.asarray(found.all(axis=0))

    @property
    def nbytes(self) -> int:
        return int(self._counts.nbytes)


class KeySet:
    """A Bloom filter (bits, 2 hashes) of block keys: a false positive says "in" wrongly."""

    def __init__(self, bits: int) -> None:
        self._bits = np.zeros((bits + 7) // 8, dtype=np.uint8)
        self._hasher = KeyHasher(bits, 2, seed=0x5EED)

    def add(self, key: BlockKey) -> None:
        for s in self._hasher.slots(key):
            self._bits[s >> 3] |= np.uint8(1 << (s & 7))

    def __contains__(self, key: BlockKey) -> bool:
        bits = self._bits
        return all(bits[s >> 3] & (1 << (s & 7)) for s in self._hasher.slots(key))

    def contains_many(
        self, namespace: str, group: int, hi: np.ndarray, lo: np.ndarray
    ) -> np.ndarray:
        slots = self._hasher.slots_many(namespace, group, hi, lo)
        byte = self._bits[slots >> np.uint64(3)]
        found = (byte >> (slots & np.uint64(7)).astype(np.uint8)) & np.uint8(1)
        return np.asarray(found.all(axis=0))


def parent_key(
    namespace: str, group: int, parent_hash: bytes | None, own: BlockKey
) -> BlockKey | None:
    """The key of the block ``parent_hash`` names (None: a chain start, or itself)."""
    if parent_hash is None:
        return None
    hi, lo = hash_coords(parent_hash)
    key = (namespace, group, hi, lo)
    return None if key == own else key


@dataclass(frozen=True)
class Cut:
    """Which last uses go: all before ``before_ns``; those in ``[before_ns, boundary_end_ns)``
    while ``below_bytes`` (bytes older than ``before_ns`` not yet evicted) would not cover the
    excess on their own."""

    before_ns: int
    boundary_end_ns: int
    below_bytes: int


class LastUseHistogram:
    """Bytes and blocks per interval of last use over ``[oldest_ns, now_ns]`` (module doc)."""

    def __init__(self, oldest_ns: int, now_ns: int, buckets: int = BUCKETS) -> None:
        self.oldest_ns = min(oldest_ns, now_ns)
        self.now_ns = now_ns
        self._span = max(1, now_ns - self.oldest_ns + 1)
        self._buckets = buckets
        self._bytes = np.zeros(buckets, dtype=np.int64)
        self._blocks = np.zeros(buckets, dtype=np.int64)

    def bucket(self, mtime_ns: int) -> int:
        when = min(max(mtime_ns, self.oldest_ns), self.now_ns)  # a future mtime counts as now
        return (when - self.oldest_ns) * self._buckets // self._span

    def start_ns(self, bucket: int) -> int:
        """The first last use of ``bucket`` (exact inverse of :meth:`bucket`)."""
        return self.oldest_ns + -(-bucket * self._span // self._buckets)

    def add(self, mtime_ns: int, size: int) -> None:
        b = self.bucket(mtime_ns)
        self._bytes[b] += size
        self._blocks[b] += 1

    @property
    def total_bytes(self) -> int:
        return int(self._bytes.sum())

    def cut(self, excess: int) -> Cut | None:
        """The cut-off that frees ``excess`` bytes oldest first; None if nothing is needed.
        When all of it cannot cover ``excess`` the cut takes everything."""
        if excess <= 0:
            return None
        cumulative = np.cumsum(self._bytes)
        b = int(np.searchsorted(cumulative, excess, side="left"))
        if b >= self._buckets:
            end = self.now_ns + 1
            return Cut(end, end, int(cumulative[-1]))
        below = int(cumulative[b] - self._bytes[b])
        return Cut(self.start_ns(b), self.start_ns(b + 1), below)


class Evicted(enum.Enum):
    REMOVED = "removed"  # this gc renamed it into the trash
    GONE = "gone"  # someone else removed it first


@dataclass
class Block:
    """One published block file as gc handles it (a victim candidate)."""

    path: str
    namespace: str
    group: int
    hash_hi: int
    hash_lo: int
    size: int  # bytes it holds on the disk (allocated), what gc's budget counts
    mtime_ns: int  # last use
    ino: int
    block_hash: bytes | None = None  # from the header; None if unread or unreadable
    parent_hash: bytes | None = None

    @property
    def key(self) -> BlockKey:
        return (self.namespace, self.group, self.hash_hi, self.hash_lo)

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


# An eviction callback returns Evicted, or the block's newer mtime if it was used since the scan.
EvictFn = Callable[[Block], "Evicted | int"]


@dataclass
class VictimTally:
    """What a pass evicted, in constant memory (the victims themselves only when listed)."""

    blocks: int = 0
    bytes: int = 0
    gone: int = 0
    refreshed: int = 0  # candidates kept because a reader used them since the scan
    oldest_ns: int | None = None
    newest_ns: int | None = None
    by_namespace: dict[str, dict[str, int]] | None = None
    listed: list[Block] | None = None

    def record(self, block: Block) -> None:
        self.blocks += 1
        self.bytes += block.size
        t = block.mtime_ns
        self.oldest_ns = t if self.oldest_ns is None else min(self.oldest_ns, t)
        self.newest_ns = t if self.newest_ns is None else max(self.newest_ns, t)
        if self.by_namespace is None:
            self.by_namespace = {}
        row = self.by_namespace.setdefault(block.namespace, {"blocks": 0, "bytes": 0})
        row["blocks"] += 1
        row["bytes"] += block.size
        if self.listed is not None:
            self.listed.append(block)

"""Lookups: existence probes of published blocks, and the longest-prefix search over a chain.

:class:`Lookup` answers :meth:`GroupStore.contains <kvstore.store.group_store.GroupStore.contains>`
and :meth:`~kvstore.store.group_store.GroupStore.longest_prefix` with existence probes of shard
paths; a probe that fails with an I/O error is a miss (counted, one log line per call).

Longest-prefix search over a hash chain:

Block hashes chain (each block's hash covers its parent's), and eviction removes leaves of
prefix chains first, so the blocks of a chain that are present are normally a prefix of it.
A binary search over existence probes finds its length in O(log n) probes. Because crashes,
quarantines or manual deletes can leave holes, the answer is verified: positions at
exponentially growing distances below it (and position 0) are probed as well, and a hole there
restarts the search below the hole. The result therefore never counts a block that a probe saw
missing; a hole no probe visited is caught when the block is read (a miss, then recompute).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from kvstore.keys import check_hash
from kvstore.store.array import GroupArray

log = logging.getLogger("kvstore")

SLOW_PROBE_S = 50e-6  # an existence probe slower than this is a network round trip
SAMPLE_PROBES = 2  # probes timed before choosing the threads (all slow) or this thread


def longest_present_prefix(n: int, present: Callable[[int], bool]) -> int:
    """Length of the leading run of positions ``0..n-1`` for which ``present`` holds.

    ``present`` is called O(log n) times; each position is probed at most once.
    """
    seen: dict[int, bool] = {}

    def probe(i: int) -> bool:
        if i not in seen:
            seen[i] = present(i)
        return seen[i]

    bound = n
    while True:
        lo, hi = 0, bound  # first missing position lies in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            if probe(mid):
                lo = mid + 1
            else:
                hi = mid
        hole = _first_sampled_hole(lo, probe)
        if hole is None:
            return lo
        bound = hole


def _first_sampled_hole(length: int, probe: Callable[[int], bool]) -> int | None:
    """A missing position among length-2, length-3, length-5, ..., 0, if a probe finds one."""
    if length == 0:
        return None
    positions = []
    step = 2
    while length - step > 0:
        positions.append(length - step)
        step = step * 2 - 1 if step > 2 else 3
    positions.append(0)
    for i in sorted(set(positions), reverse=True):
        if not probe(i):
            return i
    return None


class Lookup:
    """Existence probes of one group array's published block files."""

    def __init__(self, array: GroupArray) -> None:
        self.array = array

    def contains(self, hashes: Sequence[bytes]) -> list[bool]:
        """For each hash, whether a published block exists (no content check).

        A probe that fails with an I/O error (EIO, EACCES, ...) answers "absent": a lookup is a
        cache question, and a miss only costs recompute. One log line per call.

        When each of the first probes is slow (a shared file system: each one a network round
        trip, a FUSE or NFS LOOKUP) the rest run on the I/O threads, overlapping up to
        ``io_threads`` round trips (measured on GlusterFS: docs/shared-filesystems.md); on a
        local disk (a few microseconds each) they stay on this thread, in one loop without
        per-probe locking (vLLM's secondary tier probes 256 keys per step this way).
        """
        probe = _Probe(self.array)
        checked = [check_hash(h) for h in hashes]
        # Each of the first probes is timed alone: one slow probe is a preemption or a wait
        # for the GIL on a busy machine, not a network file system; both slow is one.
        found: list[bool] = []
        slow = True
        for h in checked[:SAMPLE_PROBES]:
            started = time.perf_counter()
            found += probe.serial([h])
            slow = slow and time.perf_counter() - started > SLOW_PROBE_S
        rest = checked[SAMPLE_PROBES:]
        threaded: list[bool | BaseException] = []
        if slow and len(rest) > 1:
            threaded = list(self.array.engine.map(probe, rest))
        else:
            found += probe.serial(rest)  # one tight loop: a local probe costs microseconds
        probe.done(lookups=0)
        for result in threaded:
            if isinstance(result, BaseException):  # not an I/O error (those are misses): a bug
                raise result
            found.append(result)
        return found

    def longest_prefix(self, chain: Sequence[bytes]) -> int:
        """Number of leading blocks of ``chain`` (hashes of consecutive blocks) present.

        Binary search over existence probes, relying on chains being prefix-closed (eviction
        removes leaves first), then verified: positions spaced exponentially below the answer
        are probed too, and a hole found there shortens the answer. O(log n) probes. A probe
        that fails with an I/O error answers "absent", as in :meth:`contains`.
        """
        probe = _Probe(self.array)
        result = longest_present_prefix(len(chain), lambda i: probe(check_hash(chain[i])))
        probe.done(lookups=1)
        return result


class _Probe:
    """Existence probes of one lookup call: I/O errors are misses, counted and logged once."""

    def __init__(self, array: GroupArray) -> None:
        self._array = array
        self._exists = array.fio.exists
        self.probes = 0
        self.errors = 0
        self._first: OSError | None = None
        self._lock = threading.Lock()  # contains() probes from the I/O threads

    def __call__(self, block_hash: bytes) -> bool:
        try:
            found = self._exists(self._array.block_path(block_hash))
        except OSError as exc:
            with self._lock:
                self.errors += 1
                self._first = self._first or exc
            found = False
        with self._lock:
            self.probes += 1
        return found

    def serial(self, hashes: Sequence[bytes]) -> list[bool]:
        """Probes of (checked) ``hashes`` on this thread, while no other thread probes: one
        :meth:`FileIO.exists_many <kvstore.io.fileio.FileIO.exists_many>` call (for the
        NativeFileIO, native and without the GIL: vLLM's scheduler thread runs meanwhile)."""
        found = [False] * len(hashes)
        paths: list[str] = []
        where: list[int] = []  # the position in hashes of each of paths
        for i, path in enumerate(self._array.block_paths(hashes)):
            if isinstance(path, OSError):  # a fan-out directory that is a link, say
                self._failed(path)
                continue
            paths.append(path)
            where.append(i)
        for i, outcome in zip(where, self._array.fio.exists_many(paths), strict=True):
            if isinstance(outcome, OSError):
                self._failed(outcome)
            else:
                found[i] = outcome
        self.probes += len(hashes)
        return found

    def _failed(self, exc: OSError) -> None:
        self.errors += 1
        self._first = self._first or exc

    def done(self, lookups: int) -> None:
        array = self._array
        array.stats.add(lookups=lookups, probes=self.probes, read_errors=self.errors)
        if self._first is not None:
            log.warning(
                "kvstore: %d of %d existence probes in %s failed (first: %s); answered as misses",
                self.errors,
                self.probes,
                array.label,
                self._first,
            )

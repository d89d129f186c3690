"""Longest-prefix search over a hash chain.

Block hashes chain (each block's hash covers its parent's), and eviction removes leaves of
prefix chains first, so the blocks of a chain that are present are normally a prefix of it.
A binary search over existence probes finds its length in O(log n) probes. Because crashes,
quarantines or manual deletes can leave holes, the answer is verified: positions at
exponentially growing distances below it (and position 0) are probed as well, and a hole there
restarts the search below the hole. The result therefore never counts a block that a probe saw
missing; a hole no probe visited is caught when the block is read (a miss, then recompute).
"""

from __future__ import annotations

from collections.abc import Callable


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

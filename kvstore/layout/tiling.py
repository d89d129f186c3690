"""Tiling checks: that the mappings of every rank of one layout move every byte exactly once.

:func:`check_tiling` checks given mappings (local pages, shares, and the writers of each
election residue over the canonical block);
:func:`~kvstore.layout.parallel.verify_tiling` derives every rank's mapping and checks it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvstore.errors import LayoutError
from kvstore.layout.records import RankMapping

__all__ = ["check_tiling"]


def check_tiling(mappings: Sequence[RankMapping]) -> None:
    """Check that ``mappings`` (one per rank of one layout) move every byte exactly once.

    * each rank's runs cover its local pages exactly once (per layer page, or the group's span
      of the packed row), and its segments cover its share exactly once with the same
      canonical bytes as its runs;
    * for every residue of the writer election, the elected ranks' runs tile the canonical
      block exactly once.
    """
    if not mappings:
        raise LayoutError("tiling: expected the mappings of every rank, got none")
    first = mappings[0]
    what = f"{first.geometry.kind} group under {first.layout}"
    for mapping in mappings:
        if (mapping.geometry, mapping.layout, mapping.form) != (
            first.geometry,
            first.layout,
            first.form,
        ):
            raise LayoutError(f"tiling: mappings of {what} mix geometries, layouts or forms")
    ranks = sorted(first.layout.global_rank(m.rank) for m in mappings)
    if ranks != list(range(first.layout.world_size)):
        raise LayoutError(
            f"tiling: expected one mapping per rank 0..{first.layout.world_size - 1} of {what}, "
            f"got ranks {ranks}"
        )
    for mapping in mappings:
        _check_local_cover(mapping, what)
        _check_share_cover(mapping, what)
    canonical_size = first.geometry.canonical_block_bytes
    for residue in range(math.lcm(*(m.num_writers for m in mappings))):
        intervals = [
            (canonical, canonical + size)
            for m in mappings
            if m.is_writer(residue)
            for run in m.runs
            for _, canonical, size in run.fragments()
        ]
        problem = _partition_problem(intervals, 0, canonical_size)
        if problem:
            raise LayoutError(
                f"tiling: writers of election residue {residue} of {what} {problem} of the "
                f"canonical block ({canonical_size} bytes)"
            )


def _check_local_cover(mapping: RankMapping, what: str) -> None:
    by_region: dict[int, list[tuple[int, int]]] = {}
    for run in mapping.runs:
        for local, _, size in run.fragments():
            by_region.setdefault(run.local_region, []).append((local, local + size))
    n_local = len(mapping.local_layers)
    if mapping.form.packing == "packed":
        start = mapping.form.group_offset
        expected = {0: (start, start + n_local * mapping.page_bytes)} if n_local else {}
    else:
        expected = dict.fromkeys(range(n_local), (0, mapping.page_bytes))
    if set(by_region) != set(expected):
        raise LayoutError(
            f"tiling: rank {mapping.rank} of {what} has runs for local regions "
            f"{sorted(by_region)}, expected {sorted(expected)}"
        )
    for region, (start, end) in expected.items():
        problem = _partition_problem(by_region[region], start, end)
        if problem:
            raise LayoutError(
                f"tiling: runs of rank {mapping.rank} of {what} {problem} of local region {region}"
            )


def _check_share_cover(mapping: RankMapping, what: str) -> None:
    chunk_bytes = mapping.geometry.inner_chunk_bytes
    share = [(s.share_offset, s.share_offset + s.size) for s in mapping.segments]
    problem = _partition_problem(share, 0, mapping.share_bytes)
    run_bytes = sorted(
        (canonical, canonical + size)
        for run in mapping.runs
        for _, canonical, size in run.fragments()
    )
    segment_bytes = sorted(
        (s.canonical_offset, s.canonical_offset + s.size) for s in mapping.segments
    )
    inconsistent = any(
        s.canonical_offset != s.chunk * chunk_bytes + s.chunk_offset
        or not 0 <= s.chunk_offset < s.chunk_offset + s.size <= chunk_bytes
        for s in mapping.segments
    )
    if problem or inconsistent or _merged(run_bytes) != _merged(segment_bytes):
        raise LayoutError(
            f"tiling: segments of rank {mapping.rank} of {what} do not place its share "
            f"({problem or 'canonical bytes differ from its runs'})"
        )


def _merged(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in intervals:
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def _partition_problem(intervals: list[tuple[int, int]], start: int, end: int) -> str | None:
    """None when ``intervals`` tile ``[start, end)`` exactly once, else what is wrong."""
    position = start
    for a, b in sorted(intervals):
        if a < position:
            return f"cover bytes [{a}, {min(b, position)}) twice"
        if a > position:
            return f"leave bytes [{position}, {a}) uncovered"
        position = b
    if position > end:
        return f"reach past the end, to byte {position} of [{start}, {end})"
    if position < end:
        return f"leave bytes [{position}, {end}) uncovered"
    return None

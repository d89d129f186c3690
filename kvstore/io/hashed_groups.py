"""The groups of a hashed transfer, as the Python reference cuts and checksums them.

A hashed write or read (:meth:`FileIO.write_new_hashed <kvstore.io.fileio.FileIO.write_new_hashed>`,
:meth:`FileIO.read_regular_hashed <kvstore.io.fileio.FileIO.read_regular_hashed>`) moves a
block's data group by group and checksums each group while it is in the CPU cache. These
functions cut the groups exactly as kvstore/_native/fileproto_hashed.c's ``kv_fp_hashed_transfer``
does, so that both raise the same errors and stop at the same short read.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence

from kvstore.checksum import chunk_sums
from kvstore.io.callcheck import check_sums_apart, check_uint64_sums
from kvstore.io.types import Hashing

# Most pieces of segments in one group of a hashed transfer: the bound
# kvstore/_native/fileproto_hashed.c's GROUP_PARTS keeps, so both cut a run the same way (the
# same short-read words).
_GROUP_PARTS = 64


def hashed_groups(
    segments: Sequence[tuple[int, memoryview]], h: Hashing
) -> list[tuple[int, list[memoryview]]]:
    """The groups of a hashed transfer, as kvstore/_native/fileproto_hashed.c's
    ``kv_fp_hashed_transfer`` cuts them: ``(file offset, pieces)``, each a file-contiguous run
    of whole chunks of at most ``h.group_nbytes`` (rounded down to whole chunks, at least one)
    in at most :data:`_GROUP_PARTS` pieces,
    of segments ``[h.first, h.last)``. Raises the extension's ValueError, with its words, for
    bad geometry."""
    n = len(segments)
    if not 0 <= h.first <= h.last <= n:
        raise ValueError(
            f"file protocol: expected hashed segments 0 <= first <= last <= {n}, got "
            f"[{h.first}, {h.last})"
        )
    size = h.chunk_nbytes
    if size <= 0 or h.group_nbytes <= 0:
        raise ValueError(
            "file protocol: expected chunk_nbytes > 0 and group_nbytes > 0, got "
            f"{size} and {h.group_nbytes}"
        )
    views = [data for _, data in segments[h.first : h.last]]
    for i, view in enumerate(views, h.first):
        if len(view) % size:
            raise ValueError(
                f"file protocol: expected hashed segment {i} to hold whole chunks of {size} "
                f"bytes, got {len(view)} bytes"
            )
    check_uint64_sums(h.sums, sum(len(v) for v in views) // size)
    check_sums_apart(h.sums, views, h.first)
    # Whole chunks, at least one: a chunk larger than the group is a group of its own.
    group = size if h.group_nbytes < size else h.group_nbytes - h.group_nbytes % size
    offsets = [offset for offset, _ in segments[h.first : h.last]]
    groups: list[tuple[int, list[memoryview]]] = []
    i, consumed = 0, 0  # the segment being cut, and its bytes already in a group
    while i < len(views):
        if len(views[i]) == consumed:
            i, consumed = i + 1, 0
            continue
        start, want = offsets[i] + consumed, 0
        parts: list[memoryview] = []
        while i < len(views) and len(parts) < _GROUP_PARTS:
            left = len(views[i]) - consumed
            if left == 0:  # this segment is done: does the next one continue the group?
                if i + 1 < len(views) and offsets[i + 1] == start + want:
                    i, consumed = i + 1, 0
                    continue
                break
            take = min(left, group - want)
            if take == 0:
                break
            parts.append(views[i][consumed : consumed + take])
            consumed += take
            want += take
        groups.append((start, parts))
    return groups


def plain_hashing(h: Hashing) -> Hashing:
    """``h`` with its geometry as Python ints (numpy integers are taken, as the C takes them,
    but mixed numpy types would turn the reference's slice arithmetic into floats)."""
    return dataclasses.replace(
        h,
        first=operator.index(h.first),
        last=operator.index(h.last),
        chunk_nbytes=operator.index(h.chunk_nbytes),
        group_nbytes=operator.index(h.group_nbytes),
    )


def hash_parts(h: Hashing, parts: Sequence[memoryview], done: int) -> int:
    """The chunks of ``parts`` checksummed into ``h.sums`` from value ``done`` on; returns
    the values written so far."""
    for part in parts:
        count = len(part) // h.chunk_nbytes
        flat = h.sums.reshape(-1)  # any C-contiguous shape, as the C takes it
        chunk_sums(h.algo, part, h.chunk_nbytes, count, flat[done : done + count])
        done += count
    return done

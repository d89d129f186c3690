"""``kvstore-inspect``'s use of the one block check (:mod:`kvstore.store.check`).

The store's own read path turns any damage into a miss and moves the file aside; a tool must
do neither. :func:`check_block` runs every check a server runs (file size, magic, version,
header crc, key, namespace, group, geometry, per-chunk checksum) and those a server does not
need (the sharding index plain zarr readers rely on, zero padding, that compressed chunks
decode), reading the file once with plain ``pread`` calls, and returns a
:class:`~kvstore.store.full_check.BlockCheck` listing what failed. It never raises for a damaged
block; it raises only :class:`~kvstore.inspect.resolve.InspectError` for a caller error (bad
chunk numbers).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvstore.errors import InspectError
from kvstore.store import full_check
from kvstore.store.format import BlockHeader
from kvstore.store.full_check import BlockCheck
from kvstore.store.paths import parse_lo
from kvstore.store.view import GroupView


def check_block(
    group: GroupView,
    path: Path,
    *,
    chunks: Sequence[int] | None = None,
    expect_hash: bytes | None = None,
    want_data: bool = False,
) -> tuple[BlockCheck, np.ndarray | None]:
    """Verify the block file at ``path`` of ``group``; optionally return the chunks' bytes.

    ``chunks``: inner chunk numbers to verify (default all). ``expect_hash``: the full hash the
    caller looked up (checked against the header). With ``want_data`` the second item holds
    the chunks' bytes back to back (uint8, ``len(chunks) * chunk_nbytes``; bytes past the end
    of a short file are zero), whatever their state; otherwise it is None.
    """
    try:
        return full_check.check_file(
            path,
            group.shard,
            coords=_coords(path),
            expect_hash=expect_hash,
            chunks=chunks,
            want_data=want_data,
        )
    except ValueError as exc:  # chunk numbers out of range: the caller's selection
        raise InspectError(str(exc)) from None


def quick_header(group: GroupView, path: Path) -> tuple[BlockHeader | None, str | None]:
    """Header of ``path`` checked against where it was found, without reading any chunk.

    Returns ``(header, None)`` or ``(None, problem)``. Cheap (one small read): used to scan
    every block of a group (prefix trees, hash prefixes).
    """
    header, fault = full_check.quick_check(path, group.shard, _coords(path))
    return header, None if fault is None else fault.detail


def _coords(path: Path) -> tuple[int, int] | None:
    """The ``(hash_hi, hash_lo)`` a shard file's path gives, None if it is not a block path."""
    lo = parse_lo(path.name)
    hi = parse_lo(path.parent.name)
    return None if lo is None or hi is None else (hi, lo)

"""Rules every row of a buffer of whole files must meet: the native ``check_rows`` and its
Python reference.

The offline check reads many block files into the rows of one buffer
(:meth:`FileIO.read_files <kvstore.io.fileio.FileIO.read_files>`) and asks which rows are
certainly intact. The rules are generic - byte runs equal to given bytes, byte runs of zeros,
single bytes within a range, the key's coordinates, checksum slots against their chunks, a
crc32c of the bytes before a stored one - so this module knows nothing of the block format:
:func:`kvstore.store.batch_check.raw_block_rules` builds them from an array's layout.

:func:`check_rows` runs them natively (kvstore/_native/fileproto_rows.c: one call per batch,
without the GIL, checksums included) or, without the extension, through
:func:`reference_check_rows`: numpy over all rows at once, one crc32c call per row. Both check
their arguments alike (:func:`kvstore.io.callcheck.check_rows_args`) and return the same bytes
for every input (tests/native/test_differential_rows.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.checksum import XXH3_64, crc32c, native_xxh3_capsule, strided_chunk_sums
from kvstore.io.callcheck import check_rows_args
from kvstore.io.fileproto import native_fileproto


@dataclass(frozen=True)
class RowRules:
    """What every row of ``row_nbytes`` must hold (each field as check_rows takes it)."""

    row_nbytes: int
    equal: tuple[tuple[int, bytes], ...]  # (offset, bytes): the row holds these bytes there
    zero: tuple[tuple[int, int], ...]  # (offset, length): all zero there
    ranges: tuple[tuple[int, int, int], ...]  # (offset, low, high): low <= byte <= high
    key: tuple[int, int, int]  # (hi_offset, lo_offset, lo_shift): see check_rows
    slots: tuple[int, int, int, int, int]  # (slots_offset, chunks, first, stride, chunk_nbytes)
    crc_offset: int  # the little-endian crc32c of the bytes before it

    def arguments(
        self, rows: object, count: object, hash_hi: object, hash_lo: object
    ) -> tuple[Any, ...]:
        """check_rows' arguments but the xxh3 capsule, in its order, for ``count`` rows of
        ``rows`` at these coordinates."""
        return (
            rows,
            count,
            self.row_nbytes,
            self.equal,
            self.zero,
            self.ranges,
            self.key,
            hash_hi,
            hash_lo,
            self.slots,
            self.crc_offset,
        )


def check_rows(
    rows: memoryview, count: int, rules: RowRules, hash_hi: Sequence[int], hash_lo: Sequence[int]
) -> bytes:
    """For each of the first ``count`` rows of ``rows`` (found at ``hash_hi[i]``,
    ``hash_lo[i]``): 1 when it meets every rule, else 0. Natively when the extension and the
    xxh3 batch are bound, else :func:`reference_check_rows`."""
    native = native_fileproto()
    xxh3 = native_xxh3_capsule() if native is not None else None
    args = rules.arguments(rows, count, hash_hi, hash_lo)
    if native is None or xxh3 is None:
        return reference_check_rows(*args)
    call: Callable[..., bytes] = native.check_rows  # the arguments' count mypy cannot see
    return call(*args, xxh3)


def reference_check_rows(  # noqa: PLR0913 - check_rows' arguments, in its order
    rows: object,
    count: object,
    row_nbytes: object,
    equal: object,
    zero: object,
    ranges: object,
    key: object,
    hash_hi: object,
    hash_lo: object,
    slots: object,
    crc_offset: object,
) -> bytes:
    """``check_rows`` in Python (kvstore/_native/fileproto.c documents the rules)."""
    c = check_rows_args(
        rows, count, row_nbytes, equal, zero, ranges, key, hash_hi, hash_lo, slots, crc_offset
    )
    n, size = c.count, c.row_nbytes
    table = np.frombuffer(c.view, dtype=np.uint8, count=n * size).reshape(n, size)
    ok = np.ones(n, dtype=bool)
    for offset, expected in c.equal:
        ok &= (table[:, offset : offset + len(expected)] == np.frombuffer(expected, np.uint8)).all(
            axis=1
        )
    for offset, low, high in c.ranges:
        ok &= (table[:, offset] >= low) & (table[:, offset] <= high)
    hi_offset, lo_offset, lo_shift = c.key
    ok &= table[:, hi_offset] == np.array(c.hash_hi, dtype=np.uint64)
    stored_lo = table[:, lo_offset : lo_offset + 8].copy().view(">u8").ravel()
    ok &= (stored_lo >> np.uint64(lo_shift)) == np.array(c.hash_lo, dtype=np.uint64)
    for offset, length in c.zero:
        ok &= ~table[:, offset : offset + length].any(axis=1)
    at = c.crc_offset
    stored_crc = table[:, at : at + 4].copy().view("<u4").ravel()
    for i in np.flatnonzero(ok):
        ok[i] = crc32c(table[i, :at].tobytes()) == stored_crc[i]
    ok &= _slots_ok(table, c.slots)
    return ok.astype(np.uint8).tobytes()


def _slots_ok(table: np.ndarray, slots: tuple[int, int, int, int, int]) -> np.ndarray:
    """Each row's checksum slots: every one non-zero and the xxh3 of its chunk."""
    slots_offset, chunks, first, stride, chunk_nbytes = slots
    n, size = table.shape
    if chunks == 0 or n == 0:
        return np.ones(n, dtype=bool)
    stored = table[:, slots_offset : slots_offset + 8 * chunks].copy().view("<u8")
    flat = table.reshape(-1).data
    starts = [r * size + first for r in range(n)]
    sums = strided_chunk_sums(XXH3_64, flat, starts, stride, chunks, chunk_nbytes)
    ok: np.ndarray = ((stored != 0) & (stored == sums.reshape(n, chunks))).all(axis=1)
    return ok

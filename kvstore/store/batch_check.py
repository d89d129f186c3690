"""Many raw block files of one array checked at once: which of them are certainly intact.

The offline check of one file (:func:`~kvstore.store.full_check.check_file`) costs tens of
microseconds of Python per file, which is all of a tiny block's time (one 4 KiB inner chunk
reads in a few). :class:`RawBatchCheck` reads a batch of files into the rows of one buffer
in one native call that releases the GIL for the whole batch (:meth:`FileIO.read_files
<kvstore.io.fileio.FileIO.read_files>`: a regular file of the exact size, never blocking on a
FIFO, never following a link, never touching the mtime), then checks every row at once in numpy
and hashes every inner chunk of the batch in one native xxh3 batch
(:func:`~kvstore.checksum.strided_chunk_sums`).

The contract is one-sided: a file is reported intact only when every condition that
:func:`check_file` requires of an intact raw block holds (size, magic, version, flags, header
crc, hash lengths, key coordinates, namespace, group, geometry, the fixed sharding index, a
known checksum algorithm, every slot filled and matching its chunk, zero padding). Anything
else - missing, unreadable, not regular, damaged, or merely unusual (another algorithm than
xxh3, a hash shorter than 9 bytes) - is "not known intact", and the caller runs
:func:`check_file` on it, whose findings are the verdict. So the result for every damaged
file is the full check's, and the batch only decides faster that a good file is good.
tests/store/test_batch_check.py holds the two to each other over every kind of damage.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.checksum import XXH3_64, crc32c, strided_chunk_sums
from kvstore.io.buffers import ThreadStaging
from kvstore.io.file_batch import READ_WHOLE
from kvstore.io.native_fileio import DEFAULT_FILEIO
from kvstore.keys import HASH_LO_BITS
from kvstore.store import format as fmt
from kvstore.store.check import ShardSpec

# Bytes of files read per round: many tiny blocks share a round's numpy checks and checksum
# batch, while a thread's buffer stays small whatever the block size (a 2 MiB block: 4 a round).
ROUND_NBYTES = 8 << 20
# decode_header takes the hash's first hash_len bytes; hash_coords reads bytes 1..8 of them:
# from 9 bytes on, the coordinates are those of the zero-padded field, read here as a whole.
_MIN_HASH_LEN = 9


class RawBatchCheck:
    """The batch check of the raw block files of one array (``spec.codec`` None)."""

    def __init__(self, spec: ShardSpec) -> None:
        if spec.codec is not None:
            raise ValueError("RawBatchCheck: expected a raw array, got a compressed one")
        self._spec = spec
        layout = spec.layout
        prefix, geometry = spec.raw_template
        self._prefix = np.frombuffer(prefix, dtype=np.uint8)
        self._geometry = np.frombuffer(geometry, dtype=np.uint8)
        self._index = np.frombuffer(layout.index_bytes, dtype=np.uint8)
        self._rows = max(1, ROUND_NBYTES // layout.file_nbytes)
        self._staging = ThreadStaging()

    def intact(
        self, paths: Sequence[str], hash_hi: Sequence[int], hash_lo: Sequence[int]
    ) -> list[bool]:
        """For each file (found at hash coordinates ``hash_hi[i]``, ``hash_lo[i]``): True when
        :func:`~kvstore.store.full_check.check_file` would find no fault in it; False when it
        might (the caller checks that one with :func:`check_file`). Never raises for a
        damaged, vanished or unreadable file; never changes a file."""
        if not len(paths) == len(hash_hi) == len(hash_lo):
            raise ValueError(
                f"intact: expected one coordinate pair per path, got {len(paths)} paths, "
                f"{len(hash_hi)} hash_hi and {len(hash_lo)} hash_lo"
            )
        out: list[bool] = []
        step = self._rows
        for i in range(0, len(paths), step):
            out += self._round(paths[i : i + step], hash_hi[i : i + step], hash_lo[i : i + step])
        return out

    def _round(
        self, paths: Sequence[str], hash_hi: Sequence[int], hash_lo: Sequence[int]
    ) -> list[bool]:
        layout = self._spec.layout
        size = layout.file_nbytes
        rows = self._staging.copy_rows(len(paths), size)
        # Missing, not regular, wrong size, short: not read whole, and check_file says which.
        read = DEFAULT_FILEIO.read_files(paths, size, rows.reshape(-1).data)
        ok = np.array(read, dtype=np.int64) == READ_WHOLE
        ok &= self._header_ok(rows, hash_hi, hash_lo)
        ok &= self._layout_ok(rows)
        if ok.any():
            ok &= self._sums_ok(rows)
        # The header crc last, one call per row still in the running (as bytes: slicing a
        # memoryview costs a fraction of slicing the array).
        at = fmt.CRC_OFFSET
        fixed = memoryview(rows[:, :at].tobytes())
        stored = rows[:, at : at + 4].copy().view("<u4").ravel().tolist()
        return [
            bool(good) and crc32c(fixed[i * at : (i + 1) * at]) == stored[i]
            for i, good in enumerate(ok.tolist())
        ]

    def _header_ok(
        self, rows: np.ndarray, hash_hi: Sequence[int], hash_lo: Sequence[int]
    ) -> np.ndarray:
        """The fixed header's fields every raw block of the array shares, the hash lengths and
        algorithm, and the key's coordinates (the crc is checked last, on the rows left)."""
        ok: np.ndarray = (rows[:, : fmt.HASH_LEN_OFFSET] == self._prefix).all(axis=1)
        ok &= (rows[:, fmt.GEOMETRY_OFFSET : fmt.CREATED_OFFSET] == self._geometry).all(axis=1)
        hash_len = rows[:, fmt.HASH_LEN_OFFSET]
        ok &= (hash_len >= _MIN_HASH_LEN) & (hash_len <= fmt.MAX_HASH)
        ok &= rows[:, fmt.HASH_LEN_OFFSET + 1] <= fmt.MAX_HASH
        ok &= rows[:, fmt.ALGO_OFFSET] == XXH3_64
        at = fmt.HASH_OFFSET
        want_hi = np.array(hash_hi, dtype=np.int64)  # out of range (corrupt listing): no match
        want_lo = np.array(hash_lo, dtype=np.uint64)
        lo = rows[:, at + 1 : at + 9].copy().view(">u8").ravel() >> np.uint64(64 - HASH_LO_BITS)
        ok &= (rows[:, at] == want_hi) & (lo == want_lo)
        return ok

    def _layout_ok(self, rows: np.ndarray) -> np.ndarray:
        """The fixed sharding index, filled checksum slots, and zero padding (the header's
        reserved u32 and tail, and the chunks' stride padding)."""
        layout = self._spec.layout
        n = layout.num_chunks
        ok: np.ndarray = (rows[:, layout.data_end :] == self._index).all(axis=1)
        ok &= ~rows[:, fmt.HEADER_FIXED_NBYTES - 4 : fmt.HEADER_FIXED_NBYTES].any(axis=1)
        ok &= ~rows[:, fmt.checksum_slot_offset(n) : layout.header_nbytes].any(axis=1)
        ok &= self._slots(rows).all(axis=1)
        if not layout.dense:
            first, stride = layout.chunk_offset(0), layout.chunk_stride
            chunks = rows[:, first : first + n * stride].reshape(len(rows), n, stride)
            ok &= ~chunks[:, :, layout.chunk_nbytes :].any(axis=(1, 2))
        return ok

    def _sums_ok(self, rows: np.ndarray) -> np.ndarray:
        """Every inner chunk's xxh3 equals its slot: one native batch over the whole round."""
        layout = self._spec.layout
        n, count = layout.num_chunks, len(rows)
        size, first = layout.file_nbytes, layout.chunk_offset(0)
        flat = rows.reshape(-1).data
        if n <= count:  # one run per chunk number, across the files (a tiny block: one run)
            starts = [first + c * layout.chunk_stride for c in range(n)]
            by_chunk = strided_chunk_sums(XXH3_64, flat, starts, size, count, layout.chunk_nbytes)
            sums = by_chunk.reshape(n, count).T
        else:  # one run per file, across its chunks
            starts = [r * size + first for r in range(count)]
            sums = strided_chunk_sums(
                XXH3_64, flat, starts, layout.chunk_stride, n, layout.chunk_nbytes
            ).reshape(count, n)
        ok: np.ndarray = (sums == self._slots(rows)).all(axis=1)
        return ok

    def _slots(self, rows: np.ndarray) -> np.ndarray:
        """The checksum slots of every row, (rows, chunks) uint64."""
        at = fmt.HEADER_FIXED_NBYTES
        n = self._spec.layout.num_chunks
        return rows[:, at : at + 8 * n].copy().view("<u8").astype(np.uint64)

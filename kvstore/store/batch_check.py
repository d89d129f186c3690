"""Many raw block files of one array checked at once: which of them are certainly intact.

The offline check of one file (:func:`~kvstore.store.full_check.check_file`) costs tens of
microseconds of Python per file, which is all of a tiny block's time (one 4 KiB inner chunk
reads in a few). :class:`RawBatchCheck` reads a batch of files into the rows of one buffer
in one native call that releases the GIL for the whole batch (:meth:`FileIO.read_files
<kvstore.io.fileio.FileIO.read_files>`: a regular file of the exact size, never blocking on a
FIFO, never following a link, never touching the mtime), then checks every row against the
array's rules (:func:`raw_block_rules`) in a second one, header fields, padding, crc and every
inner chunk's xxh3 included (:func:`kvstore.io.row_rules.check_rows`; numpy and one crc call
per row without the extension).

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

from kvstore.checksum import XXH3_64
from kvstore.io.buffers import ThreadStaging
from kvstore.io.file_batch import READ_WHOLE
from kvstore.io.native_fileio import DEFAULT_FILEIO
from kvstore.io.row_rules import RowRules, check_rows
from kvstore.keys import HASH_LO_BITS
from kvstore.store import format as fmt
from kvstore.store.check import ShardSpec

# Bytes of files read per round: many tiny blocks share a round's two native calls, while a
# thread's buffer stays small whatever the block size (a 2 MiB block: 4 a round).
ROUND_NBYTES = 8 << 20
# decode_header takes the hash's first hash_len bytes; hash_coords reads bytes 1..8 of them:
# from 9 bytes on, the coordinates are those of the zero-padded field, read here as a whole.
_MIN_HASH_LEN = 9


def raw_block_rules(spec: ShardSpec) -> RowRules:
    """The rules a whole raw block file of ``spec``'s array meets when :func:`check_file` would
    find no fault in it (the module doc lists them), as :func:`check_rows` takes them."""
    layout = spec.layout
    prefix, geometry = spec.raw_template
    n = layout.num_chunks
    slots_end = fmt.checksum_slot_offset(n)
    zero = [
        (fmt.HEADER_FIXED_NBYTES - 4, 4),  # the header's reserved u32
        (slots_end, layout.header_nbytes - slots_end),  # the header's tail after the slots
    ]
    first, stride, chunk = layout.chunk_offset(0), layout.chunk_stride, layout.chunk_nbytes
    if stride > chunk:  # padded chunks: each one's padding is zero
        zero += [(first + c * stride + chunk, stride - chunk) for c in range(n)]
    return RowRules(
        row_nbytes=layout.file_nbytes,
        equal=(
            (0, prefix),  # magic, version, flags, header size, namespace, group
            (fmt.GEOMETRY_OFFSET, geometry),
            (layout.data_end, bytes(layout.index_bytes)),  # the fixed sharding index
        ),
        zero=tuple(zero),
        ranges=(
            (fmt.HASH_LEN_OFFSET, _MIN_HASH_LEN, fmt.MAX_HASH),  # the block hash's length
            (fmt.HASH_LEN_OFFSET + 1, 0, fmt.MAX_HASH),  # the parent hash's length
            (fmt.ALGO_OFFSET, XXH3_64, XXH3_64),  # the checksum algorithm
        ),
        # The hash's first byte is hash_hi; its next 8 bytes, big-endian, shifted, hash_lo.
        key=(fmt.HASH_OFFSET, fmt.HASH_OFFSET + 1, 64 - HASH_LO_BITS),
        slots=(fmt.HEADER_FIXED_NBYTES, n, first, stride, chunk),
        crc_offset=fmt.CRC_OFFSET,
    )


class RawBatchCheck:
    """The batch check of the raw block files of one array (``spec.codec`` None)."""

    def __init__(self, spec: ShardSpec) -> None:
        if spec.codec is not None:
            raise ValueError("RawBatchCheck: expected a raw array, got a compressed one")
        self._rules = raw_block_rules(spec)
        self._rows = max(1, ROUND_NBYTES // spec.layout.file_nbytes)
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
        size = self._rules.row_nbytes
        flat = self._staging.copy_rows(len(paths), size).reshape(-1).data
        # Missing, not regular, wrong size, short: not read whole, and check_file says which.
        read = DEFAULT_FILEIO.read_files(paths, size, flat)
        held = check_rows(flat, len(paths), self._rules, hash_hi, hash_lo)
        return [code == READ_WHOLE and bool(ok) for code, ok in zip(read, held, strict=True)]

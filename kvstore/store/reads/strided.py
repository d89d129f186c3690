"""A whole block read straight into a strided host view (a row of pieces).

The vLLM tier's row of a CPU-tier chunk: no staging buffer, no scatter copy after. One
``preadv`` of the header and every piece where it lies
(:func:`~kvstore.store.pieces.block_pieces`, the mirror of a write from pieces), then the
header's check and every chunk's checksum computed where it landed, compared with the header's
slots. Same checks, order of failure and errors as a contiguous read; a block that fails leaves
the view's bytes partly written (the caller must not use them: the read is a miss). Always
buffered (``direct_reads`` needs aligned memory, which pieces of a caller's rows need not be).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

from kvstore.errors import CorruptBlockError
from kvstore.io.types import Segment
from kvstore.store import check
from kvstore.store import format as fmt
from kvstore.store.pieces import BlockPieces, block_pieces
from kvstore.store.plan import WholeRead
from kvstore.store.reads.context import ReadContext

_LITTLE_ENDIAN = sys.byteorder == "little"  # checksum slots are u64 little endian


class StridedRead:
    """Whole blocks of one array into non-contiguous numpy views."""

    def __init__(self, ctx: ReadContext) -> None:
        self._ctx = ctx
        self._array = ctx.array
        # Only raw dense arrays lay a block's chunks out as its pieces are.
        self._raw_dense = ctx.plan.whole is not WholeRead.GENERAL

    def read(self, block_hash: bytes, given: np.ndarray, chunks: Sequence[int] | None) -> int:
        """Read and verify the block ``block_hash`` into the strided view ``given``; anything
        but a whole block of a raw dense array is refused (ValueError)."""
        ctx = self._ctx
        array = self._array
        layout = ctx.layout
        if chunks is not None or not self._raw_dense:
            what = "chunk selections" if chunks is not None else f"{array.label}'s layout"
            raise ValueError(
                "read buffer: a strided numpy view is read only as a whole block of a raw, "
                f"dense (unpadded, uncompressed) array; got one for {what}: pass contiguous "
                "memory"
            )
        if not given.flags.writeable:
            raise ValueError("read buffer: expected writable memory, got a read-only view")
        pieces = block_pieces(given, ctx.block_nbytes, layout.chunk_nbytes)
        assert pieces is not None  # a non-contiguous ndarray
        touch_before = ctx.touch_before()
        path = array.block_path(block_hash)
        header = ctx.header()
        segments: list[Segment] = [(0, header), *pieces.segments(ctx.data_offset)]
        read_id = array.engine.read_file(path, segments, ctx.file_nbytes, touch_before)
        try:
            algo = check.header_algo(header, array.shard, block_hash)
            if array.verify_reads:
                check.check_algo(algo)  # an unknown algorithm id is a corrupt block
                self._verify_pieces(algo, header, pieces)
        except CorruptBlockError as exc:
            exc.file_id = read_id  # quarantine this file, not whatever has the name later
            raise
        return ctx.block_nbytes

    def _verify_pieces(self, algo: int, header: memoryview, pieces: BlockPieces) -> None:
        """Every chunk of a block read into ``pieces`` against the header's slots (chunk
        order: the pieces' order)."""
        layout = self._ctx.layout
        count = layout.num_chunks
        sums = pieces.chunk_sums(algo, layout.chunk_nbytes)
        end = fmt.checksum_slot_offset(count)
        if _LITTLE_ENDIAN and sums.tobytes() == bytes(header[fmt.HEADER_FIXED_NBYTES : end]):
            return
        bad = np.flatnonzero(sums != fmt.decode_checksums(header, count))
        if bad.size:
            raise CorruptBlockError(f"checksum mismatch in inner chunk {int(bad[0])}")

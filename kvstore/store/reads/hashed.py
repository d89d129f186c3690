"""A whole block of a large raw dense array, read and checksummed piece by piece.

Verifying a block after reading all of it reads its bytes from memory a second time once the
block is larger than the CPU cache (a 256-token block is 16-80 MiB): the checksums then cost
as much as the copy. Here each piece of about :data:`~kvstore.store.plan.READ_PIECE_NBYTES`
(whole chunks) is checksummed right after its ``preadv``, while it is in the cache, inside the
engine's read (:meth:`~kvstore.io.engine.Engine.read_file_hashed`, capability ``hashed_io``:
one native call with NativeFileIO), with the array's algorithm. Then the header is checked,
before any chunk (a bad header fails as it always did), and the sums are compared with its
slots; a header naming another algorithm gets its chunks checksummed again with that one.
Same checks, same errors as the other whole-block reads. Always buffered (the plan takes this
path only where reads are): O_DIRECT bytes arrive by DMA, not through the CPU cache.
"""

from __future__ import annotations

import numpy as np

from kvstore.errors import CorruptBlockError
from kvstore.io.types import Hashing, Segment
from kvstore.store import check
from kvstore.store import format as fmt
from kvstore.store.reads.context import ReadContext


class HashedRead:
    """Whole blocks of one large raw dense array, checksummed as they are read."""

    def __init__(self, ctx: ReadContext) -> None:
        self._ctx = ctx
        self._array = ctx.array

    def read(self, block_hash: bytes, given: object) -> int:
        """Read and verify the block ``block_hash`` into host memory ``given``."""
        ctx = self._ctx
        out = ctx.host_out(given, ctx.block_nbytes)
        self.read_into(block_hash, out, ctx.touch_before())
        return ctx.block_nbytes

    def read_into(self, block_hash: bytes, out: memoryview, touch_before: int) -> None:
        """:meth:`read` into bytes already checked (writable, large enough)."""
        ctx = self._ctx
        array = self._array
        layout = ctx.layout
        size = layout.chunk_nbytes
        header = ctx.header()
        data = out[: layout.num_chunks * size]
        sums = np.empty(layout.num_chunks, dtype=np.uint64)
        hashing = Hashing(1, 2, array.checksum_algo, size, ctx.plan.piece_nbytes, sums)
        segments: list[Segment] = [(0, header), (ctx.data_offset, data)]
        # Always buffered: the plan takes this path only where reads are (module docstring).
        identity = array.engine.read_file_hashed(
            array.block_path(block_hash), segments, ctx.file_nbytes, touch_before, hashing
        )
        try:
            algo = check.header_algo(header, array.shard, block_hash)
            check.check_algo(algo)  # an unknown algorithm id is a corrupt block
            slots = fmt.decode_checksums(header, layout.num_chunks)
            if algo != hashing.algo or np.count_nonzero(sums != slots):
                # Another algorithm, or a mismatch: verify_run checksums the chunks with the
                # header's algorithm and raises, naming the first bad chunk.
                check.verify_run(algo, slots, 0, data, size)
        except CorruptBlockError as exc:
            exc.file_id = identity  # the file found corrupt, whatever the name holds now
            raise

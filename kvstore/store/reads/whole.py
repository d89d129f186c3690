"""A whole block of a raw dense array read into one host buffer (the common case)."""

from __future__ import annotations

from kvstore.errors import CorruptBlockError
from kvstore.io.buffers import is_aligned
from kvstore.store import check
from kvstore.store.reads.context import ReadContext


class WholeRead:
    """Header and data in one ``preadv``, then header and every chunk checked in one call
    (:func:`~kvstore.store.check.check_whole_block`). Per-block Python is a visible share of
    a small block's time, so this path does nothing a whole dense block does not need."""

    def __init__(self, ctx: ReadContext) -> None:
        self._ctx = ctx
        self._array = ctx.array
        self._engine = ctx.array.engine
        self._shard = ctx.array.shard
        self._verify = ctx.array.verify_reads

    def read(self, block_hash: bytes, given: object) -> int:
        """Read and verify the block ``block_hash`` into ``given``; returns its bytes."""
        ctx = self._ctx
        need = ctx.block_nbytes
        out = ctx.host_out(given, need)
        touch_before = ctx.touch_before()
        path = self._array.block_path(block_hash)
        header = ctx.header()
        data = out[:need]
        # Both offsets (0 and the aligned header size) are aligned: only the memory is checked.
        direct = ctx.direct and is_aligned(header) and is_aligned(data)
        read_id = self._engine.read_file(
            path,
            [(0, header), (ctx.data_offset, data)],
            ctx.file_nbytes,
            touch_before,
            direct=direct,
        )
        try:
            check.check_whole_block(self._shard, header, block_hash, out, verify=self._verify)
        except CorruptBlockError as exc:
            exc.file_id = read_id  # quarantine this file, not whatever has the name later
            raise
        return need

"""A batch of whole blocks read and verified in one native call per I/O thread.

Whole blocks all read into pieces of one geometry that tiles its span in whole chunks (the
vLLM tier's rows), or small blocks into one buffer each where the plan says so: each I/O
thread reads and verifies its share of the batch in one call (:meth:`FileIO.read_pieces
<kvstore.io.fileio.FileIO.read_pieces>` over the engine's ``map_batches``: the GIL released
from the first block to the last), and only the header's fields are checked here
(:func:`~kvstore.store.check.header_algo`). Same checks as a block-by-block read; a block that
fails any of them (missing, not regular, short, corrupt, another algorithm than xxh3) is read
again by the block-by-block path, which names, counts and quarantines what is wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

from kvstore.checksum import XXH3_64
from kvstore.errors import CorruptBlockError
from kvstore.io.buffers import ThreadStaging
from kvstore.io.types import VERIFIED, PiecePlan
from kvstore.keys import check_hash
from kvstore.store import check
from kvstore.store.pieces import PlanCache, batch_spans
from kvstore.store.reads.context import ReadContext
from kvstore.store.types import BlockRead


class BatchRead:
    """Batched whole-block reads of one array; ``read_one`` is the block-by-block path."""

    def __init__(self, ctx: ReadContext, read_one: Callable[[BlockRead], int]) -> None:
        self._ctx = ctx
        self._array = ctx.array
        self._read_one = read_one
        self._buffers = ctx.plan.batch_buffers
        self._headers = ThreadStaging()
        layout = ctx.layout
        self._plans = PlanCache(layout.file_nbytes, memoryview(b""), layout.file_nbytes)

    def read(self, reads: Sequence[BlockRead]) -> list[int | BaseException] | None:
        """Each block's outcome (its bytes, or the exception), or None: not such a batch (the
        caller reads it block by block)."""
        batch = self._batch(reads)
        if batch is None:
            return None
        plan, spans = batch
        ctx = self._ctx
        array = self._array
        hn = ctx.layout.header_nbytes
        headers = self._headers.get(len(reads) * hn)
        blocks: list[tuple[str, memoryview, memoryview]] = []
        hashes: list[bytes] = []
        at: list[int] = []  # the position in reads of each of blocks
        outcomes: list[int | BaseException | None] = [None] * len(reads)
        for i, req in enumerate(reads):
            try:
                block_hash = check_hash(req.block_hash)
                path = array.block_path(block_hash)
            except Exception as exc:  # as Engine.map reports it: this block's outcome
                outcomes[i] = exc
                continue
            blocks.append((path, headers[i * hn : (i + 1) * hn].data, spans[i]))
            hashes.append(block_hash)
            at.append(i)
        touch_before = ctx.touch_before()
        fio = ctx.fio
        direct = ctx.direct
        codes = array.engine.map_batches(
            lambda part: fio.read_pieces(part, hn, plan, touch_before, direct=direct), blocks
        )
        for i, block, block_hash, code in zip(at, blocks, hashes, codes, strict=True):
            outcomes[i] = self._outcome(reads[i], block[1], block_hash, code)
        return cast("list[int | BaseException]", outcomes)

    def _batch(self, reads: Sequence[BlockRead]) -> tuple[PiecePlan, list[memoryview]] | None:
        """The plan and the spans of a batch :meth:`read` takes, or None."""
        if any(req.chunks is not None for req in reads):
            return None
        batch = batch_spans(
            [req.out for req in reads],
            self._ctx.block_nbytes,
            self._ctx.layout.chunk_nbytes,
            whole=self._buffers,
            writable=True,
        )
        if batch is None:
            return None
        geometry, spans = batch
        return self._plans.plan(geometry), spans

    def _outcome(
        self, req: BlockRead, header: memoryview, block_hash: bytes, code: int
    ) -> int | BaseException:
        """A block's outcome (its bytes, or the exception) from its read_pieces ``code``."""
        if code == VERIFIED:
            try:
                if check.header_algo(header, self._array.shard, block_hash) == XXH3_64:
                    return self._ctx.block_nbytes
            except CorruptBlockError:
                pass  # the block-by-block read reads it again and reports it
        try:
            return self._read_one(req)
        except Exception as exc:  # as Engine.map reports it: this block's outcome
            return exc

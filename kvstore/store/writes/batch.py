"""A batch of whole blocks written and named in one native call per I/O thread.

For a store without durability whose blocks are all given as pieces of one geometry that tiles
its span in whole chunks (the vLLM tier's rows), or as small blocks in one buffer each: each
I/O thread writes and names its share of the batch in one call (:meth:`FileIO.publish_pieces
<kvstore.io.fileio.FileIO.publish_pieces>` over the engine's ``map_batches``: the GIL released
from the first block to the last), so a block costs its header's packing here instead of a
dozen Python calls. Same files as the step-by-step path; a block the call could not publish (a
missing fan-out directory, a full disk, anything but a regular file at its name) goes through
that path, which recovers or reports it in its words. Larger blocks in one buffer each are
left to the hashed write, which keeps them in the CPU cache.

The call names each file with ``renameat2(RENAME_NOREPLACE)`` alone. Where the file system
refuses that flag (FUSE file systems such as GlusterFS, NFS), the step-by-step path's
``link`` + ``unlink`` names it instead: after the first refusal this array writes step by step,
so only that first batch is written twice.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import cast

from kvstore.io.buffers import ThreadStaging
from kvstore.io.fileio import NEW_FILE_FLAGS, O_DIRECT
from kvstore.io.rename import NOREPLACE_REFUSED
from kvstore.io.types import ALREADY_THERE, PUBLISHED, PieceBlock, PiecePlan
from kvstore.keys import check_hash
from kvstore.store.files import BlockFiles, Published, new_token
from kvstore.store.paths import temp_path_for
from kvstore.store.pieces import PlanCache, batch_spans
from kvstore.store.types import BlockWrite, WriteStatus

log = logging.getLogger("kvstore")


class BatchWrite:
    """Batched whole-block writes of one array; ``write_one`` is the step-by-step path."""

    def __init__(
        self, files: BlockFiles, index: memoryview, write_one: Callable[[BlockWrite], Published]
    ) -> None:
        self._files = files
        self._array = files.array
        self._write_one = write_one
        layout = files.array.layout
        self._headers = ThreadStaging()
        self._plans = PlanCache(layout.file_nbytes, index, layout.data_end)
        self._buffers = files.array.plan.writes.batch_buffers
        self._noreplace_refused = False  # the file system refused renameat2(RENAME_NOREPLACE)

    def write(self, writes: Sequence[BlockWrite]) -> list[Published | BaseException] | None:
        """Each block's result, or None: not such a batch (the caller writes it step by
        step)."""
        if self._noreplace_refused:
            return None
        batch = self._batch(writes)
        if batch is None:
            return None
        plan, spans = batch
        array = self._array
        hn = array.layout.header_nbytes
        headers = self._headers.get(len(writes) * hn)
        now = time.time_ns()
        blocks: list[PieceBlock] = []
        results: list[Published | BaseException | None] = [None] * len(writes)
        at: list[int] = []  # the position in writes of each of blocks
        for i, req in enumerate(writes):
            try:
                block_hash = check_hash(req.block_hash)
                final = array.block_path(block_hash)
                header = headers[i * hn : (i + 1) * hn].data
                self._files.pack_fixed(header, block_hash, req.parent_hash, now)
            except Exception as exc:  # as Engine.map reports it: this block's result
                results[i] = exc
                continue
            blocks.append((temp_path_for(final, new_token()), final, header, spans[i]))
            at.append(i)
        engine = array.engine
        flags = NEW_FILE_FLAGS | (O_DIRECT if engine.direct.enabled else 0)
        mode = engine.config.file_mode
        fio = array.fio
        codes = engine.map_batches(lambda part: fio.publish_pieces(part, flags, mode, plan), blocks)
        for i, block, code in zip(at, blocks, codes, strict=True):
            results[i] = self._outcome(writes[i], block[1], code)
        return cast("list[Published | BaseException]", results)

    def _batch(self, writes: Sequence[BlockWrite]) -> tuple[PiecePlan, list[memoryview]] | None:
        """The plan and the spans of a batch :meth:`write` takes, or None."""
        layout = self._array.layout
        batch = batch_spans(
            [w.data for w in writes],
            layout.block_nbytes,
            layout.chunk_nbytes,
            whole=self._buffers,
            writable=False,
        )
        if batch is None:
            return None
        geometry, spans = batch
        return self._plans.plan(geometry), spans

    def _outcome(self, req: BlockWrite, final: str, code: int) -> Published | BaseException:
        """A block's result from its :meth:`FileIO.publish_pieces` outcome ``code``."""
        if code == PUBLISHED:
            return WriteStatus.WRITTEN, final.rpartition(os.sep)[0], None
        if code == ALREADY_THERE:
            return WriteStatus.EXISTS, None, None
        if -code in NOREPLACE_REFUSED and not self._noreplace_refused:
            self._noreplace_refused = True
            log.info(
                "kvstore: %s refuses renameat2(RENAME_NOREPLACE) (%s): blocks are named with "
                "link + unlink, one by one",
                final.rpartition(os.sep)[0],
                errno.errorcode.get(-code, str(-code)),
            )
        try:  # the step-by-step path recovers (a lost fan-out directory) or reports it
            return self._write_one(req)
        except Exception as exc:  # as Engine.map reports it: this block's result
            return exc

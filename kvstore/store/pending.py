"""The multi-writer protocol of docs/design.md §5: many writers fill one file, one publishes.

:meth:`PendingWriter.begin_blocks` makes a :class:`~kvstore.store.types.PendingBlock` per
block (no I/O): its hash, parent, created time, checksum algorithm and the random token that
names the temporary file. It is handed to every writer of the block (every rank), and each
writes into the same temporary file at fixed offsets:

* :meth:`PendingWriter.write_chunks`: whole inner chunks with their checksum slots;
* :meth:`PendingWriter.write_ranges`: byte ranges inside inner chunks (DCP/PCP split tokens),
  plus a completion marker past the end of the block; their checksums are computed at commit.

Every writer writes the identical fixed header and index bytes. One party then calls
:meth:`PendingWriter.commit_blocks` (vLLM: the scheduler's ``complete_store``, after every
worker reported): it checks the file (size, header for this key, every range writer's marker,
a checksum in every slot - a slot left 0 means a writer never ran) and publishes it through
:class:`~kvstore.store.files.BlockFiles` (the file steps it shares with the whole-block
publisher), or discards it (FAILED). Compressed arrays receive
raw chunks the same way; the committer compresses them before publishing.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence

import numpy as np

from kvstore.checksum import checksum_function
from kvstore.errors import BlockMissingError, CorruptBlockError, KvstoreError
from kvstore.io.engine import AnySegment
from kvstore.io.types import Segment
from kvstore.keys import check_hash
from kvstore.store import check
from kvstore.store import format as fmt
from kvstore.store.array import GroupArray
from kvstore.store.files import BlockFiles, Published, chunk_checksums, new_token
from kvstore.store.paths import temp_path_for
from kvstore.store.segments import chunk_segments, consecutive_runs, nbytes
from kvstore.store.types import ChunkWrite, PendingBlock, RangeWrite, WriteResult, WriteStatus

MAX_RANGE_WRITERS = 4096  # completion-marker bytes a pending file may carry past its end
# A temporary file's token: no dot (temp_path_for's rsync shape), nothing a path could misread.
_TOKEN = re.compile(r"[0-9a-z_-]{1,64}")


class PendingWriter:
    """The multi-writer protocol on one group array."""

    def __init__(self, array: GroupArray, files: BlockFiles) -> None:
        self.array = array
        self.files = files
        self._fio = array.fio

    def begin_blocks(
        self,
        hashes: Sequence[bytes],
        parents: Sequence[bytes | None] | None = None,
        tokens: Sequence[str] | None = None,
    ) -> list[PendingBlock]:
        """Descriptors of new pending blocks (no I/O); hand each to every writer of the block.

        ``tokens`` name the temporary files. By default each is random, for writers handed the
        descriptor by one coordinator (vLLM's scheduler). Writers without a coordinator (the
        ranks of an SGLang server) derive one token per block each, identically, so they meet
        in one file; see :meth:`is_complete`.
        """
        array = self.array
        array.check_writable()
        parent_list = parents if parents is not None else [None] * len(hashes)
        token_list = list(tokens) if tokens is not None else [new_token() for _ in hashes]
        if len(token_list) != len(hashes):
            raise KvstoreError(f"begin_blocks: {len(hashes)} hashes but {len(token_list)} tokens")
        for token in token_list:
            if not isinstance(token, str) or not _TOKEN.fullmatch(token):
                raise KvstoreError(
                    f"pending token: expected 1..64 characters of [0-9a-z_-], got {token!r}"
                )
        now = time.time_ns()
        return [
            PendingBlock(
                namespace=array.namespace,
                group=array.index,
                block_hash=check_hash(h),
                parent_hash=check_hash(p) if p is not None else None,
                token=t,
                created_ns=now,
                checksum_algo=array.checksum_algo,
            )
            for h, p, t in zip(hashes, parent_list, token_list, strict=True)
        ]

    def temp_path(self, pending: PendingBlock) -> str:
        """The temporary file all writers of ``pending`` fill."""
        self._check_pending(pending)
        return temp_path_for(self.array.block_path(pending.block_hash), pending.token)

    # -- writers -----------------------------------------------------------------------------

    def write_chunks(self, writes: Sequence[ChunkWrite]) -> list[BaseException | None]:
        """Each writer's whole inner chunks, with their checksums, into the pending files.

        Returns, per item, None or the error (the caller then aborts the block).
        """
        written = self.array.engine.map(self._write_chunks_one, writes)
        return self._write_then_sync([w.pending for w in writes], written)

    def write_ranges(self, writes: Sequence[RangeWrite]) -> list[BaseException | None]:
        """Each writer's byte ranges inside inner chunks; checksums are computed at commit."""
        written = self.array.engine.map(self._write_ranges_one, writes)
        return self._write_then_sync([w.pending for w in writes], written)

    def _write_then_sync(
        self, pendings: Sequence[PendingBlock], written: Sequence[str | BaseException]
    ) -> list[BaseException | None]:
        """Sync the pending files a writer's batch wrote (all of them written first, as in
        :meth:`Publisher.write_blocks`); per item None or the error."""
        if self.array.engine.config.durable:
            items = list(zip(pendings, written, strict=True))
            written = self.array.engine.map(self._sync_written, items)
        return [r if isinstance(r, BaseException) else None for r in written]

    def _sync_written(self, item: tuple[PendingBlock, str | BaseException]) -> str:
        """Sync a pending file this writer wrote; if it is gone, the block it became.

        Writers without a coordinator (SGLang's ranks, :meth:`is_complete`) race here: between
        this writer's write and its sync, another writer of the block can find every checksum
        slot filled - this writer's are written last - and publish the file by renaming it.
        The published block then holds this writer's bytes, and syncing it is this sync. A
        file gone without a published block (aborted, swept) stays an error."""
        pending, path = item
        if isinstance(path, BaseException):
            raise path
        try:
            self.files.sync_file(path)
        except FileNotFoundError:
            if not self._sync_published(pending):
                raise
        return path

    def _sync_published(self, pending: PendingBlock) -> bool:
        """Sync ``pending``'s published block file; False when there is none."""
        try:
            self.files.sync_file(self.array.block_path(pending.block_hash))
        except FileNotFoundError:
            return False
        return True

    def _write_chunks_one(self, item: ChunkWrite) -> str:
        layout = self.array.layout
        pending = item.pending
        data = self.files.data(item.data)
        chunks = list(item.chunks)
        if nbytes(data) != len(chunks) * layout.chunk_nbytes:
            raise KvstoreError(
                f"chunk data: expected {len(chunks)} x {layout.chunk_nbytes} bytes, "
                f"got {nbytes(data)}"
            )
        if any(not 0 <= c < layout.num_chunks for c in chunks):
            raise KvstoreError(f"chunk numbers: expected 0..{layout.num_chunks - 1}, got {chunks}")
        sums = chunk_checksums(pending.checksum_algo, data, layout.chunk_nbytes, len(chunks))
        segments: list[AnySegment] = list(self._shared_segments(pending))
        segments.extend(chunk_segments(layout, chunks, data))
        segments.sort(key=lambda s: s[0])
        # Checksum slots last (segments are written in list order): a filled slot tells the
        # committer the chunk is complete, so a writer killed mid-write must not leave a slot
        # in front of the chunk's bytes.
        for run_start, run_end in consecutive_runs(chunks):
            slots = fmt.encode_checksums(sums[run_start:run_end])
            segments.append((fmt.checksum_slot_offset(chunks[run_start]), memoryview(slots)))
        path = self.temp_path(pending)
        self.files.write_file(path, segments, exclusive=False, sync=False)
        return path

    def _write_ranges_one(self, item: RangeWrite) -> str:
        layout = self.array.layout
        if not 0 <= item.writer_slot < MAX_RANGE_WRITERS:
            raise KvstoreError(
                f"range writer slot: expected 0..{MAX_RANGE_WRITERS - 1}, got {item.writer_slot}"
            )
        segments: list[AnySegment] = list(self._shared_segments(item.pending))
        # Completion marker past the end of the block: the committer checks every range writer
        # reported, since a missing writer's bytes are indistinguishable from zeros.
        segments.append((layout.file_nbytes + item.writer_slot, memoryview(b"\x01")))
        for offset, buffer in item.ranges:
            data = self.files.data(buffer)
            size = nbytes(data)
            chunk, within = divmod(offset, layout.chunk_nbytes)
            if chunk >= layout.num_chunks or within + size > layout.chunk_nbytes or offset < 0:
                raise KvstoreError(
                    f"range write [{offset}, +{size}): expected it inside one inner chunk of "
                    f"{layout.chunk_nbytes} bytes within a {layout.block_nbytes}-byte block"
                )
            segments.append((layout.chunk_offset(chunk) + within, data))
        segments.sort(key=lambda s: s[0])
        path = self.temp_path(item.pending)
        self.files.write_file(path, segments, exclusive=False, sync=False)
        return path

    def _shared_segments(self, pending: PendingBlock) -> list[Segment]:
        """The bytes every writer writes identically: the fixed header and the index."""
        self._check_pending(pending)
        fixed = self.files.fixed_header(
            pending.block_hash, pending.parent_hash, pending.created_ns, pending.checksum_algo
        )
        layout = self.array.layout
        return [(0, memoryview(fixed)), (layout.data_end, memoryview(layout.index_bytes))]

    # -- the committer -----------------------------------------------------------------------

    def commit_blocks(
        self,
        pendings: Sequence[PendingBlock],
        checksum_chunks: Sequence[Sequence[int]] | None = None,
        range_writers: int = 0,
    ) -> list[WriteResult]:
        """Publish pending blocks whose writers all finished.

        ``checksum_chunks[i]`` lists the inner chunks of ``pendings[i]`` written by ranges
        (several writers): their checksums are computed now. ``range_writers`` is how many
        range writers (slots ``0..range_writers-1``) each block must have heard from. A block
        is published only if its file has the right size, a valid header for this key, every
        range writer's completion marker and a checksum in every slot; otherwise it is
        discarded (FAILED) and never becomes visible.
        """
        todo = checksum_chunks if checksum_chunks is not None else [()] * len(pendings)
        items = [(p, c, range_writers) for p, c in zip(pendings, todo, strict=True)]
        results = self.array.engine.map(self._commit_one, items)
        return self.files.finish_writes(results, [p.block_hash for p in pendings])

    def is_complete(self, pending: PendingBlock) -> bool:
        """Whether every whole-chunk writer of ``pending`` has written (no I/O beyond reading
        the header; nothing is changed): the file holds a valid header for the key and a
        checksum in every slot. Writers without a coordinator each ask this after their own
        write; the one that sees the block complete commits it. False for a missing, short
        or damaged file: someone is still writing, or it is left for ``kvstore gc``."""
        layout = self.array.layout
        header = bytearray(layout.header_nbytes)
        try:
            self.array.engine.read_file(
                self.temp_path(pending),
                [(0, memoryview(header))],
                layout.file_nbytes,
                allow_trailer=True,
            )
            raw = check.ShardSpec(layout, self.array.namespace_digest, self.array.index)
            check.check_header(header, raw, pending.block_hash)
        except (OSError, KvstoreError):
            return False
        slots = fmt.decode_checksums(header, layout.num_chunks)
        return bool(np.all(slots != 0))

    def abort_blocks(self, pendings: Sequence[PendingBlock]) -> None:
        """Remove the temporary files of pending blocks that will not be committed."""
        for pending in pendings:
            self.array.remove_quietly(self.temp_path(pending))

    def _commit_one(self, item: tuple[PendingBlock, Sequence[int], int]) -> Published:
        pending, chunks, range_writers = item
        array = self.array
        tmp = self.temp_path(pending)
        final = array.block_path(pending.block_hash)
        try:
            if self._fio.exists(final):
                array.remove_quietly(tmp)
                return WriteStatus.EXISTS, None, None
            slot_writes = self._complete_checksums(tmp, pending, chunks, range_writers)
            compressed = array.compressed
            if compressed is not None:  # writers wrote raw chunks: compress, then publish
                packed = temp_path_for(final, new_token())
                published = compressed.publish_from_raw(
                    tmp, packed, final, pending, self.files.publish_name, slot_writes
                )
                return WriteStatus.WRITTEN, os.path.dirname(final), published
            array.engine.finish_file(tmp, array.layout.file_nbytes, slot_writes)
            published = self.files.publish_name(tmp, final)
        except (FileNotFoundError, BlockMissingError):
            array.remove_quietly(tmp)
            if not self._fio.exists(final):
                raise
            # The temporary file became the block under our feet: another committer of it
            # (writers without a coordinator each commit a block they find complete)
            # published it since the existence check above.
            return WriteStatus.EXISTS, None, None
        except BaseException:
            array.remove_quietly(tmp)
            raise
        return WriteStatus.WRITTEN, os.path.dirname(final), published

    def _complete_checksums(
        self, tmp: str, pending: PendingBlock, chunks: Sequence[int], range_writers: int
    ) -> list[Segment]:
        """Check every writer reported; return the checksum slot writes of range-written chunks."""
        array = self.array
        layout = array.layout
        header = bytearray(layout.header_nbytes)
        chunk_bufs = [bytearray(layout.chunk_nbytes) for _ in chunks]
        markers = bytearray(range_writers)
        segments = [(0, memoryview(header))] + [
            (layout.chunk_offset(c), memoryview(b)) for c, b in zip(chunks, chunk_bufs, strict=True)
        ]
        array.engine.read_file(tmp, segments, layout.file_nbytes, allow_trailer=True)
        if range_writers:
            try:
                marks = [(layout.file_nbytes, memoryview(markers))]
                array.engine.read_file(tmp, marks, layout.file_nbytes, allow_trailer=True)
            except CorruptBlockError:
                pass  # the file ends before the last slots: those writers never reported
        silent = [slot for slot, flag in enumerate(markers) if flag != 1]
        if silent:
            raise KvstoreError(
                f"incomplete block: range writer slot(s) {silent} of {range_writers} never wrote"
            )
        # The raw chunks the writers left (a compressed array compresses them after this).
        raw = check.ShardSpec(layout, array.namespace_digest, array.index)
        check.check_header(header, raw, pending.block_hash)
        slots = fmt.decode_checksums(header, layout.num_chunks).copy()
        writes: list[Segment] = []
        if chunks:
            fn = checksum_function(pending.checksum_algo)
            for c, buf in zip(chunks, chunk_bufs, strict=True):
                slots[c] = fn(memoryview(buf))
                slot = memoryview(fmt.encode_checksums([int(slots[c])]))
                writes.append((fmt.checksum_slot_offset(c), slot))
        missing = np.flatnonzero(slots == 0)
        if len(missing):
            raise KvstoreError(
                f"incomplete block: {len(missing)} of {layout.num_chunks} inner chunks were never "
                f"written (first: chunk {int(missing[0])})"
            )
        return writes

    def _check_pending(self, pending: PendingBlock) -> None:
        array = self.array
        if pending.namespace != array.namespace or pending.group != array.index:
            raise KvstoreError(
                f"pending block belongs to {pending.namespace}/g{pending.group}, not {array.label}"
            )

"""Publishing blocks: temporary file, sync, rename to the block's name, sync the directory.

Published block files are immutable: they appear by renaming a complete, synced temporary file
(``.<lo>.tmp-<token>`` beside the final name: :func:`kvstore.store.paths.temp_path_for`) to
the block's name, never replacing one (:meth:`FileIO.rename <kvstore.io.fileio.FileIO.rename>`),
and are only ever removed, so a reader never sees a partial block. A crash leaves only
temporary files, which the admin CLI sweeps.

:class:`Publisher` writes whole blocks (one writer: :meth:`Publisher.write_blocks`); the file
steps it shares with the multi-writer protocol (:mod:`kvstore.store.pending`) are
:class:`kvstore.store.files.BlockFiles`: writing a file (recreating a lost fan-out
directory), naming it, and finishing a batch (directory syncs, counts, one log line).
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import time
from collections.abc import Sequence
from typing import TypeVar, cast

import numpy as np

from kvstore.errors import KvstoreError
from kvstore.io.buffers import aligned_buffer
from kvstore.io.engine import AnySegment
from kvstore.io.entries import file_id
from kvstore.io.types import Segment
from kvstore.keys import check_hash
from kvstore.store import format as fmt
from kvstore.store.array import GroupArray
from kvstore.store.files import BlockFiles, Published, Written, new_token
from kvstore.store.paths import final_path_of, temp_path_for
from kvstore.store.pieces import BlockPieces, block_pieces
from kvstore.store.segments import host_segments, nbytes
from kvstore.store.types import BlockWrite, WriteResult, WriteStatus
from kvstore.store.writes.batch import BatchWrite
from kvstore.store.writes.hashed import HashedWrite
from kvstore.store.writes.headers import HeaderPages

log = logging.getLogger("kvstore")

T = TypeVar("T")


_ZEROS = memoryview(bytes(fmt.ALIGN))


def max_held_files() -> int:
    """Most temporary-file descriptors one write_blocks call holds at once (one per block of
    a slice of the batch): 256, far above a scheduler step's blocks, or a sixteenth of a low
    ``RLIMIT_NOFILE`` (several groups may write at once, beside held fan-out directories)."""
    try:
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return 16
    if soft == resource.RLIM_INFINITY:
        return 256
    return max(16, min(256, soft // 16))


MAX_HELD_FILES = max_held_files()


class Publisher(BlockFiles):
    """Whole-block writes of one group array (the file steps: :class:`BlockFiles`)."""

    def __init__(self, array: GroupArray) -> None:
        super().__init__(array)
        self._headers = HeaderPages(self)
        index = aligned_buffer(len(array.layout.index_bytes))
        index[:] = np.frombuffer(array.layout.index_bytes, dtype=np.uint8)
        self._index = index.data.toreadonly()
        plan = array.plan.writes
        self._hashed = HashedWrite(self, self._headers, self._index) if plan.hashed else None
        self._batch = BatchWrite(self, self._index, self._write_and_publish) if plan.batch else None

    # -- whole blocks ------------------------------------------------------------------------

    def write_blocks(self, writes: Sequence[BlockWrite]) -> list[WriteResult]:
        """Write and publish whole blocks; blocks already present are skipped (EXISTS).

        Three passes over the batch: write every temporary file; sync each and rename it to
        its name; sync the directories. Each file is still synced before its rename and each
        directory after it, as one block at a time would, but syncing the files only once all
        of them are written lets the file system commit its journal once for many files
        rather than once per file (about +10-20 % write throughput with 2 MiB blocks, 4
        threads, ext4; see docs/performance.md).

        A durable store keeps each temporary file's descriptor open from its write to the
        end of the batch: the file is synced on it (not opened again), and its identity,
        needed only to withdraw it if its directory sync fails, is read from it then (no
        ``lstat`` per block). At most :data:`MAX_HELD_FILES` are held: a larger batch goes
        by slices, each slice's files giving up their descriptors (after one ``fstat`` each)
        before the next is written.
        """
        self.array.check_writable()
        engine = self.array.engine
        batched = self._batch.write(writes) if self._batch is not None else None
        if batched is not None:
            return self.finish_writes(batched, [w.block_hash for w in writes])
        durable = engine.config.durable
        results: list[Published | BaseException] = []
        held: list[Written] = []
        try:
            for start in range(0, len(writes), MAX_HELD_FILES):
                if held:  # a later slice: release the earlier one's descriptors first
                    results = [self._release(r) for r in results]
                    self._close_all(held)
                    held = []
                staged = engine.map(self._write_one, writes[start : start + MAX_HELD_FILES])
                if durable:  # only a durable store's files keep their descriptors
                    held = [w for w in staged if type(w) is Written and w.fd is not None]
                results += engine.map(self._publish, staged)
            return self.finish_writes(results, [w.block_hash for w in writes])
        finally:
            self._close_all(held)

    def _write_and_publish(self, req: BlockWrite) -> Published:
        """Both passes of :meth:`write_blocks` for one block (what a batch could not do)."""
        return self._publish(self._write_one(req))

    def _write_one(self, req: BlockWrite) -> Written | None:
        """First pass of :meth:`write_blocks`: the block's temporary file, written but not
        synced (its descriptor open when the store is durable); None when the block is
        already published."""
        array = self.array
        block_hash = check_hash(req.block_hash)
        final = array.block_path(block_hash)
        if self._fio.exists(final):
            return None
        layout = array.layout
        compressed = array.compressed
        given = req.data
        pieces = block_pieces(given, layout.block_nbytes, layout.chunk_nbytes)
        if pieces is not None and (compressed is not None or not layout.dense):
            given, pieces = np.ascontiguousarray(given), None  # joined: one copy, as before
        if pieces is not None:
            in_place = self._piece_segments(block_hash, req.parent_hash, pieces)
            return self._write_segments(final, in_place, layout.file_nbytes, host=True)
        data = self.data(given, host=compressed is not None)
        if nbytes(data) != layout.block_nbytes:
            raise KvstoreError(
                f"block data: expected {layout.block_nbytes} bytes, got {nbytes(data)}"
            )
        tmp = temp_path_for(final, new_token())
        if self._hashed is not None and isinstance(data, memoryview):
            try:
                fd = self._hashed.write(tmp, block_hash, req.parent_hash, data)
            except BaseException:
                array.remove_quietly(tmp)
                raise
            return self._written(tmp, fd)
        file_nbytes: int | None = None
        if compressed is not None:
            assert isinstance(data, memoryview)
            parent = check_hash(req.parent_hash) if req.parent_hash is not None else None
            host, file_nbytes = compressed.segments(
                block_hash, parent, time.time_ns(), array.checksum_algo, data, layout.chunk_nbytes
            )
            segments: list[AnySegment] = list(host)
        else:
            header = self._headers.header_of(block_hash, req.parent_hash, data)
            segments = [(0, header)]
            if layout.dense:
                segments.append((layout.data_offset, data))
            elif isinstance(data, memoryview) and array.engine.direct.enabled:
                # O_DIRECT cannot send chunks whose length is not a 4 KiB multiple: the padded
                # data region is assembled once, in aligned memory, by one strided copy (the
                # engine would otherwise stage every chunk and pad, one copy each).
                segments.append((layout.data_offset, self._headers.padded_image(data)))
            else:
                pad = _ZEROS[: layout.chunk_stride - layout.chunk_nbytes]
                for c in range(layout.num_chunks):
                    start = c * layout.chunk_nbytes
                    chunk = data[start : start + layout.chunk_nbytes]
                    segments.append((layout.chunk_offset(c), chunk))
                    segments.append((layout.chunk_offset(c) + layout.chunk_nbytes, pad))
            segments.append((layout.data_end, self._index))
        size = layout.file_nbytes if file_nbytes is None else file_nbytes
        # Host memory unless the data stayed a tensor for a device engine (compressed blocks
        # are always built in host memory).
        on_host = compressed is not None or isinstance(data, memoryview)
        return self._write_segments(final, segments, size, host=on_host, tmp=tmp)

    def _written(self, tmp: str, fd: int) -> Written:
        """A written temporary file: its descriptor kept when the store is durable, else
        closed (the file removed if the close fails)."""
        if not self.array.engine.config.durable:
            try:
                self._fio.close(fd)
            except BaseException:
                self.array.remove_quietly(tmp)
                raise
            return Written(tmp, None)
        return Written(tmp, fd)

    def _piece_segments(
        self, block_hash: bytes, parent: bytes | None, pieces: BlockPieces
    ) -> list[AnySegment]:
        """The segments of a raw dense block given as pieces: header (checksums computed on
        the pieces where they lie), one segment per piece at its canonical offset, index."""
        array = self.array
        layout = array.layout
        sums = pieces.chunk_sums(array.checksum_algo, layout.chunk_nbytes)
        header = self._headers.header_into(block_hash, parent, time.time_ns(), sums)
        segments: list[AnySegment] = [(0, header)]
        segments += pieces.segments(layout.data_offset)  # no slice built in Python per piece
        segments.append((layout.data_end, self._index))
        return segments

    def _write_segments(
        self,
        final: str,
        segments: list[AnySegment],
        size: int,
        *,
        host: bool,
        tmp: str | None = None,
    ) -> Written:
        """The new temporary file of ``final`` holding ``segments``, unsynced (its descriptor
        kept open when the store is durable); removed if the write fails. ``host``: the
        caller knows that no segment is a tensor (the array's engine takes them as they are,
        with no look at each)."""
        array = self.array
        tmp = temp_path_for(final, new_token()) if tmp is None else tmp
        try:
            try:
                fd = self._write_new(tmp, segments, size, host)
            except FileNotFoundError:
                self._recreate_fan_out(tmp)  # (as recreating_fan_out, without a closure)
                fd = self._write_new(tmp, segments, size, host)
        except BaseException:
            array.remove_quietly(tmp)
            raise
        return self._written(tmp, fd)

    def _publish(self, staged: Written | BaseException | None) -> Published:
        """Second pass of :meth:`write_blocks`: sync a written temporary file on its open
        descriptor, then give it its name (never replacing one): FileIO.sync_and_rename, one
        native call for NativeFileIO."""
        if isinstance(staged, BaseException):
            raise staged  # the first pass failed: reported as this block's result
        if staged is None:
            return WriteStatus.EXISTS, None, None
        final = final_path_of(staged.tmp)
        try:
            self._fio.sync_and_rename(staged.fd, staged.tmp, final)
        except BaseException:
            self.array.remove_quietly(staged.tmp)
            raise
        # The identity of a durable store's file is read from its descriptor if ever needed.
        return (
            WriteStatus.WRITTEN,
            os.path.dirname(final),
            staged if staged.fd is not None else None,
        )

    def _release(self, result: Published | BaseException) -> Published | BaseException:
        """``result`` with a held file's identity read (``fstat``) so that its descriptor can
        be closed; a file whose ``fstat`` fails could not be withdrawn: an error."""
        if isinstance(result, BaseException) or not isinstance(result[2], Written):
            return result
        fd = result[2].fd
        assert fd is not None  # held descriptors are closed only after their release
        try:
            return result[0], result[1], file_id(self._fio.fstat(fd))
        except OSError as exc:
            return exc

    def _close_all(self, held: Sequence[Written]) -> None:
        """Close the descriptors a batch holds (each once; errors of a close are moot: the
        files were synced on them or are being given up)."""
        for written in held:
            if written.fd is not None:
                fd, written.fd = written.fd, None
                with contextlib.suppress(OSError):
                    self._fio.close(fd)

    def _write_new(self, path: str, segments: list[AnySegment], size: int, host: bool) -> int:
        """A new file's write, returning its open descriptor unsynced: ``host`` segments go
        to the array's engine as they are; otherwise :meth:`_engine_write_new` sorts them."""
        if host:
            return self.array.engine.write_new_file(path, cast("list[Segment]", segments), size)
        return self._engine_write_new(path, segments, size)

    def _engine_write_new(self, path: str, segments: Sequence[AnySegment], size: int) -> int:
        """:meth:`_engine_write` of a new file, returning its open descriptor unsynced."""
        host = host_segments(segments)
        if host is not None:
            return self.array.engine.write_new_file(path, host, size)
        device = self.array.device_engine
        assert device is not None  # data() keeps tensors only for such engines
        return device.write_new_file(path, segments, size)

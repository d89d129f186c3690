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
import sys
import threading
import time
from collections.abc import Sequence
from typing import TypeVar, cast

import numpy as np

from kvstore.checksum import (
    XXH3_64,
    chunk_sums,
)
from kvstore.errors import KvstoreError
from kvstore.io.buffers import ThreadStaging, aligned_buffer
from kvstore.io.engine import AnySegment, Data
from kvstore.io.entries import file_id
from kvstore.io.fileio import O_DIRECT
from kvstore.io.host import NEW_FILE_FLAGS, HostEngine
from kvstore.io.types import ALREADY_THERE, PUBLISHED, Hashing, PieceBlock, PiecePlan, Segment
from kvstore.keys import check_hash
from kvstore.store import format as fmt
from kvstore.store.array import GroupArray
from kvstore.store.files import BlockFiles, Published, Written, chunk_checksums, new_token
from kvstore.store.paths import final_path_of, temp_path_for
from kvstore.store.pieces import BlockPieces, PlanCache, batch_spans, block_pieces
from kvstore.store.segments import host_segments, nbytes
from kvstore.store.types import BlockWrite, WriteResult, WriteStatus

log = logging.getLogger("kvstore")

T = TypeVar("T")


_ZEROS = memoryview(bytes(fmt.ALIGN))
# Raw dense blocks of at least this many bytes in host memory are checksummed group by group
# as they are written (FileIO.write_new_hashed), in groups of _HASH_GROUP_NBYTES: hashing a
# whole block and then writing it reads a block larger than the CPU cache from memory twice.
# CPU time of writing 256 MiB of distinct blocks to tmpfs, best of 5, relative to the same
# writes without checksums (a FileIO-level micro-benchmark, session 25): 32 MiB blocks hashed
# in 256 KiB groups 0.95-1.0, hash-then-write 0.85-0.89; 1-2 MiB blocks alike either way
# (0.89-1.1, noise), so the threshold only keeps small blocks' files to one vectored write.
_HASHED_WRITE_MIN_NBYTES = 1 << 20
_HASH_GROUP_NBYTES = 256 << 10


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
        # Whole-block headers are built in a per-thread page-aligned buffer, so an O_DIRECT
        # write sends them from where they are (no staging copy, no allocation per block):
        # attribute "page" of _pages (see _header_page).
        self._pages = threading.local()
        self._padded_images = ThreadStaging()
        index = aligned_buffer(len(array.layout.index_bytes))
        index[:] = np.frombuffer(array.layout.index_bytes, dtype=np.uint8)
        self._index = index.data.toreadonly()
        # Large raw dense blocks of host memory are hashed as they are written (_write_hashed):
        # a host engine (any: device data reaches it in host memory), xxh3 (the native
        # hash of the fused write), little-endian slots written in place.
        layout = array.layout
        self._hashed_writes = (
            layout.dense
            and array.compressed is None
            and layout.block_nbytes >= _HASHED_WRITE_MIN_NBYTES
            and array.checksum_algo == XXH3_64
            and isinstance(array.engine, HostEngine)
            and sys.byteorder == "little"
        )
        # Batches of blocks given as pieces (the vLLM tier's rows) are written and named in
        # one native call per I/O thread where the store is not durable (_publish_pieces).
        self._piece_batches = (
            layout.dense
            and array.compressed is None
            and array.checksum_algo == XXH3_64
            and isinstance(array.engine, HostEngine)
            and not array.engine.config.durable
            and self._fio.native_piece_batches
        )
        self._batch_headers = ThreadStaging()
        self._piece_plans = PlanCache(layout.file_nbytes, self._index, layout.data_end)

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
        batched = self._publish_pieces(writes) if self._piece_batches else None
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

    def _publish_pieces(
        self, writes: Sequence[BlockWrite]
    ) -> list[Published | BaseException] | None:
        """:meth:`write_blocks` of a store without durability whose blocks are all given as
        pieces of one geometry that tiles its span in whole chunks (the vLLM tier's rows):
        each I/O thread writes and names its share of the batch in one native call
        (:meth:`FileIO.publish_pieces <kvstore.io.fileio.FileIO.publish_pieces>`: the GIL
        released from the first block to the last), so a block costs its header's packing
        here instead of a dozen Python calls. Same files as :meth:`_write_one` and
        :meth:`_publish`; a block the call could not publish (a missing fan-out directory, a
        full disk, anything but a regular file at its name) goes through those two, which
        recover or report it in their words. None: not such a batch (the caller writes it
        step by step)."""
        batch = self._piece_batch(writes)
        if batch is None:
            return None
        plan, spans = batch
        array = self.array
        hn = array.layout.header_nbytes
        headers = self._batch_headers.get(len(writes) * hn)
        now = time.time_ns()
        blocks: list[PieceBlock] = []
        results: list[Published | BaseException | None] = [None] * len(writes)
        at: list[int] = []  # the position in writes of each of blocks
        for i, req in enumerate(writes):
            try:
                block_hash = check_hash(req.block_hash)
                final = array.block_path(block_hash)
                header = headers[i * hn : (i + 1) * hn].data
                self._pack_fixed(header, block_hash, req.parent_hash, now)
            except Exception as exc:  # as HostEngine.map reports it: this block's result
                results[i] = exc
                continue
            blocks.append((temp_path_for(final, new_token()), final, header, spans[i]))
            at.append(i)
        engine = array.engine
        assert isinstance(engine, HostEngine)  # _piece_batches says so
        flags = NEW_FILE_FLAGS | (O_DIRECT if engine.direct.enabled else 0)
        mode = engine.config.file_mode
        codes = engine.map_batches(
            lambda part: self._fio.publish_pieces(part, flags, mode, plan), blocks
        )
        for i, block, code in zip(at, blocks, codes, strict=True):
            results[i] = self._piece_outcome(writes[i], block[1], code)
        return cast("list[Published | BaseException]", results)

    def _piece_batch(
        self, writes: Sequence[BlockWrite]
    ) -> tuple[PiecePlan, list[memoryview]] | None:
        """The plan and the spans of a batch :meth:`_publish_pieces` takes, or None. Blocks
        in one buffer each are taken where they are small: larger ones are hashed group by
        group as they are written (:meth:`_write_hashed`), which keeps them in the CPU cache."""
        layout = self.array.layout
        batch = batch_spans(
            [w.data for w in writes],
            layout.block_nbytes,
            layout.chunk_nbytes,
            whole=layout.block_nbytes < _HASHED_WRITE_MIN_NBYTES,
            writable=False,
        )
        if batch is None:
            return None
        geometry, spans = batch
        return self._piece_plans.plan(geometry), spans

    def _piece_outcome(self, req: BlockWrite, final: str, code: int) -> Published | BaseException:
        """A block's result from its :meth:`FileIO.publish_pieces` outcome ``code``."""
        if code == PUBLISHED:
            return WriteStatus.WRITTEN, final.rpartition(os.sep)[0], None
        if code == ALREADY_THERE:
            return WriteStatus.EXISTS, None, None
        try:  # the step-by-step path recovers (a lost fan-out directory) or reports it
            return self._publish(self._write_one(req))
        except Exception as exc:  # as HostEngine.map reports it: this block's result
            return exc

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
        if self._hashed_writes and isinstance(data, memoryview):
            return self._write_hashed(final, tmp, block_hash, req.parent_hash, data)
        file_nbytes: int | None = None
        if compressed is not None:
            assert isinstance(data, memoryview)
            parent = check_hash(req.parent_hash) if req.parent_hash is not None else None
            host, file_nbytes = compressed.segments(
                block_hash, parent, time.time_ns(), array.checksum_algo, data, layout.chunk_nbytes
            )
            segments: list[AnySegment] = list(host)
        else:
            header = self._header_of(block_hash, req.parent_hash, data)
            segments = [(0, header)]
            if layout.dense:
                segments.append((layout.data_offset, data))
            elif isinstance(data, memoryview) and array.engine.direct.enabled:
                # O_DIRECT cannot send chunks whose length is not a 4 KiB multiple: the padded
                # data region is assembled once, in aligned memory, by one strided copy (the
                # engine would otherwise stage every chunk and pad, one copy each).
                segments.append((layout.data_offset, self._padded_image(data)))
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

    def _write_hashed(
        self, final: str, tmp: str, block_hash: bytes, parent: bytes | None, data: memoryview
    ) -> Written:
        """The temporary file of a large raw dense block given as host memory, its chunks
        checksummed into the header's slots group by group as the data is written, the header
        (its fixed part packed first: its crc does not cover the slots) and the index written
        after the data (:meth:`HostEngine.write_new_file_hashed`). Same file as the path
        that hashes the whole block first."""
        layout = self.array.layout
        page: tuple[memoryview, np.ndarray] | None = getattr(self._pages, "page", None)
        header, slots = self._header_page() if page is None else page
        self._pack_fixed(header, block_hash, parent, time.time_ns())
        hashing: Hashing | None = getattr(self._pages, "hashing", None)
        if hashing is None:
            hashing = self._pages.hashing = Hashing(
                1, 2, XXH3_64, layout.chunk_nbytes, _HASH_GROUP_NBYTES, slots
            )
        segments: list[Segment] = [
            (0, header),
            (layout.data_offset, data),
            (layout.data_end, self._index),
        ]
        try:
            fd = self._recreating_fan_out(tmp, lambda: self._engine_hashed(tmp, segments, hashing))
        except BaseException:
            self.array.remove_quietly(tmp)
            raise
        return self._written(tmp, fd)

    def _engine_hashed(self, tmp: str, segments: list[Segment], hashing: Hashing) -> int:
        engine = self.array.engine
        assert isinstance(engine, HostEngine)  # _hashed_writes says so
        return engine.write_new_file_hashed(tmp, segments, self.array.layout.file_nbytes, hashing)

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
        header = self._header_into(block_hash, parent, time.time_ns(), sums)
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
                self._recreate_fan_out(tmp)  # (as _recreating_fan_out, without a closure)
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

    # -- headers of whole blocks ---------------------------------------------------------------

    def _padded_image(self, data: memoryview) -> memoryview:
        """The data region of a padded layout (chunks at their stride, zero padding) built in
        this thread's aligned buffer from the back-to-back chunks ``data``."""
        layout = self.array.layout
        n, size, stride = layout.num_chunks, layout.chunk_nbytes, layout.chunk_stride
        image = self._padded_images.get(n * stride)[: n * stride].reshape(n, stride)
        image[:, :size] = np.frombuffer(data, dtype=np.uint8, count=n * size).reshape(n, size)
        image[:, size:] = 0  # the buffer may hold another layout's bytes there
        return image.reshape(-1).data

    def _header_into(
        self, block_hash: bytes, parent: bytes | None, created_ns: int, sums: np.ndarray
    ) -> memoryview:
        """:meth:`header`, built in this thread's aligned header buffer (valid until the
        thread's next call): fixed part, checksum slots, zero padding."""
        page: tuple[memoryview, np.ndarray] | None = getattr(self._pages, "page", None)
        view, slots = self._header_page() if page is None else page
        slots[:] = sums  # as u64 little endian (the slots' dtype)
        self._pack_fixed(view, block_hash, parent, created_ns)
        return view

    def _header_of(self, block_hash: bytes, parent: bytes | None, data: Data) -> memoryview:
        """:meth:`_header_into` of a block created now whose canonical bytes are ``data``,
        the chunks' checksums computed straight into the header's slots (host memory) or on
        the tensor's device."""
        page: tuple[memoryview, np.ndarray] | None = getattr(self._pages, "page", None)
        view, slots = self._header_page() if page is None else page
        layout = self.array.layout
        algo = self.array.checksum_algo
        if isinstance(data, memoryview):
            chunk_sums(algo, data, layout.chunk_nbytes, layout.num_chunks, slots)
        else:
            slots[:] = chunk_checksums(algo, data, layout.chunk_nbytes, layout.num_chunks)
        self._pack_fixed(view, block_hash, parent, time.time_ns())
        return view

    def _header_page(self) -> tuple[memoryview, np.ndarray]:
        """The calling thread's header buffer of this array (created on its first use): the
        whole header as a memoryview, and its checksum slots as a ``<u8`` array over the same
        memory. Only :meth:`_header_into` writes it, always the fixed part and every slot,
        never the padding after the slots: that stays zero, as the fresh buffer was."""
        layout = self.array.layout
        buffer = aligned_buffer(layout.header_nbytes)  # zeroed
        slots = buffer[fmt.HEADER_FIXED_NBYTES : fmt.checksum_slot_offset(layout.num_chunks)]
        page = (buffer.data, slots.view("<u8"))
        self._pages.page = page
        return page

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

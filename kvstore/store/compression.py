"""Optional compression of inner chunks: the format v1 addendum (docs/format.md).

**Setting.** Compression is a property of a group array, chosen when the array is created from
:attr:`StoreConfig.compression <kvstore.config.StoreConfig.compression>` and recorded in the
array's ``zarr.json`` as the sharding codec's inner codec chain, ``bytes`` then ``blosc``, so
plain zarr-python (and any zarr v3 reader with blosc) decodes every value. It is also named in
``attributes.kvstore.compression``. Once the array exists its setting is authoritative: a
server configured with another one gets a :class:`~kvstore.errors.ConfigError` naming both
(tools that open a namespace by name adopt the stored setting).

=====================  ==================================================================
``none`` (default)     raw inner chunks at fixed 4 KiB-aligned offsets (format v1)
``lz4``                blosc ``lz4``, clevel 5, bit shuffle (typesize = element size)
``zstd-N`` (N = 1..9)  blosc ``zstd`` at blosc clevel N, bit shuffle (blosc maps clevel 1, 2,
                       3 to zstd levels 1, 3, 5)
=====================  ==================================================================

Bit shuffle, not byte shuffle: on bf16 KV values byte shuffle leaves the high bytes (sign and
exponent, ~4 bits of entropy) to lz4, which cannot entropy-code them (1.03x), while bit shuffle
turns the exponent bits into long runs (1.2x); zstd codes entropy either way and gains a few
per cent from bit shuffle. ``python scripts/bench.py --suite compression`` measures all of them.

**Shard file of a compressed block** (header flag ``FLAG_COMPRESSED``)::

    [0, header_nbytes)                  header as in format v1; chunk_stride = 0, file_nbytes =
                                        the actual file size; checksum slot c = checksum of the
                                        *stored* (compressed) bytes of chunk c
    [header_nbytes, data_end)           the compressed chunks back to back in chunk order, no
                                        padding (offsets depend on the data)
    [data_end, data_end + 16*n + 4)     standard zarr sharding index: (offset, nbytes) of every
                                        stored chunk, then crc32c; data_end = file size - 16*n - 4

The reader uses the standard index (one source of truth for offsets, with its own crc32c)
rather than a second table in the header. A compressed shard is written whole by one writer:
offsets are known only after compressing, so several ranks cannot fill one file at fixed
offsets, and O_DIRECT writes go through the engine's aligned staging copy.

**Reading** checks, in order: file size within bounds fixed by the geometry (at most
``header + n * (chunk_nbytes + 16) + index``, so a hostile file cannot make a reader allocate
more than about one block); header (magic, version, crc, key, namespace, group, geometry, the
compressed flag, file size); index crc32c and that the index describes exactly the packed
layout above, each stored chunk at most ``chunk_nbytes + 16`` bytes; the checksum of every
stored chunk it reads (before the decompressor sees the bytes); the blosc header (decoded size
= ``chunk_nbytes``, stored size = the index entry); then decompresses straight into the caller's
buffer. A whole-block read is one ``preadv`` of the file; a partial read (a TP rank's heads)
reads the header, the index, and each contiguous run of the chunks it needs.

**Several writers** (the vLLM connector: ranks write their parts of one block): ranks write raw
chunks into the temporary file at fixed offsets exactly as for uncompressed arrays; the
committer then reads the complete raw file, checks every chunk against the checksum its writer
recorded, compresses, writes the compressed file (fsynced when durable) under a new temporary
name, renames it into place and removes the raw file. The raw bytes are therefore written once
and read once more on the committing node: compression pays off where the published bytes
cross a slow or remote link, not on a fast local disk (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore.checksum import checksum_function
from kvstore.errors import BlockMissingError, ConfigError, CorruptBlockError, KvstoreError
from kvstore.io.buffers import ThreadStaging
from kvstore.io.engine import Engine
from kvstore.io.entries import FileId, corrupt_file_is
from kvstore.io.types import Segment
from kvstore.io.vectored import read_fully
from kvstore.store import check
from kvstore.store import format as fmt
from kvstore.store.check import ShardSpec
from kvstore.store.codec import Codec, compressed_bounds, decode_index, encode_index
from kvstore.store.segments import consecutive_runs
from kvstore.store.types import PendingBlock


class CompressedShards:
    """Whole-block writes, reads and commits of one compressed group array."""

    def __init__(self, codec: Codec, shard: ShardSpec, engine: Engine) -> None:
        self.codec = codec
        self.shard = shard  # the array's layout, namespace digest and group
        self.layout = shard.layout
        self.engine = engine
        self._fio = engine.fio
        self._staging = ThreadStaging()
        self.min_file, self.max_file = compressed_bounds(shard.layout)

    # -- writing -----------------------------------------------------------------------------

    def segments(  # noqa: PLR0913 - the header fields of the block (hash, parent, time, checksum algo) and its data with their stride
        self,
        block_hash: bytes,
        parent: bytes | None,
        created_ns: int,
        algo: int,
        data: memoryview,
        chunk_stride: int,
    ) -> tuple[list[Segment], int]:
        """The whole compressed file of a block whose chunk c is ``data[c*stride:][:nbytes]``."""
        layout = self.layout
        size = layout.chunk_nbytes
        stored = [
            memoryview(self.codec.compress(data[c * chunk_stride : c * chunk_stride + size]))
            for c in range(layout.num_chunks)
        ]
        fn = checksum_function(algo)
        sums = [fn(s) for s in stored]
        data_end = layout.data_offset + sum(len(s) for s in stored)
        file_nbytes = data_end + layout.index_nbytes
        header = bytearray(layout.header_nbytes)
        fixed = fmt.encode_fixed_header(
            layout,
            self.shard.namespace_digest,
            self.shard.group,
            block_hash,
            parent,
            algo,
            created_ns,
            compressed_file_nbytes=file_nbytes,
        )
        header[: len(fixed)] = fixed
        slots = fmt.encode_checksums(sums)
        header[fmt.HEADER_FIXED_NBYTES : fmt.HEADER_FIXED_NBYTES + len(slots)] = slots
        segments: list[Segment] = [(0, memoryview(header))]
        offset = layout.data_offset
        for s in stored:
            segments.append((offset, s))
            offset += len(s)
        index = encode_index([len(s) for s in stored], layout.data_offset)
        segments.append((data_end, memoryview(index)))
        return segments, file_nbytes

    def publish_from_raw(  # noqa: PLR0913 - the three file names of a multi-writer publish, the pending block and the publisher's callback
        self,
        raw_tmp: str,
        packed_tmp: str,
        final: str,
        pending: PendingBlock,
        publish: Callable[[str, str], FileId | None],
        slot_writes: Sequence[Segment] = (),
    ) -> FileId | None:
        """Compress the complete raw temporary file of a multi-writer block and publish it
        with ``publish(temporary, final)`` (:meth:`kvstore.store.publish.Publisher.publish_name`),
        returning what it returns.

        ``slot_writes`` are the checksum slots the committer computed for range-written chunks.
        Every chunk is checked against its slot, so bytes torn between the writers and the
        committer are never compressed into a block that would then verify. The compressed file
        is written as ``packed_tmp``, renamed to ``final``, and the raw file removed.
        """
        layout = self.layout
        staging = self._staging.get(layout.file_nbytes).data
        header = staging[: layout.header_nbytes]
        view = staging[layout.data_offset : layout.data_end]
        self.engine.read_file(
            raw_tmp,
            [(0, header), (layout.data_offset, view)],
            layout.file_nbytes,
            allow_trailer=True,
        )
        for offset, slot in slot_writes:
            header[offset : offset + len(slot)] = slot
        slots = fmt.decode_checksums(header, layout.num_chunks)
        fn = checksum_function(pending.checksum_algo)
        stride, size = layout.chunk_stride, layout.chunk_nbytes
        for c in range(layout.num_chunks):
            if fn(view[c * stride : c * stride + size]) != slots[c]:
                raise KvstoreError(
                    f"pending block: inner chunk {c} does not match the checksum its writer "
                    "recorded; not published"
                )
        segments, file_nbytes = self.segments(
            pending.block_hash,
            pending.parent_hash,
            pending.created_ns,
            pending.checksum_algo,
            view,
            stride,
        )
        try:
            self.engine.write_file(packed_tmp, segments, file_nbytes, exclusive=True)
            published = publish(packed_tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                self._fio.unlink(packed_tmp)
            raise
        with contextlib.suppress(OSError):
            self._fio.unlink(raw_tmp)
        return published

    # -- reading -----------------------------------------------------------------------------

    def read(  # noqa: PLR0913 - the block (path, hash), the chunks and their buffer, and the reader's verify/touch settings
        self,
        path: str,
        block_hash: bytes,
        chunks: Sequence[int],
        out: memoryview,
        verify: bool,
        touch_if_older_than_ns: int = 0,
    ) -> None:
        """Read, verify and decompress ``chunks`` of the block at ``path`` into ``out``.

        A :class:`CorruptBlockError` names the file read (``file_id``): it alone may be
        quarantined. A name that is not a regular file: :class:`EntryKindError`, never a wait.
        """
        try:
            fd, st = self._fio.open_regular(path)
        except FileNotFoundError:
            raise BlockMissingError(path) from None
        with corrupt_file_is(st):
            self._read_verified(fd, st, block_hash, chunks, out, verify, touch_if_older_than_ns)

    def _read_verified(  # noqa: PLR0913 - :meth:`read` on an open descriptor and its fstat
        self,
        fd: int,
        st: os.stat_result,
        block_hash: bytes,
        chunks: Sequence[int],
        out: memoryview,
        verify: bool,
        touch_if_older_than_ns: int,
    ) -> None:
        """:meth:`read` on the open descriptor ``fd`` (closed here)."""
        layout = self.layout
        fio = self._fio
        try:
            size = st.st_size
            if not self.min_file <= size <= self.max_file:
                raise CorruptBlockError(
                    f"file size: expected {self.min_file}..{self.max_file} bytes for a compressed "
                    f"block of this geometry, got {size}"
                )
            whole = len(chunks) == layout.num_chunks
            staging = self._staging.get(size if whole else 2 * self.max_file).data
            if whole:
                _read_exact(fio, fd, [staging[:size]], 0)
                header = staging[: layout.header_nbytes]
                index = staging[size - layout.index_nbytes : size]
                stored_at = 0  # file offset of staging[0]
            else:
                header = staging[: layout.header_nbytes]
                index = staging[layout.header_nbytes : layout.header_nbytes + layout.index_nbytes]
                _read_exact(fio, fd, [header], 0)
                _read_exact(fio, fd, [index], size - layout.index_nbytes)
            decoded = check.check_header(header, self.shard, block_hash, size)
            offsets = decode_index(index, layout, size)
            if not whole:
                # The stored runs go to staging past the header and index copies.
                base = layout.header_nbytes + layout.index_nbytes
                stored_at = layout.data_offset - base
                wanted = sorted(set(chunks))
                for i, j in consecutive_runs(wanted):
                    start, end = int(offsets[wanted[i]]), int(offsets[wanted[j - 1] + 1])
                    _read_exact(fio, fd, [staging[start - stored_at : end - stored_at]], start)
            if st.st_mtime_ns < touch_if_older_than_ns:
                # Last-use tracking is best effort (read-only mount, foreign owner).
                with contextlib.suppress(OSError):
                    fio.touch(fd)
        finally:
            fio.close(fd)
        slots = fmt.decode_checksums(header, layout.num_chunks)
        fn = check.chunk_checksum(decoded.checksum_algo) if verify else None
        size_raw = layout.chunk_nbytes
        for i, c in enumerate(chunks):
            stored = staging[int(offsets[c]) - stored_at : int(offsets[c + 1]) - stored_at]
            if fn is not None and fn(stored) != slots[c]:
                raise CorruptBlockError(f"checksum mismatch in inner chunk {c}")
            self.codec.decompress_into(stored, out[i * size_raw : (i + 1) * size_raw])

    def read_header(self, path: str, block_hash: bytes) -> tuple[fmt.BlockHeader, np.ndarray]:
        """The verified header and checksum slots of a published compressed block."""
        layout = self.layout
        fio = self._fio
        header = bytearray(layout.header_nbytes)
        try:
            fd, st = fio.open_regular(path)
        except FileNotFoundError:
            raise BlockMissingError(path) from None
        try:
            size = st.st_size
            if not self.min_file <= size <= self.max_file:
                raise CorruptBlockError(
                    f"file size: expected {self.min_file}..{self.max_file} bytes, got {size}"
                )
            _read_exact(fio, fd, [memoryview(header)], 0)
        finally:
            fio.close(fd)
        decoded = check.check_header(header, self.shard, block_hash, size)
        return decoded, fmt.decode_checksums(header, layout.num_chunks).copy()


def check_array_compression(stored: str, wanted: str, where: str) -> None:
    """ConfigError unless a server's configured compression matches the array's."""
    if stored != wanted:
        raise ConfigError(
            f"{where} was created with compression {stored!r} (its zarr.json), but this store "
            f"is configured with compression {wanted!r}; an array keeps its setting: configure "
            f"compression={stored!r} to use it, or use another store root"
        )


def _read_exact(fio: Any, fd: int, buffers: list[Any], offset: int) -> None:
    want = sum(len(b) for b in buffers)
    got = read_fully(fio, fd, buffers, offset)
    if got != want:
        raise CorruptBlockError(f"short read at {offset}: expected {want}, got {got}")

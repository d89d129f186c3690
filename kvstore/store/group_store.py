"""Block operations on one KV-cache group array: the hot path of kvstore.

Contract (every method takes and returns batches; one bad block never fails its batch):

* :meth:`GroupStore.contains` - which hashes have a published block.
* :meth:`GroupStore.longest_prefix` - how many leading blocks of a hash chain are present.
* :meth:`GroupStore.write_blocks` - write whole blocks, publish atomically.
* :meth:`GroupStore.begin_blocks`, :meth:`write_chunks`, :meth:`write_ranges`,
  :meth:`commit_blocks`, :meth:`abort_blocks` - the multi-writer protocol of DESIGN.md §4:
  every writer (rank) fills the same temporary file at fixed offsets, one party publishes.
* :meth:`GroupStore.read_blocks` - read whole blocks or chosen inner chunks (heads x layers)
  into caller buffers, touching only those byte ranges; every read verifies the header against
  the key and each chunk against its checksum. A missing, short, mis-keyed, foreign or corrupt
  block is a miss: one log line, counted, quarantined, never served.
* :meth:`GroupStore.delete_blocks`, :meth:`iter_blocks`, :meth:`read_header`.

Data and read buffers are host memory (anything with the buffer protocol) or uint8-viewable
``torch.Tensor`` objects. With an engine that takes device segments (GDS) a tensor stays where
it is: its checksums are computed on its device (``wsum64``) and its bytes move by cuFile; a
device read is verified on the device when the block's algorithm allows it, otherwise its
chunks are copied to the host for verification (logged once per store). With the other
engines a tensor is copied to host memory first (the efficient batched staging of device pages
is :class:`kvstore.rank_io.RankIO`'s, through the engine's :mod:`kvstore.io.staging`).

Published block files are immutable: they appear by ``rename`` of a complete, synced temporary
file and are only ever removed, so a reader never sees a partial block. A crash leaves only
``*.tmp-*`` files, which the admin CLI sweeps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvstore.checksum import (
    DEVICE_ALGOS,
    NAMES,
    checksum_chunks,
    checksum_function,
    checksum_id,
    checksum_tensor_rows,
)
from kvstore.errors import (
    BlockMissingError,
    CorruptBlockError,
    EntryKindError,
    KvstoreError,
    StoreFormatError,
)
from kvstore.identity import GroupSpec
from kvstore.io.buffers import ThreadStaging, is_aligned
from kvstore.io.engine import AnySegment, Data, Engine, device_engine
from kvstore.io.fileio import FileId, file_id, move_if_same, remove_if_same, sync_parents
from kvstore.io.staging import HostStaging, Staging
from kvstore.io.types import Segment
from kvstore.keys import check_hash, chunk_key
from kvstore.store import format as fmt
from kvstore.store.compression import Codec, CompressedShards
from kvstore.store.format import BlockHeader, ShardLayout
from kvstore.store.lookup import longest_present_prefix
from kvstore.store.types import (
    BlockRead,
    BlockWrite,
    ChunkWrite,
    PendingBlock,
    RangeWrite,
    ReadResult,
    ReadStatus,
    StoreStats,
    WriteResult,
    WriteStatus,
)

log = logging.getLogger("kvstore")

TMP_MARK = ".tmp-"


def temp_path_for(final: str, token: str) -> str:
    """The temporary file that becomes ``final``: ``<dir>/.<name>.tmp-<token>``.

    The dot-name shape is rsync's, which distributed file systems place like the final name:
    GlusterFS's default ``rsync-hash-regex`` (``^\\.(.+)\\.[^.]+$``) hashes it as ``<name>``, so
    temporary and final name live on the same brick and publishing with ``link(2)`` is one
    atomic link there. With any other shape, half the temporary files land on another brick
    and DHT's two-step cross-brick link lets two nodes both publish one block (measured:
    docs/shared-filesystems.md). Tokens never contain a dot.
    """
    directory, name = os.path.split(final)
    return os.path.join(directory, f".{name}{TMP_MARK}{token}")


def final_path_of(temp: str) -> str:
    """Inverse of :func:`temp_path_for`."""
    directory, name = os.path.split(temp)
    return os.path.join(directory, name[1 : name.rindex(TMP_MARK)])


# A publish step's outcome: status, the directory to sync, the identity of the file published.
_Published = tuple[WriteStatus, str | None, FileId | None]

SLOW_PROBE_S = 50e-6  # an existence probe slower than this is a network round trip
MAX_RANGE_WRITERS = 4096  # completion-marker bytes a pending file may carry past its end
_ZEROS = memoryview(bytes(fmt.ALIGN))
# Engines whose store already logged a device read verified through the host (once per store).
_HOST_VERIFY_LOGGED: weakref.WeakSet[object] = weakref.WeakSet()


@dataclass(frozen=True)
class StoredBlock:
    """A published block file found by :meth:`GroupStore.iter_blocks`."""

    path: Path
    hash_hi: int
    hash_lo: int
    nbytes: int
    mtime_ns: int


class GroupStore:
    """Blocks of one KV-cache group (array ``g<index>``) of one namespace."""

    def __init__(
        self,
        *,
        namespace: str,
        namespace_digest: bytes,
        index: int,
        spec: GroupSpec,
        layout: ShardLayout,
        array_path: Path,
        engine: Engine,
        leading_dims: int,
        stats: StoreStats,
        checksum: str,
        verify_reads: bool,
        quarantine_dir: Path | None,
        read_only: bool = False,
        compression: str = "none",
        staging: Staging | None = None,
    ) -> None:
        self.namespace = namespace
        self.namespace_digest = namespace_digest
        self.index = index
        self.spec = spec
        self.layout = layout
        self.array_path = array_path
        self.engine = engine
        # Device-segment engine (GDS) or None: whether tensors go to the engine as they are.
        self._device_engine = device_engine(engine)
        # How RankIO stages batches of rows for this engine (host, pinned or device rows).
        self.staging = staging or HostStaging()
        self.stats = stats
        self._leading_dims = leading_dims
        self._checksum_algo = checksum_id(checksum)
        self._verify = verify_reads
        self._quarantine_dir = quarantine_dir
        self.read_only = read_only
        self._fio = engine.fio
        self._array_prefix = str(array_path) + os.sep
        self._access_granularity_ns = engine.config.access_granularity_s * 1_000_000_000
        # O_DIRECT reads of aligned requests (config direct_reads, where O_DIRECT works).
        self._direct_reads = engine.config.direct_reads and engine.direct.enabled
        self._header_staging = ThreadStaging()
        # The array's inner-chunk compression (its zarr.json decides); None: raw chunks.
        self.compression = compression
        codec = Codec.for_name(compression, layout.itemsize)
        self._compressed = CompressedShards(self, codec) if codec is not None else None

    # -- naming ------------------------------------------------------------------------------

    def path_of(self, block_hash: bytes) -> str:
        """Absolute path of the block's published shard file."""
        return self._array_prefix + chunk_key(block_hash, self._leading_dims)

    def fanout_dir(self, hash_hi: int) -> Path:
        """Directory holding the shard files whose hash starts with byte ``hash_hi``."""
        return self.array_path.joinpath("c", *(["0"] * self._leading_dims), str(hash_hi))

    # -- lookup ------------------------------------------------------------------------------

    def contains(self, hashes: Sequence[bytes]) -> list[bool]:
        """For each hash, whether a published block exists (no content check).

        A probe that fails with an I/O error (EIO, EACCES, ...) answers "absent": a lookup is a
        cache question, and a miss only costs recompute. One log line per call.

        When the first probes are slow (a shared file system: each one a network round trip,
        a FUSE or NFS LOOKUP) the rest run on the I/O threads, overlapping up to
        ``io_threads`` round trips (measured on GlusterFS: docs/shared-filesystems.md); on a
        local disk (a few microseconds each) they stay on this thread.
        """
        probe = _Probe(self)
        checked = [check_hash(h) for h in hashes]
        started = time.perf_counter()
        found: list[bool | BaseException] = [probe(h) for h in checked[:2]]
        rest = checked[2:]
        if len(rest) > 1 and time.perf_counter() - started > len(found) * SLOW_PROBE_S:
            found += self.engine.map(probe, rest)
        else:
            found += [probe(h) for h in rest]
        probe.done(lookups=0)
        for result in found:
            if isinstance(result, BaseException):  # not an I/O error (those are misses): a bug
                raise result
        return [bool(f) for f in found]

    def longest_prefix(self, chain: Sequence[bytes]) -> int:
        """Number of leading blocks of ``chain`` (hashes of consecutive blocks) present.

        Binary search over existence probes, relying on chains being prefix-closed (eviction
        removes leaves first), then verified: positions spaced exponentially below the answer
        are probed too, and a hole found there shortens the answer. O(log n) probes. A probe
        that fails with an I/O error answers "absent", as in :meth:`contains`.
        """
        probe = _Probe(self)
        result = longest_present_prefix(len(chain), lambda i: probe(check_hash(chain[i])))
        probe.done(lookups=1)
        return result

    # -- whole-block writes ------------------------------------------------------------------

    def write_blocks(self, writes: Sequence[BlockWrite]) -> list[WriteResult]:
        """Write and publish whole blocks; blocks already present are skipped (EXISTS).

        Three passes over the batch: write every temporary file; sync each and rename it to
        its name; sync the directories. Each file is still synced before its rename and each
        directory after it, as one block at a time would, but syncing the files only once all
        of them are written lets the file system commit its journal once for many files
        rather than once per file (about +10-20 % write throughput with 2 MiB blocks, 4
        threads, ext4; see docs/performance.md).
        """
        self._check_writable()
        staged = self.engine.map(self._write_one, writes)
        results = self.engine.map(self._publish, staged)
        return self._finish_writes(results, [w.block_hash for w in writes])

    def _write_one(self, req: BlockWrite) -> str | None:
        """First pass of :meth:`write_blocks`: the block's temporary file, written but not
        synced; None when the block is already published."""
        block_hash = check_hash(req.block_hash)
        final = self.path_of(block_hash)
        if self._fio.exists(final):
            return None
        layout = self.layout
        data = self._data(req.data, host=self._compressed is not None)
        if _nbytes(data) != layout.block_nbytes:
            raise KvstoreError(
                f"block data: expected {layout.block_nbytes} bytes, got {_nbytes(data)}"
            )
        if self._compressed is not None:
            assert isinstance(data, memoryview)
            return self._write_compressed(block_hash, req.parent_hash, data, final)
        sums = _checksums(self._checksum_algo, data, layout.chunk_nbytes, layout.num_chunks)
        header = self._header(block_hash, req.parent_hash, time.time_ns(), sums)
        segments: list[AnySegment] = [(0, memoryview(header))]
        if layout.dense:
            segments.append((layout.data_offset, data))
        else:
            pad = _ZEROS[: layout.chunk_stride - layout.chunk_nbytes]
            for c in range(layout.num_chunks):
                start = c * layout.chunk_nbytes
                segments.append((layout.chunk_offset(c), data[start : start + layout.chunk_nbytes]))
                segments.append((layout.chunk_offset(c) + layout.chunk_nbytes, pad))
        segments.append((layout.data_end, memoryview(layout.index_bytes)))
        tmp = temp_path_for(final, uuid.uuid4().hex[:16])
        try:
            self._write_with_dir(tmp, segments, exclusive=True, sync=False)
        except BaseException:
            self._remove_quietly(tmp)
            raise
        return tmp

    def _publish(self, staged: str | BaseException | None) -> _Published:
        """Second pass of :meth:`write_blocks`: sync a written temporary file, then give it
        its name (never replacing one: FileIO.rename)."""
        if isinstance(staged, BaseException):
            raise staged  # the first pass failed: reported as this block's result
        if staged is None:
            return WriteStatus.EXISTS, None, None
        final = final_path_of(staged)
        try:
            if self.engine.config.durable:
                self._sync_file(staged)
            published = self.publish_name(staged, final)
        except BaseException:
            self._remove_quietly(staged)
            raise
        return WriteStatus.WRITTEN, os.path.dirname(final), published

    def publish_name(self, tmp: str, final: str) -> FileId | None:
        """Give the complete temporary file ``tmp`` the name ``final`` (never replacing one).

        Returns the identity of the file published when the store is durable: if the
        directory sync then fails, :meth:`_finish_writes` withdraws that file - and only that
        file, not a copy someone else published under the name since. One ``lstat`` of a name
        only this writer knows, on a path that syncs the file and its directory anyway.
        """
        published = file_id(self._fio.lstat_at(None, tmp)) if self.engine.config.durable else None
        self._fio.rename(tmp, final)
        return published

    def _sync_file(self, path: str) -> None:
        """fdatasync a file written (unsynced) earlier in the batch."""
        fd = self._fio.open(path, os.O_RDONLY)
        try:
            self._fio.fdatasync(fd)
        finally:
            self._fio.close(fd)

    def _write_compressed(
        self, block_hash: bytes, parent: bytes | None, data: memoryview, final: str
    ) -> str:
        """:meth:`_write_one` for a compressed array: the whole packed file, published alike."""
        assert self._compressed is not None
        segments, file_nbytes = self._compressed.segments(
            block_hash,
            check_hash(parent) if parent is not None else None,
            time.time_ns(),
            self._checksum_algo,
            data,
            self.layout.chunk_nbytes,
        )
        tmp = temp_path_for(final, uuid.uuid4().hex[:16])
        try:
            self._write_with_dir(tmp, segments, exclusive=True, file_nbytes=file_nbytes, sync=False)
        except BaseException:
            self._remove_quietly(tmp)
            raise
        return tmp

    def _header(
        self, block_hash: bytes, parent: bytes | None, created_ns: int, sums: Sequence[int]
    ) -> bytearray:
        header = bytearray(self.layout.header_nbytes)
        fixed = self._fixed_header(block_hash, parent, created_ns, self._checksum_algo)
        header[: len(fixed)] = fixed
        slots = fmt.encode_checksums(list(sums))
        header[fmt.HEADER_FIXED_NBYTES : fmt.HEADER_FIXED_NBYTES + len(slots)] = slots
        return header

    def _fixed_header(
        self, block_hash: bytes, parent: bytes | None, created_ns: int, algo: int
    ) -> bytes:
        return fmt.encode_fixed_header(
            self.layout,
            self.namespace_digest,
            self.index,
            block_hash,
            check_hash(parent) if parent is not None else None,
            algo,
            created_ns,
        )

    def _write_with_dir(
        self,
        path: str,
        segments: Sequence[AnySegment],
        *,
        exclusive: bool,
        file_nbytes: int | None = None,
        sync: bool = True,
    ) -> None:
        """engine.write_file, recreating a lost fan-out directory of a live array.

        If the array itself is gone (``kvstore rm`` removed the namespace while this server
        ran), the write fails instead of resurrecting a namespace without its metadata.
        ``file_nbytes``: the file's size when it is not the raw layout's (compressed blocks).
        """
        size = self.layout.file_nbytes if file_nbytes is None else file_nbytes
        try:
            self._engine_write(path, segments, size, exclusive, sync)
        except FileNotFoundError:
            if not self._fio.exists(self._array_prefix + "zarr.json"):
                raise KvstoreError(
                    f"namespace {self.namespace} was removed from the store (no {self.array_path}"
                    "/zarr.json); reopen the store to recreate it"
                ) from None
            # Recreated from the root without following a link: one planted where a fan-out
            # directory was must not receive block files (with their prompts) elsewhere.
            created: list[str] = []
            self._fio.close(self._open_chain(os.path.dirname(path), created))
            if self.engine.config.durable:
                sync_parents(self._fio, created)
            self._engine_write(path, segments, size, exclusive, sync)

    def _open_chain(self, directory: str, created: list[str] | None = None) -> int:
        """A descriptor of ``directory`` (below the store root), entered from the root with no
        link followed (:func:`~kvstore.io.fileio.open_dir_nofollow`); missing directories are
        created (and listed in ``created``) when ``created`` is given."""
        root = self.array_path.parent.parent  # <root>/<namespace>/g<k>
        parts = os.path.relpath(directory, root).split(os.sep)
        mode = None if created is None else self.engine.config.dir_mode
        return self._fio.open_dir(root, parts, mode, created)

    def _engine_write(
        self, path: str, segments: Sequence[AnySegment], size: int, exclusive: bool, sync: bool
    ) -> None:
        """Device segments to the device engine; host-only lists to any engine."""
        host = _host_segments(segments)
        if host is not None:
            self.engine.write_file(path, host, size, exclusive=exclusive, sync=sync)
            return
        assert self._device_engine is not None  # _data keeps tensors only for such engines
        self._device_engine.write_file(path, segments, size, exclusive=exclusive, sync=sync)

    def _data(self, buffer: object, *, host: bool = False) -> Data:
        """A caller's block bytes as the engine takes them: a flat uint8 tensor for a device
        engine (unless ``host``), host memory otherwise (tensors copied there)."""
        if not isinstance(buffer, torch.Tensor):
            return _byte_view(buffer)
        flat = _tensor_bytes(buffer)
        if self._device_engine is not None and not host:
            return flat
        if flat.device.type != "cpu":
            flat = flat.to("cpu")
        return flat.numpy().data

    def _finish_writes(
        self,
        results: Sequence[_Published | BaseException],
        hashes: Sequence[bytes],
    ) -> list[WriteResult]:
        """Fsync the directories of published blocks (once each), count, log failures."""
        out: list[WriteResult] = []
        dirs: set[str] = set()
        failures: list[str] = []
        published: dict[int, FileId | None] = {}
        for i, (result, block_hash) in enumerate(zip(results, hashes, strict=True)):
            if isinstance(result, FileExistsError) and result.filename2 == self.path_of(block_hash):
                # The publishing rename found the block there: another process or node
                # published it since our existence check (FileIO.rename never replaces).
                out.append(WriteResult(WriteStatus.EXISTS))
                continue
            if isinstance(result, BaseException):
                message = f"{type(result).__name__}: {result}"
                failures.append(f"{_short(block_hash)} ({message})")
                out.append(WriteResult(WriteStatus.FAILED, message))
                continue
            status, directory, identity = result
            if status is WriteStatus.WRITTEN and directory is not None:
                dirs.add(directory)
            published[i] = identity
            out.append(WriteResult(status))
        if dirs and self.engine.config.durable:
            ordered = sorted(dirs)
            synced = self.engine.map(self._fio.fsync_dir, ordered)
            bad_dirs = {
                d for d, e in zip(ordered, synced, strict=True) if isinstance(e, BaseException)
            }
            if bad_dirs:
                # The renames happened but may not survive a power loss. FAILED promises "not
                # published", so those blocks are withdrawn (a reader that got one read valid,
                # verified bytes; the engine just cannot count on the block).
                error = next(e for e in synced if isinstance(e, BaseException))
                message = f"directory fsync failed: {error}"
                for i, block_hash in enumerate(hashes):
                    path = self.path_of(block_hash)
                    if out[i].status is WriteStatus.WRITTEN and os.path.dirname(path) in bad_dirs:
                        self._withdraw(path, published.get(i))
                        out[i] = WriteResult(WriteStatus.FAILED, message)
                failures.append(message)
        written = sum(r.status is WriteStatus.WRITTEN for r in out)
        self.stats.add(
            blocks_written=written,
            blocks_existing=sum(r.status is WriteStatus.EXISTS for r in out),
            write_failures=sum(r.status is WriteStatus.FAILED for r in out),
            bytes_written=written * self.layout.block_nbytes,
        )
        if failures:
            log.warning(
                "kvstore: %d of %d block writes failed in %s/g%d, first: %s",
                len(failures),
                len(hashes),
                self.namespace,
                self.index,
                failures[0],
            )
        return out

    def _withdraw(self, path: str, published: FileId | None) -> None:
        """Remove the file this process published at ``path``, if the name still holds it
        (another node may have removed it and published its own copy meanwhile)."""
        if published is None:
            return  # not durable: no directory sync, nothing withdrawn
        with contextlib.suppress(OSError):
            remove_if_same(self._fio, None, path, published)

    # -- multi-writer protocol ----------------------------------------------------------------

    def begin_blocks(
        self, hashes: Sequence[bytes], parents: Sequence[bytes | None] | None = None
    ) -> list[PendingBlock]:
        """Descriptors of new pending blocks (no I/O); hand each to every writer of the block."""
        self._check_writable()
        parent_list = parents if parents is not None else [None] * len(hashes)
        now = time.time_ns()
        return [
            PendingBlock(
                namespace=self.namespace,
                group=self.index,
                block_hash=check_hash(h),
                parent_hash=check_hash(p) if p is not None else None,
                token=uuid.uuid4().hex[:16],
                created_ns=now,
                checksum_algo=self._checksum_algo,
            )
            for h, p in zip(hashes, parent_list, strict=True)
        ]

    def temp_path(self, pending: PendingBlock) -> str:
        """The temporary file all writers of ``pending`` fill."""
        self._check_pending(pending)
        return temp_path_for(self.path_of(pending.block_hash), pending.token)

    def write_chunks(self, writes: Sequence[ChunkWrite]) -> list[BaseException | None]:
        """Each writer's whole inner chunks, with their checksums, into the pending files.

        Returns, per item, None or the error (the caller then aborts the block).
        """
        return self._write_then_sync(self.engine.map(self._write_chunks_one, writes))

    def _write_then_sync(
        self, written: Sequence[str | BaseException]
    ) -> list[BaseException | None]:
        """Sync the pending files a writer's batch wrote (all of them written first, as in
        :meth:`write_blocks`); per item None or the error."""
        if self.engine.config.durable:
            written = self.engine.map(self._sync_written, written)
        return [r if isinstance(r, BaseException) else None for r in written]

    def _sync_written(self, path: str | BaseException) -> str:
        if isinstance(path, BaseException):
            raise path
        self._sync_file(path)
        return path

    def _write_chunks_one(self, item: ChunkWrite) -> str:
        layout = self.layout
        pending = item.pending
        data = self._data(item.data)
        chunks = list(item.chunks)
        if _nbytes(data) != len(chunks) * layout.chunk_nbytes:
            raise KvstoreError(
                f"chunk data: expected {len(chunks)} x {layout.chunk_nbytes} bytes, "
                f"got {_nbytes(data)}"
            )
        if any(not 0 <= c < layout.num_chunks for c in chunks):
            raise KvstoreError(f"chunk numbers: expected 0..{layout.num_chunks - 1}, got {chunks}")
        sums = _checksums(pending.checksum_algo, data, layout.chunk_nbytes, len(chunks))
        segments: list[AnySegment] = list(self._shared_segments(pending))
        segments.extend(self._chunk_segments(chunks, data))
        segments.sort(key=lambda s: s[0])
        # Checksum slots last (segments are written in list order): a filled slot tells the
        # committer the chunk is complete, so a writer killed mid-write must not leave a slot
        # in front of the chunk's bytes.
        for run_start, run_end in _consecutive_runs(chunks):
            slots = fmt.encode_checksums(sums[run_start:run_end])
            segments.append((fmt.checksum_slot_offset(chunks[run_start]), memoryview(slots)))
        path = self.temp_path(pending)
        self._write_with_dir(path, segments, exclusive=False, sync=False)
        return path

    def write_ranges(self, writes: Sequence[RangeWrite]) -> list[BaseException | None]:
        """Each writer's byte ranges inside inner chunks; checksums are computed at commit."""
        return self._write_then_sync(self.engine.map(self._write_ranges_one, writes))

    def _write_ranges_one(self, item: RangeWrite) -> str:
        layout = self.layout
        if not 0 <= item.writer_slot < MAX_RANGE_WRITERS:
            raise KvstoreError(
                f"range writer slot: expected 0..{MAX_RANGE_WRITERS - 1}, got {item.writer_slot}"
            )
        segments: list[AnySegment] = list(self._shared_segments(item.pending))
        # Completion marker past the end of the block: the committer checks every range writer
        # reported, since a missing writer's bytes are indistinguishable from zeros.
        segments.append((layout.file_nbytes + item.writer_slot, memoryview(b"\x01")))
        for offset, buffer in item.ranges:
            data = self._data(buffer)
            size = _nbytes(data)
            chunk, within = divmod(offset, layout.chunk_nbytes)
            if chunk >= layout.num_chunks or within + size > layout.chunk_nbytes or offset < 0:
                raise KvstoreError(
                    f"range write [{offset}, +{size}): expected it inside one inner chunk of "
                    f"{layout.chunk_nbytes} bytes within a {layout.block_nbytes}-byte block"
                )
            segments.append((layout.chunk_offset(chunk) + within, data))
        segments.sort(key=lambda s: s[0])
        path = self.temp_path(item.pending)
        self._write_with_dir(path, segments, exclusive=False, sync=False)
        return path

    def _shared_segments(self, pending: PendingBlock) -> list[Segment]:
        """The bytes every writer writes identically: the fixed header and the index."""
        self._check_pending(pending)
        fixed = self._fixed_header(
            pending.block_hash, pending.parent_hash, pending.created_ns, pending.checksum_algo
        )
        return [(0, memoryview(fixed)), (self.layout.data_end, memoryview(self.layout.index_bytes))]

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
        results = self.engine.map(self._commit_one, items)
        return self._finish_writes(results, [p.block_hash for p in pendings])

    def _commit_one(self, item: tuple[PendingBlock, Sequence[int], int]) -> _Published:
        pending, chunks, range_writers = item
        tmp = self.temp_path(pending)
        final = self.path_of(pending.block_hash)
        try:
            if self._fio.exists(final):
                self._remove_quietly(tmp)
                return WriteStatus.EXISTS, None, None
            slot_writes = self._complete_checksums(tmp, pending, chunks, range_writers)
            if self._compressed is not None:  # writers wrote raw chunks: compress, then publish
                packed = temp_path_for(final, uuid.uuid4().hex[:16])
                published = self._compressed.publish_from_raw(
                    tmp, packed, final, pending, slot_writes
                )
                return WriteStatus.WRITTEN, os.path.dirname(final), published
            self.engine.finish_file(tmp, self.layout.file_nbytes, slot_writes)
            published = self.publish_name(tmp, final)
        except BaseException:
            self._remove_quietly(tmp)
            raise
        return WriteStatus.WRITTEN, os.path.dirname(final), published

    def _complete_checksums(
        self, tmp: str, pending: PendingBlock, chunks: Sequence[int], range_writers: int
    ) -> list[Segment]:
        """Check every writer reported; return the checksum slot writes of range-written chunks."""
        layout = self.layout
        header = bytearray(layout.header_nbytes)
        chunk_bufs = [bytearray(layout.chunk_nbytes) for _ in chunks]
        markers = bytearray(range_writers)
        segments = [(0, memoryview(header))] + [
            (layout.chunk_offset(c), memoryview(b)) for c, b in zip(chunks, chunk_bufs, strict=True)
        ]
        self.engine.read_file(tmp, segments, layout.file_nbytes, allow_trailer=True)
        if range_writers:
            try:
                marks = [(layout.file_nbytes, memoryview(markers))]
                self.engine.read_file(tmp, marks, layout.file_nbytes, allow_trailer=True)
            except CorruptBlockError:
                pass  # the file ends before the last slots: those writers never reported
        silent = [slot for slot, flag in enumerate(markers) if flag != 1]
        if silent:
            raise KvstoreError(
                f"incomplete block: range writer slot(s) {silent} of {range_writers} never wrote"
            )
        check_header_for(fmt.decode_header(header), self, pending.block_hash)
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

    def abort_blocks(self, pendings: Sequence[PendingBlock]) -> None:
        """Remove the temporary files of pending blocks that will not be committed."""
        for pending in pendings:
            self._remove_quietly(self.temp_path(pending))

    def _check_writable(self) -> None:
        if self.read_only:
            raise KvstoreError(f"{self.namespace}/g{self.index}: store opened read-only")

    def _check_pending(self, pending: PendingBlock) -> None:
        if pending.namespace != self.namespace or pending.group != self.index:
            raise KvstoreError(
                f"pending block belongs to {pending.namespace}/g{pending.group}, "
                f"not {self.namespace}/g{self.index}"
            )

    # -- reads -------------------------------------------------------------------------------

    def read_blocks(self, reads: Sequence[BlockRead]) -> list[ReadResult]:
        """Read and verify blocks into the callers' buffers; failures are misses."""
        outcomes = self.engine.map(self._read_one, reads)
        results: list[ReadResult] = []
        hits = misses = corrupt = errors = nbytes = 0
        for outcome, req in zip(outcomes, reads, strict=True):
            if isinstance(outcome, BaseException):
                result = self._read_failure(outcome, req.block_hash)
            else:
                nbytes += outcome
                result = ReadResult(ReadStatus.HIT)
            hits += result.status is ReadStatus.HIT
            misses += result.status is ReadStatus.MISS
            corrupt += result.status is ReadStatus.CORRUPT
            errors += result.status is ReadStatus.ERROR
            results.append(result)
        self.stats.add(
            hits=hits, misses=misses, corrupt=corrupt, read_errors=errors, bytes_read=nbytes
        )
        return results

    def _read_one(self, req: BlockRead) -> int:
        block_hash = check_hash(req.block_hash)
        layout = self.layout
        whole = req.chunks is None
        chunks: Sequence[int] = range(layout.num_chunks) if whole else list(req.chunks or ())
        need = len(chunks) * layout.chunk_nbytes
        # A device buffer with a host-only engine (or a compressed array) is read through a
        # host bounce buffer and copied over after verification.
        device_out: torch.Tensor | None = None
        out: Data
        if isinstance(req.out, torch.Tensor):
            flat = _tensor_bytes(req.out)
            if self._device_engine is not None and self._compressed is None:
                out = flat
            elif flat.device.type == "cpu":
                out = flat.numpy().data
            else:
                device_out = flat
                out = torch.empty(need, dtype=torch.uint8).numpy().data
        else:
            out = _byte_view(req.out)
            if out.readonly:
                raise ValueError("read buffer: expected writable memory, got a read-only buffer")
        if _nbytes(out) < need:
            raise ValueError(f"read buffer: expected at least {need} bytes, got {_nbytes(out)}")
        if not whole and any(not 0 <= c < layout.num_chunks for c in chunks):
            raise ValueError(f"chunk numbers: expected 0..{layout.num_chunks - 1}, got {chunks}")
        touch_before = (
            time.time_ns() - self._access_granularity_ns
            if self._access_granularity_ns and not self.read_only
            else 0
        )
        if self._compressed is not None:
            assert isinstance(out, memoryview)
            path = self.path_of(block_hash)
            # CorruptBlockError carries the identity of the file read (CompressedShards.read)
            self._compressed.read(path, block_hash, chunks, out, self._verify, touch_before)
            if device_out is not None:
                device_out[:need].copy_(torch.frombuffer(out, dtype=torch.uint8)[:need])
            return need
        header: bytearray | memoryview
        if self._direct_reads:  # an aligned header buffer, so the whole read may be O_DIRECT
            header = self._header_staging.get(layout.header_nbytes)[: layout.header_nbytes].data
        else:
            header = bytearray(layout.header_nbytes)
        segments: list[AnySegment] = [
            (0, memoryview(header)),
            *self._chunk_segments(chunks, out),
        ]
        segments.sort(key=lambda s: s[0])
        host = _host_segments(segments)
        path = self.path_of(block_hash)
        read_id: FileId
        if host is None:
            assert self._device_engine is not None
            read_id = self._device_engine.read_file(
                path, segments, layout.file_nbytes, touch_before
            )
        else:
            direct = self._direct_reads and all(
                offset % fmt.ALIGN == 0 and is_aligned(data) for offset, data in host
            )
            read_id = self.engine.read_file(
                path, host, layout.file_nbytes, touch_before, direct=direct
            )
        try:
            decoded = fmt.decode_header(header)
            check_header_for(decoded, self, block_hash)
            if self._verify:
                self._verify_chunks(decoded.checksum_algo, header, chunks, out)
        except CorruptBlockError as exc:
            exc.file_id = read_id  # quarantine this file, not whatever has the name later
            raise
        if device_out is not None:
            device_out[:need].copy_(torch.frombuffer(out, dtype=torch.uint8)[:need])
        return need

    def _chunk_segments(self, chunks: Sequence[int], out: Data) -> list[AnySegment]:
        """File segments of ``chunks`` whose bytes lie back to back in ``out`` (runs merged)."""
        layout = self.layout
        size = layout.chunk_nbytes
        if layout.dense and isinstance(chunks, range) and chunks.step == 1:  # one run (whole)
            return [(layout.chunk_offset(chunks.start), out[: len(chunks) * size])]
        segments: list[AnySegment] = []
        i = 0
        while i < len(chunks):
            j = i + 1
            if layout.dense:  # consecutive chunk numbers are one contiguous file range
                while j < len(chunks) and chunks[j] == chunks[j - 1] + 1:
                    j += 1
            segments.append((layout.chunk_offset(chunks[i]), out[i * size : j * size]))
            i = j
        return segments

    def _verify_chunks(
        self, algo: int, header: bytearray | memoryview, chunks: Sequence[int], out: Data
    ) -> None:
        layout = self.layout
        try:
            fn = checksum_function(algo)
        except StoreFormatError as exc:
            raise CorruptBlockError(str(exc)) from None
        slots = fmt.decode_checksums(header, layout.num_chunks)
        size = layout.chunk_nbytes
        if isinstance(out, torch.Tensor):
            if algo not in DEVICE_ALGOS:
                self._log_host_verify(algo)
            rows = out[: len(chunks) * size].view(len(chunks), size)
            sums = np.asarray(checksum_tensor_rows(algo, rows), dtype=np.uint64)
        else:
            sums = np.fromiter(
                (fn(out[i : i + size]) for i in range(0, len(chunks) * size, size)),
                dtype=np.uint64,
                count=len(chunks),
            )
        bad = np.flatnonzero(sums != slots[np.asarray(chunks, dtype=np.intp)])
        if len(bad):
            raise CorruptBlockError(f"checksum mismatch in inner chunk {chunks[int(bad[0])]}")

    def _log_host_verify(self, algo: int) -> None:
        if self.engine in _HOST_VERIFY_LOGGED:
            return
        _HOST_VERIFY_LOGGED.add(self.engine)
        log.info(
            "kvstore: blocks checksummed with %s are verified through host memory when read "
            "into device buffers (write them with wsum64 to verify on the device)",
            NAMES.get(algo, algo),
        )

    def _read_failure(self, exc: BaseException, block_hash: bytes) -> ReadResult:
        if isinstance(exc, BlockMissingError):
            return ReadResult(ReadStatus.MISS)
        if isinstance(exc, ValueError | KvstoreError) and not isinstance(
            exc, CorruptBlockError | OSError
        ):
            raise exc  # a caller bug (bad buffer, bad hash), not a block problem
        if isinstance(exc, CorruptBlockError):
            where = self._quarantine(block_hash, exc.file_id)
            log.warning(
                "kvstore: block %s of %s/g%d is corrupt (%s); served as a miss, %s",
                _short(block_hash),
                self.namespace,
                self.index,
                exc,
                where,
            )
            return ReadResult(ReadStatus.CORRUPT, str(exc))
        log.warning(
            "kvstore: reading block %s of %s/g%d failed (%s); served as a miss",
            _short(block_hash),
            self.namespace,
            self.index,
            exc,
        )
        return ReadResult(ReadStatus.ERROR, str(exc))

    def _quarantine(self, block_hash: bytes, read_id: FileId | None) -> str:
        """Move the corrupt file that was read (``read_id``) out of the block's name, into
        ``<namespace>/quarantine``; the words for the log line say what happened.

        Every directory on the way is entered without following a symbolic link
        (:func:`~kvstore.io.fileio.open_dir_nofollow`, from the store root), and the rename
        goes between those open directories: a link planted at ``quarantine`` (or anywhere
        above the block) never takes the file out of the root. If ``quarantine`` is not a real
        directory the file is removed instead (it is never served either way). The file is
        moved only while the name still holds the file read (:func:`move_if_same`): another
        reader or ``verify --fix`` may have removed it and a writer re-published a good copy.
        """
        path = self.path_of(block_hash)
        if self.read_only:
            return "left in place (store opened read-only)"
        if read_id is None:  # an engine that does not say what it read: touch nothing
            return "left in place (the file read is not known)"
        fanout = os.path.dirname(path)
        name = os.path.basename(path)
        qdir = self._quarantine_dir
        try:
            src_fd = self._open_chain(fanout)
        except FileNotFoundError:
            return "already gone"
        except (OSError, ValueError) as exc:
            return f"left in place (cannot enter {fanout}: {exc})"
        try:
            if qdir is None:
                return self._outcome(remove_if_same(self._fio, src_fd, name, read_id), None)
            target = f"g{self.index}-{os.path.basename(fanout)}-{name}-{time.time_ns()}"
            try:
                q_fd = self._fio.open_dir(
                    qdir.parent.parent,
                    [qdir.parent.name, qdir.name],
                    create_mode=self.engine.config.dir_mode,
                )
            except (EntryKindError, OSError) as exc:
                outcome = remove_if_same(self._fio, src_fd, name, read_id)
                return f"{self._outcome(outcome, None)}: cannot quarantine ({exc})"
            try:
                outcome = move_if_same(self._fio, src_fd, name, q_fd, target, read_id)
            finally:
                self._fio.close(q_fd)
            return self._outcome(outcome, qdir / target)
        except OSError as exc:
            return f"could not quarantine ({exc})"
        finally:
            self._fio.close(src_fd)

    @staticmethod
    def _outcome(outcome: str, target: Path | None) -> str:
        """Log words for a :func:`move_if_same` / :func:`remove_if_same` outcome."""
        if outcome == "moved":
            return f"quarantined as {target}"
        if outcome == "gone":
            return "already gone"
        if outcome == "replaced":
            return "left in place (the name holds another file since the read)"
        return outcome  # "removed"

    def read_header(self, block_hash: bytes) -> tuple[BlockHeader, np.ndarray]:
        """The verified header and checksum slots of a published block (for tools)."""
        block_hash = check_hash(block_hash)
        if self._compressed is not None:
            return self._compressed.read_header(self.path_of(block_hash), block_hash)
        header = bytearray(self.layout.header_nbytes)
        self.engine.read_file(
            self.path_of(block_hash), [(0, memoryview(header))], self.layout.file_nbytes
        )
        decoded = fmt.decode_header(header)
        check_header_for(decoded, self, block_hash)
        return decoded, fmt.decode_checksums(header, self.layout.num_chunks).copy()

    # -- removal and iteration ---------------------------------------------------------------

    def delete_blocks(self, hashes: Sequence[bytes]) -> int:
        """Remove published blocks; returns how many existed."""
        self._check_writable()
        removed = 0
        for h in hashes:
            try:
                self._fio.unlink(self.path_of(check_hash(h)))
                removed += 1
            except FileNotFoundError:
                pass
        return removed

    def iter_blocks(self) -> Iterator[StoredBlock]:
        """Every published block file of this group (temporary files skipped), unordered."""
        for hi in range(256):
            directory = self.fanout_dir(hi)
            try:
                entries = list(os.scandir(directory))
            except FileNotFoundError:
                continue
            for entry in entries:
                if not entry.name.isdigit():
                    continue
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue  # removed while we listed
                yield StoredBlock(Path(entry.path), hi, int(entry.name), st.st_size, st.st_mtime_ns)

    def _remove_quietly(self, path: str) -> None:
        with contextlib.suppress(OSError):
            self._fio.unlink(path)


class _Probe:
    """Existence probes of one lookup call: I/O errors are misses, counted and logged once."""

    def __init__(self, group: GroupStore) -> None:
        self._group = group
        self._exists = group._fio.exists
        self.probes = 0
        self.errors = 0
        self._first: OSError | None = None
        self._lock = threading.Lock()  # contains() probes from the I/O threads

    def __call__(self, block_hash: bytes) -> bool:
        try:
            found = self._exists(self._group.path_of(block_hash))
        except OSError as exc:
            with self._lock:
                self.errors += 1
                self._first = self._first or exc
            found = False
        with self._lock:
            self.probes += 1
        return found

    def done(self, lookups: int) -> None:
        g = self._group
        g.stats.add(lookups=lookups, probes=self.probes, read_errors=self.errors)
        if self._first is not None:
            log.warning(
                "kvstore: %d of %d existence probes in %s/g%d failed (first: %s); "
                "answered as misses",
                self.errors,
                self.probes,
                g.namespace,
                g.index,
                self._first,
            )


def check_header_for(header: BlockHeader, group: GroupStore, block_hash: bytes) -> None:
    """:func:`format.check_header` against a group's identity and layout."""
    fmt.check_header(header, group.layout, group.namespace_digest, group.index, block_hash)


def _consecutive_runs(chunks: Sequence[int]) -> Iterator[tuple[int, int]]:
    """[start, end) index ranges of ``chunks`` whose numbers increase by one."""
    start = 0
    for i in range(1, len(chunks) + 1):
        if i == len(chunks) or chunks[i] != chunks[i - 1] + 1:
            yield start, i
            start = i


def _nbytes(data: Data) -> int:
    return data.numel() if isinstance(data, torch.Tensor) else len(data)


def _tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor (a view, no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("buffer: expected a contiguous tensor")
    flat = tensor.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _checksums(algo: int, data: Data, chunk_nbytes: int, count: int) -> list[int]:
    """Checksums of ``count`` chunks of ``data``: on the tensor's device for device data."""
    if isinstance(data, torch.Tensor):
        if count == 0:
            return []
        return checksum_tensor_rows(algo, data[: count * chunk_nbytes].view(count, chunk_nbytes))
    return checksum_chunks(algo, data, chunk_nbytes, count)


def _host_segments(segments: Sequence[AnySegment]) -> list[Segment] | None:
    """``segments`` typed as host segments when none holds a tensor, else None."""
    if any(isinstance(data, torch.Tensor) for _, data in segments):
        return None
    return [(offset, data) for offset, data in segments if not isinstance(data, torch.Tensor)]


def _byte_view(buffer: object) -> memoryview:
    view = memoryview(buffer)  # type: ignore[arg-type]
    if not view.c_contiguous:
        raise ValueError("buffer: expected C-contiguous memory")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _short(block_hash: bytes) -> str:
    return block_hash.hex()[:16]

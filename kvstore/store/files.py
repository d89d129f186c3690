"""The file steps every block write shares: headers, writing a file, naming it, finishing a batch.

Both ways of writing a block go through :class:`BlockFiles`: the whole-block publisher
(:class:`kvstore.store.publish.Publisher`, one writer per block) and the multi-writer protocol
(:mod:`kvstore.store.pending`, many writers fill one file, one publishes it). The steps:

* the header of a block (its fixed part and checksum slots) and the chunks' checksums;
* writing a file through the array's engine (host or device segments), recreating a fan-out
  directory that vanished while the array itself is still there;
* syncing a file written unsynced earlier in a batch, and naming a complete temporary file
  with its final name, never replacing one;
* finishing a batch: one fsync per distinct directory of the blocks published, withdrawing the
  blocks of a directory whose sync failed, counting, one log line for the failures.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvstore.checksum import checksum_chunks, checksum_tensor_rows
from kvstore.errors import KvstoreError
from kvstore.io.engine import AnySegment, Data
from kvstore.io.entries import FileId, file_id, remove_if_same
from kvstore.io.fileio import sync_parents
from kvstore.keys import check_hash
from kvstore.store import format as fmt
from kvstore.store.array import GroupArray, short_hash
from kvstore.store.paths import ZARR_JSON
from kvstore.store.segments import engine_data, host_segments
from kvstore.store.types import WriteResult, WriteStatus

log = logging.getLogger("kvstore")

T = TypeVar("T")


@dataclass(slots=True)
class Written:
    """A temporary block file the first pass of :meth:`Publisher.write_blocks` wrote, with
    its descriptor while the batch holds it (durable stores: the file is synced on it, and
    its identity is read from it only if a directory sync fails); None once closed."""

    tmp: str
    fd: int | None


# A publish step's outcome: status, the directory to sync, the file published: its identity,
# or the written file whose descriptor tells it (None when the store is not durable).
Published = tuple[WriteStatus, str | None, FileId | Written | None]


# Results without an error message are immutable: one object each for every block.
_WRITTEN = WriteResult(WriteStatus.WRITTEN)
_EXISTS = WriteResult(WriteStatus.EXISTS)


def new_token() -> str:
    """A fresh temporary-file token (no dot: see :func:`~kvstore.store.paths.temp_path_for`):
    16 hex digits of 64 random bits (as ``uuid4().hex[:16]`` gave, without the UUID object)."""
    return os.urandom(8).hex()


class BlockFiles:
    """The file steps of one group array that every block write shares (module docstring)."""

    def __init__(self, array: GroupArray) -> None:
        self.array = array
        self._fio = array.fio
        # The fixed header fields every block of the array shares, packed once.
        self._fixed = fmt.FixedHeaderTemplate(array.layout, array.namespace_digest, array.index)

    def header(
        self, block_hash: bytes, parent: bytes | None, created_ns: int, sums: Sequence[int]
    ) -> bytearray:
        """The whole header of a raw block: fixed part and every checksum slot."""
        header = bytearray(self.array.layout.header_nbytes)
        fixed = self.fixed_header(block_hash, parent, created_ns, self.array.checksum_algo)
        header[: len(fixed)] = fixed
        slots = fmt.encode_checksums(list(sums))
        header[fmt.HEADER_FIXED_NBYTES : fmt.HEADER_FIXED_NBYTES + len(slots)] = slots
        return header

    def pack_fixed(
        self, view: memoryview, block_hash: bytes, parent: bytes | None, created_ns: int
    ) -> None:
        """The fixed part of a header into ``view`` (``parent`` checked here)."""
        self._fixed.pack_into(
            view,
            block_hash,
            check_hash(parent) if parent is not None else None,
            self.array.checksum_algo,
            created_ns,
        )

    def fixed_header(
        self, block_hash: bytes, parent: bytes | None, created_ns: int, algo: int
    ) -> bytes:
        """The fixed part of a block's header (:func:`~kvstore.store.format.encode_fixed_header`
        of this array)."""
        parent_hash = check_hash(parent) if parent is not None else None
        return self._fixed.encode(block_hash, parent_hash, algo, created_ns)

    def data(self, buffer: object, *, host: bool = False) -> Data:
        """A caller's bytes as this array's engine takes them (:func:`engine_data`)."""
        return engine_data(buffer, self.array.device_engine, host=host)

    def write_file(
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
        size = self.array.layout.file_nbytes if file_nbytes is None else file_nbytes
        self.recreating_fan_out(
            path, lambda: self._engine_write(path, segments, size, exclusive, sync)
        )

    def recreating_fan_out(self, path: str, write: Callable[[], T]) -> T:
        """``write()`` into ``path``; if its fan-out directory is gone, recreated and again
        (see :meth:`write_file`)."""
        try:
            return write()
        except FileNotFoundError:
            self._recreate_fan_out(path)
            return write()

    def _recreate_fan_out(self, path: str) -> None:
        """After a write into ``path`` found no directory: its fan-out directory recreated,
        or :class:`KvstoreError` when the array itself is gone (see :meth:`write_file`)."""
        array = self.array
        if not self._fio.exists(f"{array.array_path}{os.sep}{ZARR_JSON}"):
            raise KvstoreError(
                f"namespace {array.namespace} was removed from the store (no "
                f"{array.array_path}/{ZARR_JSON}); reopen the store to recreate it"
            ) from None
        # Recreated from the root without following a link: one planted where a fan-out
        # directory was must not receive block files (with their prompts) elsewhere.
        created: list[str] = []
        self._fio.close(array.open_dir(os.path.dirname(path), created))
        if array.engine.config.durable:
            sync_parents(self._fio, created)

    def _engine_write(
        self, path: str, segments: Sequence[AnySegment], size: int, exclusive: bool, sync: bool
    ) -> None:
        """Device segments to the device engine; host-only lists to any engine."""
        host = host_segments(segments)
        if host is not None:
            self.array.engine.write_file(path, host, size, exclusive=exclusive, sync=sync)
            return
        device = self.array.device_engine
        assert device is not None  # data() keeps tensors only for such engines
        device.write_file(path, segments, size, exclusive=exclusive, sync=sync)

    def sync_file(self, path: str) -> None:
        """fdatasync a file written (unsynced) earlier in the batch."""
        fd = self._fio.open(path, os.O_RDONLY)
        try:
            self._fio.fdatasync(fd)
        finally:
            self._fio.close(fd)

    def publish_name(self, tmp: str, final: str) -> FileId | None:
        """Give the complete temporary file ``tmp`` the name ``final`` (never replacing one).

        Returns the identity of the file published when the store is durable: if the
        directory sync then fails, :meth:`finish_writes` withdraws that file - and only that
        file, not a copy someone else published under the name since. One ``lstat`` of a name
        only this writer knows, on a path that syncs the file and its directory anyway.
        """
        durable = self.array.engine.config.durable
        published = file_id(self._fio.lstat_at(None, tmp)) if durable else None
        self._fio.rename(tmp, final)
        return published

    def finish_writes(
        self, results: Sequence[Published | BaseException], hashes: Sequence[bytes]
    ) -> list[WriteResult]:
        """Fsync the directories of published blocks (once each), count, log failures."""
        array = self.array
        durable = array.engine.config.durable
        out: list[WriteResult] = []
        # Directories to sync and the identities of the files published: kept only when
        # the store is durable (nothing else reads them).
        dirs: set[str] = set()
        failures: list[str] = []
        published: dict[int, FileId | Written | None] = {}
        for i, (result, block_hash) in enumerate(zip(results, hashes, strict=True)):
            if type(result) is tuple:  # published, or present already (the common cases)
                status, directory, identity = result
                out.append(_WRITTEN if status is WriteStatus.WRITTEN else _EXISTS)
                if durable:
                    if status is WriteStatus.WRITTEN and directory is not None:
                        dirs.add(directory)
                    published[i] = identity
                continue
            if isinstance(result, FileExistsError) and result.filename2 == array.block_path(
                block_hash
            ):
                # The publishing rename found the block there: another process or node
                # published it since our existence check (FileIO.rename never replaces).
                out.append(_EXISTS)
                continue
            assert isinstance(result, BaseException)  # Published is a tuple
            message = f"{type(result).__name__}: {result}"
            failures.append(f"{short_hash(block_hash)} ({message})")
            out.append(WriteResult(WriteStatus.FAILED, message))
        if dirs:
            failures += self._sync_dirs(sorted(dirs), hashes, out, published)
        # Counted once the directory syncs have withdrawn what they must (one pass, statuses
        # compared by identity: an Enum's hash is a Python-level call).
        written = existing = 0
        for outcome in out:
            if outcome.status is WriteStatus.WRITTEN:
                written += 1
            elif outcome.status is WriteStatus.EXISTS:
                existing += 1
        array.stats.add(
            blocks_written=written,
            blocks_existing=existing,
            write_failures=len(out) - written - existing,
            bytes_written=written * array.layout.block_nbytes,
        )
        if failures:
            log.warning(
                "kvstore: %d of %d block writes failed in %s, first: %s",
                len(failures),
                len(hashes),
                array.label,
                failures[0],
            )
        return out

    def _sync_dirs(
        self,
        ordered: list[str],
        hashes: Sequence[bytes],
        out: list[WriteResult],
        published: dict[int, FileId | Written | None],
    ) -> list[str]:
        """Fsync the directories of a batch; blocks in one that failed are withdrawn."""
        synced = self.array.engine.map(self._fio.fsync_dir, ordered)
        bad_dirs = {d for d, e in zip(ordered, synced, strict=True) if isinstance(e, BaseException)}
        if not bad_dirs:
            return []
        # The renames happened but may not survive a power loss. FAILED promises "not
        # published", so those blocks are withdrawn (a reader that got one read valid,
        # verified bytes; the engine just cannot count on the block).
        error = next(e for e in synced if isinstance(e, BaseException))
        message = f"directory fsync failed: {error}"
        for i, block_hash in enumerate(hashes):
            path = self.array.block_path(block_hash)
            if out[i].status is WriteStatus.WRITTEN and os.path.dirname(path) in bad_dirs:
                self._withdraw(path, published.get(i))
                out[i] = WriteResult(WriteStatus.FAILED, message)
        return [message]

    def _withdraw(self, path: str, published: FileId | Written | None) -> None:
        """Remove the file this process published at ``path``, if the name still holds it
        (another node may have removed it and published its own copy meanwhile)."""
        if published is None:
            return  # not durable: no directory sync, nothing withdrawn
        with contextlib.suppress(OSError):
            if isinstance(published, Written):
                assert published.fd is not None  # held until the batch's directory syncs end
                published = file_id(self._fio.fstat(published.fd))
            remove_if_same(self._fio, None, path, published)


def chunk_checksums(algo: int, data: Data, chunk_nbytes: int, count: int) -> list[int]:
    """Checksums of ``count`` chunks of ``data``: on the tensor's device for device data."""
    if isinstance(data, memoryview):
        return checksum_chunks(algo, data, chunk_nbytes, count)
    if count == 0:
        return []
    return checksum_tensor_rows(algo, data[: count * chunk_nbytes].view(count, chunk_nbytes))

"""Host I/O engine: a thread pool doing ``pwritev``/``preadv`` on block files.

Contract of an I/O engine (the GPU engines implement the same):

* :meth:`HostEngine.map` runs a function over many items on the I/O threads and returns the
  results in order (exceptions are returned, not raised, so one bad block never fails a batch).
* :meth:`HostEngine.write_file` writes byte segments into a block file at fixed offsets, in
  the order given (so a writer killed half way has written a prefix of the list). With
  ``exclusive=True`` the file is new (``O_EXCL``) and the segments tile ``[0, file_nbytes)``;
  otherwise the file may already hold other writers' segments. A new file ends at
  ``file_nbytes``; when the store is durable it is fdatasync'ed before the call returns,
  unless ``sync=False``: then the caller syncs it (the group store writes a whole batch first
  and syncs it after, so that one journal commit covers many files).
* :meth:`HostEngine.write_new_file` writes a new file as ``write_file(exclusive=True)`` does,
  unsynced, and hands its open descriptor to the caller, which syncs it when the batch is
  written and closes it (no second open per file to sync it).
* :meth:`HostEngine.read_file` reads segments of a published file after checking its size.

Writes of new whole files use O_DIRECT when the probe at start-up passed: page-aligned
buffers are passed straight to the kernel and anything else is copied once into a per-thread
aligned staging buffer; the last partial page is written buffered on the same descriptor
(O_DIRECT cleared with one ``fcntl``), so the file never needs truncating. Partial writes
(several writers per file) and reads are buffered: reads with several threads beat O_DIRECT
reads on the measured disks, and partial writes touch the header page that other writers
share.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TypeVar

import numpy as np

from kvstore.callargs import address, ssize
from kvstore.checksum import chunk_sums
from kvstore.config import StoreConfig
from kvstore.errors import BlockMissingError, ConfigError
from kvstore.io.align import ALIGN, align_up
from kvstore.io.buffers import ThreadStaging, aligned_buffer, is_aligned
from kvstore.io.callcheck import check_segments
from kvstore.io.deadline import DaemonWorkers
from kvstore.io.entries import FileId
from kvstore.io.fileio import (
    NEW_FILE_FLAGS,
    O_DIRECT,
    PROBE_PREFIX,
    FileIO,
    filesystem_type,
)
from kvstore.io.fileproto import native_fileproto
from kvstore.io.native_fileio import DEFAULT_FILEIO
from kvstore.io.newfile import NewFilePlan, plan_new_file
from kvstore.io.types import DirectIOProbe, EngineCapabilities, Hashing, Segment
from kvstore.io.vectored import coalesce, write_fully

log = logging.getLogger("kvstore.io")

T = TypeVar("T")
R = TypeVar("R")


def probe_direct_io(directory: Path, mode: str, fio: FileIO = DEFAULT_FILEIO) -> DirectIOProbe:
    """Can ``directory`` take aligned O_DIRECT writes, then a buffered tail on the same
    descriptor (what every new block file gets)?

    ``mode`` is the config's ``direct_io``: "off" skips the probe, "on" turns a failure into a
    :class:`ConfigError`, "auto" falls back to buffered writes with one log line.
    """
    if mode == "off":
        return DirectIOProbe(False, "direct_io=off")
    fs_type = filesystem_type(directory)
    if not O_DIRECT:
        result = DirectIOProbe(False, "O_DIRECT is not available on this platform")
    elif mode == "auto" and fs_type.startswith("fuse"):
        # FUSE file systems pass O_DIRECT on to their servers: a GlusterFS brick then writes
        # each fragment of a request unbuffered and, under load, fails odd-sized fragments
        # with EINVAL at write or fdatasync time - long after a start-up probe passed
        # (docs/shared-filesystems.md). Buffered writes there; direct_io=on still tries.
        result = DirectIOProbe(False, f"{fs_type} file system: O_DIRECT is left to its servers")
    else:
        probe = directory / f"{PROBE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        buffer = aligned_buffer(ALIGN)
        try:
            fd = fio.open(str(probe), os.O_CREAT | os.O_EXCL | os.O_WRONLY | O_DIRECT)
            try:  # what a block write does: aligned pages direct, then a buffered tail
                fio.pwritev(fd, [buffer.data], 0)
                fio.clear_direct(fd, os.O_CREAT | os.O_EXCL | os.O_WRONLY | O_DIRECT)
                fio.pwritev(fd, [memoryview(b"\0")], ALIGN)
            finally:
                fio.close(fd)
            result = DirectIOProbe(True, "O_DIRECT probe passed")
        except OSError as exc:
            result = DirectIOProbe(False, f"O_DIRECT probe failed in {directory}: {exc}")
        finally:
            with contextlib.suppress(OSError):
                fio.unlink(str(probe))
    if not result.enabled:
        if mode == "on":
            raise ConfigError(f"direct_io=on: expected O_DIRECT to work, but {result.reason}")
        log.info("kvstore: buffered writes (%s)", result.reason)
    return result


class HostEngine:
    """Moves block bytes between host memory and files with a pool of I/O threads."""

    name = "host"
    capabilities = EngineCapabilities(hashed_io=True, batches=True)

    def __init__(
        self, config: StoreConfig, fio: FileIO = DEFAULT_FILEIO, probe: bool = True
    ) -> None:
        self.config = config
        self.fio = fio
        self.direct = (
            probe_direct_io(config.root, config.direct_io, fio)
            if probe
            else DirectIOProbe(False, "not probed (read-only)")
        )
        self._threads = config.io_threads
        # Daemon threads: one stuck in a hung mount must not hold up the process's exit.
        self._workers = DaemonWorkers(config.io_threads, "kvstore-io")
        self._staging = ThreadStaging()
        self._closed = False

    # -- scheduling -------------------------------------------------------------------------

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R | BaseException]:
        """``fn`` over ``items`` on the I/O threads; results (or the exception) in order."""
        n = len(items)
        results: list[R | BaseException] = [None] * n  # type: ignore[list-item]
        if n == 0:
            return results
        if n == 1 or self._threads == 1 or self._closed:  # closed: no thread would take work
            for i, item in enumerate(items):
                results[i] = _call(fn, item)
            return results
        counter = itertools.count()  # next() on a count is atomic under the GIL

        def drain() -> None:
            while (i := next(counter)) < n:
                results[i] = _call(fn, items[i])

        workers: list[Future[None]] = []
        for _ in range(min(self._threads, n) - 1):
            done: Future[None] = Future()
            self._workers.submit(functools.partial(_run_into, drain, done))
            workers.append(done)
        drain()  # the calling thread works too instead of idling
        for worker in workers:
            worker.result()
        return results

    def map_batches(
        self, call: Callable[[Sequence[T]], list[int]], items: Sequence[T]
    ) -> list[int]:
        """``call`` over at most one contiguous part of ``items`` per I/O thread (near-equal
        sizes: each part one native batch call), its per-item codes joined in order. A part
        whose call raises (bad input: nothing of it was done) gives -1 for each of its items,
        logged once: the caller takes those items one by one."""
        n = len(items)
        count = max(1, min(n, self._threads))
        bounds = [n * k // count for k in range(count + 1)]
        parts = [slice(a, b) for a, b in itertools.pairwise(bounds) if b > a]
        codes: list[int] = []
        for part, outcome in zip(parts, self.map(lambda p: call(items[p]), parts), strict=True):
            if isinstance(outcome, BaseException):
                log.warning(
                    "kvstore: a batch of %d blocks failed before any I/O (%s: %s); its blocks "
                    "go one by one",
                    part.stop - part.start,
                    type(outcome).__name__,
                    outcome,
                )
                codes += [-1] * (part.stop - part.start)
            else:
                codes += outcome
        return codes

    # -- writes -----------------------------------------------------------------------------

    def write_file(
        self,
        path: str,
        segments: Sequence[Segment],
        file_nbytes: int,
        *,
        exclusive: bool,
        sync: bool = True,
    ) -> None:
        """Write ``segments`` into ``path``; see the module docstring for the contract."""
        if exclusive:
            self._sync_and_close(self.write_new_file(path, segments, file_nbytes), sync)
            return
        fd = self.fio.open(path, os.O_WRONLY | os.O_CREAT, self.config.file_mode)
        try:
            for offset, buffers in coalesce(segments):
                write_fully(self.fio, fd, buffers, offset)
            # Shared (multi-writer) files are never truncated by a writer: other writers'
            # completion markers may lie past file_nbytes; the committer truncates.
            if self.config.durable and sync:
                self.fio.fdatasync(fd)
        finally:
            self.fio.close(fd)

    def write_new_file(self, path: str, segments: Sequence[Segment], file_nbytes: int) -> int:
        """Write the new file ``path`` (``O_EXCL``; ``segments`` tile ``[0, file_nbytes)``),
        unsynced, and return its open descriptor: the caller syncs it when it chooses and
        closes it. On an error the descriptor is closed before the exception propagates
        (the file is left for the caller to remove)."""
        if self.direct.enabled:
            return self._write_new_direct(path, segments, file_nbytes)
        mode = self.config.file_mode
        return self.fio.write_new(path, NEW_FILE_FLAGS, mode, segments, file_nbytes)

    def write_new_file_hashed(
        self, path: str, segments: Sequence[Segment], file_nbytes: int, hashing: Hashing
    ) -> int:
        """:meth:`write_new_file` of host segments, the chunks of segments ``hashing.first``
        to ``hashing.last`` checksummed into ``hashing.sums`` as they are written
        (:meth:`FileIO.write_new_hashed <kvstore.io.fileio.FileIO.write_new_hashed>`: those
        segments first, the others after them - a block's header, whose slots the sums may
        be, after its data). The same file as :meth:`write_new_file` once the sums are in.

        With O_DIRECT the hashed segments go direct from where they lie when every segment
        can (the in-place case of :meth:`_write_new_direct`); otherwise the sums are computed
        first and the file written as :meth:`write_new_file` writes it.
        """
        if not self.direct.enabled:
            return self.fio.write_new_hashed(
                path, NEW_FILE_FLAGS, self.config.file_mode, segments, file_nbytes, hashing
            )
        in_place = _in_place_writes(segments, file_nbytes)
        if in_place is not None and hashing.last <= in_place[1]:  # hashed ones all direct
            writes, buffered_from = in_place
            return self.fio.write_new_hashed(
                path,
                NEW_FILE_FLAGS | O_DIRECT,
                self.config.file_mode,
                writes,
                file_nbytes,
                hashing,
                buffered_from,
            )
        done = 0
        for _, data in segments[hashing.first : hashing.last]:
            count = len(data) // hashing.chunk_nbytes
            chunk_sums(
                hashing.algo, data, hashing.chunk_nbytes, count, hashing.sums[done : done + count]
            )
            done += count
        return self._write_new_direct(path, segments, file_nbytes)

    def _sync_and_close(self, fd: int, sync: bool) -> None:
        """The end of a whole new file's write: synced when the store is durable and ``sync``,
        then closed (closed even when the sync fails)."""
        try:
            if self.config.durable and sync:
                self.fio.fdatasync(fd)
        finally:
            self.fio.close(fd)

    def finish_file(self, path: str, file_nbytes: int, segments: Sequence[Segment] = ()) -> None:
        """The committer's step on a shared temporary file: write its last ``segments``, cut it
        to its final size, sync it once."""
        fd = self.fio.open(path, os.O_WRONLY)
        try:
            for offset, buffers in coalesce(segments):
                write_fully(self.fio, fd, buffers, offset)
            self.fio.ftruncate(fd, file_nbytes)
            if self.config.durable:
                self.fio.fdatasync(fd)
        finally:
            self.fio.close(fd)

    def _write_new_direct(self, path: str, segments: Sequence[Segment], file_nbytes: int) -> int:
        """O_DIRECT write of a whole new file; returns the open descriptor
        (:meth:`write_new_file`).

        The common case - every segment but the last page-aligned in address and length (a
        dense block: the header and index in aligned buffers, the data in aligned memory) -
        is written from where it lies: the aligned segments direct, the last one, if it is
        not aligned, buffered after them (O_DIRECT cleared on the descriptor). Anything else
        is planned by :mod:`kvstore.io.newfile` and partly staged. Both give the same file.
        """
        flags = NEW_FILE_FLAGS | O_DIRECT
        mode = self.config.file_mode
        in_place = _in_place_writes(segments, file_nbytes)
        if in_place is not None:
            writes_in_place, buffered_from = in_place
            return self.fio.write_new(
                path, flags, mode, writes_in_place, file_nbytes, buffered_from
            )
        plan = plan_new_file(
            [(offset, len(data), is_aligned(data)) for offset, data in segments], file_nbytes
        )
        # The staged bytes (the header where it is not aligned memory, the zarr index) are
        # packed in a small staging buffer, not at their file offsets: one that mirrored the
        # whole file would be as large as the block (80 MiB for a 70B block of 256 tokens) and
        # cost a page fault per 4 KiB the first time each I/O thread touched it.
        windows, staged_nbytes = _staging_windows(plan)
        staging = self._staging.get(staged_nbytes)

        def place(start: int, end: int) -> np.ndarray:
            for first, last, at in windows:
                if first <= start and end <= last:
                    return staging[at + start - first : at + end - first]
            raise AssertionError(f"staged bytes [{start}, {end}) outside every window")

        for i in plan.staged:
            offset, data = segments[i]
            place(offset, offset + len(data))[:] = np.frombuffer(data, dtype=np.uint8)
        writes: list[Segment] = []
        position = 0  # the aligned writes tile the file from 0
        for i, start, end in plan.writes:
            data = segments[i][1] if i >= 0 else place(start, end).data
            writes.append((position, data))
            position += len(data)
        if plan.tail:
            # Buffered after the aligned part: one F_SETFL with the flags the file was opened
            # with (no F_GETFL) cannot be refused. Sending the last page padded, direct, and
            # truncating instead saves a call but costs more on ext4 (a shrinking truncate
            # puts the inode on the journal's orphan list: +25 % per 8 KiB file unsynced on
            # this VM's disk; docs/performance.md).
            writes.append((plan.tail[0], place(*plan.tail).data))
        return self.fio.write_new(path, flags, mode, writes, file_nbytes, len(plan.writes))

    # -- reads ------------------------------------------------------------------------------

    def read_file(  # noqa: PLR0913 - implements IOEngine.read_file (signature fixed by io/engine.py)
        self,
        path: str,
        segments: Sequence[Segment],
        file_nbytes: int,
        touch_if_older_than_ns: int = 0,
        *,
        allow_trailer: bool = False,
        direct: bool = False,
    ) -> FileId:
        """Fill ``segments`` from published file ``path`` of expected size ``file_nbytes``;
        returns the identity (device, inode) of the file read.

        Raises :class:`BlockMissingError` if it does not exist,
        :class:`~kvstore.errors.EntryKindError` if it is not a regular file (a FIFO is never
        waited on: :meth:`FileIO.open_regular`) and :class:`CorruptBlockError`, carrying the
        file's identity, if its size is wrong (``allow_trailer``: shorter) or a read comes back
        short. If the file's mtime is older than ``touch_if_older_than_ns`` it is set to now
        after the read: mtime is the block's last use, which eviction orders by (atime cannot
        be trusted under relatime/noatime). A read-only store simply keeps its old times.
        ``direct``: open with O_DIRECT (every segment must then be 4 KiB aligned in offset,
        length and address).
        """
        return self._read(
            path, segments, file_nbytes, touch_if_older_than_ns, allow_trailer, direct
        )

    def read_file_hashed(  # noqa: PLR0913 - read_file's arguments plus the checksums' plan
        self,
        path: str,
        segments: Sequence[Segment],
        file_nbytes: int,
        touch_if_older_than_ns: int,
        hashing: Hashing,
        *,
        direct: bool = False,
    ) -> FileId:
        """:meth:`read_file` of host segments, the chunks of segments ``hashing.first`` to
        ``hashing.last`` checksummed into ``hashing.sums`` as they are read, each group while
        it is in the CPU cache (:meth:`FileIO.read_regular_hashed
        <kvstore.io.fileio.FileIO.read_regular_hashed>`: one native call for
        NativeFileIO). The caller compares the sums."""
        flags = os.O_RDONLY | (O_DIRECT if direct else 0)
        try:
            return self.fio.read_regular_hashed(
                path, flags, segments, file_nbytes, hashing, touch_if_older_than_ns
            )
        except FileNotFoundError:
            raise BlockMissingError(path) from None

    def _read(  # noqa: PLR0913 - read_file's arguments, as FileIO.read_regular takes them
        self,
        path: str,
        segments: Sequence[Segment],
        file_nbytes: int,
        touch_if_older_than_ns: int,
        allow_trailer: bool,
        direct: bool,
    ) -> FileId:
        flags = os.O_RDONLY | (O_DIRECT if direct else 0)
        try:  # the whole protocol in one call (one native call for NativeFileIO)
            return self.fio.read_regular(
                path, flags, segments, file_nbytes, allow_trailer, touch_if_older_than_ns
            )
        except FileNotFoundError:
            raise BlockMissingError(path) from None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._workers.close()  # maps in flight keep their threads until they return

    def describe(self) -> str:
        """One line naming the engine and its write mode."""
        mode = "O_DIRECT writes" if self.direct.enabled else "buffered writes"
        return f"host engine, {self._threads} threads, {mode} ({self.direct.reason})"


def _staging_windows(plan: NewFilePlan) -> tuple[list[tuple[int, int, int]], int]:
    """Where the staged file ranges of ``plan`` go in a packed staging buffer:
    ``(file start, file end, staging offset)`` per run of file-contiguous staged bytes (each
    starting on a page of the buffer, so the aligned writes stay aligned), and the buffer size.
    """
    spans = [(start, end) for i, start, end in plan.writes if i < 0]
    if plan.tail:
        spans.append(plan.tail)
    windows: list[tuple[int, int, int]] = []
    size = 0
    for start, end in spans:
        if windows and windows[-1][1] == start:  # continues the previous run
            first, _, at = windows[-1]
            windows[-1] = (first, end, at)
        else:
            first, at = start, size
            windows.append((start, end, size))
        size = align_up(at + end - first)
    return windows, size


def _run_into(work: Callable[[], None], done: Future[None]) -> None:
    """Run ``work`` on a daemon thread and settle ``done`` with its outcome."""
    try:
        work()
    except BaseException as exc:  # handed to the waiting caller, not lost
        done.set_exception(exc)
    else:
        done.set_result(None)


def _call(fn: Callable[[T], R], item: T) -> R | BaseException:
    try:
        return fn(item)
    except Exception as exc:
        return exc


def _in_place_writes(
    segments: Sequence[Segment], file_nbytes: int
) -> tuple[Sequence[Segment], int] | None:
    """The writes of an O_DIRECT new file when every segment can go from where it lies, and
    the index of the first buffered one; None when some segment needs staging (then
    :func:`~kvstore.io.newfile.plan_new_file` plans the write).

    That is the case when the segments tile ``[0, file_nbytes)`` page-aligned in address and
    length except for the last one's length: its whole pages go direct with the rest, its
    unaligned last page buffered (the writes the plan gives, without the staging copy).
    """
    position = 0
    for offset, data in segments:
        if offset != position:
            return None
        position += len(data)
    if position != file_nbytes or not segments:
        return None
    native = native_fileproto()  # no I/O: for any FileIO
    first, address_aligned = (
        native.first_unaligned(segments, ALIGN)
        if native
        else first_unaligned_reference(segments, ALIGN)
    )
    last = len(segments) - 1
    if first > last:
        return segments, len(segments)
    if first < last or not address_aligned:
        return None
    offset, data = segments[last]
    split = len(data) - len(data) % ALIGN
    writes = list(segments[:last])
    if split:
        writes.append((offset, data[:split]))
    writes.append((offset + split, data[split:]))
    return writes, len(writes) - 1


def first_unaligned_reference(segments: Sequence[Segment], alignment: int) -> tuple[int, bool]:
    """The first segment whose memory is not ``alignment``-aligned in address or length
    (``len(segments)`` if none) and whether its address is: the native ``first_unaligned``
    in Python, with its checks (an alignment > 0, the segments as ``check_segments`` takes
    them)."""
    alignment = ssize(alignment, "alignment")
    if alignment <= 0:
        raise ValueError(f"first_unaligned: expected an alignment > 0, got {alignment}")
    checked = check_segments(segments, writable=False)
    for i, (_, data) in enumerate(checked):
        address_ok = address(data) % alignment == 0
        # An empty buffer's address is moot (is_aligned in kvstore/io/buffers.py).
        if len(data) % alignment or (len(data) and not address_ok):
            return i, address_ok
    return len(checked), True

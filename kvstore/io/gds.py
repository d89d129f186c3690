"""GPUDirect Storage engine: device tensors to block files through cuFile (kvikio).

Segments may hold uint8 device tensors as well as host memory (capability
``device_segments``). Host-only calls go to the host engine this class extends (header reads,
compressed blocks, commits, and the hashed and batched reads and writes of host memory).

* **Whole new files** (``exclusive``): the engine creates the file itself with the store's
  rules (``O_CREAT | O_EXCL | O_NOFOLLOW``, the config's owner-only mode), then opens it for
  cuFile and checks the handle names the same inode (kvikio opens by path). Device segments
  whose offset, size and address are 4 KiB aligned are written straight from where they are;
  everything else (the header and index bytes, odd-sized chunks and their zero padding) is
  assembled at its file offset in a per-thread aligned device staging buffer, a small bounce
  region, so every cuFile write has an aligned offset and size. The file is written to a 4 KiB
  boundary by cuFile; the last partial page (the end of the index) is written buffered through
  our own descriptor, which also fdatasyncs when the store is durable.
  All cuFile writes of one file share one handle and are in flight together.
* **Shared files** (multi-writer chunks and ranges, the committer's last writes): segments go
  in order, as the protocol needs (checksum slots last). The 4 KiB-aligned middle of a device
  segment goes through cuFile; its unaligned head and tail (under 4 KiB each, a region other
  writers may share) are copied to the host and written with ``pwrite``. Host segments are
  written with ``pwrite``. A page is therefore only ever written one way.
* **Reads**: the size is checked on our own descriptor (missing -> miss, wrong size ->
  corrupt), aligned middles of device segments are read by cuFile, heads and tails through a
  host bounce.

kvikio's compatibility mode (``on``: POSIX I/O through host bounce buffers inside kvikio) is
honoured as configured and named by :meth:`describe`; the bytes on disk are the same.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence

import numpy as np
import torch

from kvstore.config import StoreConfig
from kvstore.errors import BlockMissingError, CorruptBlockError, StoreIOError
from kvstore.io.align import ALIGN, align_up
from kvstore.io.cufile import CuFileHandle, CuFiles, IOFuture
from kvstore.io.device import DeviceOps
from kvstore.io.engine import AnySegment, Data
from kvstore.io.entries import FileId, corrupt_file_is, file_id
from kvstore.io.fileio import FileIO
from kvstore.io.host import HostEngine
from kvstore.io.native_fileio import DEFAULT_FILEIO
from kvstore.io.newfile import plan_new_file
from kvstore.io.staging import DeviceStaging
from kvstore.io.types import EngineCapabilities, Segment
from kvstore.io.vectored import read_fully, write_fully


class GdsEngine(HostEngine):
    """cuFile writes and reads of device tensors; host memory via the host engine."""

    name = "gds"
    capabilities = EngineCapabilities(hashed_io=True, batches=True, device_segments=True)

    def __init__(  # noqa: PLR0913 - the device engine's collaborators (device ops, cuFile handles, file I/O), each injectable for tests
        self,
        config: StoreConfig,
        ops: DeviceOps,
        cufiles: CuFiles,
        device: torch.device,
        fio: FileIO = DEFAULT_FILEIO,
        probe: bool = True,
    ) -> None:
        super().__init__(config, fio, probe)
        self.ops = ops
        self.cufiles = cufiles
        cufiles.want_threads(self._threads)  # kvikio runs pread/pwrite on its own pool
        self.device = device
        self._local = threading.local()  # per-thread device staging buffer
        self.staging = DeviceStaging(ops)

    def describe(self) -> str:
        return (
            f"gds engine (kvikio compat mode {self.cufiles.compat_mode}, {self.ops.name}), "
            f"{self._threads} threads"
        )

    # -- writes -------------------------------------------------------------------------------

    def write_file(
        self,
        path: str,
        segments: Sequence[AnySegment],
        file_nbytes: int,
        *,
        exclusive: bool,
        sync: bool = True,
    ) -> None:
        host = _host_only(segments)
        if host is not None:
            super().write_file(path, host, file_nbytes, exclusive=exclusive, sync=sync)
        elif exclusive:
            self._sync_and_close(self._write_new(path, segments, file_nbytes), sync)
        else:
            fd = self.fio.open(path, os.O_WRONLY | os.O_CREAT, self.config.file_mode)
            try:
                self._write_in_order(path, fd, segments)
                if self.config.durable and sync:
                    self.fio.fdatasync(fd)
            finally:
                self.fio.close(fd)

    def write_new_file(self, path: str, segments: Sequence[AnySegment], file_nbytes: int) -> int:
        """:meth:`HostEngine.write_new_file` of host or device segments."""
        host = _host_only(segments)
        if host is not None:
            return super().write_new_file(path, host, file_nbytes)
        return self._write_new(path, segments, file_nbytes)

    def finish_file(self, path: str, file_nbytes: int, segments: Sequence[AnySegment] = ()) -> None:
        host = _host_only(segments)
        if host is not None:
            super().finish_file(path, file_nbytes, host)
            return
        fd = self.fio.open(path, os.O_WRONLY)
        try:
            self._write_in_order(path, fd, segments)
            self.fio.ftruncate(fd, file_nbytes)
            if self.config.durable:
                self.fio.fdatasync(fd)
        finally:
            self.fio.close(fd)

    def _write_new(self, path: str, segments: Sequence[AnySegment], file_nbytes: int) -> int:
        """A whole new file from device (and host) segments, unsynced; returns its open
        descriptor (closed before an error propagates)."""
        plan = plan_new_file(  # aligned device memory direct, the rest staged on the device
            [(off, _nbytes(d), _aligned_device(d, off)) for off, d in segments], file_nbytes
        )
        staging = self._device_staging(align_up(file_nbytes))  # mirrors the whole file
        for i in plan.staged:
            offset, data = segments[i]
            size = _nbytes(data)
            staging[offset : offset + size].copy_(_as_tensor(data), non_blocking=True)
        direct: list[tuple[int, torch.Tensor]] = []  # (offset, aligned device tensor)
        for i, start, end in plan.writes:
            if i >= 0:
                offset, data = segments[i]
                assert isinstance(data, torch.Tensor)  # only device tensors are planned direct
                direct.append((offset, data))
            else:
                direct.append((start, staging[start:end]))
        tail = (
            staging[plan.tail[0] : plan.tail[1]] if plan.tail else torch.empty(0, dtype=torch.uint8)
        )
        self.ops.synchronize(self.device)  # cuFile reads device memory outside stream order
        fd = self.fio.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, self.config.file_mode)
        try:
            handle = self._open_same(path, fd)
            try:
                futures: list[tuple[IOFuture, int, int]] = []
                try:
                    for off, t in direct:
                        futures.append((handle.pwrite(t, t.numel(), off), off, t.numel()))
                except BaseException:
                    with contextlib.suppress(Exception):
                        _wait_all(futures, "cuFile write")  # submitted ones finish first
                    raise
                _wait_all(futures, "cuFile write")
            finally:
                handle.close()
            if tail.numel():
                write_fully(
                    self.fio, fd, [_to_host(tail, 0, tail.numel())], file_nbytes - tail.numel()
                )
        except BaseException:
            self.fio.close(fd)
            raise
        return fd

    def _write_in_order(self, path: str, fd: int, segments: Sequence[AnySegment]) -> None:
        """Shared-file writes, one segment after the other (see the module docstring)."""
        handle: CuFileHandle | None = None
        try:
            for offset, data in segments:
                if not isinstance(data, torch.Tensor):
                    write_fully(self.fio, fd, [data], offset)
                    continue
                head, middle, tail = _split(offset, data.numel())
                if head[1]:
                    write_fully(self.fio, fd, [_to_host(data, 0, head[1])], offset)
                if middle[1]:
                    if handle is None:
                        self.ops.synchronize(self.device)
                        handle = self._open_same(path, fd)
                    piece = data[middle[0] - offset : middle[0] - offset + middle[1]]
                    _wait_all([(handle.pwrite(piece, middle[1], middle[0]), *middle)], "write")
                if tail[1]:
                    start = tail[0] - offset
                    write_fully(self.fio, fd, [_to_host(data, start, tail[1])], tail[0])
        finally:
            if handle is not None:
                handle.close()

    # -- reads --------------------------------------------------------------------------------

    def read_file(  # noqa: PLR0912, PLR0913 - implements IOEngine.read_file (signature fixed by io/engine.py); the branches are the host/bounced/cuFile paths of one segment loop
        self,
        path: str,
        segments: Sequence[AnySegment],
        file_nbytes: int,
        touch_if_older_than_ns: int = 0,
        *,
        allow_trailer: bool = False,
        direct: bool = False,
    ) -> FileId:
        host = _host_only(segments)
        if host is not None:
            return super().read_file(
                path,
                host,
                file_nbytes,
                touch_if_older_than_ns,
                allow_trailer=allow_trailer,
                direct=direct,
            )
        try:
            fd, st = self.fio.open_regular(path, os.O_RDONLY)
        except FileNotFoundError:
            raise BlockMissingError(path) from None
        handle: CuFileHandle | None = None
        try:
            with corrupt_file_is(st):
                if st.st_size != file_nbytes and not (allow_trailer and st.st_size > file_nbytes):
                    raise CorruptBlockError(
                        f"file size: expected {file_nbytes} bytes, got {st.st_size}"
                    )
                for offset, data in segments:
                    if not isinstance(data, torch.Tensor):
                        self._read_host(fd, data, offset)
                        continue
                    head, middle, tail = _split(offset, data.numel())
                    if head[1]:
                        self._read_bounced(fd, data, 0, head[1], offset)
                    if middle[1]:
                        if handle is None:
                            handle = self._open_same(path, fd, "r")
                        piece = data[middle[0] - offset : middle[0] - offset + middle[1]]
                        got = handle.pread(piece, middle[1], middle[0]).get()
                        if got != middle[1]:
                            raise CorruptBlockError(
                                f"short read at {middle[0]}: expected {middle[1]}, got {got}"
                            )
                    if tail[1]:
                        self._read_bounced(fd, data, tail[0] - offset, tail[1], tail[0])
                if st.st_mtime_ns < touch_if_older_than_ns:
                    with contextlib.suppress(OSError):
                        self.fio.touch(fd)
        finally:
            if handle is not None:
                handle.close()
            self.fio.close(fd)
        self.ops.synchronize(self.device)  # bounced copies into device memory are complete
        return file_id(st)

    def _read_host(self, fd: int, data: memoryview, offset: int) -> None:
        got = read_fully(self.fio, fd, [data], offset)
        if got != len(data):
            raise CorruptBlockError(f"short read at {offset}: expected {len(data)}, got {got}")

    def _read_bounced(self, fd: int, data: torch.Tensor, start: int, size: int, at: int) -> None:
        bounce = np.empty(size, dtype=np.uint8)
        self._read_host(fd, bounce.data, at)
        data[start : start + size].copy_(torch.from_numpy(bounce))

    # -- helpers ------------------------------------------------------------------------------

    def _device_staging(self, nbytes: int) -> torch.Tensor:
        current: torch.Tensor | None = getattr(self._local, "staging", None)
        if current is None or current.numel() < nbytes:
            current = self.ops.device_empty(align_up(max(nbytes, ALIGN)), self.device)
            self._local.staging = current
        return current

    def _open_same(self, path: str, fd: int, flags: str = "r+") -> CuFileHandle:
        """A cuFile handle on ``path``, refused unless it is the file ``fd`` has open (kvikio
        opens by name: the name must not have been swapped since we created or opened it)."""
        handle = self.cufiles.open(path, flags)
        mine, theirs = self.fio.fstat(fd), os.fstat(handle.fileno())
        if (mine.st_dev, mine.st_ino) != (theirs.st_dev, theirs.st_ino):
            handle.close()
            raise StoreIOError(f"{path}: replaced while being opened for cuFile")
        return handle


def _host_only(segments: Sequence[AnySegment]) -> list[Segment] | None:
    """``segments`` typed as host segments when none holds a tensor, else None."""
    if any(isinstance(data, torch.Tensor) for _, data in segments):
        return None
    return [(offset, data) for offset, data in segments if not isinstance(data, torch.Tensor)]


def _nbytes(data: Data) -> int:
    return data.numel() if isinstance(data, torch.Tensor) else len(data)


def _aligned_device(data: Data, offset: int) -> bool:
    return (
        isinstance(data, torch.Tensor)
        and offset % ALIGN == 0
        and data.numel() % ALIGN == 0
        and data.data_ptr() % ALIGN == 0
    )


def _as_tensor(data: Data) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        return data
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if len(data)
        else torch.empty(0, dtype=torch.uint8)
    )


def _to_host(data: torch.Tensor, start: int, size: int) -> memoryview:
    return data[start : start + size].to("cpu").numpy().data


def _split(offset: int, size: int) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """``(start, length)`` of the unaligned head, the 4 KiB-aligned middle and the tail of the
    file range ``[offset, offset + size)``; a range without a whole aligned page is all head."""
    end = offset + size
    first, last = align_up(offset), end - end % ALIGN
    if first >= last:
        return (offset, size), (first, 0), (end, 0)
    return (offset, first - offset), (first, last - first), (last, end - last)


def _wait_all(futures: Sequence[tuple[IOFuture, int, int]], what: str) -> None:
    """Wait for every future (kvikio's tasks read the buffers and use the handle until they
    finish: none may still run when the handle is closed), then raise the first failure."""
    first: BaseException | None = None
    for future, offset, size in futures:
        try:
            done = future.get()
        except Exception as exc:  # re-raised below, once the others have finished
            first = first or exc
            continue
        if done != size and first is None:
            first = StoreIOError(f"{what} at {offset}: expected {size} bytes, moved {done}")
    if first is not None:
        raise first

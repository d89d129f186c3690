"""Every file-system call kvstore makes, in one small replaceable object.

The page store and the I/O engines never call ``os`` directly for store files: they call a
:class:`FileIO`. Tests substitute a subclass that records operations (to replay a power loss)
or injects errors (EIO, ENOSPC, short transfers) at any call. The default implementation is a
thin, allocation-free layer over ``os``; ``pwritev``/``preadv`` release the GIL.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from typing import Any

# Linux's IOV_MAX; os.sysconf may not know it everywhere.
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
O_DIRECT: int = getattr(os, "O_DIRECT", 0)


class FileIO:
    """File operations on absolute paths and raw descriptors. Subclass to record or inject."""

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        # O_NOFOLLOW: a symlink planted inside the store is never followed out of it.
        return os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pwritev(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def fstat_size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def fstat(self, fd: int) -> os.stat_result:
        return os.fstat(fd)

    def touch(self, fd: int) -> None:
        """Set the file's modification time to now (readers record last use this way)."""
        os.utime(fd)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def exists(self, path: str) -> bool:
        try:
            os.stat(path)
        except FileNotFoundError:
            return False
        return True

    def makedirs(self, path: str, mode: int = 0o700) -> None:
        """Create ``path`` and missing parents, each with ``mode`` (os.makedirs gives parents
        the umask's default, which would leave intermediate directories world-readable)."""
        missing = []
        current = os.path.abspath(path)
        while not os.path.isdir(current):
            missing.append(current)
            parent = os.path.dirname(current)
            if parent == current:
                break
            current = parent
        for directory in reversed(missing):
            try:
                os.mkdir(directory, mode)
            except FileExistsError:
                if not os.path.isdir(directory):
                    raise

    def drop_cache(self, fd: int) -> None:
        """Ask the kernel to drop this file's clean cached pages (benchmarks' cold reads)."""
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


DEFAULT_FILEIO = FileIO()


def drop_tree_cache(directory: str | os.PathLike[str]) -> None:
    """Evict a tree's clean pages from the page cache, so the next read is cold (benchmarks)."""
    for dirpath, _, files in os.walk(directory):
        for name in files:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def write_fully(fio: FileIO, fd: int, buffers: Sequence[Any], offset: int) -> None:
    """``pwritev`` all of ``buffers`` at ``offset``, in IOV_MAX batches, retrying short writes.

    A write that makes no progress raises ``OSError(ENOSPC)`` rather than looping forever.
    """
    pending = [memoryview(b).cast("B") for b in buffers]
    pos = offset
    while pending:
        batch = pending[:IOV_MAX]
        want = sum(len(b) for b in batch)
        done = fio.pwritev(fd, batch, pos)
        if done <= 0:
            raise OSError(errno.ENOSPC, "pwritev made no progress")
        pos += done
        pending = _advance(pending, done) if done < want else pending[len(batch) :]


def read_fully(fio: FileIO, fd: int, buffers: Sequence[Any], offset: int) -> int:
    """``preadv`` into all of ``buffers`` from ``offset``; returns bytes read (short at EOF)."""
    pending = [memoryview(b).cast("B") for b in buffers]
    pos = offset
    total = 0
    while pending:
        batch = pending[:IOV_MAX]
        want = sum(len(b) for b in batch)
        done = fio.preadv(fd, batch, pos)
        if done <= 0:
            return total
        total += done
        pos += done
        pending = _advance(pending, done) if done < want else pending[len(batch) :]
    return total


def _advance(buffers: list[memoryview], nbytes: int) -> list[memoryview]:
    """``buffers`` with the first ``nbytes`` consumed."""
    out = list(buffers)
    while nbytes:
        head = out[0]
        if len(head) <= nbytes:
            nbytes -= len(head)
            out.pop(0)
        else:
            out[0] = head[nbytes:]
            nbytes = 0
    return out

"""Every file-system call kvstore makes, in one small replaceable object.

The page store and the I/O engines never call ``os`` directly for store files: they call a
:class:`FileIO`. Tests substitute a subclass that records operations (to replay a power loss)
or injects errors (EIO, ENOSPC, short transfers) at any call. The default implementation is a
thin, allocation-free layer over ``os``; ``pwritev``/``preadv`` release the GIL.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
from collections.abc import Sequence
from typing import Any

# Linux's IOV_MAX; os.sysconf may not know it everywhere.
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_RENAME_NOREPLACE = 1  # linux/fs.h
_AT_FDCWD = -100
# errnos meaning "this file system (or kernel) lacks the operation", not "it failed"
_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})
_NO_HARD_LINKS = frozenset({errno.EPERM, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})


def _load_renameat2() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()


def rename_noreplace(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst`` unless ``dst`` exists (then FileExistsError, ``src`` kept).

    Atomic wherever the file system offers an atomic primitive:

    1. ``renameat2(RENAME_NOREPLACE)``: local file systems (ext4, xfs, btrfs, tmpfs).
    2. Where that flag is refused (EINVAL: FUSE file systems such as GlusterFS, NFS),
       ``link(src, dst)`` - which fails with EEXIST on the server, atomically - then
       ``unlink(src)`` (a crash in between leaves a second name, swept as an orphan temp).
       On a GlusterFS distribute volume ``link`` is atomic only when ``src`` lies on the
       brick ``dst`` hashes to; otherwise DHT makes it two steps (a link file on ``dst``'s
       brick, then the link on ``src``'s) that ignore the first step's EEXIST, and two nodes
       racing can both succeed. kvstore's rsync-style temporary names
       (``.<name>.tmp-<token>``, :func:`kvstore.store.group_store.temp_path_for`) are placed on
       ``<name>``'s brick by GlusterFS's default ``rsync-hash-regex``
       (docs/shared-filesystems.md). Checking ``dst``'s inode after ``link`` would not catch
       that race: each client then resolves ``dst`` to its own copy.
    3. Where hard links are missing too, an existence check then ``rename``: two racing
       publishers may both succeed, the later copy replacing the earlier (the same block,
       verified on every read; a reader of the replaced copy on another node may miss).
    """
    if _renameat2 is not None:
        paths = (os.fsencode(src), os.fsencode(dst))
        if _renameat2(_AT_FDCWD, paths[0], _AT_FDCWD, paths[1], _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in _UNSUPPORTED:
            raise OSError(err, os.strerror(err), src, None, dst)
    try:
        os.link(src, dst)
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:
            raise
    else:
        with contextlib.suppress(OSError):
            os.unlink(src)
        return
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), src, None, dst)
    os.rename(src, dst)


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """The type of the file system holding ``path`` as the kernel names it ("ext4", "xfs",
    "tmpfs", "fuse.glusterfs", "nfs4", ...), from the longest mount point above it in
    ``/proc/self/mountinfo``; "" where that cannot be read (not Linux)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    target = os.path.realpath(path)
    best, kind = -1, ""
    for line in lines:
        fields = line.split()
        try:
            separator = fields.index("-")
            mount_point = fields[4].replace("\\040", " ")
            fs_type = fields[separator + 1]
        except (ValueError, IndexError):
            continue
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) > best:
            best, kind = len(mount_point), fs_type
    return kind


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

    def clear_direct(self, fd: int) -> None:
        """Turn O_DIRECT off on an open descriptor (Linux allows it through F_SETFL)."""
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~O_DIRECT)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def rename(self, src: str, dst: str) -> None:
        """Atomically give ``src`` the name ``dst``; ``dst`` must not exist (FileExistsError).

        kvstore renames only to publish a new name (a block, a metadata document, a
        quarantined file) and never replaces one: on a shared file system a name replaced
        under a reader on another node fails that reader's reads (GlusterFS: ENOENT on its
        open descriptor), and two nodes publishing the same block must leave one copy rather
        than swap it under readers. See :func:`rename_noreplace`.
        """
        rename_noreplace(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def exists(self, path: str) -> bool:
        try:
            os.stat(path)
        except FileNotFoundError:
            return False
        return True

    def makedirs(self, path: str, mode: int = 0o700) -> list[str]:
        """Create ``path`` and missing parents, each with ``mode`` (os.makedirs gives parents
        the umask's default, which would leave intermediate directories world-readable).

        Returns the directories this call created, outermost first (see :func:`sync_parents`).
        """
        missing = []
        current = os.path.abspath(path)
        while not os.path.isdir(current):
            missing.append(current)
            parent = os.path.dirname(current)
            if parent == current:
                break
            current = parent
        created = []
        for directory in reversed(missing):
            try:
                os.mkdir(directory, mode)
                created.append(directory)
            except FileExistsError:
                if not os.path.isdir(directory):
                    raise
        return created

    def drop_cache(self, fd: int) -> None:
        """Ask the kernel to drop this file's clean cached pages (benchmarks' cold reads)."""
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


DEFAULT_FILEIO = FileIO()


def sync_parents(fio: FileIO, created: Sequence[str]) -> None:
    """fsync the parent of every directory in ``created`` (what :meth:`FileIO.makedirs` made).

    A new directory's name lives in its parent: until the parent is synced a power loss may
    drop it, and every file below with it, however well those files were synced.
    """
    for parent in sorted({os.path.dirname(d) for d in created}):
        fio.fsync_dir(parent)


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

"""Every file-system call kvstore makes, in one small replaceable object.

The page store and the I/O engines never call ``os`` directly for store files: they call a
:class:`FileIO`.

A hostile tree is normal input: any entry may be a symbolic link, FIFO, socket, device or
directory where kvstore expects a file, or the reverse. Hence the rules every open here keeps:

* no open blocks: ``O_NONBLOCK`` always (a FIFO with no writer would block ``open(2)``
  forever; on regular files Linux ignores the flag);
* no symbolic link is followed below the root: ``O_NOFOLLOW`` on the last component, and
  :func:`open_dir_nofollow` for directories entered by a rare path (quarantine, trash);
* a file is read only after ``fstat`` says it is regular (:meth:`FileIO.open_regular`,
  :meth:`FileIO.exists`); anything else is :class:`~kvstore.errors.EntryKindError`;
* a file is moved or removed only if it is still the file that was read
  (:func:`move_if_same`, :func:`remove_if_same`), never "whatever has the name now".

Tests substitute a subclass that records operations (to replay a power loss) or injects errors
(EIO, ENOSPC, short transfers) at any call. The default implementation is a thin,
allocation-free layer over ``os``; ``pwritev``/``preadv`` release the GIL.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import stat
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from kvstore.errors import CorruptBlockError, EntryKindError

# Linux's IOV_MAX; os.sysconf may not know it everywhere.
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_RENAME_NOREPLACE = 1  # linux/fs.h
_AT_FDCWD = -100
# errnos meaning "this file system (or kernel) lacks the operation", not "it failed"
_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})
_NO_HARD_LINKS = frozenset({errno.EPERM, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})
# Every open of a store file: never blocks (FIFO), never follows a final symbolic link.
_OPEN_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NONBLOCK

FileId = tuple[int, int]  # (st_dev, st_ino): which file, whatever its name is now

_KINDS = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def describe_kind(mode: int) -> str:
    """What a ``st_mode`` is, in words ("a FIFO", "a symbolic link", ...)."""
    for test, words in _KINDS:
        if test(mode):
            return words
    return f"an entry of unknown type {stat.S_IFMT(mode):#o}"


@contextlib.contextmanager
def corrupt_file_is(st: os.stat_result) -> Iterator[None]:
    """A :class:`~kvstore.errors.CorruptBlockError` raised inside names the file ``st``
    describes (``file_id``): what a reader found corrupt is that file, and only that file may
    be quarantined for it, whatever the name holds by then."""
    try:
        yield
    except CorruptBlockError as exc:
        exc.file_id = file_id(st)
        raise


def not_regular(path: str | os.PathLike[str], mode: int) -> EntryKindError:
    """The error for a name that should hold a regular file and holds ``mode``'s kind."""
    return EntryKindError(f"{os.fspath(path)}: expected a regular file, got {describe_kind(mode)}")


def describe_os_error(exc: OSError) -> str:
    """``exc`` as ``[Errno N] text`` without its file name.

    An ``OSError`` from a call on a descriptor (``fdopen``, ``fstat``, ``read``) carries the
    descriptor number as its "file name" (``[Errno 21] Is a directory: 3``): callers put the
    path in front themselves.
    """
    if exc.errno is None or exc.strerror is None:
        return str(exc)
    return f"[Errno {exc.errno}] {exc.strerror}"


def file_id(st: os.stat_result) -> FileId:
    """The identity of the file ``st`` describes (device and inode)."""
    return st.st_dev, st.st_ino


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
       (``.<name>.tmp-<token>``, :func:`kvstore.store.paths.temp_path_for`) are placed on
       ``<name>``'s brick by GlusterFS's default ``rsync-hash-regex``
       (docs/shared-filesystems.md). Checking ``dst``'s inode after ``link`` would not catch
       that race: each client then resolves ``dst`` to its own copy.
    3. Where hard links are missing too, an existence check then ``rename``: two racing
       publishers may both succeed, the later copy replacing the earlier (the same block,
       verified on every read; a reader of the replaced copy on another node may miss).
    """
    rename_noreplace_at(None, src, None, dst)


def rename_noreplace_at(src_dir_fd: int | None, src: str, dst_dir_fd: int | None, dst: str) -> None:
    """:func:`rename_noreplace` with each name relative to an open directory (None: the
    working directory, as ``AT_FDCWD``): a directory opened by :func:`open_dir_nofollow`
    stays the directory checked, whatever is renamed or linked above it meanwhile."""
    if _renameat2 is not None:
        paths = (os.fsencode(src), os.fsencode(dst))
        src_at = _AT_FDCWD if src_dir_fd is None else src_dir_fd
        dst_at = _AT_FDCWD if dst_dir_fd is None else dst_dir_fd
        if _renameat2(src_at, paths[0], dst_at, paths[1], _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in _UNSUPPORTED:
            raise OSError(err, os.strerror(err), src, None, dst)
    try:
        if src_dir_fd is None and dst_dir_fd is None:
            os.link(src, dst)
        else:
            os.link(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:
            raise
    else:
        with contextlib.suppress(OSError):
            os.unlink(src, dir_fd=src_dir_fd)
        return
    try:
        os.lstat(dst, dir_fd=dst_dir_fd)
    except FileNotFoundError:
        if src_dir_fd is None and dst_dir_fd is None:
            os.rename(src, dst)
        else:
            os.rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
    else:
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), src, None, dst)


def open_dir_nofollow(
    root: str | os.PathLike[str],
    parts: Sequence[str],
    *,
    create_mode: int | None = None,
    created: list[str] | None = None,
) -> int:
    """A descriptor of the directory ``root/parts[0]/.../parts[-1]``, entered one component at
    a time with ``O_NOFOLLOW``: no symbolic link below ``root`` is followed (``root`` itself
    may be one, as a store root may). Never blocks (``O_NONBLOCK``, ``O_DIRECTORY``).

    ``create_mode``: missing components are created with this mode; their paths are appended
    to ``created`` when given (for :func:`sync_parents`: this function syncs nothing).
    Raises :class:`~kvstore.errors.EntryKindError` naming the first component that is not a
    real directory (a link, a file, a FIFO...), ``FileNotFoundError`` when one is missing and
    not created, ``ValueError`` for a component that is not one plain name. The caller closes
    the descriptor.
    """
    fd = os.open(root, _DIR_FLAGS)
    where = os.fspath(root)
    try:
        for part in parts:
            _check_plain_name(part)
            where = os.path.join(where, part)
            try:
                child = _open_child_dir(fd, part, where)
            except FileNotFoundError:
                if create_mode is None:
                    raise
                try:
                    os.mkdir(part, create_mode, dir_fd=fd)
                except FileExistsError:
                    pass  # created meanwhile: checked like any other by the open below
                else:
                    if created is not None:
                        created.append(where)
                child = _open_child_dir(fd, part, where)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_plain_name(part: str) -> None:
    if part in ("", ".", "..") or "/" in part or "\0" in part:
        raise ValueError(f"directory name: expected one plain name, got {part!r}")


def _open_child_dir(dir_fd: int, name: str, where: str) -> int:
    try:
        return os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        try:
            kind = describe_kind(os.lstat(name, dir_fd=dir_fd).st_mode)
        except OSError:
            kind = "something else"
        raise EntryKindError(f"{where}: expected a directory, got {kind}") from None


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
        """``os.open`` with ``O_NOFOLLOW`` (a symlink planted inside the store is never
        followed out of it) and ``O_NONBLOCK`` (a FIFO planted there never blocks the open;
        Linux ignores the flag for regular files, so reads and writes are unchanged)."""
        return os.open(path, flags | _OPEN_FLAGS, mode)

    def open_regular(self, path: str, flags: int = os.O_RDONLY) -> tuple[int, os.stat_result]:
        """Open an existing file to read it: a descriptor and its ``fstat``, or
        :class:`~kvstore.errors.EntryKindError` (descriptor closed) when ``path`` holds anything
        but a regular file (FIFO, socket, device, directory). The one ``fstat`` is the one a
        reader needs anyway (size check, mtime, identity): no extra system call."""
        try:
            fd = self.open(path, flags)
        except OSError as exc:
            # ELOOP: O_NOFOLLOW met a symbolic link; ENXIO: a socket (or a device without a
            # driver). Said in words: the lstat costs nothing on the path that succeeds.
            if exc.errno not in (errno.ELOOP, errno.ENXIO):
                raise
            try:
                mode = os.lstat(path).st_mode
            except OSError:
                raise exc from None
            if stat.S_ISREG(mode):
                raise
            raise not_regular(path, mode) from None
        try:
            st = self.fstat(fd)
        except BaseException:
            self.close(fd)
            raise
        if not stat.S_ISREG(st.st_mode):
            self.close(fd)
            raise not_regular(path, st.st_mode)
        return fd, st

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

    def rename_at(self, src_dir_fd: int | None, src: str, dst_dir_fd: int | None, dst: str) -> None:
        """:meth:`rename` between open directories (:func:`rename_noreplace_at`)."""
        rename_noreplace_at(src_dir_fd, src, dst_dir_fd, dst)

    def lstat_at(self, dir_fd: int | None, name: str) -> os.stat_result:
        """``lstat`` of ``name`` in an open directory (links not followed)."""
        return os.lstat(name, dir_fd=dir_fd)

    def unlink_at(self, dir_fd: int | None, name: str) -> None:
        os.unlink(name, dir_fd=dir_fd)

    def open_dir(
        self,
        root: str | os.PathLike[str],
        parts: Sequence[str],
        create_mode: int | None = None,
        created: list[str] | None = None,
    ) -> int:
        """:func:`open_dir_nofollow` (a descriptor; the caller closes it)."""
        return open_dir_nofollow(root, parts, create_mode=create_mode, created=created)

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
        """Whether a regular file has the name ``path`` (the existence probe of lookups).

        ``lstat``: a symbolic link is not followed. A name held by anything but a regular file
        (a link, FIFO, socket, device, directory) raises
        :class:`~kvstore.errors.EntryKindError`, which lookups count as a failed probe: a miss,
        logged.
        """
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(mode):
            raise not_regular(path, mode)
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
                # Created meanwhile by another process: it must be a real directory (a link
                # there would take everything below it out of the store).
                mode = os.lstat(directory).st_mode
                if not stat.S_ISDIR(mode):
                    raise EntryKindError(
                        f"{directory}: expected a directory, got {describe_kind(mode)}"
                    ) from None
        return created

    def drop_cache(self, fd: int) -> None:
        """Ask the kernel to drop this file's clean cached pages (benchmarks' cold reads)."""
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


DEFAULT_FILEIO = FileIO()


def move_if_same(
    fio: FileIO,
    src_dir_fd: int | None,
    src: str,
    dst_dir_fd: int | None,
    dst: str,
    identity: FileId,
) -> str:
    """Rename ``src`` to the new name ``dst`` only if ``src`` is still the file ``identity``
    (what the caller read or wrote). Returns "moved", "gone" (no such name) or "replaced"
    (the name now holds another file, which is left in place).

    Why not simply check, then rename: another process may replace the name between the two
    calls (a reader or ``verify --fix`` removed a corrupt block, a writer re-published a good
    copy). Linking the open descriptor (``linkat`` of ``/proc/self/fd/N``) would not help
    either: the old name must still be removed, by name. So the check is made twice: an
    ``lstat`` before the rename (the common case of a replaced file costs nothing), and an
    ``lstat`` of ``dst`` after it, which no one else names - if the rename caught another
    file, that file is renamed back (without replacing: if the name was published yet again
    meanwhile, the name already holds a copy and the one caught is removed). A concurrent
    reader may see a miss in between, never a wrong block; nothing published is lost.
    """
    try:
        if file_id(fio.lstat_at(src_dir_fd, src)) != identity:
            return "replaced"
        fio.rename_at(src_dir_fd, src, dst_dir_fd, dst)
    except FileNotFoundError:
        return "gone"
    if file_id(fio.lstat_at(dst_dir_fd, dst)) == identity:
        return "moved"
    try:
        fio.rename_at(dst_dir_fd, dst, src_dir_fd, src)
    except FileExistsError:
        fio.unlink_at(dst_dir_fd, dst)
    return "replaced"


def remove_if_same(fio: FileIO, dir_fd: int | None, name: str, identity: FileId) -> str:
    """Remove ``name`` only if it is still the file ``identity``: "removed", "gone" or
    "replaced" (see :func:`move_if_same`). The file is first renamed to a temporary name of
    the ``.<name>.tmp-<token>`` shape in the same directory, so a crash in between leaves
    only a temporary file, swept like any other."""
    directory, base = os.path.split(name)
    hidden = os.path.join(directory, f".{base}.tmp-rm{uuid.uuid4().hex[:12]}")
    outcome = move_if_same(fio, dir_fd, name, dir_fd, hidden, identity)
    if outcome != "moved":
        return outcome
    fio.unlink_at(dir_fd, hidden)
    return "removed"


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

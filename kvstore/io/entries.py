"""What a name under the store root holds, checked without trusting the tree.

A hostile tree is normal input: any entry may be a symbolic link, FIFO, socket, device or
directory where kvstore expects a file, or the reverse, and any name may be replaced by another
process between two calls. The primitives here keep the rules of :mod:`kvstore.io.fileio`
wherever a name is entered, described, moved or removed:

* what an entry is, in words (:func:`describe_kind`), and the error for a name that holds
  anything but a regular file (:func:`not_regular`, an
  :class:`~kvstore.errors.EntryKindError`);
* which file a name held when it was read (:func:`file_id`), carried by a
  :class:`~kvstore.errors.CorruptBlockError` (:func:`corrupt_file_is`);
* directories entered one component at a time, no symbolic link followed, no open blocking
  (:func:`open_dir_nofollow`);
* a file moved or removed only if it is still the file that was read (:func:`move_if_same`,
  :func:`remove_if_same`), never "whatever has the name now".
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from collections.abc import Iterator, Sequence
from typing import Protocol

from kvstore.errors import CorruptBlockError, EntryKindError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NONBLOCK

FileId = tuple[int, int]  # (st_dev, st_ino): which file, whatever its name is now


class EntryOps(Protocol):
    """The three calls :func:`move_if_same` makes; :class:`kvstore.io.fileio.FileIO` has them
    (tests substitute one that records or injects errors)."""

    def lstat_at(self, dir_fd: int | None, name: str) -> os.stat_result: ...

    def rename_at(
        self, src_dir_fd: int | None, src: str, dst_dir_fd: int | None, dst: str
    ) -> None: ...

    def unlink_at(self, dir_fd: int | None, name: str) -> None: ...


# What each kind of entry is called in messages and reports, tested in this order.
_KINDS = (
    (stat.S_ISREG, "regular file"),
    (stat.S_ISDIR, "directory"),
    (stat.S_ISLNK, "symbolic link"),
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
)


def kind_noun(mode: int) -> str:
    """What a ``st_mode`` is, as a noun ("FIFO", "symbolic link", ...)."""
    for test, words in _KINDS:
        if test(mode):
            return words
    return f"entry of unknown type {stat.S_IFMT(mode):#o}"


def describe_kind(mode: int) -> str:
    """What a ``st_mode`` is, in words with the article ("a FIFO", "an entry of ...")."""
    noun = kind_noun(mode)
    return ("an " if noun.startswith("entry") else "a ") + noun


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
    to ``created`` when given (for :func:`~kvstore.io.fileio.sync_parents`: this function
    syncs nothing).
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


def move_if_same(  # noqa: PLR0913 - two (directory, name) pairs as renameat(2) takes them, the FileIO that acts and the identity to match
    fio: EntryOps,
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


def remove_if_same(fio: EntryOps, dir_fd: int | None, name: str, identity: FileId) -> str:
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

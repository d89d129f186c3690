"""Giving a file a new name without ever replacing one that exists (the store's publish).

kvstore renames only to publish a new name (a block, a metadata document, a quarantined file):
on a shared file system a name replaced under a reader on another node fails that reader's
reads, and two nodes publishing the same block must leave one copy rather than swap it under
readers. :func:`rename_noreplace` is that rename on every file system kvstore supports
(docs/shared-filesystems.md); :meth:`kvstore.io.fileio.FileIO.rename` calls it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from typing import Any

from kvstore.callargs import path_bytes

RENAME_NOREPLACE = 1  # linux/fs.h
AT_FDCWD = -100
# errnos meaning "this file system (or kernel) lacks the operation", not "it failed"
# renameat2(RENAME_NOREPLACE) refused: the file system (FUSE, NFS) or the C library lacks it.
NOREPLACE_REFUSED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})
_NO_HARD_LINKS = frozenset({errno.EPERM, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})


def load_renameat2() -> Any:
    """glibc's ``renameat2`` through ctypes (errno kept), or None where the C library lacks it."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = load_renameat2()


def renameat2_noreplace(src: bytes, dst: bytes) -> int:
    """``renameat2(src, dst, RENAME_NOREPLACE)`` alone, as kvstore/_native/fileproto_pieces.c's
    batch publish calls it (no fallback): 0, or the errno it failed with (ENOSYS where the C
    library lacks the call)."""
    if _renameat2 is None:
        return errno.ENOSYS
    if _renameat2(AT_FDCWD, src, AT_FDCWD, dst, RENAME_NOREPLACE) == 0:
        return 0
    return ctypes.get_errno()


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
    working directory, as ``AT_FDCWD``): a directory opened by
    :func:`~kvstore.io.entries.open_dir_nofollow` stays the directory checked, whatever is
    renamed or linked above it meanwhile."""
    # A NUL would end the name the C library sees: the file would get another name.
    paths = (path_bytes(src), path_bytes(dst))
    if _renameat2 is not None:
        src_at = AT_FDCWD if src_dir_fd is None else src_dir_fd
        dst_at = AT_FDCWD if dst_dir_fd is None else dst_dir_fd
        if _renameat2(src_at, paths[0], dst_at, paths[1], RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in NOREPLACE_REFUSED:
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

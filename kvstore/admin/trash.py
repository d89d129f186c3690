"""Taking files out of a live store: the two-phase deletion protocol.

Servers read a store while the admin tools remove things from it, possibly from other
machines over a shared file system. The protocol that keeps every read whole:

1. **Unpublish by rename.** ``gc`` never unlinks a published block name: it renames the file
   to ``<ns>/trash/<hi>/g<k>-<hi>-<lo>-<ns time>`` (same directory tree, same file system, so
   the rename is atomic; fanned out by the block's fan-out directory like the store, so that a
   pass evicting millions does not leave one directory of millions). From then on a reader
   opening the published name gets ENOENT - a miss, which the engine recomputes. A reader that
   opened the file before keeps a descriptor of the same, complete, immutable inode and reads
   and verifies it as usual.
   ``rm`` does the same for a whole namespace: ``<root>/<ns>`` becomes
   ``<root>/.trash-<ns>-<ns time>``.
2. **Unlink after a grace period.** Trash entries are deleted only when the time in their name
   is older than the grace period (default 60 s, far longer than any block read). On a local
   POSIX file system an unlinked open file stays readable anyway; on NFS, unlinking a file
   another client has open can make that client's reads fail (its "silly rename" protects only
   opens made on the same client), which is what the grace period prevents.

Every ``gc`` run (and every ``--watch`` pass, and ``rm``) first empties expired trash of every
namespace and expired removed namespaces of the root. Quarantine (``<ns>/quarantine/``) is
never emptied automatically: its files are kept for people to look at.

**Hostile trees.** ``trash/`` and ``quarantine/`` are entered only as real directories: the
namespace directory and then the held directory are opened with ``O_NOFOLLOW | O_DIRECTORY``
and the rename targets that descriptor (``renameat``), so a symbolic link planted at
``<ns>/trash`` (to a directory outside the root, say) is never moved into: :func:`trash_block`
and :func:`quarantine_file` raise :class:`HeldDirectoryError` instead, and the caller decides
(gc deletes the victim directly, verify leaves it in place; both report it).

**Clock jumps.** An entry named with a time in the future (the clock was ahead when it was
trashed, then stepped back) would wait until the clock catches up; :func:`restamp_future`
renames it with the current time, so it expires one grace period later.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvstore.admin.scan import HeldFile
from kvstore.errors import KvstoreError
from kvstore.io import stall
from kvstore.io.entries import FileId, kind_noun, move_if_same
from kvstore.io.native_fileio import DEFAULT_FILEIO
from kvstore.store.paths import QUARANTINE, REMOVED_PREFIX, TRASH

DEFAULT_GRACE_S = 60.0
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_TRAILING_NS = re.compile(r"-([0-9]+)$")


class HeldDirectoryError(KvstoreError):
    """``<ns>/trash`` or ``<ns>/quarantine`` exists but is not a real directory (a symbolic
    link, a file, a FIFO ...): nothing is moved into it."""


class ReplacedError(KvstoreError):
    """The name now holds another file than the one judged (re-published since the check):
    nothing is moved."""


@dataclass(frozen=True)
class Emptied:
    """What emptying the trash removed (or, in a dry run, would remove)."""

    entries: int
    files: int
    bytes: int
    failed: tuple[str, ...] = ()  # "<path>: <why>" of entries that could not be deleted
    allocated: int = 0  # what the removed entries held on the disk


def trash_block(namespace_path: Path, group: int, hi: int, lo: int, path: str) -> str | None:
    """Unpublish block file ``path`` by renaming it into ``<ns>/trash/``.

    Returns the trash path, or None if the file (or its namespace) was already gone.
    """
    name = f"g{group}-{hi}-{lo}-{time.time_ns()}"
    return _move(path, namespace_path, (TRASH, str(hi)), name)


def quarantine_file(
    namespace_path: Path, name: str, path: str, identity: FileId | None = None
) -> str | None:
    """Move ``path`` (a file or directory) into ``<ns>/quarantine/<name>-<ns time>``.

    With ``identity`` (the st_dev, st_ino of the file that was judged) only that file is
    moved: if a writer re-published the name since, :class:`ReplacedError` and the new file
    stays (see :func:`kvstore.io.entries.move_if_same`). None if ``path`` is gone.
    """
    return _move(path, namespace_path, (QUARANTINE,), f"{name}-{time.time_ns()}", identity)


def remove_namespace_dir(root: Path, name: str) -> Path:
    """Unpublish namespace ``name`` by renaming it to ``<root>/.trash-<name>-<ns time>``."""
    target = root / f"{REMOVED_PREFIX}{name}-{time.time_ns()}"
    (root / name).rename(target)
    return target


def expired(held: Iterable[HeldFile], grace_s: float, now_ns: int | None = None) -> list[HeldFile]:
    """The entries put in trash more than ``grace_s`` seconds before ``now_ns``."""
    now = time.time_ns() if now_ns is None else now_ns
    limit = now - int(grace_s * 1e9)
    return [h for h in held if h.since_ns <= limit]


def delete_held(entries: Iterable[HeldFile], *, dry_run: bool = False) -> Emptied:
    """Unlink trash files / remove trashed directories (phase 2); vanished ones are skipped,
    ones that cannot be deleted (an unreadable directory inside, EACCES, EIO) are listed in
    :attr:`Emptied.failed` and the rest carries on. A link is unlinked, never followed."""
    count = files = nbytes = held = 0
    failed: list[str] = []
    for entry in entries:
        if not dry_run:
            try:
                if stat.S_ISDIR(os.lstat(entry.path).st_mode):
                    shutil.rmtree(entry.path)  # fd-based on Linux: links inside not followed
                else:
                    Path(entry.path).unlink()
            except FileNotFoundError:
                continue
            except OSError as exc:
                failed.append(f"{entry.path}: cannot delete ({exc.strerror or exc})")
                continue
        stall.beat()
        count += 1
        files += entry.files
        nbytes += entry.size
        held += entry.allocated
    return Emptied(count, files, nbytes, tuple(failed), held)


def restamp_future(held: Iterable[HeldFile], now_ns: int | None = None) -> list[HeldFile]:
    """Rename entries whose name carries a time after ``now_ns`` to carry ``now_ns`` instead
    (same directory); returns ``held`` with those entries updated. Entries that vanished are
    left out."""
    now = time.time_ns() if now_ns is None else now_ns
    out: list[HeldFile] = []
    for h in held:
        if h.since_ns <= now:
            out.append(h)
            continue
        old = Path(h.path)
        new = old.with_name(_TRAILING_NS.sub("", old.name) + f"-{now}")
        try:
            old.rename(new)  # renames the entry itself (a link is not followed)
        except FileNotFoundError:
            continue
        except OSError:
            out.append(h)  # cannot rename (read-only?): it keeps its time
            continue
        out.append(HeldFile(str(new), h.namespace, h.size, h.files, now, h.allocated))
    return out


def _move(
    path: str,
    namespace_path: Path,
    held_dirs: tuple[str, ...],
    name: str,
    identity: FileId | None = None,
) -> str | None:
    """Rename ``path`` to ``<namespace>/<held_dirs...>/name``, entering the namespace and each
    held directory (created if missing) only as real directories; None if ``path`` or the
    namespace is gone. With ``identity``, only if ``path`` still is that file (else
    :class:`ReplacedError`)."""
    try:
        parent = os.open(namespace_path, _DIR_FLAGS)
    except FileNotFoundError:
        return None  # the namespace was removed meanwhile
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise HeldDirectoryError(f"{namespace_path}: expected a directory, got none") from None
        raise
    # The namespace's own permission bits (owner-only unless the store is group-shared);
    # every mkdir is relative to its parent's descriptor: a removed namespace is not
    # resurrected.
    mode = stat.S_IMODE(os.fstat(parent).st_mode)
    directory = namespace_path
    try:
        for component in held_dirs:
            directory = directory / component
            with contextlib.suppress(FileExistsError):
                os.mkdir(component, mode, dir_fd=parent)
            try:
                held = os.open(component, _DIR_FLAGS, dir_fd=parent)
            except FileNotFoundError:
                return None
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise HeldDirectoryError(_not_a_directory(directory)) from None
            os.close(parent)
            parent = held
        if not _rename_into(path, parent, name, identity):
            return None  # gone already (another gc, a reader's quarantine, rm of the ns)
    finally:
        os.close(parent)
    return str(directory / name)


def _rename_into(path: str, held: int, name: str, identity: FileId | None) -> bool:
    """Rename ``path`` to ``name`` in the open directory ``held``; False if ``path`` is gone.
    With ``identity``, only if ``path`` still is that file (else :class:`ReplacedError`)."""
    try:
        if identity is None:
            os.rename(path, name, dst_dir_fd=held)
            return True
        outcome = move_if_same(DEFAULT_FILEIO, None, path, held, name, identity)
    except FileNotFoundError:
        return False
    if outcome == "replaced":
        raise ReplacedError(
            f"{path}: the name now holds another file than the one checked "
            "(re-published meanwhile), left in place"
        )
    return outcome == "moved"


def _not_a_directory(directory: Path) -> str:
    try:
        st = os.lstat(directory)
    except OSError:
        return f"{directory}: expected a directory, got none"
    what = kind_noun(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        with contextlib.suppress(OSError):
            what += f" to {directory.readlink()}"
    return f"{directory}: expected a directory, got a {what} (never entered)"

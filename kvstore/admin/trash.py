"""Taking files out of a live store: the two-phase deletion protocol.

Servers read a store while the admin tools remove things from it, possibly from other
machines over a shared file system. The protocol that keeps every read whole:

1. **Unpublish by rename.** ``gc`` never unlinks a published block name: it renames the file
   to ``<ns>/trash/g<k>-<hi>-<lo>-<ns time>`` (same directory tree, same file system, so the
   rename is atomic). From then on a reader opening the published name gets ENOENT - a miss,
   which the engine recomputes. A reader that opened the file before keeps a descriptor of the
   same, complete, immutable inode and reads and verifies it as usual.
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
"""

from __future__ import annotations

import contextlib
import shutil
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvstore.admin.scan import REMOVED_PREFIX, TRASH, HeldFile
from kvstore.store.page_store import QUARANTINE

DEFAULT_GRACE_S = 60.0


@dataclass(frozen=True)
class Emptied:
    """What emptying the trash removed (or, in a dry run, would remove)."""

    entries: int
    files: int
    bytes: int


def trash_block(namespace_path: Path, group: int, hi: int, lo: int, path: str) -> str | None:
    """Unpublish block file ``path`` by renaming it into ``<ns>/trash/``.

    Returns the trash path, or None if the file (or its namespace) was already gone.
    """
    name = f"g{group}-{hi}-{lo}-{time.time_ns()}"
    return _move(path, namespace_path / TRASH, name)


def quarantine_file(namespace_path: Path, name: str, path: str) -> str | None:
    """Move ``path`` (a file or directory) into ``<ns>/quarantine/<name>-<ns time>``."""
    return _move(path, namespace_path / QUARANTINE, f"{name}-{time.time_ns()}")


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
    """Unlink trash files / remove trashed directories (phase 2); vanished ones are skipped."""
    count = files = nbytes = 0
    for entry in entries:
        if not dry_run:
            path = Path(entry.path)
            try:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
            except FileNotFoundError:
                continue
        count += 1
        files += entry.files
        nbytes += entry.size
    return Emptied(count, files, nbytes)


def _move(path: str, directory: Path, name: str) -> str | None:
    target = directory / name
    try:
        # The namespace's own permission bits (owner-only unless the store is group-shared):
        # never parents=True, that would resurrect a removed namespace.
        mode = stat.S_IMODE(directory.parent.stat().st_mode)
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode)
        Path(path).rename(target)
    except FileNotFoundError:
        return None  # gone already (another gc, a reader's quarantine, rm of the namespace)
    return str(target)

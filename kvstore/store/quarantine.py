"""Moving a block file found corrupt out of its name, into ``<namespace>/quarantine``."""

from __future__ import annotations

import os
import time
from pathlib import Path

from kvstore.errors import EntryKindError
from kvstore.io.entries import FileId, move_if_same, remove_if_same
from kvstore.keys import hash_coords
from kvstore.store.array import GroupArray
from kvstore.store.paths import held_block_name


def quarantine(array: GroupArray, block_hash: bytes, read_id: FileId | None) -> str:  # noqa: PLR0911 - each early return is one outcome in words for the log line (read-only, unknown file, gone, cannot enter, moved, removed)
    """Move the corrupt file that was read (``read_id``) out of the block's name, into
    ``<namespace>/quarantine``; the words for the log line say what happened.

    Every directory on the way is entered without following a symbolic link
    (:func:`~kvstore.io.entries.open_dir_nofollow`, from the store root), and the rename goes
    between those open directories: a link planted at ``quarantine`` (or anywhere above the
    block) never takes the file out of the root. If ``quarantine`` is not a real directory the
    file is removed instead (it is never served either way). The file is moved only while the
    name still holds the file read (:func:`move_if_same`): another reader or ``verify --fix``
    may have removed it and a writer re-published a good copy.
    """
    path = array.block_path(block_hash)
    if array.read_only:
        return "left in place (store opened read-only)"
    if read_id is None:  # an engine that does not say what it read: touch nothing
        return "left in place (the file read is not known)"
    fio = array.fio
    fanout = os.path.dirname(path)
    name = os.path.basename(path)
    qdir = array.quarantine_dir
    try:
        src_fd = array.open_dir(fanout)
    except FileNotFoundError:
        return "already gone"
    except (OSError, ValueError) as exc:
        return f"left in place (cannot enter {fanout}: {exc})"
    try:
        if qdir is None:
            return _outcome(remove_if_same(fio, src_fd, name, read_id), None)
        target = held_block_name(array.index, *hash_coords(block_hash), time.time_ns())
        try:
            q_fd = fio.open_dir(
                qdir.parent.parent,
                [qdir.parent.name, qdir.name],
                create_mode=array.engine.config.dir_mode,
            )
        except (EntryKindError, OSError) as exc:
            outcome = remove_if_same(fio, src_fd, name, read_id)
            return f"{_outcome(outcome, None)}: cannot quarantine ({exc})"
        try:
            outcome = move_if_same(fio, src_fd, name, q_fd, target, read_id)
        finally:
            fio.close(q_fd)
        return _outcome(outcome, qdir / target)
    except OSError as exc:
        return f"could not quarantine ({exc})"
    finally:
        fio.close(src_fd)


def _outcome(outcome: str, target: Path | None) -> str:
    """Log words for a :func:`move_if_same` / :func:`remove_if_same` outcome."""
    if outcome == "moved":
        return f"quarantined as {target}"
    if outcome == "gone":
        return "already gone"
    if outcome == "replaced":
        return "left in place (the name holds another file since the read)"
    return outcome  # "removed"

"""What files hold: apparent and allocated bytes of one entry or of a whole tree.

Shared by the scan (every block's sizes, foreign directories' contents) and ``kvstore rm``
(what a removed namespace held). Links are counted, never followed.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvstore.io.dirlist import EntryStat
from kvstore.store import paths
from kvstore.store.view import Problem


def allocated_bytes(st: EntryStat) -> int:
    """What a file holds on the disk: its allocated 512-byte units (``st_blocks``), and never
    less than its size (a FUSE or network file system may report no blocks at all: gc must
    not then see an empty store)."""
    return max(st.st_blocks * 512, st.st_size)


def tree_usage(path: str, unreadable: list[Problem] | None = None) -> tuple[int, int, int]:
    """(files, bytes, allocated bytes) of every entry below ``path`` that is not a directory
    (or of ``path`` itself); links are counted, never followed. Directories that cannot be
    listed are appended to ``unreadable`` (when given) and counted as empty."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0, 0, 0
    if not stat.S_ISDIR(st.st_mode):
        return 1, st.st_size, allocated_bytes(st)
    files = size = held = 0
    pending = [path]
    while pending:
        directory = pending.pop()
        try:
            listed = paths.iter_dir(directory)
            for name, est in listed:
                if stat.S_ISDIR(est.st_mode):
                    pending.append(f"{directory}{os.sep}{name}")
                else:
                    files += 1
                    size += est.st_size
                    held += allocated_bytes(est)
        except OSError as exc:
            if unreadable is not None:
                unreadable.append(Problem(Path(directory), listing_problem(exc)))
            continue
    return files, size, held


def listing_problem(exc: OSError) -> str:
    """A directory that cannot be listed, in words (the scan's ``unreadable`` problems)."""
    return f"cannot list: {exc.strerror or exc}"

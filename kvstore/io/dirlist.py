"""A directory's entries, each with its ``lstat``: many per native call, or one by one.

Every listing of the admin and inspection tools goes through :func:`dir_entry_batches` (by
way of :func:`kvstore.store.paths.iter_dir_batches`). A fan-out directory of a big store holds
hundreds of thousands of entries, and each ``os.stat`` of the Python listing releases and
retakes the GIL: with the tools' listing and reader threads on two cores, that hand-over costs
more than the system calls. The native step (``list_dir_step`` of ``kvstore._native._fileproto``)
reads one ``getdents64`` buffer and ``fstatat``'s its entries without the GIL, then hands them
over at once.

:func:`reference_dir_entries` is the Python reference (``os.scandir`` + ``os.stat(...,
follow_symlinks=False)``); both give the same entries in the same order with the same stat
fields, leave out entries that vanish before their ``lstat``, and raise the same ``OSError``
for the others (tests/native holds them to each other).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import NamedTuple, Protocol

from kvstore.io import stall
from kvstore.io.fileproto import native_fileproto

# One getdents64 buffer per native step: ~2,000 entries of a fan-out directory (names of 19
# digits), a bounded amount of memory whatever the directory's size.
STEP_NBYTES = 64 << 10
REFERENCE_BATCH = 1024  # entries per batch of the reference's dir_entry_batches


class EntryStat(Protocol):
    """The ``lstat`` fields the tools read of an entry: :class:`ListedStat` or an
    ``os.stat_result`` alike."""

    @property
    def st_mode(self) -> int: ...
    @property
    def st_ino(self) -> int: ...
    @property
    def st_dev(self) -> int: ...
    @property
    def st_nlink(self) -> int: ...
    @property
    def st_size(self) -> int: ...
    @property
    def st_blocks(self) -> int: ...
    @property
    def st_mtime_ns(self) -> int: ...
    @property
    def st_ctime_ns(self) -> int: ...


class ListedStat(NamedTuple):
    """An entry's ``lstat`` as a listing gives it (the fields of ``os.stat_result`` of the
    same names and values)."""

    st_mode: int
    st_ino: int
    st_dev: int
    st_nlink: int
    st_size: int
    st_blocks: int
    st_mtime_ns: int
    st_ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> ListedStat:
        return cls(
            st.st_mode,
            st.st_ino,
            st.st_dev,
            st.st_nlink,
            st.st_size,
            st.st_blocks,
            st.st_mtime_ns,
            st.st_ctime_ns,
        )


def dir_entries(fd: int) -> Iterator[tuple[str, ListedStat]]:
    """``(name, lstat)`` of every entry of the directory open at ``fd`` but ``.`` and ``..``,
    in the directory's order, from its current position (the descriptor is the caller's: it
    is read, never closed). An entry removed before its ``lstat`` is left out; any other
    failure raises that ``OSError``. Beats (:mod:`kvstore.io.stall`) after each system call
    that answers and once at the end. Native when the extension is bound, else
    :func:`reference_dir_entries`."""
    return itertools.chain.from_iterable(dir_entry_batches(fd))


def dir_entry_batches(fd: int) -> Iterator[list[tuple[str, ListedStat]]]:
    """:func:`dir_entries` a batch at a time (one native step's entries, or
    :data:`REFERENCE_BATCH` of the reference's): for a caller that walks millions of entries,
    one generator step per batch instead of one per entry. An ``OSError`` is raised after
    the batch of the entries listed before it."""
    native = native_fileproto()
    if native is None:
        yield from _reference_batches(fd)
        return
    make = tuple.__new__  # a ListedStat from the C's tuple without a Python __new__ call
    # The step beats after each system call that answers (stall.beat_slot): a slow mount's
    # listing is progress, entry by entry, as in the reference.
    while (step := native.list_dir_step(fd, STEP_NBYTES, stall.beat_slot())) is not None:
        listed, failure = step
        if listed:
            yield [(name, make(ListedStat, fields)) for name, fields in listed]
        if failure is not None:
            code, name = failure
            raise OSError(code, os.strerror(code), name)
    stall.beat()


def reference_dir_entries(fd: int) -> Iterator[tuple[str, ListedStat]]:
    """:func:`dir_entries` in Python: one ``os.stat`` per entry."""
    with os.scandir(fd) as it:
        for entry in it:
            try:
                st = os.stat(entry.name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            stall.beat()
            yield entry.name, ListedStat.of(st)
    stall.beat()


def _reference_batches(fd: int) -> Iterator[list[tuple[str, ListedStat]]]:
    batch: list[tuple[str, ListedStat]] = []
    try:
        for item in reference_dir_entries(fd):
            batch.append(item)
            if len(batch) >= REFERENCE_BATCH:
                yield batch
                batch = []
    except OSError:
        if batch:
            yield batch
        raise
    if batch:
        yield batch

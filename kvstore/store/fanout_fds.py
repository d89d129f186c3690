"""Descriptors of one array's fan-out directories, held across existence probes.

A lookup probes ``fstatat(<fan-out directory>, "<lo>", AT_SYMLINK_NOFOLLOW)`` against a held
descriptor instead of ``lstat`` of the block's full path: the kernel then resolves one name
instead of ten, and no path string is built per key (docs/performance.md, "Secondary tier vs
vLLM fs tier").

Links: the fan-out root (``<array>/c/0/.../0``) is entered from the store root one component
at a time with ``O_NOFOLLOW`` (:meth:`FileIO.open_dir <kvstore.io.fileio.FileIO.open_dir>`),
each fan-out directory from it the same way (:meth:`~kvstore.io.fileio.FileIO.open_dir_at`).
A link, file or FIFO at a fan-out directory's name is an
:class:`~kvstore.errors.EntryKindError` for the keys below it (misses, counted and logged),
as a link at a block's name is.

Staleness: a held descriptor names the directory it was opened on, whatever happens to the
name afterwards. A fan-out directory removed (and perhaps recreated by a writer) would answer
"missing" forever through it; a namespace renamed away by ``kvstore rm`` would still answer
with its old blocks. So every lookup call (:meth:`FanoutDirs.begin`) first ``lstat``'s the
fan-out root by path, one system call per call, and compares it with the held descriptors:

* another directory at the path (device and inode differ from the held root's; while the
  root is held open its inode number cannot be reused): everything held is dropped;
* the same directory, but its modification or change time differs from when the fan-out
  descriptors were opened: a fan-out directory was removed, created or renamed since (those
  are the only entries of the fan-out root, and any change of them sets both times), so the
  fan-out descriptors are dropped and reopened on demand.

Timestamps are coarse (a kernel tick; a second on some file systems), so a change in the same
tick as the recorded times would go unseen: times younger than :data:`RACY_S` when recorded
are not trusted (every call then reopens the fan-out descriptors, as just after a namespace
was created), and no fan-out descriptor is used longer than :data:`MAX_AGE_S` whatever the
times say (a file server whose clock runs behind ours). So a false miss lasts at most
:data:`MAX_AGE_S`. A false hit through the fan-out root cannot happen (its identity is checked
by every call, and while it is held its inode number cannot be reused); through a fan-out
directory it would take that directory moved elsewhere (not removed: a removed directory is
empty) unseen by the times, which kvstore never does, for at most :data:`MAX_AGE_S`, and a
read checks the block's key in its header anyway.

Threads: lookups may run on several threads at once. A dropped descriptor is closed only
once no call that could still use it is in flight (closing it earlier could let another
open reuse its number and send a probe to another directory): each call holds the epoch it
began in, each drop starts a new epoch, and descriptors dropped in an epoch are closed when
the calls of that epoch and earlier ones have ended.

Bound: at most ``max_held`` fan-out descriptors per array (default: all 256 of them, fewer
under a low ``RLIMIT_NOFILE``), plus the fan-out root; the oldest is dropped to open another.
:meth:`FanoutDirs.close` (store close) closes all of them.
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from time import monotonic  # (a name of this module: tests move its clock)

from kvstore.errors import ConfigError, EntryKindError
from kvstore.io.fileio import FileIO
from kvstore.store.paths import FANOUT

RACY_S = 2.0  # directory times younger than this when recorded are not trusted (FAT: 2 s)
# Longest a fan-out descriptor is used without reopening: bounds a false miss that only times
# which do not move (a file server's clock behind ours) can cause. Each expiry costs the next
# call one openat per fan-out directory it touches (~3 us, at most 256 per array).
MAX_AGE_S = 30.0


def default_max_held() -> int:
    """Fan-out descriptors one array may hold: all of them unless ``RLIMIT_NOFILE`` is low
    (an eighth of the soft limit, so that a store of several arrays leaves room for the
    block files its I/O threads open)."""
    try:
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return 16
    if soft == resource.RLIM_INFINITY:
        return len(FANOUT)
    return max(16, min(len(FANOUT), soft // 8))


class FanoutDirs:
    """Held descriptors of the fan-out root of one array and of its fan-out directories."""

    def __init__(
        self, fio: FileIO, root: Path, parts: Sequence[str], max_held: int | None = None
    ) -> None:
        """``root``: the store root; ``parts``: the components from it to the fan-out root."""
        self._fio = fio
        self._root = root
        self._parts = list(parts)
        self.path = str(root.joinpath(*parts))  # the fan-out root's path
        self.max_held = default_max_held() if max_held is None else max_held
        if self.max_held < 1:
            raise ConfigError(f"max_held: expected at least 1 descriptor, got {self.max_held}")
        self._lock = threading.Lock()
        self._top: int | None = None  # descriptor of the fan-out root
        self._top_dev: int | None = None  # its st_dev and st_ino
        self._top_ino: int | None = None
        self._top_error: OSError | None = None  # why it cannot be used (this call)
        self._path_id: tuple[int, int] | None = None  # (st_dev, st_ino) at the path (begin)
        # The fan-out root's times when the fan-out descriptors began to be opened, and until
        # when (monotonic) they may be used without a recheck: 0 when the times are too
        # young to be trusted (RACY_S), so that every call rechecks.
        self._mtime: int | None = None
        self._ctime: int | None = None
        self._expires = 0.0
        #: hash_hi -> descriptor of its fan-out directory. Read without the lock (one dict
        #: lookup is atomic); changed under it.
        self.dirs: dict[int, int] = {}
        self._epoch = 0
        self._active: dict[int, int] = {}  # epoch -> calls in flight that began in it
        self._dropped: list[tuple[int, int]] = []  # (epoch, descriptor) waiting to be closed
        self._closed = False

    @property
    def held(self) -> int:
        """Descriptors held open now, dropped ones not yet closed included."""
        with self._lock:
            return len(self.dirs) + (self._top is not None) + len(self._dropped)

    def begin(self) -> int:
        """Check the held descriptors against the fan-out root's path (one ``lstat``) before a
        lookup call; returns the call's epoch, to give back to :meth:`end`."""
        try:
            st = self._fio.lstat_at(None, self.path)
        except OSError as exc:
            found: os.stat_result | OSError = exc
        else:
            found = st
        with self._lock:
            if isinstance(found, OSError):
                # Missing (a removed namespace): every probe a miss; EACCES, EIO: an error.
                self._drop_all()
                self._top_error = found
            else:
                self._top_error = None
                if (
                    found.st_mtime_ns != self._mtime
                    or found.st_ctime_ns != self._ctime
                    or found.st_ino != self._top_ino
                    or found.st_dev != self._top_dev
                    or monotonic() > self._expires
                ):
                    self._recheck(found)
            epoch = self._epoch
            active = self._active
            active[epoch] = active.get(epoch, 0) + 1
            return epoch

    def open(self, hash_hi: int) -> int | None:
        """The descriptor of fan-out directory ``hash_hi``, opened now if not held; None when
        it or the fan-out root does not exist (a miss).

        Raises :class:`~kvstore.errors.EntryKindError` when it (or a directory above it) is
        not a real directory, another ``OSError`` when it cannot be opened (failed probes).
        """
        with self._lock:
            fd = self.dirs.get(hash_hi)
            if fd is not None:
                return fd
            if self._top is None:
                if self._top_error is None:
                    try:
                        self._open_top()
                    except OSError as exc:
                        self._top_error = exc
                if self._top_error is not None:
                    if isinstance(self._top_error, FileNotFoundError):
                        return None
                    raise _again(self._top_error)
            assert self._top is not None
            if len(self.dirs) >= self.max_held:
                oldest = next(iter(self.dirs))
                self._dropped.append((self._epoch, self.dirs.pop(oldest)))
                self._epoch += 1
            name = str(hash_hi)
            try:
                fd = self._fio.open_dir_at(self._top, name, f"{self.path}/{name}")
            except FileNotFoundError:
                return None
            self.dirs[hash_hi] = fd
            return fd

    def end(self, epoch: int) -> None:
        """A lookup call that began in ``epoch`` is done: close what no call can still use."""
        with self._lock:
            active = self._active
            left = active[epoch] - 1
            if left:
                active[epoch] = left
            else:
                del active[epoch]
            if self._closed:
                self._drop_all()
            if self._dropped:
                self._close_unused()

    def close(self) -> None:
        """Close every held descriptor (at once, or when the calls in flight end); a later
        call opens what it needs and closes it when it ends."""
        with self._lock:
            self._closed = True
            epoch = self._epoch
            self._active[epoch] = self._active.get(epoch, 0) + 1
        self.end(epoch)

    # -- with the lock held ----------------------------------------------------------------------

    def _open_top(self) -> None:
        top = self._fio.open_dir(self._root, self._parts)
        try:
            st = self._fio.fstat(top)
        except BaseException:
            self._fio.close(top)
            raise
        self._top = top
        self._top_dev, self._top_ino = st.st_dev, st.st_ino
        if (st.st_dev, st.st_ino) != self._path_id:
            # Not the directory begin() saw at the path (it was replaced meanwhile): the times
            # recorded say nothing about this one, so the next call rechecks.
            self._expires = 0.0

    def _recheck(self, st: os.stat_result) -> None:
        """The fan-out root at the path is ``st``: drop what may be stale, record its times."""
        self._path_id = (st.st_dev, st.st_ino)
        if self._path_id != (self._top_dev, self._top_ino):
            self._drop_all()
        else:
            self._drop_dirs()
        self._mtime, self._ctime = st.st_mtime_ns, st.st_ctime_ns
        trusted = time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > RACY_S * 1e9
        self._expires = monotonic() + MAX_AGE_S if trusted else 0.0

    def _close_unused(self) -> None:
        """Close the dropped descriptors no call in flight began early enough to use."""
        oldest = min(self._active, default=self._epoch + 1)
        keep = []
        for dropped_in, fd in self._dropped:
            if dropped_in < oldest:
                with contextlib.suppress(OSError):
                    self._fio.close(fd)
            else:
                keep.append((dropped_in, fd))
        self._dropped = keep

    def _drop_dirs(self) -> None:
        """Drop the fan-out descriptors: closed once the calls in flight are done."""
        if self.dirs:
            self._dropped.extend((self._epoch, fd) for fd in self.dirs.values())
            self.dirs = {}
            self._epoch += 1
        self._mtime = self._ctime = None

    def _drop_all(self) -> None:
        self._drop_dirs()
        if self._top is not None:
            self._dropped.append((self._epoch, self._top))
            self._top = None
            self._epoch += 1
        self._top_dev = self._top_ino = None


def _again(exc: OSError) -> OSError:
    """A fresh copy of ``exc`` to raise for another key (raising one object again and again
    would grow its traceback)."""
    if isinstance(exc, EntryKindError):
        return EntryKindError(str(exc))
    return OSError(exc.errno, exc.strerror, exc.filename)

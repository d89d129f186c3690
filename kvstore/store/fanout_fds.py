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
are not trusted (the next call drops the fan-out descriptors again), and no fan-out
descriptor is kept longer than :data:`MAX_AGE_S` whatever the times say (a server whose
clock runs behind). A false miss therefore lasts at most :data:`MAX_AGE_S`; a false hit
cannot happen: a probe goes through a directory that was at its path when the call began
(only a removed directory's descriptor can be stale, and a removed directory is empty).

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
import resource
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from kvstore.errors import ConfigError, EntryKindError
from kvstore.io.fileio import FileIO
from kvstore.store.paths import FANOUT

RACY_S = 2.0  # directory times younger than this when recorded are not trusted (FAT: 2 s)
MAX_AGE_S = 5.0  # longest a fan-out descriptor is used without reopening (bounds a false miss)


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
        self._top_error: OSError | None = None  # why it cannot be used (this call)
        self._top_id: tuple[int, int] | None = None  # its (st_dev, st_ino)
        self._path_id: tuple[int, int] | None = None  # (st_dev, st_ino) at the path (begin)
        self._times: tuple[int, int] | None = None  # its (mtime, ctime) when `dirs` began
        self._trusted = False  # `_times` old enough to detect a change (RACY_S)
        self._since = 0.0  # monotonic time `dirs` began
        #: hash_hi -> descriptor of its fan-out directory. Read without the lock (one dict
        #: lookup is atomic); changed under it.
        self.dirs: dict[int, int] = {}
        self._epoch = 0
        self._active: Counter[int] = Counter()  # epoch -> calls in flight that began in it
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
            found: tuple[tuple[int, int], tuple[int, int]] | OSError = exc
        else:
            found = ((st.st_dev, st.st_ino), (st.st_mtime_ns, st.st_ctime_ns))
        with self._lock:
            self._top_error = None
            if isinstance(found, OSError):
                # Missing (a removed namespace): every probe a miss; EACCES, EIO: an error.
                self._drop_all()
                self._top_error = found
            else:
                identity, times = found
                self._path_id = identity
                if identity != self._top_id:
                    self._drop_all()
                elif (
                    times != self._times
                    or not self._trusted
                    or time.monotonic() - self._since > MAX_AGE_S
                ):
                    self._drop_dirs()
                if self._times is None:
                    self._times = times
                    self._trusted = time.time_ns() - max(times) > RACY_S * 1e9
                    self._since = time.monotonic()
            epoch = self._epoch
            self._active[epoch] += 1
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
            self._active[epoch] -= 1
            if not self._active[epoch]:
                del self._active[epoch]
            if self._closed:
                self._drop_all()
            oldest = min(self._active, default=self._epoch + 1)
            keep = []
            for dropped_in, fd in self._dropped:
                if dropped_in < oldest:
                    with contextlib.suppress(OSError):
                        self._fio.close(fd)
                else:
                    keep.append((dropped_in, fd))
            self._dropped = keep

    def close(self) -> None:
        """Close every held descriptor (at once, or when the calls in flight end); a later
        call opens what it needs and closes it when it ends."""
        with self._lock:
            self._closed = True
            epoch = self._epoch
            self._active[epoch] += 1
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
        self._top_id = (st.st_dev, st.st_ino)
        if self._top_id != self._path_id:
            # Not the directory begin() saw at the path (it was replaced meanwhile): its times
            # say nothing about this one, so the next call reopens the fan-out descriptors.
            self._times = (st.st_mtime_ns, st.st_ctime_ns)
            self._trusted = False
            self._since = time.monotonic()

    def _drop_dirs(self) -> None:
        """Drop the fan-out descriptors: closed once the calls in flight are done."""
        if self.dirs:
            self._dropped.extend((self._epoch, fd) for fd in self.dirs.values())
            self.dirs = {}
            self._epoch += 1
        self._times = None

    def _drop_all(self) -> None:
        self._drop_dirs()
        if self._top is not None:
            self._dropped.append((self._epoch, self._top))
            self._top = None
            self._epoch += 1
        self._top_id = None


def _again(exc: OSError) -> OSError:
    """A fresh copy of ``exc`` to raise for another key (raising one object again and again
    would grow its traceback)."""
    if isinstance(exc, EntryKindError):
        return EntryKindError(str(exc))
    return OSError(exc.errno, exc.strerror, exc.filename)

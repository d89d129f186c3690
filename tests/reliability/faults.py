"""A FileIO that fails its k-th call, once or from then on (issue 8, threat 3).

Every method of :class:`~kvstore.io.fileio.FileIO` counts as one call site. A fault is an
``OSError`` with a real errno (EIO, ENOSPC, EDQUOT, EROFS, EACCES), a short transfer
(``short``: ``pwritev``/``preadv`` move half of what was asked, at least one byte) or a transfer
of nothing (``eof``: 0 bytes, as at end of file). ``close`` closes the descriptor and then
fails, as Linux does (the descriptor is gone even when close reports an error).
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Sequence
from typing import Any

from kvstore.io.fileio import FileIO

ERRNOS = {
    "EIO": errno.EIO,
    "ENOSPC": errno.ENOSPC,
    "EDQUOT": errno.EDQUOT,
    "EROFS": errno.EROFS,
    "EACCES": errno.EACCES,
}
TRANSFER_FAULTS = ("short", "eof")
KINDS = (*ERRNOS, *TRANSFER_FAULTS)
TRANSFERS = ("pwritev", "preadv")


def _half(buffers: Sequence[Any]) -> list[memoryview]:
    views = [memoryview(b).cast("B") for b in buffers]
    want = max(1, sum(len(v) for v in views) // 2)
    out = []
    for v in views:
        if want <= 0:
            break
        out.append(v[:want])
        want -= len(out[-1])
    return out


class FaultFileIO(FileIO):
    """Counts every call; fails call number ``at`` (and, if ``persistent``, every later one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.arm(None)

    def arm(self, kind: str | None, at: int = 0, persistent: bool = False) -> None:
        """Start counting from zero; ``kind`` None records without failing."""
        with self._lock:
            self.kind = kind
            self.at = at
            self.persistent = persistent
            self.calls: list[str] = []
            self.injected: list[str] = []

    def disarm(self) -> None:
        with self._lock:
            self.kind = None

    def _hit(self, name: str) -> bool:
        with self._lock:
            k = len(self.calls)
            self.calls.append(name)
            if self.kind is None:
                return False
            hit = k == self.at or (self.persistent and k > self.at)
            if hit and self.kind in TRANSFER_FAULTS and name not in TRANSFERS:
                hit = False
            if hit:
                self.injected.append(name)
            return hit

    def _fail(self, name: str, path: str = "") -> OSError:
        code = ERRNOS[self.kind or "EIO"]
        return OSError(code, f"injected {errno.errorcode[code]} in {name}", path or None)

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        if self._hit("open"):
            raise self._fail("open", path)
        return super().open(path, flags, mode)

    def close(self, fd: int) -> None:
        hit = self._hit("close")
        super().close(fd)
        if hit:
            raise self._fail("close")

    def pwritev(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        if self._hit("pwritev"):
            if self.kind == "short":
                return os.pwritev(fd, _half(buffers), offset)
            if self.kind == "eof":
                return 0
            raise self._fail("pwritev")
        return super().pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        if self._hit("preadv"):
            if self.kind == "short":
                return os.preadv(fd, _half(buffers), offset)
            if self.kind == "eof":
                return 0
            raise self._fail("preadv")
        return super().preadv(fd, buffers, offset)

    def ftruncate(self, fd: int, length: int) -> None:
        if self._hit("ftruncate"):
            raise self._fail("ftruncate")
        super().ftruncate(fd, length)

    def fdatasync(self, fd: int) -> None:
        if self._hit("fdatasync"):
            raise self._fail("fdatasync")
        super().fdatasync(fd)

    def fstat_size(self, fd: int) -> int:
        if self._hit("fstat_size"):
            raise self._fail("fstat_size")
        return super().fstat_size(fd)

    def fstat(self, fd: int) -> os.stat_result:
        if self._hit("fstat"):
            raise self._fail("fstat")
        return super().fstat(fd)

    def touch(self, fd: int) -> None:
        if self._hit("touch"):
            raise self._fail("touch")
        super().touch(fd)

    def fsync_dir(self, path: str) -> None:
        if self._hit("fsync_dir"):
            raise self._fail("fsync_dir", path)
        super().fsync_dir(path)

    def rename(self, src: str, dst: str) -> None:
        if self._hit("rename"):
            raise self._fail("rename", src)
        super().rename(src, dst)

    def unlink(self, path: str) -> None:
        if self._hit("unlink"):
            raise self._fail("unlink", path)
        super().unlink(path)

    def exists(self, path: str) -> bool:
        if self._hit("exists"):
            raise self._fail("exists", path)
        return super().exists(path)

    def makedirs(self, path: str, mode: int = 0o700) -> list[str]:
        if self._hit("makedirs"):
            raise self._fail("makedirs", path)
        return super().makedirs(path, mode)

"""FileIO stand-ins for a disk that misbehaves only when the store writes a block.

:class:`TempWrites` tracks the descriptors of temporary files (block files only, unless
``blocks_only`` is off) and calls :meth:`TempWrites.on_temp_write` before each ``pwritev`` into
one; subclasses make that write fail, stall or crawl. Other writes (metadata documents, the
publish) are left alone, so only block stores are affected.
"""

from __future__ import annotations

from typing import Any

from kvstore.io.fileio import FileIO
from kvstore.store.paths import TMP_MARK


class TempWrites(FileIO):
    """Routes every ``pwritev`` into a tracked temporary file through :meth:`on_temp_write`."""

    blocks_only = True  # only files under a chunk directory ("/c/"), not zarr.json documents

    def __init__(self) -> None:
        self._tmp_fds: set[int] = set()

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        fd = super().open(path, flags, mode)
        if TMP_MARK in path and (not self.blocks_only or "/c/" in path):
            self._tmp_fds.add(fd)
        return fd

    def close(self, fd: int) -> None:
        self._tmp_fds.discard(fd)
        super().close(fd)

    def pwritev(self, fd: int, buffers: Any, offset: int) -> int:
        if fd in self._tmp_fds:
            self.on_temp_write(buffers)
        return super().pwritev(fd, buffers, offset)

    def on_temp_write(self, buffers: Any) -> None:
        """Called before a write into a tracked temporary file; may raise or wait."""

"""What every read strategy of one array shares, fixed when the reader is built."""

from __future__ import annotations

import threading
import time

from kvstore.io.buffers import ThreadStaging
from kvstore.store.array import GroupArray
from kvstore.store.segments import byte_view


class ReadContext:
    """One array's read settings and per-thread buffers (see :mod:`kvstore.store.reads`)."""

    def __init__(self, array: GroupArray) -> None:
        self.array = array
        self.fio = array.fio
        self.plan = array.plan.reads
        layout = array.layout
        self.layout = layout
        self.block_nbytes = layout.block_nbytes
        self.file_nbytes = layout.file_nbytes
        self.data_offset = layout.chunk_offset(0)  # where chunk 0 starts in the file
        self.direct = self.plan.direct
        self._granularity_ns = array.engine.config.access_granularity_s * 1_000_000_000
        self._header_staging = ThreadStaging()
        # Each thread's header buffer as the memoryview a read fills (attribute "header"):
        # one lookup per block instead of a lookup and two numpy calls.
        self._local = threading.local()

    def touch_before(self) -> int:
        """The mtime below which a block read now gets its mtime refreshed (0: never)."""
        return time.time_ns() - self._granularity_ns if self.plan.touches else 0

    def header(self) -> memoryview:
        """The calling thread's header buffer (per-thread, aligned, reused: no allocation per
        block; aligned, so the whole read may be O_DIRECT). Every byte of it is read from the
        file or the read fails."""
        header: memoryview | None = getattr(self._local, "header", None)
        if header is None:
            nbytes = self.layout.header_nbytes
            header = self._header_staging.get(nbytes)[:nbytes].data
            self._local.header = header
        return header

    def host_out(self, given: object, need: int) -> memoryview:
        """``given`` (host memory) as the writable bytes a read of ``need`` bytes fills."""
        out = byte_view(given)
        if out.readonly:
            raise ValueError("read buffer: expected writable memory, got a read-only buffer")
        if len(out) < need:
            raise ValueError(f"read buffer: expected at least {need} bytes, got {len(out)}")
        return out

"""A large raw dense block of host memory, checksummed group by group as it is written.

Hashing a whole block and then writing it reads a block larger than the CPU cache from memory
twice. Here the engine's write (:meth:`~kvstore.io.engine.Engine.write_new_file_hashed`,
capability ``hashed_io``) checksums each group of the data into the header's slots just
before writing it; the header (its fixed part packed first: its crc does not cover the slots)
and the index go after the data. Same file as the path that hashes the whole block first.
"""

from __future__ import annotations

import threading
import time

from kvstore.checksum import XXH3_64
from kvstore.io.types import Hashing, Segment
from kvstore.store.files import BlockFiles
from kvstore.store.writes.headers import HeaderPages


class HashedWrite:
    """Temporary files of one array's large blocks, hashed as written."""

    def __init__(self, files: BlockFiles, pages: HeaderPages, index: memoryview) -> None:
        self._files = files
        self._pages = pages
        self._index = index
        self._local = threading.local()  # attribute "hashing": this thread's Hashing
        self._group_nbytes = files.array.plan.writes.group_nbytes

    def write(self, tmp: str, block_hash: bytes, parent: bytes | None, data: memoryview) -> int:
        """Write the temporary file ``tmp`` of the block; its open descriptor, unsynced. The
        caller removes ``tmp`` if this raises."""
        array = self._files.array
        layout = array.layout
        header, slots = self._pages.page()
        self._files.pack_fixed(header, block_hash, parent, time.time_ns())
        hashing: Hashing | None = getattr(self._local, "hashing", None)
        if hashing is None or hashing.sums is not slots:
            hashing = self._local.hashing = Hashing(
                1, 2, XXH3_64, layout.chunk_nbytes, self._group_nbytes, slots
            )
        segments: list[Segment] = [
            (0, header),
            (layout.data_offset, data),
            (layout.data_end, self._index),
        ]
        return self._files.recreating_fan_out(
            tmp,
            lambda: array.engine.write_new_file_hashed(tmp, segments, layout.file_nbytes, hashing),
        )

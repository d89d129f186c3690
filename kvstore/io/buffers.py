"""Page-aligned host buffers, allocated once and reused.

O_DIRECT (and GPUDirect) transfers need buffer addresses and lengths aligned to the device's
logical block size; 4 KiB covers every filesystem we target. Anonymous ``mmap`` memory is
page aligned. Freshly mapped pages are slow to touch the first time on the measured VMs
(0.5-0.9 GB/s), so buffers are touched at allocation and kept for the life of the engine.
"""

from __future__ import annotations

import ctypes
import mmap
import threading

import numpy as np

from kvstore.io.align import ALIGN, align_up


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A zeroed, page-aligned, writable uint8 array of ``nbytes`` (rounded up to 4 KiB)."""
    size = max(ALIGN, align_up(nbytes))
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    array = np.frombuffer(region, dtype=np.uint8)
    array[::ALIGN] = 0  # touch every page now, not on the hot path
    return array[:nbytes]


def is_aligned(view: memoryview, alignment: int = ALIGN) -> bool:
    """True when ``view``'s address and length are multiples of ``alignment``."""
    if len(view) % alignment:
        return False
    return address_of(view) % alignment == 0 if len(view) else True


def address_of(view: memoryview) -> int:
    """The address of ``view``'s first byte (called per segment on the write path: ctypes is
    ~4x cheaper than numpy's ``.ctypes.data`` for writable memory)."""
    if not view.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


# Where rows that the kernel copies into (a buffered read: page cache to user memory) start
# within a page. The copy's source is page aligned (a file's data from offset 0); a destination
# at the same or a nearby offset within its page makes the kernel's string copy ~2x slower
# (measured on this project's AMD EPYC VMs reading 1 MiB files from tmpfs: 0.59-0.77 s page
# aligned, 0.21-0.40 s at 64-2048 bytes in; Intel's 4K aliasing penalises the same pattern).
# Half a page is the farthest from either. Never for O_DIRECT, which needs aligned memory.
COPY_ROW_OFFSET = ALIGN // 2


class ThreadStaging:
    """One growable aligned staging buffer per thread (I/O threads never share one)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes`` owned by the calling thread (contents undefined)."""
        current: np.ndarray | None = getattr(self._local, "buffer", None)
        if current is None or len(current) < nbytes:
            current = aligned_buffer(nbytes)
            self._local.buffer = current
        return current

    def copy_rows(self, count: int, row_nbytes: int) -> np.ndarray:
        """``count`` rows of ``row_nbytes`` (a 2-d uint8 array, contiguous, contents
        undefined) owned by the calling thread, starting :data:`COPY_ROW_OFFSET` bytes into
        a page: for buffered reads, whose kernel copy is fastest there. Not for O_DIRECT."""
        nbytes = count * row_nbytes
        flat = self.get(COPY_ROW_OFFSET + nbytes)[COPY_ROW_OFFSET : COPY_ROW_OFFSET + nbytes]
        return flat.reshape(count, row_nbytes)

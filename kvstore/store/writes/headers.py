"""Headers of whole blocks, built in per-thread page-aligned buffers.

An O_DIRECT write sends a header from where it is built (no staging copy, no allocation per
block). Each thread has one page per array; only :meth:`HeaderPages.header_into` and the
writers that pack a page themselves write it, always the fixed part and every slot, never the
padding after the slots: that stays zero, as the fresh buffer was.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from kvstore.checksum import chunk_sums
from kvstore.io.buffers import ThreadStaging, aligned_buffer
from kvstore.io.engine import Data
from kvstore.store import format as fmt
from kvstore.store.files import BlockFiles, chunk_checksums


class HeaderPages:
    """Per-thread header pages (and padded data images) of one array's whole blocks."""

    def __init__(self, files: BlockFiles) -> None:
        self._files = files
        self._layout = files.array.layout
        self._local = threading.local()  # attribute "page": (header view, its slots)
        self._padded_images = ThreadStaging()

    def page(self) -> tuple[memoryview, np.ndarray]:
        """The calling thread's header buffer (created on its first use): the whole header as
        a memoryview, and its checksum slots as a ``<u8`` array over the same memory."""
        page: tuple[memoryview, np.ndarray] | None = getattr(self._local, "page", None)
        if page is not None:
            return page
        layout = self._layout
        buffer = aligned_buffer(layout.header_nbytes)  # zeroed
        slots = buffer[fmt.HEADER_FIXED_NBYTES : fmt.checksum_slot_offset(layout.num_chunks)]
        page = (buffer.data, slots.view("<u8"))
        self._local.page = page
        return page

    def header_into(
        self, block_hash: bytes, parent: bytes | None, created_ns: int, sums: np.ndarray
    ) -> memoryview:
        """A whole header in this thread's page (valid until the thread's next call): fixed
        part, checksum slots ``sums``, zero padding."""
        view, slots = self.page()
        slots[:] = sums  # as u64 little endian (the slots' dtype)
        self._files.pack_fixed(view, block_hash, parent, created_ns)
        return view

    def header_of(self, block_hash: bytes, parent: bytes | None, data: Data) -> memoryview:
        """:meth:`header_into` of a block created now whose canonical bytes are ``data``, the
        chunks' checksums computed straight into the slots (host memory) or on the tensor's
        device."""
        view, slots = self.page()
        layout = self._layout
        algo = self._files.array.checksum_algo
        if isinstance(data, memoryview):
            chunk_sums(algo, data, layout.chunk_nbytes, layout.num_chunks, slots)
        else:
            slots[:] = chunk_checksums(algo, data, layout.chunk_nbytes, layout.num_chunks)
        self._files.pack_fixed(view, block_hash, parent, time.time_ns())
        return view

    def padded_image(self, data: memoryview) -> memoryview:
        """The data region of a padded layout (chunks at their stride, zero padding) built in
        this thread's aligned buffer from the back-to-back chunks ``data``."""
        layout = self._layout
        n, size, stride = layout.num_chunks, layout.chunk_nbytes, layout.chunk_stride
        image = self._padded_images.get(n * stride)[: n * stride].reshape(n, stride)
        image[:, :size] = np.frombuffer(data, dtype=np.uint8, count=n * size).reshape(n, size)
        image[:, size:] = 0  # the buffer may hold another layout's bytes there
        return image.reshape(-1).data

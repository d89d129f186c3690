"""``direct_reads``: aligned whole-chunk reads go through O_DIRECT, anything else buffered."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvstore.io.buffers import aligned_buffer
from kvstore.io.fileio import O_DIRECT, FileIO
from kvstore.store.types import BlockRead, BlockWrite, ReadStatus
from tests.helpers import StoreFactory, block_bytes, block_hash, chunk_bytes, make_small_identity


class FlagRecorder(FileIO):
    def __init__(self) -> None:
        self.read_flags: list[int] = []

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        if not flags & (os.O_WRONLY | os.O_RDWR):
            self.read_flags.append(flags)
        return super().open(path, flags, mode)


@pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT on this platform")
def test_direct_reads_round_trip(make_store: StoreFactory) -> None:
    fio = FlagRecorder()
    store = make_store(fio=fio, direct_reads=True, direct_io="auto")
    if not store.engine.direct.enabled:
        pytest.skip(f"O_DIRECT unavailable here: {store.engine.direct.reason}")
    group = store.namespace(make_small_identity()).group(0)
    layout = group.layout
    h = block_hash(1, "direct")
    data = block_bytes(layout, 1)
    group.write_blocks([BlockWrite(h, data)])
    aligned = aligned_buffer(layout.block_nbytes)
    fio.read_flags.clear()
    (result,) = group.read_blocks([BlockRead(h, aligned)])
    assert result.status is ReadStatus.HIT
    assert np.array_equal(aligned, data)
    assert fio.read_flags and all(f & O_DIRECT for f in fio.read_flags)
    # An unaligned buffer (and a partial read into one) is read buffered, with the same result.
    unaligned = np.zeros(layout.block_nbytes + 1, dtype=np.uint8)[1:]
    fio.read_flags.clear()
    (result,) = group.read_blocks([BlockRead(h, unaligned, [1, 2])])
    assert result.status is ReadStatus.HIT
    size = 2 * layout.chunk_nbytes
    assert np.array_equal(unaligned[:size], chunk_bytes(layout, data, [1, 2]))
    assert fio.read_flags and not any(f & O_DIRECT for f in fio.read_flags)

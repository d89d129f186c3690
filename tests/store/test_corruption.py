"""Damaged, mis-keyed and foreign block files are misses: logged once, quarantined, not served."""

from __future__ import annotations

import errno
import logging
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.identity import Identity
from kvstore.io.fileio import FileIO
from kvstore.store.group_store import GroupStore
from kvstore.store.paths import QUARANTINE
from kvstore.store.types import BlockRead, BlockWrite, ReadResult, ReadStatus, WriteStatus
from tests.helpers import (
    StoreFactory,
    block_bytes,
    block_hash,
    chunk_bytes,
    make_small_identity,
    make_two_group_identity,
)


def write(group: GroupStore, i: int, salt: str = "") -> tuple[bytes, np.ndarray]:
    h = block_hash(i, salt)
    data = block_bytes(group.layout, i)
    assert group.write_blocks([BlockWrite(h, data)])[0].status is WriteStatus.WRITTEN
    return h, data


def read(
    group: GroupStore, h: bytes, chunks: Sequence[int] | None = None
) -> tuple[ReadResult, np.ndarray]:
    n = group.layout.num_chunks if chunks is None else len(chunks)
    out = np.zeros(n * group.layout.chunk_nbytes, dtype=np.uint8)
    (result,) = group.read_blocks([BlockRead(h, out, chunks)])
    return result, out


def flip(path: str | Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def quarantined(group: GroupStore) -> list[Path]:
    directory = group.array_path.parent / QUARANTINE
    return sorted(directory.iterdir()) if directory.exists() else []


def assert_corrupt_then_miss(
    group: GroupStore, h: bytes, caplog: pytest.LogCaptureFixture, reason: str
) -> None:
    """The read is CORRUPT with ``reason``, logs one warning, quarantines; the next is MISS."""
    path = Path(group.path_of(h))
    bad_bytes = path.read_bytes()
    before = group.stats.snapshot()
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="kvstore"):
        result, _ = read(group, h)
    assert result.status is ReadStatus.CORRUPT
    assert not result.ok
    assert re.search(reason, result.error), result.error
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    message = lines[0].getMessage()
    assert "is corrupt" in message
    assert "quarantined as" in message
    assert h.hex()[:16] in message
    assert not path.exists()
    (moved,) = quarantined(group)
    assert moved.read_bytes() == bad_bytes
    assert moved.name.startswith(f"g{group.index}-{h[0]}-")
    assert group.contains([h]) == [False]
    after = group.stats.snapshot()
    assert after["corrupt"] - before["corrupt"] == 1
    assert after["hits"] == before["hits"]

    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="kvstore"):
        again, _ = read(group, h)
    assert again.status is ReadStatus.MISS
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert group.stats.snapshot()["misses"] - after["misses"] == 1


@pytest.fixture
def group(make_store: StoreFactory) -> GroupStore:
    return make_store().namespace(make_small_identity()).group(0)


def test_flipped_chunk_byte(
    make_store: StoreFactory, any_identity: Identity, caplog: pytest.LogCaptureFixture
) -> None:
    g = make_store().namespace(any_identity).group(0)
    h, _ = write(g, 1)
    last = g.layout.num_chunks - 1
    flip(g.path_of(h), g.layout.chunk_offset(last) + g.layout.chunk_nbytes - 1)
    assert_corrupt_then_miss(g, h, caplog, f"checksum mismatch in inner chunk {last}")


@pytest.mark.parametrize(
    ("offset", "reason"),
    [
        (0, "header magic"),
        (8, "format version"),
        (20, "header checksum mismatch"),  # namespace digest
        (60, "header checksum mismatch"),  # block hash
        (121, "header checksum mismatch"),  # token count
        (161, "header checksum mismatch"),  # created_ns
        (169, "header checksum mismatch"),  # the crc itself
    ],
)
def test_flipped_header_byte(
    group: GroupStore, caplog: pytest.LogCaptureFixture, offset: int, reason: str
) -> None:
    h, _ = write(group, 2)
    flip(group.path_of(h), offset)
    assert_corrupt_then_miss(group, h, caplog, reason)


def test_flipped_checksum_slot(group: GroupStore, caplog: pytest.LogCaptureFixture) -> None:
    h, _ = write(group, 3)
    flip(group.path_of(h), 176 + 8 * 2 + 5)  # slot of inner chunk 2
    assert_corrupt_then_miss(group, h, caplog, "checksum mismatch in inner chunk 2")


@pytest.mark.parametrize("delta", [-1, -100, 1])
def test_wrong_size(group: GroupStore, caplog: pytest.LogCaptureFixture, delta: int) -> None:
    h, _ = write(group, 4)
    size = group.layout.file_nbytes
    with open(group.path_of(h), "r+b") as f:
        f.truncate(size + delta)
    assert_corrupt_then_miss(
        group, h, caplog, f"file size: expected {size} bytes, got {size + delta}"
    )


def test_empty_file(group: GroupStore, caplog: pytest.LogCaptureFixture) -> None:
    h = block_hash(5)
    Path(group.path_of(h)).write_bytes(b"")
    assert_corrupt_then_miss(group, h, caplog, "got 0")


def test_mis_keyed_copy(group: GroupStore, caplog: pytest.LogCaptureFixture) -> None:
    a, _ = write(group, 6)
    b = block_hash(7)
    shutil.copyfile(group.path_of(a), group.path_of(b))
    assert_corrupt_then_miss(group, b, caplog, f"mis-keyed block: expected hash {b.hex()}")
    result, _ = read(group, a)  # the original is untouched
    assert result.status is ReadStatus.HIT


def test_mis_keyed_same_coordinates(group: GroupStore, caplog: pytest.LogCaptureFixture) -> None:
    """Two hashes that share the 70 coordinate bits map to one path; the header tells them apart."""
    a = bytes(range(32))
    b = a[:9] + b"\xff" * 23
    assert group.path_of(a) == group.path_of(b)
    group.write_blocks([BlockWrite(a, block_bytes(group.layout, 8))])
    assert group.contains([b]) == [True]  # existence is by path ...
    assert_corrupt_then_miss(group, b, caplog, "mis-keyed")  # ... but b is never served a's bytes


def test_foreign_namespace(
    make_store: StoreFactory, group: GroupStore, caplog: pytest.LogCaptureFixture
) -> None:
    other = make_store().namespace(make_small_identity(model="test/other-model")).group(0)
    assert other.layout == group.layout  # same geometry: only the header tells them apart
    h, _ = write(other, 9)
    shutil.copyfile(other.path_of(h), group.path_of(h))
    digest12 = group.namespace_digest.hex()[:12]
    assert_corrupt_then_miss(group, h, caplog, f"foreign block: expected namespace {digest12}")


def test_foreign_group(make_store: StoreFactory, caplog: pytest.LogCaptureFixture) -> None:
    ns = make_store().namespace(make_two_group_identity())
    g0, g1 = ns.group(0), ns.group(1)
    assert g0.layout == g1.layout
    h, _ = write(g1, 10)
    shutil.copyfile(g1.path_of(h), g0.path_of(h))
    assert_corrupt_then_miss(g0, h, caplog, "foreign block: expected group 0, header has 1")


@pytest.mark.parametrize("right_size", [True, False])
def test_garbage(group: GroupStore, caplog: pytest.LogCaptureFixture, right_size: bool) -> None:
    h = block_hash(11)
    size = group.layout.file_nbytes if right_size else 5000
    Path(group.path_of(h)).write_bytes(np.random.default_rng(0).bytes(size))
    assert_corrupt_then_miss(group, h, caplog, "header magic" if right_size else "file size")


def test_partial_reads_verify_only_what_they_read(
    group: GroupStore, caplog: pytest.LogCaptureFixture
) -> None:
    h, data = write(group, 12)
    layout = group.layout
    flip(group.path_of(h), layout.chunk_offset(3) + 17)
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        for chunks in ([0, 1], [5], [4, 2, 0], [1, 2]):
            result, out = read(group, h, chunks)
            assert result.status is ReadStatus.HIT, chunks
            np.testing.assert_array_equal(out, chunk_bytes(layout, data, chunks))
    assert caplog.records == []
    assert group.contains([h]) == [True]
    # Reading the damaged chunk, alone or among good ones, is a miss and quarantines.
    result, _ = read(group, h, [4, 3])
    assert result.status is ReadStatus.CORRUPT
    assert result.error == "checksum mismatch in inner chunk 3"
    assert group.contains([h]) == [False]
    assert len(quarantined(group)) == 1


def test_partial_read_with_damaged_slot(group: GroupStore) -> None:
    h, data = write(group, 13)
    flip(group.path_of(h), 176 + 8 * 4)  # slot of chunk 4
    result, out = read(group, h, [5, 3])
    assert result.status is ReadStatus.HIT
    np.testing.assert_array_equal(out, chunk_bytes(group.layout, data, [5, 3]))
    result, _ = read(group, h, [4])
    assert result.status is ReadStatus.CORRUPT


def test_batch_with_one_corrupt_block(group: GroupStore) -> None:
    blocks = [write(group, i, "batch") for i in range(4)]
    flip(group.path_of(blocks[2][0]), group.layout.data_offset + 1)
    outs = [np.zeros(group.layout.block_nbytes, dtype=np.uint8) for _ in blocks]
    missing = block_hash(99, "batch")
    results = group.read_blocks(
        [BlockRead(h, out) for (h, _), out in zip(blocks, outs, strict=True)]
        + [BlockRead(missing, np.zeros(group.layout.block_nbytes, dtype=np.uint8))]
    )
    assert [r.status for r in results] == [
        ReadStatus.HIT,
        ReadStatus.HIT,
        ReadStatus.CORRUPT,
        ReadStatus.HIT,
        ReadStatus.MISS,
    ]
    for i in (0, 1, 3):
        np.testing.assert_array_equal(outs[i], blocks[i][1])


def test_without_quarantine_the_file_is_removed(
    make_store: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    g = make_store(quarantine=False).namespace(make_small_identity()).group(0)
    h, _ = write(g, 14)
    flip(g.path_of(h), g.layout.data_offset)
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        result, _ = read(g, h)
    assert result.status is ReadStatus.CORRUPT
    assert len(caplog.records) == 1
    assert caplog.records[0].getMessage().endswith("served as a miss, removed")
    assert not Path(g.path_of(h)).exists()
    assert quarantined(g) == []


def test_verify_reads_off_still_checks_the_header(make_store: StoreFactory) -> None:
    g = make_store(verify_reads=False).namespace(make_small_identity()).group(0)
    h, data = write(g, 15)
    flip(g.path_of(h), g.layout.data_offset)
    result, out = read(g, h)
    assert result.status is ReadStatus.HIT  # chunk checksums are not verified when off
    assert out[0] == data[0] ^ 0x40
    h2 = block_hash(16)
    shutil.copyfile(g.path_of(h), g.path_of(h2))
    result, _ = read(g, h2)
    assert result.status is ReadStatus.CORRUPT  # the key check is always on


class FailingReads(FileIO):
    """preadv fails with EIO."""

    def preadv(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        raise OSError(errno.EIO, "injected read error")


def test_io_error_is_error_and_file_is_kept(
    make_store: StoreFactory, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    h, _ = write(make_store().namespace(make_small_identity()).group(0), 17)
    g = make_store(fio=FailingReads()).namespace(make_small_identity()).group(0)
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        result, _ = read(g, h)
    assert result.status is ReadStatus.ERROR
    assert "injected read error" in result.error
    assert len(caplog.records) == 1
    assert "served as a miss" in caplog.records[0].getMessage()
    assert Path(g.path_of(h)).exists()  # an I/O error is not proof of corruption
    assert quarantined(g) == []
    assert g.stats.snapshot()["read_errors"] == 1


def test_caller_errors_raise(group: GroupStore) -> None:
    h, _ = write(group, 18)
    with pytest.raises(ValueError, match="read buffer: expected at least 24576 bytes, got 100"):
        group.read_blocks([BlockRead(h, np.zeros(100, dtype=np.uint8))])
    with pytest.raises(ValueError, match=r"chunk numbers: expected 0\.\.5, got \[6\]"):
        group.read_blocks([BlockRead(h, np.zeros(4096, dtype=np.uint8), [6])])
    with pytest.raises(ValueError, match="read buffer: expected writable memory"):
        group.read_blocks([BlockRead(h, bytes(group.layout.block_nbytes))])
    assert group.stats.snapshot()["read_errors"] == 0

"""The one block check (kvstore/store/check.py): every fault kind, every chunk state, no block."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvstore.checksum import crc32c
from kvstore.errors import CorruptBlockError, EntryKindError
from kvstore.identity import Identity
from kvstore.keys import hash_coords
from kvstore.store import check, full_check
from kvstore.store.check import ShardSpec
from kvstore.store.codec import Codec
from kvstore.store.format import HEADER_FIXED_NBYTES, checksum_slot_offset
from kvstore.store.full_check import ChunkState, check_file, quick_check
from kvstore.store.group_store import GroupStore
from kvstore.store.types import BlockRead, BlockWrite, ReadStatus, WriteStatus
from tests.helpers import StoreFactory, block_bytes, block_hash, chunk_bytes


def spec_of(group: GroupStore) -> ShardSpec:
    codec = Codec.for_name(group.compression, group.layout.itemsize)
    return ShardSpec(group.layout, group.namespace_digest, group.index, codec)


def written(group: GroupStore, i: int) -> tuple[bytes, str, np.ndarray]:
    h = block_hash(i, "check")
    data = block_bytes(group.layout, i)
    assert group.write_blocks([BlockWrite(h, data)])[0].status is WriteStatus.WRITTEN
    return h, group.path_of(h), data


def flip(path: str, offset: int) -> None:
    raw = bytearray(Path(path).read_bytes())
    raw[offset] ^= 0x40
    Path(path).write_bytes(raw)


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_intact_block_is_ok_and_its_chunks_come_back(
    make_store: StoreFactory, any_identity: Identity, compression: str
) -> None:
    group = make_store(compression=compression).namespace(any_identity).group(0)
    h, path, data = written(group, 1)
    chunks = [group.layout.num_chunks - 1, 0]
    result, values = check_file(
        path, spec_of(group), coords=hash_coords(h), expect_hash=h, chunks=chunks, want_data=True
    )
    assert result.ok and result.fault is None and result.problems == (), result.summary()
    assert result.header is not None and result.header.block_hash == h
    assert [c.chunk for c in result.chunks] == chunks
    assert values is not None
    assert values.tobytes() == chunk_bytes(group.layout, data, chunks).tobytes()
    header, fault = quick_check(path, spec_of(group), hash_coords(h))
    assert fault is None and header is not None and header.block_hash == h


def test_each_fault_kind(make_store: StoreFactory, odd_identity: Identity) -> None:
    """Non-dense layout: stride padding exists, so every region has a byte to damage."""
    group = make_store().namespace(odd_identity).group(0)
    layout = group.layout
    spec = spec_of(group)
    h, path, _ = written(group, 2)
    other, _, _ = written(group, 3)
    coords = hash_coords(h)
    original = Path(path).read_bytes()

    def verdict(**kwargs: object) -> full_check.Fault | None:
        result, _ = check_file(path, spec, coords=coords, **kwargs)  # type: ignore[arg-type]
        return result.fault

    Path(path).write_bytes(original[: layout.chunk_offset(1)])
    short = layout.chunk_offset(1)
    expected = f"file size: expected {layout.file_nbytes} bytes, got {short}"
    assert verdict() == full_check.Fault(full_check.TRUNCATED, expected)
    Path(path).write_bytes(original + b"\0")
    fault = verdict()
    assert fault is not None and fault.kind == full_check.OVERSIZED
    Path(path).write_bytes(original)

    fault = verdict(expect_hash=other)
    assert fault is not None and fault.kind == full_check.MIS_KEYED
    result, _ = check_file(path, spec, coords=hash_coords(other))
    assert result.fault is not None and result.fault.kind == full_check.MIS_KEYED
    foreign = ShardSpec(layout, bytes(32), group.index)
    result, _ = check_file(path, foreign, coords=coords)
    assert result.fault is not None and result.fault.kind == full_check.MISPLACED
    assert "foreign block" in result.fault.detail

    cases = {
        60: "header: header checksum mismatch",  # inside the block hash
        HEADER_FIXED_NBYTES - 2: "padding",  # reserved u32 of the header
        layout.header_nbytes - 1: "padding",  # header tail after the slots
        layout.chunk_offset(1) + 5: "checksum mismatch in 1 of",  # inside chunk 1
        layout.chunk_offset(0) + layout.chunk_nbytes + 3: "padding",  # stride padding
        layout.data_end + 3: "sharding index",
    }
    for offset, expected in cases.items():
        flip(path, offset)
        fault = verdict()
        assert fault is not None and fault.kind == full_check.CORRUPT, (offset, fault)
        assert expected in fault.detail, (offset, fault)
        Path(path).write_bytes(original)


def test_chunk_states_of_a_truncated_and_an_unwritten_block(
    make_store: StoreFactory, mla_identity: Identity
) -> None:
    group = make_store().namespace(mla_identity).group(0)
    layout = group.layout
    _, path, data = written(group, 4)
    original = Path(path).read_bytes()
    Path(path).write_bytes(original[: layout.chunk_offset(2) + 10])
    result, values = check_file(path, spec_of(group), want_data=True)
    states = [c.state for c in result.chunks]
    assert states == [ChunkState.OK, ChunkState.OK] + [ChunkState.TRUNCATED] * (len(states) - 2)
    assert any("file size: expected" in p for p in result.problems)
    assert values is not None  # the bytes that are there, zeros past the end
    size = layout.chunk_nbytes
    assert values[: 2 * size].tobytes() == data[: 2 * size].tobytes()
    assert not values[3 * size :].any()

    raw = bytearray(original)
    slot = checksum_slot_offset(1)
    raw[slot : slot + 8] = bytes(8)  # a writer that never ran
    Path(path).write_bytes(raw)
    result, _ = check_file(path, spec_of(group))
    assert result.chunks[1].state is ChunkState.UNWRITTEN and result.problems == ()
    assert result.fault is not None and "chunk 1" in result.fault.detail


def test_damaged_compressed_chunk_and_index(
    make_store: StoreFactory, small_identity: Identity
) -> None:
    group = make_store(compression="zstd-1").namespace(small_identity).group(0)
    layout = group.layout
    _, path, _ = written(group, 5)
    original = Path(path).read_bytes()
    flip(path, layout.header_nbytes + 40)  # inside the first stored chunk
    result, values = check_file(path, spec_of(group), want_data=True)
    assert result.chunks[0].state is ChunkState.MISMATCH and result.problems == ()
    assert values is not None and not values[: layout.chunk_nbytes].any()  # never decoded
    Path(path).write_bytes(original)
    flip(path, len(original) - 10)  # the index
    result, _ = check_file(path, spec_of(group))
    assert result.fault is not None and result.fault.kind == full_check.CORRUPT
    assert all(c.state is ChunkState.UNVERIFIED for c in result.chunks)


def test_unreadable_entries_are_faults_not_errors(
    make_store: StoreFactory, small_identity: Identity, tmp_path: Path
) -> None:
    group = make_store().namespace(small_identity).group(0)
    spec = spec_of(group)
    result, _ = check_file(tmp_path / "absent", spec)
    assert result.fault is not None and result.fault.kind == full_check.UNREADABLE
    assert isinstance(result.error, FileNotFoundError) and result.file_nbytes == -1
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # an open that could block: never attempted
    result, _ = check_file(fifo, spec)
    assert result.fault is not None and result.fault.kind == full_check.CORRUPT
    assert "FIFO" in result.fault.detail and isinstance(result.error, EntryKindError)
    header, fault = quick_check(fifo, spec)
    assert header is None and fault is not None and fault.kind == full_check.CORRUPT
    header, fault = quick_check(tmp_path / "absent", spec)
    assert header is None and fault is not None and fault.kind == full_check.UNREADABLE
    with pytest.raises(ValueError, match="chunk numbers"):
        check_file(fifo, spec, chunks=[group.layout.num_chunks])


def test_hot_path_checks_raise(make_store: StoreFactory, small_identity: Identity) -> None:
    group = make_store().namespace(small_identity).group(0)
    layout = group.layout
    spec = spec_of(group)
    h, path, data = written(group, 6)
    raw = Path(path).read_bytes()
    header = raw[: layout.header_nbytes]
    decoded = check.check_header(header, spec, h)
    chunks = [2, 0]
    out = memoryview(chunk_bytes(layout, data, chunks).tobytes())
    check.verify_chunks(layout, decoded.checksum_algo, header, chunks, out)
    with pytest.raises(CorruptBlockError, match="mis-keyed"):
        check.check_header(header, spec, block_hash(7, "check"))
    with pytest.raises(CorruptBlockError, match="inner chunk 1"):
        check.verify_chunks(layout, decoded.checksum_algo, header, [2, 1], out)
    with pytest.raises(CorruptBlockError, match="checksum"):
        check.chunk_checksum(99)


def test_unknown_checksum_id_in_a_compressed_block_is_a_corrupt_miss(
    make_store: StoreFactory, small_identity: Identity
) -> None:
    """A header with a valid crc naming no known checksum is damage: the read path of a
    compressed array reported it as a miss like any other (it raised StoreFormatError into
    the caller before the check was shared)."""
    group = make_store(compression="lz4").namespace(small_identity).group(0)
    h, path, _ = written(group, 8)
    raw = bytearray(Path(path).read_bytes())
    raw[54] = 99  # checksum algorithm id
    raw[168:172] = crc32c(bytes(raw[:168])).to_bytes(4, "little")
    Path(path).write_bytes(raw)
    out = np.empty(group.layout.block_nbytes, dtype=np.uint8)
    (result,) = group.read_blocks([BlockRead(h, out)])
    assert result.status is ReadStatus.CORRUPT and "checksum" in (result.error or "")

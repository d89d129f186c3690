"""Large raw dense blocks checksummed as they are written and read: the publisher hashes the
data group by group into the header's slots while it writes it (store/writes/hashed.py ->
Engine.write_new_file_hashed), the reader checksums each piece right after its read inside
the engine's call (store/reads/hashed.py -> Engine.read_file_hashed). Same files, same checks
and errors, for the native calls (NativeFileIO) and the Python reference (FileIO). The store's
tiny test blocks (6 chunks of 4 KiB) take both paths with the thresholds lowered."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.checksum import XXH3_64, chunk_sums
from kvstore.io.fileio import FileIO
from kvstore.io.host import HostEngine
from kvstore.store import format as fmt
from kvstore.store import plan as plan_module
from kvstore.store.group_store import GroupStore
from kvstore.store.types import BlockRead, BlockWrite, ReadStatus, WriteStatus
from tests.helpers import StoreFactory, block_bytes, block_hash, make_small_identity

CREATED_NS = 1_700_000_000_123_456_789


class Reference(FileIO):
    """FileIO's Python reference (a subclass never takes the native calls)."""


def _group(make_store: StoreFactory, root: Path, fio: FileIO | None) -> GroupStore:
    store = make_store(root, fio=fio) if fio is not None else make_store(root)
    group = store.namespace(make_small_identity()).group(0)
    assert group.layout.chunk_nbytes == 4096 and group.layout.num_chunks == 6
    return group


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every block takes the hashed write (groups of two chunks) and the hashed read (pieces
    of two chunks); returns the list of the hashing plans the engine was given."""
    monkeypatch.setattr(plan_module, "HASHED_WRITE_MIN_NBYTES", 0)
    monkeypatch.setattr(plan_module, "WRITE_GROUP_NBYTES", 2 * 4096)
    monkeypatch.setattr(plan_module, "READ_PIECE_NBYTES", 2 * 4096)
    monkeypatch.setattr(time, "time_ns", lambda: CREATED_NS)
    calls: list[Any] = []
    original = HostEngine.write_new_file_hashed

    def spy(self: HostEngine, path: str, segments: Any, size: int, hashing: Any) -> int:
        calls.append(hashing)
        return original(self, path, segments, size, hashing)

    monkeypatch.setattr(HostEngine, "write_new_file_hashed", spy)
    return calls


FIOS = {"native": None, "reference": Reference}


@pytest.mark.parametrize("fio", list(FIOS))
def test_hashed_write_gives_the_file_of_hash_then_write(
    hashed: list[Any],
    make_store: StoreFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fio: str,
) -> None:
    """The header's fixed part is encode_fixed_header's, its slots chunk_sums of the data, and
    the whole file byte for byte the one the hash-then-write path writes."""
    kind = FIOS[fio]
    group = _group(make_store, tmp_path / "hashed", kind() if kind else None)
    h = block_hash(1, "hashed")
    parent = block_hash(0, "hashed")
    data = block_bytes(group.layout, 1)
    assert group.write_blocks([BlockWrite(h, data, parent)])[0].status is WriteStatus.WRITTEN
    assert len(hashed) == 1 and hashed[0].group_nbytes == 2 * 4096
    raw = Path(group.path_of(h)).read_bytes()
    layout = group.layout
    fixed = fmt.encode_fixed_header(
        layout, group.namespace_digest, group.index, h, parent, XXH3_64, CREATED_NS
    )
    assert raw[: fmt.HEADER_FIXED_NBYTES] == fixed
    slots = fmt.decode_checksums(raw, layout.num_chunks)
    assert slots.tolist() == chunk_sums(XXH3_64, data.data, 4096, 6).tolist()
    assert raw[layout.data_offset : layout.data_end] == data.tobytes()
    assert raw[layout.data_end :] == layout.index_bytes

    monkeypatch.setattr(plan_module, "HASHED_WRITE_MIN_NBYTES", 1 << 60)  # hash, then write
    plain = _group(make_store, tmp_path / "plain", kind() if kind else None)
    assert plain.write_blocks([BlockWrite(h, data, parent)])[0].status is WriteStatus.WRITTEN
    assert len(hashed) == 1  # the second store took the other path
    assert Path(plain.path_of(h)).read_bytes() == raw


@pytest.mark.parametrize("fio", list(FIOS))
def test_hashed_blocks_read_back(
    hashed: list[Any], make_store: StoreFactory, tmp_path: Path, fio: str
) -> None:
    kind = FIOS[fio]
    group = _group(make_store, tmp_path, kind() if kind else None)
    blocks = {block_hash(i, "rt"): block_bytes(group.layout, i) for i in range(4)}
    results = group.write_blocks([BlockWrite(h, d) for h, d in blocks.items()])
    assert all(r.status is WriteStatus.WRITTEN for r in results)
    outs = {h: np.zeros(group.layout.block_nbytes, np.uint8) for h in blocks}
    got = group.read_blocks([BlockRead(h, outs[h]) for h in blocks])
    assert all(r.ok for r in got)
    assert all(outs[h].tobytes() == d.tobytes() for h, d in blocks.items())


@pytest.mark.parametrize("fio", list(FIOS))
@pytest.mark.parametrize("chunk", [2, 3, 5])  # a middle piece (either chunk), the last piece
def test_a_corrupt_piece_is_a_quarantined_miss(
    hashed: list[Any], make_store: StoreFactory, tmp_path: Path, fio: str, chunk: int
) -> None:
    kind = FIOS[fio]
    group = _group(make_store, tmp_path, kind() if kind else None)
    h = block_hash(2, "corrupt")
    assert (
        group.write_blocks([BlockWrite(h, block_bytes(group.layout, 2))])[0].status
        is WriteStatus.WRITTEN
    )
    path = Path(group.path_of(h))
    raw = bytearray(path.read_bytes())
    raw[group.layout.chunk_offset(chunk) + 4095] ^= 0x01
    path.write_bytes(raw)
    out = np.zeros(group.layout.block_nbytes, np.uint8)
    (result,) = group.read_blocks([BlockRead(h, out)])
    assert result.status is ReadStatus.CORRUPT
    assert result.error == f"checksum mismatch in inner chunk {chunk}"
    assert not path.exists()  # quarantined
    assert group.read_blocks([BlockRead(h, out)])[0].status is ReadStatus.MISS


@pytest.mark.parametrize("damage", ["header", "algo crc32c"])
def test_header_first_then_the_headers_algorithm(
    hashed: list[Any], make_store: StoreFactory, tmp_path: Path, damage: str
) -> None:
    """A damaged header fails as a header (before any chunk, though a chunk is damaged too);
    a valid header naming another algorithm is verified with that one."""
    group = _group(make_store, tmp_path, None)
    h = block_hash(3, "hdr")
    data = block_bytes(group.layout, 3)
    assert group.write_blocks([BlockWrite(h, data)])[0].status is WriteStatus.WRITTEN
    path = Path(group.path_of(h))
    raw = bytearray(path.read_bytes())
    if damage == "header":
        raw[60] ^= 0x01
        raw[group.layout.chunk_offset(4)] ^= 0x01
    else:  # rewritten with crc32c slots: a valid block of another algorithm
        from kvstore.checksum import CRC32C, crc32c  # noqa: PLC0415 - this case only

        raw[fmt.ALGO_OFFSET] = CRC32C
        raw[fmt.CRC_OFFSET : fmt.CRC_OFFSET + 4] = crc32c(bytes(raw[: fmt.CRC_OFFSET])).to_bytes(
            4, "little"
        )
        sums = chunk_sums(CRC32C, data.data, 4096, 6)
        raw[fmt.HEADER_FIXED_NBYTES : fmt.checksum_slot_offset(6)] = fmt.encode_checksums(
            sums.tolist()
        )
    path.write_bytes(raw)
    out = np.zeros(group.layout.block_nbytes, np.uint8)
    (result,) = group.read_blocks([BlockRead(h, out)])
    if damage == "header":
        assert result.status is ReadStatus.CORRUPT
        assert result.error is not None and "header checksum mismatch" in result.error
    else:
        assert result.ok, result.error
        assert out.tobytes() == data.tobytes()


class FailingSecondWrite(Reference):
    """Once armed, pwritev fails with EIO on its second call (the data's second group)."""

    def __init__(self) -> None:
        self.writes = -1  # not armed

    def pwritev(self, fd: int, buffers: Any, offset: int) -> int:
        if self.writes >= 0:
            self.writes += 1
            if self.writes == 2:
                raise OSError(5, "Input/output error (injected)")
        return super().pwritev(fd, buffers, offset)


def test_a_write_failing_midway_leaves_no_file(
    hashed: list[Any], make_store: StoreFactory, tmp_path: Path
) -> None:
    fio = FailingSecondWrite()
    group = _group(make_store, tmp_path, fio)
    fio.writes = 0
    h = block_hash(4, "fail")
    (result,) = group.write_blocks([BlockWrite(h, block_bytes(group.layout, 4))])
    assert result.status is WriteStatus.FAILED
    assert "injected" in (result.error or "")
    assert fio.writes == 2 and len(hashed) == 1
    left = [name for _, _, files in os.walk(tmp_path) for name in files if "tmp" in name]
    assert left == []
    assert not Path(group.path_of(h)).exists()


@pytest.mark.parametrize("fio", list(FIOS))
def test_chunks_larger_than_a_group(
    hashed: list[Any],
    make_store: StoreFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fio: str,
) -> None:
    """A chunk larger than the group or piece size (deepseek-v3's 288 KiB chunks against
    256 KiB groups) is a group of its own: written, read back, its corruption found."""
    monkeypatch.setattr(plan_module, "WRITE_GROUP_NBYTES", 1000)
    monkeypatch.setattr(plan_module, "READ_PIECE_NBYTES", 1000)
    kind = FIOS[fio]
    group = _group(make_store, tmp_path, kind() if kind else None)
    h = block_hash(5, "big chunks")
    data = block_bytes(group.layout, 5)
    assert group.write_blocks([BlockWrite(h, data)])[0].status is WriteStatus.WRITTEN
    assert hashed[-1].group_nbytes == 1000
    out = np.zeros(group.layout.block_nbytes, np.uint8)
    assert group.read_blocks([BlockRead(h, out)])[0].ok
    assert out.tobytes() == data.tobytes()
    path = Path(group.path_of(h))
    raw = bytearray(path.read_bytes())
    raw[group.layout.chunk_offset(4)] ^= 0x80
    path.write_bytes(raw)
    (result,) = group.read_blocks([BlockRead(h, out)])
    assert result.status is ReadStatus.CORRUPT
    assert result.error == "checksum mismatch in inner chunk 4"

"""The read and write hot path's fast checks are exactly the slow ones (issue 17).

:func:`kvstore.store.check.header_algo` compares a header as bytes instead of decoding it, and
:func:`kvstore.checksum.chunk_sums` checksums a block's chunks in one call: both must accept
and refuse exactly what :func:`check.check_header` and one checksum call per chunk do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from kvstore.checksum import CRC32C, WSUM64, XXH3_64, chunk_sums, crc32c, wsum64
from kvstore.errors import CorruptBlockError
from kvstore.io.host import HostEngine
from kvstore.io.types import Hashing
from kvstore.store import check, full_check
from kvstore.store import format as fmt
from kvstore.store import plan as plan_module
from kvstore.store.check import ShardSpec
from kvstore.store.format import ShardLayout
from kvstore.store.group_store import GroupStore
from kvstore.store.types import BlockRead, BlockWrite, ReadResult, ReadStatus, WriteStatus
from tests.helpers import (
    StoreFactory,
    block_bytes,
    block_hash,
    make_mla_identity,
    make_odd_identity,
    make_small_identity,
)

LAYOUT = ShardLayout(num_heads=2, num_layers=3, tokens=16, elems_per_token=128, itemsize=2)
NAMESPACE = bytes(range(32))
HASH = bytes(range(0x40, 0x60))
PARENT = bytes(range(0x80, 0xA0))


def header_of(spec: ShardSpec, block_hash: bytes, parent: bytes | None, algo: int) -> bytes:
    fixed = fmt.encode_fixed_header(
        spec.layout, spec.namespace_digest, spec.group, block_hash, parent, algo, 123456789
    )
    return fixed + bytes(spec.layout.header_nbytes - len(fixed))


def slow_verdict(buf: bytes, spec: ShardSpec, block_hash: bytes) -> int | str:
    try:
        return check.check_header(buf, spec, block_hash).checksum_algo
    except CorruptBlockError as exc:
        return str(exc)


def fast_verdict(buf: bytes, spec: ShardSpec, block_hash: bytes) -> int | str:
    try:
        return check.header_algo(buf, spec, block_hash)
    except CorruptBlockError as exc:
        return str(exc)


@pytest.mark.parametrize("parent", [None, PARENT])
@pytest.mark.parametrize("algo", [XXH3_64, CRC32C, WSUM64])
def test_header_algo_accepts_a_good_header(parent: bytes | None, algo: int) -> None:
    spec = ShardSpec(LAYOUT, NAMESPACE, 1)
    assert check.header_algo(header_of(spec, HASH, parent, algo), spec, HASH) == algo


def test_header_algo_refuses_every_damaged_byte_as_check_header_does() -> None:
    """Each bit flip in the fixed header, each foreign key: the same verdict, same words."""
    spec = ShardSpec(LAYOUT, NAMESPACE, 1)
    good = header_of(spec, HASH, PARENT, XXH3_64)
    for offset in range(fmt.HEADER_FIXED_NBYTES):
        for bit in (0x01, 0x80):
            bad = bytearray(good)
            bad[offset] ^= bit
            slow = slow_verdict(bytes(bad), spec, HASH)
            assert fast_verdict(bytes(bad), spec, HASH) == slow, (offset, bit)
            if offset < fmt.CRC_OFFSET + 4:  # every field is under the header crc
                assert isinstance(slow, str), (offset, bit)
    for key in (HASH[:-1] + b"\0", HASH[:16], b"\x01"):  # mis-keyed, shorter key
        assert fast_verdict(good, spec, key) == slow_verdict(good, spec, key)
        assert isinstance(fast_verdict(good, spec, key), str)
    for other in (ShardSpec(LAYOUT, bytes(32), 1), ShardSpec(LAYOUT, NAMESPACE, 0)):
        assert isinstance(fast_verdict(good, other, HASH), str)  # foreign namespace / group
        assert fast_verdict(good, other, HASH) == slow_verdict(good, other, HASH)
    longer = ShardLayout(2, 3, 32, 128, 2)  # the geometry of another block size
    assert isinstance(fast_verdict(good, ShardSpec(longer, NAMESPACE, 1), HASH), str)
    assert fast_verdict(good[:100], spec, HASH) == slow_verdict(good[:100], spec, HASH)


def test_header_algo_with_a_consistent_forged_header_still_refuses_it() -> None:
    """Fields rewritten with a matching crc (a header of another block, well formed) are
    refused for what they say, by the same words as check_header."""
    spec = ShardSpec(LAYOUT, NAMESPACE, 1)
    good = bytearray(header_of(spec, HASH, PARENT, XXH3_64))
    good[fmt.HASH_LEN_OFFSET + 1] = fmt.MAX_HASH + 1  # parent length out of range
    good[fmt.CRC_OFFSET : fmt.CRC_OFFSET + 4] = crc32c(bytes(good[: fmt.CRC_OFFSET])).to_bytes(
        4, "little"
    )
    slow = slow_verdict(bytes(good), spec, HASH)
    assert isinstance(slow, str) and fast_verdict(bytes(good), spec, HASH) == slow


@pytest.mark.parametrize("chunk_nbytes", [1, 4096, 8192 + 4, 18432])
@pytest.mark.parametrize("algo", [XXH3_64, CRC32C, WSUM64])
def test_chunk_sums_is_one_checksum_per_chunk(chunk_nbytes: int, algo: int) -> None:
    count = 7
    data = np.random.default_rng(chunk_nbytes).integers(
        0, 256, count * chunk_nbytes + 5, dtype=np.uint8
    )
    one = {XXH3_64: xxhash.xxh3_64_intdigest, CRC32C: crc32c, WSUM64: wsum64}[algo]
    want = [one(data[i * chunk_nbytes : (i + 1) * chunk_nbytes].tobytes()) for i in range(count)]
    got = chunk_sums(algo, data.data, chunk_nbytes, count)
    assert got.dtype == np.uint64 and got.tolist() == want
    assert chunk_sums(algo, data.data, chunk_nbytes, 0).tolist() == []
    with pytest.raises(ValueError, match="expected at least"):
        chunk_sums(algo, data[: count * chunk_nbytes].data, chunk_nbytes, count + 1)


# -- large whole blocks: read and verified piece by piece (store/reads/hashed.py) -----------


@pytest.fixture
def pieced(monkeypatch: pytest.MonkeyPatch, make_store: StoreFactory) -> GroupStore:
    """A store whose (tiny, 6-chunk) blocks take the piece-by-piece read: 2 chunks a piece."""
    monkeypatch.setattr(plan_module, "READ_PIECE_NBYTES", 2 * 4096)
    group = make_store().namespace(make_small_identity()).group(0)
    assert group.layout.chunk_nbytes == 4096 and group.layout.num_chunks == 6
    return group


def write_one(group: GroupStore, i: int) -> tuple[bytes, np.ndarray]:
    h = block_hash(i, "pieces")
    data = block_bytes(group.layout, i)
    assert group.write_blocks([BlockWrite(h, data)])[0].status is WriteStatus.WRITTEN
    return h, data


def read_whole(group: GroupStore, h: bytes) -> tuple[ReadResult, np.ndarray]:
    out = np.zeros(group.layout.block_nbytes, dtype=np.uint8)
    (result,) = group.read_blocks([BlockRead(h, out)])
    return result, out


def test_pieced_read_serves_the_block(pieced: GroupStore, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, Hashing]] = []
    original = HostEngine.read_file_hashed

    def spy(self: HostEngine, path: str, segments: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append((len(segments), args[2]))
        return original(self, path, segments, *args, **kwargs)

    monkeypatch.setattr(HostEngine, "read_file_hashed", spy)
    h, data = write_one(pieced, 1)
    result, out = read_whole(pieced, h)
    assert result.ok and out.tobytes() == data.tobytes()
    # The header, then the data hashed in pieces of two chunks; the sums are the header's.
    ((count, hashing),) = calls
    assert count == 2 and (hashing.first, hashing.last, hashing.group_nbytes) == (1, 2, 8192)
    slots = fmt.decode_checksums(Path(pieced.path_of(h)).read_bytes(), 6)
    assert hashing.sums.tolist() == slots.tolist()


@pytest.mark.parametrize("chunk", [0, 3, 5])
def test_pieced_read_finds_a_corrupt_chunk_in_any_piece(pieced: GroupStore, chunk: int) -> None:
    h, _ = write_one(pieced, 2)
    path = Path(pieced.path_of(h))
    raw = bytearray(path.read_bytes())
    raw[pieced.layout.chunk_offset(chunk) + 100] ^= 0x10
    path.write_bytes(raw)
    result, _ = read_whole(pieced, h)
    assert result.status is ReadStatus.CORRUPT
    assert result.error == f"checksum mismatch in inner chunk {chunk}"
    assert not path.exists()  # quarantined: the file read, named by its identity
    assert read_whole(pieced, h)[0].status is ReadStatus.MISS


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("header", "header checksum mismatch"),
        ("short", "file size"),
        ("mis-keyed", "mis-keyed block"),
        ("algo", "checksum algorithm id"),
    ],
)
def test_pieced_read_refuses_a_bad_file_as_before(
    pieced: GroupStore, damage: str, reason: str
) -> None:
    h, _ = write_one(pieced, 3)
    path = Path(pieced.path_of(h))
    raw = bytearray(path.read_bytes())
    if damage == "header":
        raw[60] ^= 0x01
    elif damage == "short":
        raw = raw[:-1]
    elif damage == "mis-keyed":
        other, _ = write_one(pieced, 4)
        raw = bytearray(Path(pieced.path_of(other)).read_bytes())
    else:  # a well-formed header naming an algorithm that does not exist
        raw[fmt.ALGO_OFFSET] = 99
        raw[fmt.CRC_OFFSET : fmt.CRC_OFFSET + 4] = crc32c(bytes(raw[: fmt.CRC_OFFSET])).to_bytes(
            4, "little"
        )
    path.write_bytes(raw)
    result, _ = read_whole(pieced, h)
    assert result.status is ReadStatus.CORRUPT
    assert reason in result.error, result.error


@pytest.mark.parametrize("make_identity", [make_odd_identity, make_mla_identity])
def test_padded_layouts_read_whole_blocks_right_with_pieces_on(
    monkeypatch: pytest.MonkeyPatch, make_store: StoreFactory, make_identity: Any
) -> None:
    """Layouts with stride padding between chunks (chunk size not a 4 KiB multiple) are read
    right when their blocks are large enough for the piece path (which needs dense chunks)."""
    group = make_store().namespace(make_identity()).group(0)
    piece = 2 * group.layout.chunk_nbytes  # two chunks a piece: a piece spans stride padding
    monkeypatch.setattr(plan_module, "READ_PIECE_NBYTES", piece)
    assert not group.layout.dense and group.layout.block_nbytes >= 2 * piece
    h, data = write_one(group, 5)
    result, out = read_whole(group, h)
    assert result.ok, result.error
    assert out.tobytes() == data.tobytes()


# -- padded layouts: one strided copy for O_DIRECT writes, one preadv for reads ---------------


@pytest.mark.parametrize("make_identity", [make_odd_identity, make_mla_identity])
def test_padded_blocks_are_the_same_bytes_with_and_without_o_direct(
    make_store: StoreFactory, tmp_path: Path, make_identity: Any
) -> None:
    """A padded block written through the aligned image (O_DIRECT) has the bytes the buffered
    write gives it (chunks at their stride, zero padding), checks clean and reads back."""
    files: dict[str, bytes] = {}
    for direct_io in ("off", "auto"):
        store = make_store(tmp_path / direct_io, direct_io=direct_io)
        if direct_io == "auto" and not store.engine.direct.enabled:
            pytest.skip("O_DIRECT is not available under tmp_path")
        group = store.namespace(make_identity()).group(0)
        assert not group.layout.dense
        h, data = write_one(group, 6)
        path = group.path_of(h)
        spec = ShardSpec(group.layout, group.namespace_digest, group.index)
        result, _ = full_check.check_file(path, spec, expect_hash=h)
        assert result.ok, result.summary()
        got, out = read_whole(group, h)
        assert got.ok and out.tobytes() == data.tobytes()
        raw = Path(path).read_bytes()
        files[direct_io] = raw[: fmt.CREATED_OFFSET] + raw[fmt.HEADER_FIXED_NBYTES :]
    assert files["off"] == files["auto"]  # all but the creation time and the header crc


def test_o_direct_reads_are_not_split_into_pieces(
    monkeypatch: pytest.MonkeyPatch, make_store: StoreFactory
) -> None:
    """direct_reads: one large O_DIRECT request, not 512 KiB ones one after another (their
    bytes do not come through the CPU cache, so pieces would only cost queue depth)."""
    monkeypatch.setattr(plan_module, "READ_PIECE_NBYTES", 2 * 4096)
    calls: list[int] = []
    monkeypatch.setattr(
        HostEngine,
        "read_file_hashed",
        lambda *a, **k: calls.append(1),  # never reached
    )
    store = make_store(direct_reads=True)
    if not store.engine.direct.enabled:
        pytest.skip("O_DIRECT is not available under tmp_path")
    group = store.namespace(make_small_identity()).group(0)
    h, data = write_one(group, 7)
    result, out = read_whole(group, h)
    assert result.ok and out.tobytes() == data.tobytes()
    assert calls == []

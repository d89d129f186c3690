"""On-disk format v1: a golden block file, shard layouts, header encoding and checking."""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from kvstore.checksum import chunk_sums, crc32c
from kvstore.errors import CorruptBlockError
from kvstore.store import format as fmt
from kvstore.store.format import ShardLayout
from kvstore.store.types import BlockWrite, WriteStatus
from tests.helpers import (
    FROZEN_NS,
    StoreFactory,
    make_mla_identity,
    make_odd_identity,
    make_small_identity,
    open_group,
)

GOLDEN_HASH = bytes(range(0x10, 0x30))  # 32 bytes 10 11 .. 2f
GOLDEN_PARENT = bytes(range(0xA0, 0xC0))  # 32 bytes a0 a1 .. bf
GOLDEN_NAMESPACE = "test-tiny-llama-a8466c86b91b"
GOLDEN_PATH = f"{GOLDEN_NAMESPACE}/g0/c/0/0/0/0/0/16/307516656299902406"
GOLDEN_FILE_NBYTES = 28772

# The fixed header part [0, 176), computed once by running the code and then checked by hand
# field by field against the table in format.py's docstring (little endian throughout):
#   0  4b56534841524400      magic b"KVSHARD\0"
#   8  0100                  format version 1
#  10  0000                  flags 0
#  12  00100000              header_nbytes 0x1000 = 4096 (176 + 6*8 = 224, aligned up)
#  16  a8466c86..4c301e31    namespace digest = sha256 of the identity (test_identity pins it)
#  48  00000000              group 0
#  52  20 20 01 00           hash length 32, parent length 32, checksum id 1 (xxh3_64), 0
#  56  10 11 .. 2f           block hash
#  88  a0 a1 .. bf           parent hash
# 120  10000000 06000000     16 tokens, 6 inner chunks (2 heads x 3 layers)
# 128  0010000000000000      chunk_nbytes 4096 (16 tokens x 2 x 64 x 2 bytes)
# 136  0010000000000000      chunk_stride 4096 (dense)
# 144  0010000000000000      data_offset 4096
# 152  6470000000000000      file_nbytes 0x7064 = 28772 = 4096 + 6*4096 + 6*16 + 4
# 160  15cd853dfe9c9717      created_ns 0x17979cfe3d85cd15 = 1_700_000_000_123_456_789
# 168  b208fb7a              crc32c of [0, 168) = 0x7afb08b2 (recomputed below as well)
# 172  00000000              reserved
GOLDEN_FIXED = bytes.fromhex(
    "4b565348415244000100000000100000"
    "a8466c86b91be28c1bfce68caa4da8c9"
    "a1bc2aae1913c83b9b2b7a6d4c301e31"
    "00000000202001001011121314151617"
    "18191a1b1c1d1e1f2021222324252627"
    "28292a2b2c2d2e2fa0a1a2a3a4a5a6a7"
    "a8a9aaabacadaeafb0b1b2b3b4b5b6b7"
    "b8b9babbbcbdbebf1000000006000000"
    "00100000000000000010000000000000"
    "00100000000000006470000000000000"
    "15cd853dfe9c9717b208fb7a00000000"
)
# Checksum slots [176, 224): xxh3_64 of each 4096-byte chunk of golden_data(), u64 LE
# (checked by hand against xxhash.xxh3_64_intdigest: 0x7135ffa504f1bc71, 0x040c7b32b8767f94, ...).
GOLDEN_SLOTS = bytes.fromhex(
    "71bcf104a5ff3571947f76b8327b0c04bae52e0c5ffca547"
    "31eec431c6bd828f7fe595b965861a2b42e130102b9238ec"
)
# The sharding index at [28672, 28772): (offset, nbytes) u64 LE for chunks 0..5 in C order,
# i.e. (4096 + 4096*c, 4096), then crc32c of those 96 bytes, u32 LE (0xd577d271).
GOLDEN_INDEX = bytes.fromhex(
    "00100000000000000010000000000000"
    "00200000000000000010000000000000"
    "00300000000000000010000000000000"
    "00400000000000000010000000000000"
    "00500000000000000010000000000000"
    "00600000000000000010000000000000"
    "71d277d5"
)
GOLDEN_FILE_SHA256 = "ab6076daf9d7f9c3248113fd30efdc5385c1f667c4e829ca3a474d06f83e4ce7"


def golden_data(layout: ShardLayout) -> np.ndarray:
    """Block bytes that need no RNG: i % 251 for byte i."""
    return (np.arange(layout.block_nbytes, dtype=np.int64) % 251).astype(np.uint8)


@pytest.mark.usefixtures("frozen_time")
def test_golden_block_file(make_store: StoreFactory, root: Path) -> None:
    identity = make_small_identity()
    assert identity.namespace == GOLDEN_NAMESPACE
    group = make_store().namespace(identity).group(0)
    data = golden_data(group.layout)
    result = group.write_blocks([BlockWrite(GOLDEN_HASH, data, GOLDEN_PARENT)])
    assert result[0].status is WriteStatus.WRITTEN

    path = Path(group.path_of(GOLDEN_HASH))
    assert path.relative_to(root.absolute()).as_posix() == GOLDEN_PATH
    raw = path.read_bytes()
    assert len(raw) == GOLDEN_FILE_NBYTES
    assert raw[:176] == GOLDEN_FIXED
    assert raw[176:224] == GOLDEN_SLOTS
    assert raw[224:4096] == bytes(4096 - 224)  # header padding is zero
    assert raw[4096:28672] == data.tobytes()  # dense: the canonical block verbatim
    assert raw[28672:] == GOLDEN_INDEX
    assert hashlib.sha256(raw).hexdigest() == GOLDEN_FILE_SHA256

    # Independent re-derivations of the checks done by hand above.
    assert raw[:8] == b"KVSHARD\0"
    assert struct.unpack_from("<I", raw, 168)[0] == crc32c(raw[:168])
    assert struct.unpack_from("<Q", raw, 160)[0] == FROZEN_NS
    assert struct.unpack_from("<I", raw, 28768)[0] == crc32c(raw[28672:28768])
    header = fmt.decode_header(raw)
    assert header.block_hash == GOLDEN_HASH
    assert header.parent_hash == GOLDEN_PARENT
    assert header.namespace_digest == identity.digest
    assert header.created_ns == FROZEN_NS
    read_back, slots = group.read_header(GOLDEN_HASH)
    assert read_back == header
    assert slots.tobytes() == GOLDEN_SLOTS


@pytest.mark.usefixtures("frozen_time")
def test_first_block_of_chain_has_no_parent(make_store: StoreFactory) -> None:
    group = make_store().namespace(make_small_identity()).group(0)
    group.write_blocks([BlockWrite(GOLDEN_HASH, golden_data(group.layout))])
    raw = Path(group.path_of(GOLDEN_HASH)).read_bytes()
    assert raw[52:54] == b"\x20\x00"  # hash length 32, parent length 0
    assert raw[88:120] == bytes(32)  # parent field zero padded
    assert fmt.decode_header(raw).parent_hash is None


def test_short_hash_is_zero_padded(make_store: StoreFactory) -> None:
    group = make_store().namespace(make_small_identity()).group(0)
    h16 = bytes(range(0x40, 0x50))  # xxhash-sized key
    group.write_blocks([BlockWrite(h16, golden_data(group.layout), h16[::-1])])
    raw = Path(group.path_of(h16)).read_bytes()
    assert raw[52:54] == b"\x10\x10"
    assert raw[56:88] == h16 + bytes(16)
    assert raw[88:120] == h16[::-1] + bytes(16)
    header = fmt.decode_header(raw)
    assert (header.block_hash, header.parent_hash) == (h16, h16[::-1])


def test_layout_dense() -> None:
    identity = make_small_identity()
    layout = ShardLayout.for_group(identity.groups[0], 16, 2)
    assert (layout.num_heads, layout.num_layers, layout.num_chunks) == (2, 3, 6)
    assert (layout.chunk_nbytes, layout.chunk_stride, layout.dense) == (4096, 4096, True)
    assert (layout.header_nbytes, layout.data_offset, layout.data_end) == (4096, 4096, 28672)
    assert layout.file_nbytes == 28772
    assert layout.block_nbytes == 24576
    assert layout.chunk_index(1, 2) == 5
    assert layout.chunks_of(range(1, 2), None) == [3, 4, 5]
    assert layout.chunks_of(None, range(2, 3)) == [2, 5]


def test_layout_non_dense() -> None:
    identity = make_odd_identity()
    layout = ShardLayout.for_group(identity.groups[0], 16, identity.dtype.itemsize)
    assert (layout.chunk_nbytes, layout.chunk_stride, layout.dense) == (2560, 4096, False)
    assert [layout.chunk_offset(c) for c in range(3)] == [4096, 8192, 12288]
    assert layout.file_nbytes == 4096 + 6 * 4096 + 100
    assert layout.block_nbytes == 6 * 2560
    entries = np.frombuffer(layout.index_bytes[:-4], dtype="<u8").reshape(6, 2)
    assert entries[:, 0].tolist() == [4096 * (c + 1) for c in range(6)]
    assert entries[:, 1].tolist() == [2560] * 6


def test_layout_mla() -> None:
    identity = make_mla_identity()
    layout = ShardLayout.for_group(identity.groups[0], 16, 2)
    assert (layout.num_heads, layout.num_chunks) == (1, 4)
    assert (layout.chunk_nbytes, layout.chunk_stride) == (16 * 576 * 2, 20480)
    assert layout.file_nbytes == 4096 + 4 * 20480 + 68


def test_layout_large_header() -> None:
    """More than 490 chunks push the checksum slots past the first 4 KiB."""
    layout = ShardLayout(num_heads=8, num_layers=80, tokens=16, elems_per_token=256, itemsize=2)
    assert layout.header_nbytes == 8192  # 176 + 640*8 = 5296
    assert fmt.checksum_slot_offset(639) + 8 <= layout.header_nbytes


def test_chunks_of_rejects_out_of_range() -> None:
    layout = ShardLayout(2, 3, 16, 128, 2)
    with pytest.raises(ValueError, match=r"outside heads 0\.\.2"):
        layout.chunks_of(range(3), None)
    with pytest.raises(ValueError, match=r"layers 0\.\.3"):
        layout.chunks_of(None, range(-1, 1))


def _fixed(layout: ShardLayout, **changes: object) -> bytes:
    args: dict[str, object] = {
        "namespace_digest": b"\x11" * 32,
        "group": 1,
        "block_hash": b"\x22" * 32,
        "parent_hash": None,
        "checksum_algo": 1,
        "created_ns": 5,
    }
    args.update(changes)
    return fmt.encode_fixed_header(layout, **args)  # type: ignore[arg-type]


def test_decode_rejects_damage() -> None:
    layout = ShardLayout(2, 3, 16, 128, 2)
    good = _fixed(layout)
    assert len(good) == fmt.HEADER_FIXED_NBYTES
    assert fmt.decode_header(good).group == 1
    with pytest.raises(CorruptBlockError, match="expected 176 bytes, got 100"):
        fmt.decode_header(good[:100])
    with pytest.raises(CorruptBlockError, match="header magic"):
        fmt.decode_header(b"X" + good[1:])
    with pytest.raises(CorruptBlockError, match="format version: expected 1, got 2"):
        fmt.decode_header(good[:8] + b"\x02" + good[9:])
    for offset in (12, 30, 48, 60, 100, 130, 165):
        damaged = bytearray(good)
        damaged[offset] ^= 0x01
        with pytest.raises(CorruptBlockError, match="header checksum mismatch"):
            fmt.decode_header(bytes(damaged))
    # Lengths out of range with a correct crc (a writer bug, not bit rot).
    bad_len = bytearray(good[:168])
    bad_len[52] = 40
    bad_len += struct.pack("<II", crc32c(bytes(bad_len)), 0)
    with pytest.raises(CorruptBlockError, match="hash lengths out of range: 40, 0"):
        fmt.decode_header(bytes(bad_len))


def test_check_header_names_each_mismatch() -> None:
    layout = ShardLayout(2, 3, 16, 128, 2)
    header = fmt.decode_header(_fixed(layout))
    fmt.check_header(header, layout, b"\x11" * 32, 1, b"\x22" * 32)  # belongs here: no error
    with pytest.raises(CorruptBlockError, match="mis-keyed block: expected hash 3333"):
        fmt.check_header(header, layout, b"\x11" * 32, 1, b"\x33" * 32)
    with pytest.raises(CorruptBlockError, match="foreign block: expected namespace 444444444444"):
        fmt.check_header(header, layout, b"\x44" * 32, 1, b"\x22" * 32)
    with pytest.raises(CorruptBlockError, match="foreign block: expected group 0, header has 1"):
        fmt.check_header(header, layout, b"\x11" * 32, 0, b"\x22" * 32)
    other = ShardLayout(2, 3, 32, 128, 2)  # same hash, another block size
    with pytest.raises(CorruptBlockError, match="block geometry"):
        fmt.check_header(header, other, b"\x11" * 32, 1, b"\x22" * 32)


def test_golden_layout_names_match_design(make_store: StoreFactory, root: Path) -> None:
    """Paths of MLA (3 leading dims) and attention (5) groups, per docs/format.md."""
    h = bytes([0xFF]) + b"\x00" * 7 + b"\x08" + bytes(7)
    mla = make_store().namespace(make_mla_identity()).group(0)
    rel = os.path.relpath(mla.path_of(h), root.absolute())
    assert rel == "test-tiny-mla-555076be3d4c/g0/c/0/0/0/255/2"
    odd = make_store().namespace(make_odd_identity()).group(0)
    rel = os.path.relpath(odd.path_of(h), root.absolute())
    assert rel == "test-odd-f16-865629521d1d/g0/c/0/0/0/0/0/255/2"
    assert odd.fanout_dir(7) == root.absolute() / "test-odd-f16-865629521d1d/g0/c/0/0/0/0/0/7"


@pytest.mark.parametrize(
    "layout",
    [ShardLayout(2, 3, 16, 128, 2), ShardLayout(1, 26, 16, 512, 2), ShardLayout(8, 80, 16, 256, 2)],
)
def test_fixed_header_template_is_encode_fixed_header(layout: ShardLayout) -> None:
    """The per-array template (the write path's header) writes exactly encode_fixed_header's
    bytes, for every hash and parent length, algorithm and time, into a buffer that held
    other bytes before (every byte of the fixed part is written, crc over what was written)."""
    digest = hashlib.sha256(b"ns").digest()
    template = fmt.FixedHeaderTemplate(layout, digest, 3)
    buffer = bytearray(b"\xee" * (fmt.HEADER_FIXED_NBYTES + 8))
    for n in (16, 17, 31, 32):
        for parent in (None, os.urandom(16), os.urandom(n), os.urandom(32)):
            for algo, created in ((1, 0), (2, 1_700_000_000_123_456_789), (3, 2**64 - 1)):
                block_hash = os.urandom(n)
                want = fmt.encode_fixed_header(layout, digest, 3, block_hash, parent, algo, created)
                assert template.encode(block_hash, parent, algo, created) == want
                template.pack_into(memoryview(buffer), block_hash, parent, algo, created)
                assert bytes(buffer[: fmt.HEADER_FIXED_NBYTES]) == want
                assert buffer[fmt.HEADER_FIXED_NBYTES :] == b"\xee" * 8  # nothing past it


@pytest.mark.parametrize("identity", [make_small_identity(), make_odd_identity()])
def test_headers_of_consecutive_writes_are_whole(
    make_store: StoreFactory, identity: object
) -> None:
    """One I/O thread builds every header in the same reused buffer: each block file's whole
    header region is still exactly its own header (fixed part, slots, zero padding), with no
    byte left from the block before (longer hashes, a parent, then none)."""
    group = open_group(make_store, identity, io_threads=1)  # type: ignore[arg-type]
    layout = group.layout
    keys = [(os.urandom(n), p) for n, p in ((32, os.urandom(32)), (16, None), (24, os.urandom(16)))]
    writes = [
        BlockWrite(h, np.full(layout.block_nbytes, i + 1, dtype=np.uint8), p)
        for i, (h, p) in enumerate(keys)
    ]
    assert [r.status for r in group.write_blocks(writes)] == [WriteStatus.WRITTEN] * 3
    publisher = group._publisher  # the header each file must hold
    for h, parent in keys:
        raw = Path(group.path_of(h)).read_bytes()[: layout.header_nbytes]
        data = np.full(layout.block_nbytes, keys.index((h, parent)) + 1, dtype=np.uint8).data
        sums = chunk_sums(
            publisher.array.checksum_algo, data, layout.chunk_nbytes, layout.num_chunks
        )
        created = fmt.decode_header(raw).created_ns
        assert raw == bytes(publisher.header(h, parent, created, sums.tolist()))

"""Block keys: hash checks and the (hash_hi, hash_lo) chunk coordinates of format v1."""

from __future__ import annotations

import pytest

from kvstore.errors import KvstoreError
from kvstore.keys import (
    HASH_LO_BITS,
    check_hash,
    check_hashes,
    chunk_key,
    hash_coords,
    writer_election_key,
)


def test_hi_is_first_byte_lo_is_next_62_bits() -> None:
    h = bytes([0xAB, 0x12, 0x34, 0x56, 0x78, 0x9A, 0xBC, 0xDE, 0xF1]) + bytes(range(23))
    hi, lo = hash_coords(h)
    assert hi == 0xAB
    # bytes 1..8 as a big-endian u64 = 0x123456789ABCDEF1; its top 62 bits:
    assert lo == 0x123456789ABCDEF1 >> 2
    assert lo == 0x048D159E26AF37BC


def test_coordinate_extremes() -> None:
    assert hash_coords(bytes(16)) == (0, 0)
    assert hash_coords(b"\xff" * 16) == (255, 2**62 - 1)
    # The top bit of byte 1 is the top bit of the 62-bit lo.
    assert hash_coords(b"\x00\x80" + bytes(14)) == (0, 2**61)
    assert HASH_LO_BITS == 62


def test_only_70_bits_matter() -> None:
    base = bytearray(b"\x07" + b"\x55" * 31)
    hi, lo = hash_coords(bytes(base))
    # The low two bits of byte 8 and everything from byte 9 on are not in the coordinates
    # (the header carries the full hash for that reason).
    other = bytearray(base)
    other[8] ^= 0b11
    other[9:] = b"\xee" * 23
    assert hash_coords(bytes(other)) == (hi, lo)
    # ... but every bit of bytes 0..7 and the top 6 bits of byte 8 do.
    for byte, bit in [(0, 0), (1, 7), (4, 3), (8, 2), (8, 7)]:
        flipped = bytearray(base)
        flipped[byte] ^= 1 << bit
        assert hash_coords(bytes(flipped)) != (hi, lo), (byte, bit)


def test_chunk_key() -> None:
    h = b"\x02" + b"\x00" * 7 + b"\x04" + bytes(23)  # lo = 4 >> 2 = 1
    assert chunk_key(h, 5) == "c/0/0/0/0/0/2/1"
    assert chunk_key(h, 3) == "c/0/0/0/2/1"


@pytest.mark.parametrize("n", [16, 20, 32])
def test_accepted_lengths(n: int) -> None:
    h = bytes(range(n))
    assert check_hash(h) == h
    # The annotation says bytes, but bytearray and memoryview are accepted and normalised.
    assert type(check_hash(bytearray(h))) is bytes  # type: ignore[arg-type]
    assert check_hash(memoryview(h)) == h  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [0, 8, 15, 33, 64])
def test_rejected_lengths(n: int) -> None:
    with pytest.raises(KvstoreError, match=f"expected 16..32 bytes, got {n}"):
        check_hash(bytes(n))


def test_rejected_types() -> None:
    with pytest.raises(KvstoreError, match="expected bytes, got str"):
        check_hash("0" * 32)  # type: ignore[arg-type]
    with pytest.raises(KvstoreError, match="expected bytes, got int"):
        check_hash(12345)  # type: ignore[arg-type]


def test_check_hashes_batch() -> None:
    assert check_hashes([bytes(16), bytearray(32)]) == [bytes(16), bytes(32)]  # type: ignore[list-item]
    with pytest.raises(KvstoreError):
        check_hashes([bytes(16), bytes(3)])


def test_writer_election_key() -> None:
    assert writer_election_key(bytes(range(32))) == 0x0001020304050607

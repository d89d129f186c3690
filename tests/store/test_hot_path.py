"""The read and write hot path's fast checks are exactly the slow ones (issue 17).

:func:`kvstore.store.check.header_algo` compares a header as bytes instead of decoding it, and
:func:`kvstore.checksum.chunk_sums` checksums a block's chunks in one call: both must accept
and refuse exactly what :func:`check.check_header` and one checksum call per chunk do.
"""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from kvstore.checksum import CRC32C, WSUM64, XXH3_64, chunk_sums, crc32c, wsum64
from kvstore.errors import CorruptBlockError
from kvstore.store import check
from kvstore.store import format as fmt
from kvstore.store.check import ShardSpec
from kvstore.store.format import ShardLayout

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

"""The small-block read path's one-call check is exactly the two calls it replaces (issue 17).

:func:`kvstore.store.check.check_whole_block` (header template, key and crc compared in one
``bytes`` copy, then every chunk's checksum against the slots) must accept and refuse exactly
what :func:`check.header_algo` followed by :func:`check.verify_chunks` do, with the same words.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.checksum import CRC32C, WSUM64, XXH3_64, chunk_sums, crc32c
from kvstore.errors import CorruptBlockError
from kvstore.store import check
from kvstore.store import format as fmt
from kvstore.store.check import ShardSpec
from kvstore.store.codec import Codec
from kvstore.store.format import ShardLayout
from kvstore.store.types import BlockRead, BlockWrite, ReadStatus, WriteStatus
from tests.helpers import StoreFactory, block_bytes, block_hash, make_small_identity

LAYOUT = ShardLayout(num_heads=2, num_layers=3, tokens=16, elems_per_token=128, itemsize=2)
SPEC = ShardSpec(LAYOUT, bytes(range(32)), 1)
HASH = bytes(range(0x40, 0x60))
PARENT = bytes(range(0x80, 0xA0))


def block_of(algo: int, seed: int = 0) -> tuple[bytes, bytes]:
    """(header with filled checksum slots, chunk bytes) of a good block of SPEC."""
    data = np.random.default_rng(seed).integers(0, 256, LAYOUT.block_nbytes, dtype=np.uint8)
    sums = chunk_sums(algo, data.data, LAYOUT.chunk_nbytes, LAYOUT.num_chunks)
    fixed = fmt.encode_fixed_header(LAYOUT, SPEC.namespace_digest, 1, HASH, PARENT, algo, 42)
    header = fixed + fmt.encode_checksums(sums.tolist())
    return header + bytes(LAYOUT.header_nbytes - len(header)), data.tobytes()


def two_calls(
    header: bytes, data: bytes, spec: ShardSpec, key: bytes, *, verify: bool = True
) -> str | None:
    try:
        algo = check.header_algo(header, spec, key)
        if verify:
            chunks = range(spec.layout.num_chunks)
            check.verify_chunks(spec.layout, algo, header, chunks, memoryview(data))
    except CorruptBlockError as exc:
        return str(exc)
    return None


def one_call(
    header: bytes, data: bytes, spec: ShardSpec, key: bytes, *, verify: bool = True
) -> str | None:
    try:
        check.check_whole_block(spec, memoryview(header), key, memoryview(data), verify=verify)
    except CorruptBlockError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("algo", [XXH3_64, CRC32C, WSUM64])
def test_a_good_block_passes(algo: int) -> None:
    header, data = block_of(algo)
    assert one_call(header, data, SPEC, HASH) is None
    assert two_calls(header, data, SPEC, HASH) is None


@pytest.mark.parametrize("verify", [True, False])
def test_every_damaged_header_byte_gets_the_same_verdict(verify: bool) -> None:
    """Bit flips in the fixed header and in every checksum slot: same verdict, same words."""
    header, data = block_of(XXH3_64, 1)
    for offset in range(fmt.checksum_slot_offset(LAYOUT.num_chunks)):
        for bit in (0x01, 0x80):
            bad = bytearray(header)
            bad[offset] ^= bit
            want = two_calls(bytes(bad), data, SPEC, HASH, verify=verify)
            assert one_call(bytes(bad), data, SPEC, HASH, verify=verify) == want, (offset, bit)
            if offset < fmt.CRC_OFFSET + 4 or (verify and offset >= fmt.HEADER_FIXED_NBYTES):
                assert want is not None, (offset, bit)  # nothing here goes unnoticed


@pytest.mark.parametrize("chunk", range(LAYOUT.num_chunks))
def test_a_damaged_chunk_is_named(chunk: int) -> None:
    header, data = block_of(CRC32C, 2)
    bad = bytearray(data)
    bad[chunk * LAYOUT.chunk_nbytes + 7] ^= 0x04
    assert one_call(header, bytes(bad), SPEC, HASH) == f"checksum mismatch in inner chunk {chunk}"
    assert two_calls(header, bytes(bad), SPEC, HASH) == one_call(header, bytes(bad), SPEC, HASH)
    assert one_call(header, bytes(bad), SPEC, HASH, verify=False) is None  # not verified


def test_foreign_keys_places_and_algorithms_are_refused_alike() -> None:
    header, data = block_of(XXH3_64, 3)
    for key in (HASH[:-1] + b"\0", HASH[:16]):  # mis-keyed, another length
        assert one_call(header, data, SPEC, key) == two_calls(header, data, SPEC, key)
        assert one_call(header, data, SPEC, key) is not None
    for other in (ShardSpec(LAYOUT, bytes(32), 1), ShardSpec(LAYOUT, SPEC.namespace_digest, 0)):
        assert one_call(header, data, other, HASH) == two_calls(header, data, other, HASH)
        assert one_call(header, data, other, HASH) is not None
    forged = bytearray(header)  # a well-formed header naming an algorithm that does not exist
    forged[fmt.ALGO_OFFSET] = 99
    forged[fmt.CRC_OFFSET : fmt.CRC_OFFSET + 4] = crc32c(bytes(forged[: fmt.CRC_OFFSET])).to_bytes(
        4, "little"
    )
    words = one_call(bytes(forged), data, SPEC, HASH)
    assert words is not None and "checksum algorithm id" in words
    assert words == two_calls(bytes(forged), data, SPEC, HASH)


def test_it_refuses_what_it_is_not_for() -> None:
    header, data = block_of(XXH3_64)
    with pytest.raises(ValueError, match="whole header"):
        check.check_whole_block(SPEC, memoryview(header[:100]), HASH, memoryview(data), verify=True)
    compressed = ShardSpec(LAYOUT, SPEC.namespace_digest, 1, Codec.for_name("lz4", 2))
    with pytest.raises(ValueError, match="raw array"):
        check.check_whole_block(compressed, memoryview(header), HASH, memoryview(data), verify=True)


def test_concurrent_reads_each_use_their_own_header_buffer(make_store: StoreFactory) -> None:
    """Every I/O thread reads headers into a buffer of its own (cached per thread): blocks
    read on several threads at once all verify and come back whole."""
    group = make_store(io_threads=4).namespace(make_small_identity()).group(0)
    hashes = [block_hash(i, "threads") for i in range(48)]
    writes = [BlockWrite(h, block_bytes(group.layout, i)) for i, h in enumerate(hashes)]
    assert all(r.status is WriteStatus.WRITTEN for r in group.write_blocks(writes))
    for _ in range(3):
        outs = [np.zeros(group.layout.block_nbytes, dtype=np.uint8) for _ in hashes]
        results = group.read_blocks([BlockRead(h, o) for h, o in zip(hashes, outs, strict=True)])
        assert [r.status for r in results] == [ReadStatus.HIT] * len(hashes)
        for i, out in enumerate(outs):
            assert out.tobytes() == block_bytes(group.layout, i).tobytes(), i

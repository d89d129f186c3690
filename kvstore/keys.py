"""Block keys: the engine's block hash and where it lives in a group array.

A block is named by the full hash the engine computed for it (vLLM: 32 bytes for sha256*, 16 for
xxhash*). Format v1 maps it to two chunk coordinates of the group array (docs/format.md):

* ``hash_hi`` = the first 8 bits (256 fan-out directories),
* ``hash_lo`` = the next 62 bits.

The coordinates carry only 70 bits, so the block header stores the full hash and every read
checks it: two hashes that share 70 bits can never serve each other's pages.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.errors import KvstoreError

MIN_HASH_BYTES = 16
MAX_HASH_BYTES = 32
HASH_LO_BITS = 62
HASH_HI_FANOUT = 256


def check_hash(block_hash: bytes) -> bytes:
    """Return ``block_hash`` as ``bytes`` if its length is one format v1 can key, else raise."""
    # Per block read and written: plain bytes of a good length (the engines' hashes) are
    # returned as they are (bytes() of exact bytes is the same object anyway).
    if type(block_hash) is bytes and MIN_HASH_BYTES <= len(block_hash) <= MAX_HASH_BYTES:
        return block_hash
    if not isinstance(block_hash, bytes | bytearray | memoryview):
        raise KvstoreError(f"block hash: expected bytes, got {type(block_hash).__name__}")
    raw = bytes(block_hash)
    if not MIN_HASH_BYTES <= len(raw) <= MAX_HASH_BYTES:
        raise KvstoreError(
            f"block hash: expected {MIN_HASH_BYTES}..{MAX_HASH_BYTES} bytes, got {len(raw)}"
        )
    return raw


def hash_coords(block_hash: bytes) -> tuple[int, int]:
    """The ``(hash_hi, hash_lo)`` chunk coordinates of a (checked) block hash."""
    return block_hash[0], int.from_bytes(block_hash[1:9], "big") >> (64 - HASH_LO_BITS)


def chunk_key(block_hash: bytes, leading_dims: int) -> str:
    """The zarr chunk key (path below the array) of the block's shard file.

    ``leading_dims`` is the number of array dimensions before the two hash dimensions; the
    shard spans all of them, so their chunk coordinates are all 0.
    """
    hi, lo = hash_coords(block_hash)
    return "c/" + "0/" * leading_dims + f"{hi}/{lo}"


def writer_election_key(block_hash: bytes) -> int:
    """An integer all ranks derive identically from a block hash, for writer rotation."""
    return int.from_bytes(block_hash[:8], "big")


def check_hashes(hashes: Sequence[bytes]) -> list[bytes]:
    """:func:`check_hash` over a batch."""
    return [check_hash(h) for h in hashes]

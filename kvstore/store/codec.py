"""Compressed inner chunks, the bytes (format v1 addendum; docs/format.md): the blosc codec of
an array, the size bounds of a compressed shard file, and its standard sharding index.

Pure functions of the array's geometry and codec: the block check (:mod:`kvstore.store.check`)
and the compressed reader and writer (:mod:`kvstore.store.compression`) take them from here.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numcodecs import blosc

from kvstore.checksum import crc32c
from kvstore.config import check_compression
from kvstore.errors import CorruptBlockError
from kvstore.store.format import ShardLayout

# blosc1 frame header: version, versionlz, flags, typesize, nbytes, blocksize, cbytes.
BLOSC_HEADER = struct.Struct("<BBBBIII")
BLOSC_OVERHEAD = 16  # blosc1 header; an incompressible chunk is stored with exactly this much more
_LZ4_CLEVEL = 5


@dataclass(frozen=True)
class Codec:
    """A compression setting for one array: blosc with bit shuffle."""

    name: str  # the config name: "lz4", "zstd-3"
    cname: str  # blosc compressor
    clevel: int  # blosc compression level
    typesize: int  # element size in bytes (the unit bit shuffle transposes)

    @classmethod
    def for_name(cls, name: str, itemsize: int) -> Codec | None:
        """The codec of config name ``name`` (None for "none"); ConfigError if unknown."""
        check_compression(name)
        if name == "none":
            return None
        if name == "lz4":
            return cls(name, "lz4", _LZ4_CLEVEL, itemsize)
        return cls(name, "zstd", int(name.split("-", 1)[1]), itemsize)

    def zarr_config(self) -> dict[str, Any]:
        """The blosc codec's configuration in zarr.json."""
        return {
            "typesize": self.typesize,
            "cname": self.cname,
            "clevel": self.clevel,
            "shuffle": "bitshuffle",
            "blocksize": 0,
        }

    @staticmethod
    def max_stored_nbytes(chunk_nbytes: int) -> int:
        """The largest valid stored chunk: blosc never expands by more than its header."""
        return chunk_nbytes + BLOSC_OVERHEAD

    def compress(self, data: memoryview) -> bytes:
        """The stored bytes of one raw chunk (a blosc1 frame). Releases the GIL."""
        out: bytes = blosc.compress(
            data, self.cname.encode(), self.clevel, blosc.BITSHUFFLE, 0, typesize=self.typesize
        )
        return out

    @staticmethod
    def decompress_into(stored: memoryview, out: memoryview) -> None:
        """Decode one stored chunk into ``out`` (exactly its raw size); CorruptBlockError if the
        frame does not describe exactly ``len(out)`` bytes stored in ``len(stored)``."""
        if len(stored) < BLOSC_HEADER.size:
            raise CorruptBlockError(f"compressed chunk: {len(stored)} bytes, no blosc header")
        _, _, _, _, nbytes, _, cbytes = BLOSC_HEADER.unpack_from(stored)
        if nbytes != len(out) or cbytes != len(stored):
            raise CorruptBlockError(
                f"compressed chunk: expected {len(out)} bytes stored in {len(stored)}, the blosc "
                f"header says {nbytes} in {cbytes}"
            )
        try:
            blosc.decompress(stored, out)
        except (RuntimeError, ValueError) as exc:
            raise CorruptBlockError(f"compressed chunk does not decode: {exc}") from None


def compressed_bounds(layout: ShardLayout) -> tuple[int, int]:
    """(smallest, largest) size of a valid compressed shard file of ``layout``."""
    fixed = layout.header_nbytes + layout.index_nbytes
    return (
        fixed + layout.num_chunks * BLOSC_HEADER.size,
        fixed + layout.num_chunks * Codec.max_stored_nbytes(layout.chunk_nbytes),
    )


def encode_index(sizes: Sequence[int], data_offset: int) -> bytes:
    """The standard sharding index of chunks packed back to back from ``data_offset``."""
    entries = np.empty((len(sizes), 2), dtype="<u8")
    lengths = np.asarray(sizes, dtype=np.uint64)
    entries[:, 1] = lengths
    entries[:, 0] = data_offset + np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.uint64)
    raw = entries.tobytes()
    return raw + struct.pack("<I", crc32c(raw))


def decode_index(index: memoryview, layout: ShardLayout, file_nbytes: int) -> np.ndarray:
    """Stored chunk offsets (n+1 of them: chunk c is ``[off[c], off[c+1])``) from the index.

    CorruptBlockError unless the crc matches and the entries describe exactly the packed layout
    with every stored chunk between a blosc header and ``chunk_nbytes + 16`` bytes.
    """
    n = layout.num_chunks
    if len(index) != layout.index_nbytes:
        raise CorruptBlockError(f"index: expected {layout.index_nbytes} bytes, got {len(index)}")
    raw = index[: 16 * n]
    (stored_crc,) = struct.unpack_from("<I", index, 16 * n)
    if crc32c(raw) != stored_crc:
        raise CorruptBlockError("sharding index checksum mismatch")
    entries = np.frombuffer(raw, dtype="<u8").reshape(n, 2).astype(np.int64)
    sizes = entries[:, 1]
    data_end = file_nbytes - layout.index_nbytes
    if (sizes < BLOSC_HEADER.size).any() or (
        sizes > Codec.max_stored_nbytes(layout.chunk_nbytes)
    ).any():
        raise CorruptBlockError(
            f"sharding index: stored chunk sizes must lie in [{BLOSC_HEADER.size}, "
            f"{Codec.max_stored_nbytes(layout.chunk_nbytes)}]"
        )
    offsets = np.empty(n + 1, dtype=np.int64)
    offsets[0] = layout.data_offset
    np.cumsum(sizes, out=offsets[1:])
    offsets[1:] += layout.data_offset
    if not (entries[:, 0] == offsets[:-1]).all() or offsets[-1] != data_end:
        raise CorruptBlockError(
            "sharding index: expected the chunks packed back to back from "
            f"{layout.data_offset} to {data_end}"
        )
    return offsets

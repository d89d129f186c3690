"""On-disk format v1: where every byte of a block's shard file goes.

A shard file holds one block of one KV-cache group (all heads, all layers, all tokens)::

    [0, header_nbytes)                 header (this module), zero padded to a 4 KiB multiple
    [data_offset + c*chunk_stride, +chunk_nbytes)   inner chunk c, raw little-endian elements
    [data_end, data_end + 16*n + 4)    zarr sharding index: (offset, nbytes) u64 LE per inner
                                       chunk in C order, then crc32c (u32 LE) of those bytes

Inner chunk ``c`` is ``(kv_head h, layer l)`` with ``c = h*L + l`` for attention groups (MLA:
``c = l``): ``tokens x 2 x head_dim`` elements, token-major, K then V per token. Offsets are
4 KiB aligned so O_DIRECT and GPUDirect transfers need no bounce buffer, and fixed, so several
writers (ranks) can fill one temporary file independently. The index is standard, so
zarr-python and tensorstore read every value; bytes outside the index (the header, padding)
are allowed by the sharding spec.

Header (little endian)::

    off size field
      0    8 magic b"KVSHARD\\0"
      8    2 format version (1)
     10    2 flags (0)
     12    4 header_nbytes
     16   32 namespace digest (sha256 of the identity)
     48    4 group index k (array g<k>)
     52    1 block hash length     53  1 parent hash length (0: first block of a chain)
     54    1 checksum algorithm id 55  1 reserved (0)
     56   32 block hash, zero padded
     88   32 parent hash, zero padded
    120    4 tokens in the block   124 4 number of inner chunks n
    128    8 chunk_nbytes          136 8 chunk_stride
    144    8 data_offset           152 8 file_nbytes
    160    8 created, ns since the epoch (decided once per block; all writers write the same)
    168    4 crc32c of bytes [0, 168)
    172    4 reserved (0)
    176  8*n checksum of inner chunk c, u64 (crc32c zero-extended)

Every writer of a block writes the identical fixed part [0, 176) and the index; each writes the
checksum slots of the chunks it wrote. A slot left unwritten (a writer that never ran) is 0
and fails verification, so an incomplete block is a miss, never served.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kvstore.checksum import crc32c
from kvstore.errors import CorruptBlockError
from kvstore.identity import GroupSpec

# The format adopts the I/O engines' 4 KiB alignment (what O_DIRECT and cuFile need): header,
# chunk offsets and strides are multiples of it, so a block file goes to disk without a bounce
# buffer. Re-exported: ALIGN is the format's alignment too.
from kvstore.io.align import ALIGN as ALIGN  # noqa: PLC0414 - explicit re-export (mypy strict)
from kvstore.io.align import align_up

MAGIC = b"KVSHARD\0"
FORMAT_VERSION = 1
# Format v1 fixes its alignment: another value would move every offset of every block file.
assert ALIGN == 4096
HEADER_FIXED_NBYTES = 176
_FIXED = struct.Struct("<8sHHI32sIBBBB32s32sIIQQQQQ")
_CRC = struct.Struct("<II")
# _FIXED with the fields every raw block of an array shares as two byte strings: [0, 52)
# (magic .. group) and [120, 160) (tokens .. file_nbytes); see FixedHeaderTemplate.
_TEMPLATED = struct.Struct("<52sBBBB32s32s40sQ")
assert _FIXED.size == 168
assert _TEMPLATED.size == _FIXED.size
assert _FIXED.size + _CRC.size == HEADER_FIXED_NBYTES
MAX_HASH = 32
# Offsets of fixed-header fields the hot-path check compares as bytes (see the table above).
HASH_LEN_OFFSET = 52  # block hash length, then parent hash length
ALGO_OFFSET = 54
HASH_OFFSET = 56
GEOMETRY_OFFSET = 120  # tokens .. file_nbytes
CREATED_OFFSET = 160
CRC_OFFSET = 168
# Header flag: the inner chunks are compressed with the array's codec and packed back to back
# (see kvstore/store/compression.py); chunk_stride is then 0 and file_nbytes the actual size.
FLAG_COMPRESSED = 1


@dataclass(frozen=True)
class ShardLayout:
    """Byte layout of one group's shard files; everything is fixed by the group geometry.

    Derived sizes are cached (``cached_property``): the layout is frozen, and the hot path
    reads them several times per block.
    """

    num_heads: int  # H (1 for MLA)
    num_layers: int  # L
    tokens: int  # T, tokens per block
    elems_per_token: int  # 2*head_dim (K then V) or latent_dim
    itemsize: int  # bytes per element

    @classmethod
    def for_group(cls, group: GroupSpec, tokens_per_block: int, itemsize: int) -> ShardLayout:
        per_token = group.latent_dim if group.kind == "mla" else 2 * group.head_dim
        heads = 1 if group.kind == "mla" else group.num_kv_heads
        return cls(heads, group.num_layers, tokens_per_block, per_token, itemsize)

    @cached_property
    def num_chunks(self) -> int:
        return self.num_heads * self.num_layers

    @cached_property
    def chunk_nbytes(self) -> int:
        """Bytes of one inner chunk (one head of one layer)."""
        return self.tokens * self.elems_per_token * self.itemsize

    @cached_property
    def chunk_stride(self) -> int:
        """Distance between inner chunks in the file (4 KiB aligned)."""
        return align_up(self.chunk_nbytes)

    @cached_property
    def header_nbytes(self) -> int:
        return align_up(HEADER_FIXED_NBYTES + 8 * self.num_chunks)

    @cached_property
    def data_offset(self) -> int:
        return self.header_nbytes

    @cached_property
    def data_end(self) -> int:
        return self.data_offset + self.num_chunks * self.chunk_stride

    @cached_property
    def index_nbytes(self) -> int:
        return 16 * self.num_chunks + 4

    @cached_property
    def file_nbytes(self) -> int:
        """Exact size of a complete shard file."""
        return self.data_end + self.index_nbytes

    @cached_property
    def block_nbytes(self) -> int:
        """Bytes of the canonical block (all inner chunks back to back, no padding)."""
        return self.num_chunks * self.chunk_nbytes

    @cached_property
    def dense(self) -> bool:
        """True when chunks are back to back in the file (chunk size is a 4 KiB multiple)."""
        return self.chunk_nbytes == self.chunk_stride

    def chunk_index(self, head: int, layer: int) -> int:
        """Inner chunk number of (head, layer)."""
        return head * self.num_layers + layer

    def chunk_offset(self, chunk: int) -> int:
        """File offset of inner chunk ``chunk``."""
        return self.data_offset + chunk * self.chunk_stride

    @cached_property
    def index_bytes(self) -> bytes:
        """The sharding index (with its crc32c): identical for every block of the group."""
        entries = np.empty((self.num_chunks, 2), dtype="<u8")
        entries[:, 0] = (
            self.data_offset + np.arange(self.num_chunks, dtype=np.uint64) * self.chunk_stride
        )
        entries[:, 1] = self.chunk_nbytes
        raw = entries.tobytes()
        return raw + struct.pack("<I", crc32c(raw))

    def chunks_of(self, heads: range | None, layers: range | None) -> list[int]:
        """Inner chunk numbers of a (heads x layers) selection, in C order."""
        hs = range(self.num_heads) if heads is None else heads
        ls = range(self.num_layers) if layers is None else layers
        if hs.start < 0 or hs.stop > self.num_heads or ls.start < 0 or ls.stop > self.num_layers:
            raise ValueError(
                f"selection heads={hs} layers={ls} outside heads 0..{self.num_heads} "
                f"layers 0..{self.num_layers}"
            )
        return [h * self.num_layers + layer for h in hs for layer in ls]


@dataclass(frozen=True)
class BlockHeader:
    """The decoded fixed part of a block header."""

    namespace_digest: bytes
    group: int
    block_hash: bytes
    parent_hash: bytes | None
    checksum_algo: int
    tokens: int
    num_chunks: int
    chunk_nbytes: int
    chunk_stride: int
    data_offset: int
    file_nbytes: int
    created_ns: int
    header_nbytes: int
    flags: int = 0


def encode_fixed_header(  # noqa: PLR0913 - one argument per field of the fixed header (docs/format.md)
    layout: ShardLayout,
    namespace_digest: bytes,
    group: int,
    block_hash: bytes,
    parent_hash: bytes | None,
    checksum_algo: int,
    created_ns: int,
    *,
    compressed_file_nbytes: int | None = None,
) -> bytes:
    """The fixed part of a header (``HEADER_FIXED_NBYTES`` bytes), crc included.

    ``compressed_file_nbytes``: the block's chunks are compressed and the file has this size
    (flag :data:`FLAG_COMPRESSED`, chunk_stride 0).
    """
    parent = parent_hash or b""
    compressed = compressed_file_nbytes is not None
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        FLAG_COMPRESSED if compressed else 0,
        layout.header_nbytes,
        namespace_digest,
        group,
        len(block_hash),
        len(parent),
        checksum_algo,
        0,
        block_hash,
        parent,
        layout.tokens,
        layout.num_chunks,
        layout.chunk_nbytes,
        0 if compressed else layout.chunk_stride,
        layout.data_offset,
        compressed_file_nbytes if compressed else layout.file_nbytes,
        created_ns,
    )
    return fixed + _CRC.pack(crc32c(fixed), 0)


class FixedHeaderTemplate:
    """:func:`encode_fixed_header` for the raw blocks of one array, whose fields other than
    the hashes, the checksum algorithm and the creation time are the same for every block:
    those are packed once here, so a block's fixed part is one ``pack`` and one crc32c (the
    per-block cost of a small block's write, a visible share of its time). The bytes are exactly
    :func:`encode_fixed_header`'s (tests/store/test_format.py compares them)."""

    __slots__ = ("_geometry", "_prefix")

    def __init__(self, layout: ShardLayout, namespace_digest: bytes, group: int) -> None:
        fixed = encode_fixed_header(layout, namespace_digest, group, b"\x01", None, 0, 0)
        self._prefix = fixed[:HASH_LEN_OFFSET]  # magic .. group
        self._geometry = fixed[GEOMETRY_OFFSET:CREATED_OFFSET]  # tokens .. file_nbytes

    def pack_into(
        self,
        buffer: memoryview,
        block_hash: bytes,
        parent_hash: bytes | None,
        checksum_algo: int,
        created_ns: int,
    ) -> None:
        """Write the fixed part (:data:`HEADER_FIXED_NBYTES` bytes, crc included) at the start
        of ``buffer``; the crc32c is computed over the bytes written there."""
        parent = parent_hash or b""
        _TEMPLATED.pack_into(
            buffer,
            0,
            self._prefix,
            len(block_hash),
            len(parent),
            checksum_algo,
            0,
            block_hash,
            parent,
            self._geometry,
            created_ns,
        )
        _CRC.pack_into(buffer, CRC_OFFSET, crc32c(buffer[:CRC_OFFSET]), 0)

    def encode(
        self, block_hash: bytes, parent_hash: bytes | None, checksum_algo: int, created_ns: int
    ) -> bytes:
        """The fixed part as ``bytes`` (:meth:`pack_into` into a fresh buffer)."""
        fixed = bytearray(HEADER_FIXED_NBYTES)
        self.pack_into(memoryview(fixed), block_hash, parent_hash, checksum_algo, created_ns)
        return bytes(fixed)


def checksum_slot_offset(chunk: int) -> int:
    """File offset of the checksum slot of inner chunk ``chunk``."""
    return HEADER_FIXED_NBYTES + 8 * chunk


def encode_checksums(checksums: list[int]) -> bytes:
    """Checksum slots, u64 little endian."""
    return np.asarray(checksums, dtype="<u8").tobytes()


def decode_header(buf: bytes | bytearray | memoryview) -> BlockHeader:
    """Decode and self-check the fixed part of a header; :class:`CorruptBlockError` if bad."""
    if len(buf) < HEADER_FIXED_NBYTES:
        raise CorruptBlockError(f"header: expected {HEADER_FIXED_NBYTES} bytes, got {len(buf)}")
    fixed = bytes(buf[: _FIXED.size])
    (stored_crc, _) = _CRC.unpack_from(buf, _FIXED.size)
    fields = _FIXED.unpack(fixed)
    magic, version = fields[0], fields[1]
    if magic != MAGIC:
        raise CorruptBlockError(f"header magic: expected {MAGIC!r}, got {magic!r}")
    if version != FORMAT_VERSION:
        raise CorruptBlockError(f"format version: expected {FORMAT_VERSION}, got {version}")
    if crc32c(fixed) != stored_crc:
        raise CorruptBlockError("header checksum mismatch (header bytes damaged)")
    hash_len, parent_len = fields[6], fields[7]
    if not 0 < hash_len <= MAX_HASH or parent_len > MAX_HASH:
        raise CorruptBlockError(f"header hash lengths out of range: {hash_len}, {parent_len}")
    return BlockHeader(
        namespace_digest=fields[4],
        group=fields[5],
        block_hash=fields[10][:hash_len],
        parent_hash=fields[11][:parent_len] if parent_len else None,
        checksum_algo=fields[8],
        tokens=fields[12],
        num_chunks=fields[13],
        chunk_nbytes=fields[14],
        chunk_stride=fields[15],
        data_offset=fields[16],
        file_nbytes=fields[17],
        created_ns=fields[18],
        header_nbytes=fields[3],
        flags=fields[2],
    )


def check_header(  # noqa: PLR0913 - one argument per header field compared with where the block was found
    header: BlockHeader,
    layout: ShardLayout,
    namespace_digest: bytes,
    group: int,
    block_hash: bytes,
    *,
    compressed_file_nbytes: int | None = None,
) -> None:
    """Raise :class:`CorruptBlockError` unless ``header`` belongs exactly where it was found.

    ``compressed_file_nbytes``: the array compresses its chunks and the file has this size; the
    header must then carry :data:`FLAG_COMPRESSED`, chunk_stride 0 and that size.
    """
    compressed = compressed_file_nbytes is not None
    want_flags = FLAG_COMPRESSED if compressed else 0
    if header.flags != want_flags:
        raise CorruptBlockError(
            f"header flags: expected {want_flags} ({'compressed' if compressed else 'raw'} "
            f"chunks, as the array says), got {header.flags}"
        )
    if header.block_hash != block_hash:
        raise CorruptBlockError(
            f"mis-keyed block: expected hash {block_hash.hex()}, "
            f"header has {header.block_hash.hex()}"
        )
    if header.namespace_digest != namespace_digest:
        raise CorruptBlockError(
            f"foreign block: expected namespace {namespace_digest.hex()[:12]}, "
            f"header has {header.namespace_digest.hex()[:12]}"
        )
    if header.group != group:
        raise CorruptBlockError(f"foreign block: expected group {group}, header has {header.group}")
    expected = (
        layout.tokens,
        layout.num_chunks,
        layout.chunk_nbytes,
        0 if compressed else layout.chunk_stride,
        layout.data_offset,
        compressed_file_nbytes if compressed else layout.file_nbytes,
        layout.header_nbytes,
    )
    got = (
        header.tokens,
        header.num_chunks,
        header.chunk_nbytes,
        header.chunk_stride,
        header.data_offset,
        header.file_nbytes,
        header.header_nbytes,
    )
    if expected != got:
        raise CorruptBlockError(
            "block geometry (tokens, chunks, chunk bytes, stride, data offset, file bytes, header "
            f"bytes): expected {expected}, got {got}"
        )


def decode_checksums(header_buf: bytes | bytearray | memoryview, num_chunks: int) -> np.ndarray:
    """The checksum slots of a header buffer as a uint64 array."""
    return np.frombuffer(header_buf, dtype="<u8", count=num_chunks, offset=HEADER_FIXED_NBYTES)

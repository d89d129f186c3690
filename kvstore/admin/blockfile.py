"""Reading block files for the admin tools: the header alone, or the whole file checked.

A file is checked the way a reader checks it, and more: every byte is covered by some check
(header crc, hash coordinates, identity, geometry, the fixed sharding index, each inner chunk's
checksum, and zero padding), so a flipped bit anywhere in a block file is found.

Both read through a plain descriptor and never set the file's mtime (that is a reader's record
of last use; the admin tools are not readers). The checks are the format module's
(:func:`~kvstore.store.format.decode_header`, :func:`~kvstore.store.format.check_header`,
:func:`~kvstore.store.format.decode_checksums`), applied to a file found by listing, so the
full hash comes from the header and is compared with the path's coordinates.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

import numpy as np

from kvstore.checksum import checksum_function
from kvstore.errors import CorruptBlockError, StoreFormatError
from kvstore.io.fileio import DEFAULT_FILEIO, read_fully
from kvstore.keys import hash_coords
from kvstore.store import format as fmt
from kvstore.store.compression import Codec, check_compressed_file, compressed_bounds
from kvstore.store.format import BlockHeader, ShardLayout

# Kinds of a bad block file (verify's finding kinds).
TRUNCATED = "truncated"  # shorter than the geometry says (a torn copy, a full disk)
OVERSIZED = "oversized"  # longer than the geometry says
CORRUPT = "corrupt"  # bad magic / version / header crc / geometry / index / chunk checksum
MIS_KEYED = "mis-keyed"  # a valid block stored under another hash's name
MISPLACED = "misplaced"  # a valid block of another namespace or group


@dataclass(frozen=True)
class BlockFault:
    """Why a block file is bad."""

    kind: str
    detail: str


def read_header(path: str) -> BlockHeader:
    """The decoded fixed header of a block file (self-checked: magic, version, crc).

    Raises :class:`CorruptBlockError` for a bad header and ``OSError`` (FileNotFoundError when
    it vanished) for I/O failures.
    """
    fd = _open_regular(path)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptBlockError(f"{path}: expected a regular file, got {_kind(fd)}")
        raw = os.pread(fd, fmt.HEADER_FIXED_NBYTES, 0)
    finally:
        os.close(fd)
    return fmt.decode_header(raw)


def check_block_file(
    path: str,
    layout: ShardLayout,
    namespace_digest: bytes,
    group: int,
    hi: int,
    lo: int,
    compression: str = "none",
) -> BlockFault | None:
    """Read the whole file with one vectored read and check everything a reader would.

    Size, header (magic, version, crc), hash coordinates = the path's ``(hi, lo)``, namespace
    digest and group = where it lies, geometry = the array's, the sharding index, and the
    checksum of every inner chunk. None when the block is intact. ``OSError`` propagates
    (FileNotFoundError: it vanished while we looked). ``compression``: the array's setting;
    compressed blocks are checked by :func:`~kvstore.store.compression.check_compressed_file`.
    """
    codec = Codec.for_name(compression, layout.itemsize)
    low, high = size_bounds(layout, compression)
    fd = _open_regular(path)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return BlockFault(CORRUPT, f"expected a regular file, got {_kind(fd)}")
        size = st.st_size
        if not low <= size <= high:
            # Checked before reading, so a hostile file cannot make us allocate more than one
            # block; the exact rules (header size, index) follow on the bytes.
            expected = f"{low}" if low == high else f"{low}..{high}"
            kind = TRUNCATED if size < low else OVERSIZED
            return BlockFault(kind, f"file size: expected {expected}, got {size}")
        buf = bytearray(size)
        got = read_fully(DEFAULT_FILEIO, fd, [buf], 0)
    finally:
        os.close(fd)
    if got != size:
        return BlockFault(TRUNCATED, f"short read: expected {size} bytes, got {got}")
    if codec is not None:
        return _check_compressed(memoryview(buf), layout, codec, namespace_digest, group, hi, lo)
    return check_block_bytes(memoryview(buf), layout, namespace_digest, group, hi, lo)


def _open_regular(path: str) -> int:
    """A read-only descriptor of ``path`` that cannot block: O_NONBLOCK makes the open of a
    FIFO return at once (it changes nothing for a regular file), and the callers then refuse
    anything that is not a regular file before reading."""
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)


def _kind(fd: int) -> str:
    mode = os.fstat(fd).st_mode
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO")):
        if test(mode):
            return name
    return f"file type {stat.S_IFMT(mode):o}"


def size_bounds(layout: ShardLayout, compression: str) -> tuple[int, int]:
    """(smallest, largest) size of a valid block file of an array with ``compression``.

    A raw block file has exactly ``layout.file_nbytes``. A compressed one lies within
    :func:`~kvstore.store.compression.compressed_bounds`: smaller when its chunks compress, and
    up to 16 bytes per chunk *larger* when they do not (blosc stores an incompressible chunk
    with its header), so the raw size is no bound for it.
    """
    if Codec.for_name(compression, layout.itemsize) is None:
        return layout.file_nbytes, layout.file_nbytes
    return compressed_bounds(layout)


def _placed_header(
    data: memoryview, layout: ShardLayout, namespace_digest: bytes, group: int, hi: int, lo: int
) -> tuple[BlockHeader | None, BlockFault | None]:
    """The decoded header, or why the file does not belong where it was found."""
    try:
        header = fmt.decode_header(data[: layout.header_nbytes])
    except CorruptBlockError as exc:
        return None, BlockFault(CORRUPT, str(exc))
    coords = hash_coords(header.block_hash)
    if coords != (hi, lo):
        return None, BlockFault(
            MIS_KEYED,
            f"hash coordinates: expected {hi}/{lo} (the path), header hash "
            f"{header.block_hash.hex()[:16]}… has {coords[0]}/{coords[1]}",
        )
    if header.namespace_digest != namespace_digest or header.group != group:
        return None, BlockFault(
            MISPLACED,
            f"expected namespace {namespace_digest.hex()[:12]} group {group}, header has "
            f"{header.namespace_digest.hex()[:12]} group {header.group}",
        )
    return header, None


def _check_compressed(
    data: memoryview,
    layout: ShardLayout,
    codec: Codec,
    namespace_digest: bytes,
    group: int,
    hi: int,
    lo: int,
) -> BlockFault | None:
    """:func:`check_block_file` for a block of a compressed array."""
    header, fault = _placed_header(data, layout, namespace_digest, group, hi, lo)
    if fault is not None or header is None:
        return fault
    try:
        check_compressed_file(data, layout, codec, namespace_digest, group)
    except (CorruptBlockError, StoreFormatError) as exc:
        return BlockFault(CORRUPT, str(exc))
    return None


def check_block_bytes(
    data: memoryview, layout: ShardLayout, namespace_digest: bytes, group: int, hi: int, lo: int
) -> BlockFault | None:
    """:func:`check_block_file` on bytes already read (``len(data) == layout.file_nbytes``)."""
    header, fault = _placed_header(data, layout, namespace_digest, group, hi, lo)
    if fault is not None or header is None:
        return fault
    try:
        fmt.check_header(header, layout, namespace_digest, group, header.block_hash)
    except CorruptBlockError as exc:
        return BlockFault(CORRUPT, str(exc))
    index = data[layout.data_end : layout.data_end + layout.index_nbytes]
    if index.tobytes() != layout.index_bytes:
        return BlockFault(CORRUPT, "sharding index: expected the array's fixed index, got others")
    try:
        fn = checksum_function(header.checksum_algo)
    except StoreFormatError as exc:
        return BlockFault(CORRUPT, str(exc))
    slots = fmt.decode_checksums(data[: layout.header_nbytes], layout.num_chunks)
    bad = [
        c
        for c in range(layout.num_chunks)
        if fn(data[layout.chunk_offset(c) : layout.chunk_offset(c) + layout.chunk_nbytes])
        != int(slots[c])
    ]
    if bad:
        return BlockFault(
            CORRUPT,
            f"checksum mismatch in {len(bad)} of {layout.num_chunks} inner chunks "
            f"(first: chunk {bad[0]})",
        )
    if not _padding_is_zero(data, layout):
        return BlockFault(CORRUPT, "padding: expected zero bytes, got non-zero (bytes damaged)")
    return None


def parent_key(header: BlockHeader) -> tuple[int, int] | None:
    """The ``(hi, lo)`` coordinates of the block's parent, None for the first of a chain."""
    return hash_coords(header.parent_hash) if header.parent_hash is not None else None


def _padding_is_zero(data: memoryview, layout: ShardLayout) -> bool:
    """Bytes no reader looks at (header tail, chunk stride padding) are zero, as written."""
    raw = np.frombuffer(data, dtype=np.uint8)
    if raw[fmt.HEADER_FIXED_NBYTES - 4 : fmt.HEADER_FIXED_NBYTES].any():  # reserved u32
        return False
    if raw[fmt.HEADER_FIXED_NBYTES + 8 * layout.num_chunks : layout.header_nbytes].any():
        return False
    if layout.dense:
        return True
    pads = raw[layout.data_offset : layout.data_end].reshape(layout.num_chunks, layout.chunk_stride)
    return not pads[:, layout.chunk_nbytes :].any()

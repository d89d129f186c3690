"""Check one shard file and read its inner chunks, reporting damage instead of raising.

The store's own read path (:meth:`GroupStore.read_blocks`) turns any damage into a miss and
moves or deletes the file; a tool must do neither. :func:`check_block` reads the header and
the chosen inner chunks with plain ``pread`` calls, runs every check a server runs (file size,
magic, version, header crc, key, namespace, group, geometry, per-chunk checksum) plus one a
server does not need (the zarr sharding index, which plain zarr readers rely on), and returns
a :class:`BlockCheck` listing what failed. It never raises for a damaged block; it raises only
:class:`~kvstore.inspect.source.InspectError` for a caller error (bad chunk numbers).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstore.checksum import checksum_function
from kvstore.errors import CorruptBlockError, StoreFormatError
from kvstore.inspect.source import GroupView, InspectError
from kvstore.keys import hash_coords
from kvstore.store import format as fmt
from kvstore.store.compression import Codec, compressed_bounds, decode_index
from kvstore.store.format import BlockHeader


class ChunkState(enum.Enum):
    OK = "ok"
    MISMATCH = "checksum mismatch"
    UNWRITTEN = "checksum slot empty (a writer never ran)"
    TRUNCATED = "beyond the end of the file"
    UNVERIFIED = "not verifiable (header unusable)"

    @property
    def ok(self) -> bool:
        return self is ChunkState.OK


@dataclass(frozen=True)
class ChunkCheck:
    """Verification of one inner chunk (head, layer)."""

    chunk: int
    head: int
    layer: int
    state: ChunkState
    stored: int | None  # checksum in the header slot (None when the header is unusable)
    computed: int | None  # checksum of the bytes on disk (None when unreadable)


@dataclass(frozen=True)
class BlockCheck:
    """Everything :func:`check_block` found out about one shard file."""

    path: Path
    file_nbytes: int  # actual size (-1 when the file could not be opened)
    header: BlockHeader | None  # None when the fixed header does not decode
    problems: tuple[str, ...]  # block-level findings (size, header, key, index ...)
    chunks: tuple[ChunkCheck, ...]  # the checked inner chunks, in request order

    @property
    def ok(self) -> bool:
        return not self.problems and all(c.state.ok for c in self.chunks)

    @property
    def bad_chunks(self) -> list[ChunkCheck]:
        return [c for c in self.chunks if not c.state.ok]

    def summary(self) -> str:
        """One line: "ok", or the first problems."""
        if self.ok:
            return "ok"
        parts = list(self.problems)
        bad = self.bad_chunks
        if bad:
            where = ", ".join(f"(h{c.head},l{c.layer})" for c in bad[:4])
            more = f" +{len(bad) - 4}" if len(bad) > 4 else ""
            parts.append(f"{len(bad)} inner chunk(s) bad: {where}{more} ({bad[0].state.value})")
        return "; ".join(parts)


def chunk_head_layer(group: GroupView, chunk: int) -> tuple[int, int]:
    """(head, layer) of inner chunk ``chunk`` (MLA: head 0)."""
    return divmod(chunk, group.num_layers)


def check_block(
    group: GroupView,
    path: Path,
    *,
    chunks: Sequence[int] | None = None,
    expect_hash: bytes | None = None,
    want_data: bool = False,
) -> tuple[BlockCheck, np.ndarray | None]:
    """Verify the block file at ``path`` of ``group``; optionally return the chunks' bytes.

    ``chunks``: inner chunk numbers to read and verify (default all). ``expect_hash``: the full
    hash the caller looked up (checked against the header). With ``want_data`` the second item
    holds the chunks' bytes back to back (uint8, ``len(chunks) * chunk_nbytes``; bytes past the
    end of a short file are zero), whatever their state; otherwise it is None.
    """
    layout = group.layout
    wanted = list(range(layout.num_chunks)) if chunks is None else list(chunks)
    if any(not 0 <= c < layout.num_chunks for c in wanted):
        raise InspectError(f"chunk numbers: expected 0..{layout.num_chunks - 1}, got {wanted}")
    data = np.zeros(len(wanted) * layout.chunk_nbytes, dtype=np.uint8) if want_data else None
    codec = Codec.for_name(group.compression, layout.itemsize)
    if codec is not None:
        return _check_compressed(group, path, wanted, codec, expect_hash, data), data
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        reason = "missing (no such file)" if isinstance(exc, FileNotFoundError) else str(exc)
        missing = tuple(_unreadable(group, c) for c in wanted)
        return BlockCheck(path, -1, None, (f"cannot open: {reason}",), missing), data
    try:
        size = os.fstat(fd).st_size
        problems: list[str] = []
        if size != layout.file_nbytes:
            problems.append(f"file size: expected {layout.file_nbytes} bytes, got {size}")
        header_buf = os.pread(fd, layout.header_nbytes, 0)
        header = _decode(group, path, header_buf, expect_hash, problems)
        slots: np.ndarray | None = None
        checksum = None
        if header is not None and len(header_buf) >= fmt.checksum_slot_offset(layout.num_chunks):
            slots = fmt.decode_checksums(header_buf, layout.num_chunks)
            try:
                checksum = checksum_function(header.checksum_algo)
            except StoreFormatError as exc:
                problems.append(str(exc))
        index = os.pread(fd, layout.index_nbytes, layout.data_end)
        if len(index) == layout.index_nbytes and index != layout.index_bytes:
            problems.append("zarr sharding index: differs from the one format v1 prescribes")
        states: list[ChunkCheck] = []
        size_c = layout.chunk_nbytes
        for i, c in enumerate(wanted):
            raw = os.pread(fd, size_c, layout.chunk_offset(c))
            if data is not None:
                data[i * size_c : i * size_c + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
            head, layer = chunk_head_layer(group, c)
            stored = int(slots[c]) if slots is not None else None
            if len(raw) < size_c:
                states.append(ChunkCheck(c, head, layer, ChunkState.TRUNCATED, stored, None))
                continue
            if checksum is None or stored is None:
                states.append(ChunkCheck(c, head, layer, ChunkState.UNVERIFIED, stored, None))
                continue
            computed = int(checksum(memoryview(raw)))
            if stored == 0:
                state = ChunkState.UNWRITTEN
            else:
                state = ChunkState.OK if computed == stored else ChunkState.MISMATCH
            states.append(ChunkCheck(c, head, layer, state, stored, computed))
    finally:
        os.close(fd)
    return BlockCheck(path, size, header, tuple(problems), tuple(states)), data


def _check_compressed(
    group: GroupView,
    path: Path,
    wanted: list[int],
    codec: Codec,
    expect_hash: bytes | None,
    data: np.ndarray | None,
) -> BlockCheck:
    """:func:`check_block` for a block of a compressed array (read whole). Every chunk whose
    stored bytes verify is also decoded (into ``data`` when it is given), as a reader would:
    a chunk that does not decode is a problem even when its checksum matches."""
    layout = group.layout
    low, high = compressed_bounds(layout)
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(high)
    except OSError as exc:
        reason = "missing (no such file)" if isinstance(exc, FileNotFoundError) else str(exc)
        missing = tuple(_unreadable(group, c) for c in wanted)
        return BlockCheck(path, -1, None, (f"cannot open: {reason}",), missing)
    problems: list[str] = []
    if not low <= size <= high:
        problems.append(f"file size: expected {low}..{high} bytes (compressed), got {size}")
    header = _decode(group, path, raw[: layout.header_nbytes], expect_hash, problems, size)
    offsets: np.ndarray | None = None
    if len(raw) == size and size >= layout.index_nbytes:
        try:
            offsets = decode_index(memoryview(raw)[size - layout.index_nbytes :], layout, size)
        except CorruptBlockError as exc:
            problems.append(str(exc))
    slots: np.ndarray | None = None
    checksum = None
    if header is not None and len(raw) >= fmt.checksum_slot_offset(layout.num_chunks):
        slots = fmt.decode_checksums(raw, layout.num_chunks)
        try:
            checksum = checksum_function(header.checksum_algo)
        except StoreFormatError as exc:
            problems.append(str(exc))
    states: list[ChunkCheck] = []
    size_c = layout.chunk_nbytes
    scratch = memoryview(bytearray(size_c))
    for i, c in enumerate(wanted):
        head, layer = chunk_head_layer(group, c)
        stored_sum = int(slots[c]) if slots is not None else None
        if offsets is None or checksum is None or stored_sum is None:
            states.append(ChunkCheck(c, head, layer, ChunkState.UNVERIFIED, stored_sum, None))
            continue
        stored = memoryview(raw)[int(offsets[c]) : int(offsets[c + 1])]
        computed = int(checksum(stored))
        if stored_sum == 0:
            state = ChunkState.UNWRITTEN
        else:
            state = ChunkState.OK if computed == stored_sum else ChunkState.MISMATCH
        if state is ChunkState.OK:
            out = scratch if data is None else data[i * size_c : (i + 1) * size_c].data
            try:
                codec.decompress_into(stored, out)
            except CorruptBlockError as exc:
                problems.append(f"inner chunk {c}: {exc}")
        states.append(ChunkCheck(c, head, layer, state, stored_sum, computed))
    return BlockCheck(path, size, header, tuple(problems), tuple(states))


def _decode(
    group: GroupView,
    path: Path,
    buf: bytes,
    expect_hash: bytes | None,
    problems: list[str],
    compressed_file_nbytes: int | None = None,
) -> BlockHeader | None:
    """Decode and check the header; problems are appended, never raised."""
    try:
        header = fmt.decode_header(buf)
    except CorruptBlockError as exc:
        problems.append(f"header: {exc}")
        return None
    try:
        fmt.check_header(
            header,
            group.layout,
            group.digest,
            group.index,
            header.block_hash,
            compressed_file_nbytes=compressed_file_nbytes,
        )
    except CorruptBlockError as exc:
        problems.append(str(exc))
    where = (int(path.parent.name), int(path.name)) if path.name.isdigit() else None
    if where is not None and hash_coords(header.block_hash) != where:
        problems.append(
            f"mis-keyed block: the file name says hash coordinates {where}, the header hash "
            f"{header.block_hash.hex()[:16]}... has {hash_coords(header.block_hash)}"
        )
    if expect_hash is not None and header.block_hash != expect_hash:
        problems.append(
            f"mis-keyed block: expected hash {expect_hash.hex()}, header has "
            f"{header.block_hash.hex()}"
        )
    return header


def _unreadable(group: GroupView, chunk: int) -> ChunkCheck:
    head, layer = chunk_head_layer(group, chunk)
    return ChunkCheck(chunk, head, layer, ChunkState.TRUNCATED, None, None)


def quick_header(group: GroupView, path: Path) -> tuple[BlockHeader | None, str | None]:
    """Header of ``path`` checked against where it was found, without reading any chunk.

    Returns ``(header, None)`` or ``(None, problem)``. Cheap (one small read): used to scan
    every block of a group (prefix trees, hash prefixes).
    """
    problems: list[str] = []
    try:
        with path.open("rb") as f:
            buf = f.read(fmt.HEADER_FIXED_NBYTES)
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        return None, f"cannot read: {exc}"
    compressed = size if group.compression != "none" else None
    header = _decode(group, path, buf, None, problems, compressed)
    if problems:
        return None, problems[0]
    return header, None

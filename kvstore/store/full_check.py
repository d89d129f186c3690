"""The offline block check: everything about one shard file, never raising for a damaged block.

For the tools (``kvstore verify``, ``kvstore ls``, ``kvstore-inspect``). Checked, in file order:

* **size**: exactly ``layout.file_nbytes`` (raw), or within the bounds a compressed file of
  the geometry can have (:func:`~kvstore.store.codec.compressed_bounds`);
* **header**: magic, version, header crc32c (:func:`~kvstore.store.format.decode_header`); the
  key (the full hash asked for, or the path's hash coordinates for a file found by listing);
  namespace digest and group; flags and geometry (the hot path's checks,
  :mod:`kvstore.store.check`, on the same bytes);
* **index**: raw blocks carry the array's fixed sharding index; compressed ones an index that
  describes exactly their packed chunks (with its crc32c);
* **checksums**: every inner chunk against the checksum slot its writer filled; compressed
  chunks also decode to exactly one raw chunk;
* **padding**: bytes no reader looks at (header tail, chunk stride padding) are zero.

:func:`check_file` reads the whole file once (never more than the largest valid file of the
geometry), never raises for a damaged block, never changes the file (no mtime update, nothing
moved), and returns one :class:`BlockCheck` that lists every fault and every chunk's state.
:func:`quick_check` checks the header alone (one small read), for scans.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvstore.checksum import Checksum, checksum_function, strided_chunk_sums
from kvstore.errors import CorruptBlockError, EntryKindError, StoreFormatError
from kvstore.io import stall
from kvstore.io.entries import FileId, describe_os_error, file_id
from kvstore.io.native_fileio import DEFAULT_FILEIO
from kvstore.io.vectored import read_fully
from kvstore.keys import hash_coords
from kvstore.store import format as fmt
from kvstore.store.check import ShardSpec
from kvstore.store.codec import Codec, decode_index
from kvstore.store.format import BlockHeader, ShardLayout

TRUNCATED = "truncated"  # shorter than the geometry allows (a torn copy, a full disk)
OVERSIZED = "oversized"  # longer than the geometry allows
CORRUPT = "corrupt"  # bad magic / version / header crc / geometry / index / checksum / padding
MIS_KEYED = "mis-keyed"  # a valid block stored under another hash's name
MISPLACED = "misplaced"  # a valid block of another namespace or group
UNREADABLE = "unreadable"  # could not be opened or read (BlockCheck.error says why)
# (Another kind of entry at a block name - FIFO, directory, device - is CORRUPT: never a block.)


@dataclass(frozen=True)
class Fault:
    """One thing wrong with a block file."""

    kind: str  # TRUNCATED, OVERSIZED, CORRUPT, MIS_KEYED, MISPLACED or UNREADABLE
    detail: str


# chunk_states=False batches the checksums from this many inner chunks on: below it a block's
# records cost less than the batch's setup (a 1-chunk block: 27 against 33 us).
_BATCH_FROM_CHUNKS = 16


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
    """Everything :func:`check_file` found out about one shard file."""

    path: Path
    file_nbytes: int  # actual size (-1 when the file could not be opened)
    header: BlockHeader | None  # None when the fixed header does not decode
    # Block-level faults in the order checked: size, header, key, placement, geometry, index.
    faults: tuple[Fault, ...]
    chunks: tuple[ChunkCheck, ...]  # the checked inner chunks, in request order
    # Faults found after the checksums: non-zero padding, stored chunks that do not decode.
    content_faults: tuple[Fault, ...] = ()
    error: OSError | None = field(default=None, compare=False)  # why it could not be read
    # (st_dev, st_ino) of the file that was read (None when it could not be opened): a fix
    # acts on this file only, never on whatever holds the name by then.
    identity: FileId | None = field(default=None, compare=False)

    @property
    def problems(self) -> tuple[str, ...]:
        """Every block-level fault, as text (chunk states are in :attr:`chunks`)."""
        return tuple(f.detail for f in (*self.faults, *self.content_faults))

    @property
    def ok(self) -> bool:
        return not self.faults and not self.content_faults and all(c.state.ok for c in self.chunks)

    @property
    def bad_chunks(self) -> list[ChunkCheck]:
        return [c for c in self.chunks if not c.state.ok]

    @property
    def fault(self) -> Fault | None:
        """The verdict on the file: its first fault (block-level first, then the chunks'
        checksums, then padding and decoding), None when the block is intact."""
        if self.faults:
            return self.faults[0]
        bad = self.bad_chunks
        if bad:
            return Fault(
                CORRUPT,
                f"checksum mismatch in {len(bad)} of {len(self.chunks)} inner chunks "
                f"(first: chunk {bad[0].chunk})",
            )
        return self.content_faults[0] if self.content_faults else None

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


def check_file(  # noqa: PLR0912, PLR0913, PLR0915 - the one block check: every region of the file checked in file order, each step commented; keyword-only options
    path: str | Path,
    spec: ShardSpec,
    *,
    coords: tuple[int, int] | None = None,
    expect_hash: bytes | None = None,
    chunks: Sequence[int] | None = None,
    want_data: bool = False,
    chunk_states: bool = True,
) -> tuple[BlockCheck, np.ndarray | None]:
    """Check the block file at ``path`` of the array ``spec``; optionally return chunk bytes.

    ``coords``: the ``(hash_hi, hash_lo)`` its path says (a file found by listing);
    ``expect_hash``: the full hash a caller looked up. ``chunks``: the inner chunks whose
    states are reported (default all; every chunk's bytes are read either way, for the
    padding check). With ``want_data`` the second item holds the chunks' raw bytes back to
    back (uint8, ``len(chunks) * chunk_nbytes``; bytes past the end of a short file are zero;
    compressed chunks only where they verify and decode), else None.

    ``chunk_states=False`` (a verdict is all the caller wants: ``kvstore verify``): when every
    inner chunk's checksum matches its slot, :attr:`BlockCheck.chunks` is empty instead of one
    record per chunk and the checksums are computed in one batch (the per-chunk records were
    half the cost of a 256-chunk block); any other outcome is the full check's, record for
    record. :attr:`BlockCheck.fault` is the same either way (tested against every damage).

    Never raises for a damaged or unreadable file; ``ValueError`` for chunk numbers out of
    range (a caller error).
    """
    layout = spec.layout
    wanted = list(range(layout.num_chunks)) if chunks is None else list(chunks)
    if any(not 0 <= c < layout.num_chunks for c in wanted):
        raise ValueError(f"chunk numbers: expected 0..{layout.num_chunks - 1}, got {wanted}")
    data = np.zeros(len(wanted) * layout.chunk_nbytes, dtype=np.uint8) if want_data else None
    path = Path(path)
    _, high = spec.size_bounds
    try:
        st, raw = _read_bounded(str(path), high)
    except OSError as exc:
        reason = (
            "missing (no such file)"
            if isinstance(exc, FileNotFoundError)
            else describe_os_error(exc)
        )
        unread = tuple(_chunk(layout, c, ChunkState.TRUNCATED, None, None) for c in wanted)
        # Another kind of entry at a block name (FIFO, directory, ...) is never a block.
        kind = CORRUPT if isinstance(exc, EntryKindError) else UNREADABLE
        fault = Fault(kind, f"cannot open: {reason}")
        return BlockCheck(path, -1, None, (fault,), unread, error=exc), data
    size = st.st_size
    view = memoryview(raw)
    faults = _size_faults(spec, size)
    header: BlockHeader | None = None
    try:
        header = fmt.decode_header(view[: layout.header_nbytes])
    except CorruptBlockError as exc:
        faults.append(Fault(CORRUPT, f"header: {exc}"))
    if header is not None:
        faults += header_faults(header, spec, size, coords=coords, expect_hash=expect_hash)
    stored = _stored_chunks(spec, view, size, faults)
    slots: np.ndarray | None = None
    checksum: Checksum | None = None
    if header is not None and len(view) >= fmt.checksum_slot_offset(layout.num_chunks):
        slots = fmt.decode_checksums(view, layout.num_chunks)
        try:
            checksum = checksum_function(header.checksum_algo)
        except StoreFormatError as exc:
            faults.append(Fault(CORRUPT, str(exc)))
    late: list[Fault] = []
    states: list[ChunkCheck] = []
    size_c = layout.chunk_nbytes
    all_ok = (
        not chunk_states
        and layout.num_chunks >= _BATCH_FROM_CHUNKS
        and chunks is None
        and data is None
        and spec.codec is None
        and checksum is not None
        and slots is not None
        and header is not None
        and len(view) >= layout.chunk_offset(layout.num_chunks - 1) + size_c
        and _all_sums_match(header.checksum_algo, view, layout, slots)
    )
    for i, c in enumerate(() if all_ok else wanted):
        chunk_bytes = stored[c] if stored is not None else None
        if spec.codec is None and data is not None and chunk_bytes is not None:
            data[i * size_c : i * size_c + len(chunk_bytes)] = np.frombuffer(chunk_bytes, np.uint8)
        slot = int(slots[c]) if slots is not None else None
        if spec.codec is None and chunk_bytes is not None and len(chunk_bytes) < size_c:
            states.append(_chunk(layout, c, ChunkState.TRUNCATED, slot, None))
            continue
        if chunk_bytes is None or checksum is None or slot is None:
            states.append(_chunk(layout, c, ChunkState.UNVERIFIED, slot, None))
            continue
        computed = int(checksum(chunk_bytes))
        if slot == 0:
            state = ChunkState.UNWRITTEN
        else:
            state = ChunkState.OK if computed == slot else ChunkState.MISMATCH
        if state is ChunkState.OK and spec.codec is not None:
            out = data[i * size_c : (i + 1) * size_c].data if data is not None else None
            decoded = _decode_chunk(spec.codec, chunk_bytes, out, size_c)
            if decoded is not None:
                late.append(Fault(CORRUPT, f"inner chunk {c}: {decoded}"))
        states.append(_chunk(layout, c, state, slot, computed))
    if not _padding_is_zero(view, layout, compressed=spec.codec is not None):
        late.append(Fault(CORRUPT, "padding: expected zero bytes, got non-zero (bytes damaged)"))
    check = BlockCheck(
        path, size, header, tuple(faults), tuple(states), tuple(late), identity=file_id(st)
    )
    return check, data


def header_faults(
    header: BlockHeader,
    spec: ShardSpec,
    file_nbytes: int,
    *,
    coords: tuple[int, int] | None = None,
    expect_hash: bytes | None = None,
) -> list[Fault]:
    """Whether a decoded header belongs where its file was found: the key (``coords`` from
    the path, ``expect_hash`` from a lookup), namespace and group, flags and geometry."""
    faults: list[Fault] = []
    got = hash_coords(header.block_hash)
    if coords is not None and got != coords:
        faults.append(
            Fault(
                MIS_KEYED,
                f"mis-keyed block: the path says hash coordinates {coords[0]}/{coords[1]}, the "
                f"header hash {header.block_hash.hex()[:16]}... has {got[0]}/{got[1]}",
            )
        )
    if expect_hash is not None and header.block_hash != expect_hash:
        faults.append(
            Fault(
                MIS_KEYED,
                f"mis-keyed block: expected hash {expect_hash.hex()}, header has "
                f"{header.block_hash.hex()}",
            )
        )
    if header.namespace_digest != spec.namespace_digest or header.group != spec.group:
        faults.append(
            Fault(
                MISPLACED,
                f"foreign block: expected namespace {spec.namespace_digest.hex()[:12]} group "
                f"{spec.group}, header has {header.namespace_digest.hex()[:12]} group "
                f"{header.group}",
            )
        )
    try:  # the header's own key and place: what is left is flags and geometry
        fmt.check_header(
            header,
            spec.layout,
            header.namespace_digest,
            header.group,
            header.block_hash,
            compressed_file_nbytes=file_nbytes if spec.codec is not None else None,
        )
    except CorruptBlockError as exc:
        faults.append(Fault(CORRUPT, str(exc)))
    return faults


def read_header(path: str | Path) -> tuple[BlockHeader, int]:
    """The self-checked fixed header (magic, version, crc) of a block file and the file's size.

    One small read; never sets the file's mtime. :class:`CorruptBlockError` for a bad header
    and for anything but a regular file (a FIFO, a directory: never opened, never a block),
    ``OSError`` for I/O failures (FileNotFoundError when it vanished).
    """
    try:
        fd, st = DEFAULT_FILEIO.open_regular(str(path))
    except EntryKindError as exc:
        raise CorruptBlockError(str(exc)) from None
    try:
        raw = os.pread(fd, fmt.HEADER_FIXED_NBYTES, 0)
    finally:
        DEFAULT_FILEIO.close(fd)
    stall.beat()
    return fmt.decode_header(raw), st.st_size


def quick_check(
    path: str | Path, spec: ShardSpec, coords: tuple[int, int] | None = None
) -> tuple[BlockHeader | None, Fault | None]:
    """The header of ``path`` checked against where it was found, without reading a chunk.

    ``(header, None)`` or ``(None, first fault)``. Cheap (one small read): for scanning every
    block of a group (prefix trees, hash prefixes, eviction order).
    """
    try:
        header, size = read_header(path)
    except OSError as exc:
        return None, Fault(UNREADABLE, f"cannot read: {describe_os_error(exc)}")
    except CorruptBlockError as exc:
        return None, Fault(CORRUPT, f"header: {exc}")
    faults = header_faults(header, spec, size, coords=coords)
    return (None, faults[0]) if faults else (header, None)


def _read_bounded(path: str, limit: int) -> tuple[os.stat_result, bytearray]:
    """(the fstat of the file opened, its first ``min(size, limit)`` bytes) of a regular
    file; one read."""
    fd, st = DEFAULT_FILEIO.open_regular(path)
    try:
        buf = bytearray(min(st.st_size, limit))
        got = read_fully(DEFAULT_FILEIO, fd, [buf], 0)
    finally:
        DEFAULT_FILEIO.close(fd)
    stall.beat()
    return st, buf[:got] if got < len(buf) else buf


def _size_faults(spec: ShardSpec, size: int) -> list[Fault]:
    low, high = spec.size_bounds
    if low <= size <= high:
        return []
    kind = TRUNCATED if size < low else OVERSIZED
    if spec.codec is None:
        return [Fault(kind, f"file size: expected {low} bytes, got {size}")]
    return [Fault(kind, f"file size: expected {low}..{high} bytes (compressed), got {size}")]


def _stored_chunks(
    spec: ShardSpec, view: memoryview, size: int, faults: list[Fault]
) -> list[memoryview] | None:
    """The stored bytes of every inner chunk (raw: possibly short at the end of a short file;
    compressed: None unless the index is whole and valid); index faults appended."""
    layout = spec.layout
    if spec.codec is None:
        index = view[layout.data_end : layout.data_end + layout.index_nbytes]
        if len(index) == layout.index_nbytes and index != layout.index_bytes:
            faults.append(
                Fault(CORRUPT, "sharding index: expected the array's fixed index, got another")
            )
        return [
            view[layout.chunk_offset(c) : layout.chunk_offset(c) + layout.chunk_nbytes]
            for c in range(layout.num_chunks)
        ]
    if len(view) != size or size < layout.header_nbytes + layout.index_nbytes:
        return None  # oversized or tiny: where the index is cannot be trusted
    try:
        offsets = decode_index(view[size - layout.index_nbytes :], layout, size)
    except CorruptBlockError as exc:
        faults.append(Fault(CORRUPT, str(exc)))
        return None
    return [view[int(offsets[c]) : int(offsets[c + 1])] for c in range(layout.num_chunks)]


def _decode_chunk(
    codec: Codec, stored: memoryview, out: memoryview | None, nbytes: int
) -> CorruptBlockError | None:
    try:
        codec.decompress_into(stored, out if out is not None else memoryview(bytearray(nbytes)))
    except CorruptBlockError as exc:
        return exc
    return None


def _all_sums_match(algo_id: int, view: memoryview, layout: ShardLayout, slots: np.ndarray) -> bool:
    """Whether every inner chunk of a whole raw block has its slot's checksum (none empty):
    one batch over the chunks at their stride."""
    sums = strided_chunk_sums(
        algo_id,
        view,
        [layout.chunk_offset(0)],
        layout.chunk_stride,
        layout.num_chunks,
        layout.chunk_nbytes,
    )
    stored = np.asarray(slots, dtype=np.uint64)
    return bool(stored.all() and np.array_equal(sums, stored))


def _padding_is_zero(view: memoryview, layout: ShardLayout, *, compressed: bool) -> bool:
    """Bytes no reader looks at are zero, as written: the header's reserved u32 and its tail
    after the checksum slots, and (raw blocks) each chunk's stride padding."""
    raw = np.frombuffer(view, dtype=np.uint8)
    if raw[fmt.HEADER_FIXED_NBYTES - 4 : fmt.HEADER_FIXED_NBYTES].any():
        return False
    if raw[fmt.checksum_slot_offset(layout.num_chunks) : layout.header_nbytes].any():
        return False
    if compressed or layout.dense:
        return True
    first, stride, n = layout.chunk_offset(0), layout.chunk_stride, layout.num_chunks
    if len(raw) >= first + n * stride:
        # Whole: the chunks' stride padding as one 2-D view, checked at once.
        strided = raw[first : first + n * stride].reshape(n, stride)
        return not strided[:, layout.chunk_nbytes :].any()
    for c in range(n):
        start = layout.chunk_offset(c) + layout.chunk_nbytes
        if raw[start : layout.chunk_offset(c) + layout.chunk_stride].any():
            return False
    return True


def _chunk(
    layout: ShardLayout, chunk: int, state: ChunkState, stored: int | None, computed: int | None
) -> ChunkCheck:
    head, layer = divmod(chunk, layout.num_layers)
    return ChunkCheck(chunk, head, layer, state, stored, computed)

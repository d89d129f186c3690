"""Requests, results and counters of the page store API."""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

# Anything exposing the buffer protocol as C-contiguous bytes: bytes, bytearray, memoryview,
# numpy arrays (use ``tensor.numpy()`` or kvstore.layout helpers for torch CPU tensors).
Buffer = Any


class WriteStatus(enum.Enum):
    WRITTEN = "written"  # published by this call
    EXISTS = "exists"  # already present (content addressed: not rewritten)
    FAILED = "failed"  # not published; ``error`` says why; temporary files removed


class ReadStatus(enum.Enum):
    HIT = "hit"  # verified bytes are in the caller's buffer
    MISS = "miss"  # no such block
    CORRUPT = "corrupt"  # failed verification: quarantined, counts as a miss
    ERROR = "error"  # an I/O error: counts as a miss, the file is left alone

    @property
    def ok(self) -> bool:
        return self is ReadStatus.HIT


@dataclass(frozen=True, slots=True)
class BlockWrite:
    """Write one whole block.

    ``data`` is the canonical block (all inner chunks back to back: ShardLayout.block_nbytes),
    as one C-contiguous buffer, or as a strided host view of pieces: a ``numpy.ndarray`` whose
    last axis is contiguous and whose other strides are non-negative, read in C order (the
    block is ``np.ascontiguousarray(data)``'s bytes). Each maximal contiguous innermost run (a
    "piece") must hold a whole number of inner chunks; raw dense arrays then write the pieces
    from where they are (no gather copy: a piece is one file segment, its chunks checksummed
    in place), other arrays (compressed, padded) join them first. Anything else is refused
    with a :class:`~kvstore.errors.KvstoreError`. The memory must not change until the call
    returns.
    """

    block_hash: bytes
    data: Buffer  # the canonical block, contiguous or as strided pieces (see above)
    parent_hash: bytes | None = None  # hash of the previous block of the chain, None for the first


@dataclass(frozen=True, slots=True)
class BlockRead:
    """Read a block, or only some of its inner chunks, into a caller-given buffer.

    ``out`` is writable memory that receives the chunks back to back, in ``chunks`` order: one
    C-contiguous buffer (or uint8-viewable tensor), or, for a whole block of a raw dense array
    (unpadded, uncompressed), a strided host view of pieces, the mirror of
    :class:`BlockWrite`'s: a ``numpy.ndarray`` whose last axis is contiguous, whose other
    strides are non-negative and whose maximal contiguous runs hold whole inner chunks; the
    block then lands in C order (``np.ascontiguousarray(out)`` is the block), read where the
    pieces lie (one ``preadv``) and every chunk verified there. A failed read (a miss) may
    leave a strided ``out`` partly written. A strided view anywhere else is refused with a
    ``ValueError`` naming what is expected; bad pieces with a
    :class:`~kvstore.errors.KvstoreError`.
    """

    block_hash: bytes
    out: Buffer  # writable: contiguous, or a strided view of a whole raw dense block
    chunks: Sequence[int] | None = None  # inner chunk numbers (ShardLayout.chunks_of); None = all


@dataclass(frozen=True, slots=True)
class WriteResult:
    status: WriteStatus
    error: str = ""


@dataclass(frozen=True, slots=True)
class ReadResult:
    status: ReadStatus
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status is ReadStatus.HIT


@dataclass(frozen=True)
class PendingBlock:
    """A block being written by one or more writers (docs/design.md §5); small and picklable.

    Created once by :meth:`GroupStore.begin_blocks` (no I/O) and handed to every writer; all of
    them fill the same temporary file at fixed offsets, and one party commits it.
    """

    namespace: str  # namespace directory name
    group: int  # array index
    block_hash: bytes
    parent_hash: bytes | None
    token: str  # names the temporary file; unique per attempt
    created_ns: int  # written into the header by every writer, so their headers are identical
    checksum_algo: int


@dataclass(frozen=True, slots=True)
class ChunkWrite:
    """One writer's whole inner chunks of a pending block."""

    pending: PendingBlock
    chunks: Sequence[int]  # inner chunk numbers, in the order their bytes appear in ``data``
    data: Buffer  # len(chunks) * chunk_nbytes bytes


@dataclass(frozen=True, slots=True)
class RangeWrite:
    """One writer's byte ranges of a pending block, inside inner chunks (DCP/PCP token splits).

    Chunks touched this way get their checksum at commit (``checksum_chunks``).
    """

    pending: PendingBlock
    ranges: Sequence[tuple[int, Buffer]]  # (offset in the canonical block, bytes); within a chunk
    writer_slot: int = 0  # this writer's number among the block's range writers (see commit)


@dataclass
class StoreStats:
    """Counters of one open store (all groups); thread-safe increments."""

    blocks_written: int = 0
    blocks_existing: int = 0
    write_failures: int = 0
    bytes_written: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    read_errors: int = 0
    bytes_read: int = 0
    lookups: int = 0
    probes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")
            }

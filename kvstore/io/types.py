"""The types of the engine contract, shared by :mod:`kvstore.io.engine` and the engines.

They live apart from any engine so that the contract imports no implementation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Segment = tuple[int, memoryview]  # (file offset, host bytes)


@dataclass(frozen=True)
class DirectIOProbe:
    """Outcome of the O_DIRECT probe of a store directory."""

    enabled: bool
    reason: str


@dataclass(frozen=True)
class EngineCapabilities:
    """What an I/O engine does beyond the base contract (:mod:`kvstore.io.engine`)."""

    hashed_io: bool = False  # read_file_hashed / write_new_file_hashed of host segments
    batches: bool = False  # map_batches: one call per I/O thread over a batch
    device_segments: bool = False  # device tensors in segments (the DeviceEngine contract)


@dataclass(frozen=True, slots=True)
class Hashing:
    """Checksums of whole chunks computed as a file's bytes pass through memory
    (:meth:`FileIO.write_new_hashed <kvstore.io.fileio.FileIO.write_new_hashed>`,
    :meth:`FileIO.read_regular_hashed <kvstore.io.fileio.FileIO.read_regular_hashed>`).

    Segments ``[first, last)`` of the call, each a whole number of ``chunk_nbytes`` chunks,
    are moved in groups of at most ``group_nbytes`` (file-contiguous whole chunks; at least
    one chunk, however large), each
    group hashed with checksum algorithm ``algo`` just before its write or just after its
    read, while it is in the CPU cache; ``sums`` (uint64, one per chunk of those segments, in
    order) receives the values.
    """

    first: int
    last: int
    algo: int
    chunk_nbytes: int
    group_nbytes: int
    sums: np.ndarray


@dataclass(frozen=True, slots=True)
class PiecePlan:
    """What every block of a :meth:`FileIO.publish_pieces
    <kvstore.io.fileio.FileIO.publish_pieces>` batch shares: a raw dense block file of
    ``file_nbytes`` bytes is its header, then its ``starts.size`` pieces of ``piece_nbytes``
    bytes back to back (piece ``k`` lies at ``starts[k]`` of the block's span, a whole number
    of ``chunk_nbytes`` chunks), then ``index`` at ``index_offset``. The span's chunk ``s``
    (front to back) is the block's chunk ``slot_of[s]``: its xxh3 goes into that uint64 slot
    of the header, at ``slots_offset``. ``alignment``: what O_DIRECT needs of addresses and
    lengths."""

    file_nbytes: int
    piece_nbytes: int
    starts: np.ndarray  # int64
    slot_of: np.ndarray  # int64, a permutation
    chunk_nbytes: int
    slots_offset: int
    index: memoryview
    index_offset: int
    alignment: int


# One block of a publish_pieces batch: temporary name, final name, header (fixed part
# packed; its slots are filled by the call), span of the block's pieces.
PieceBlock = tuple[str, str, memoryview, memoryview]
# publish_pieces' outcome of a block: published, or a regular file had the name already.
PUBLISHED = 1
ALREADY_THERE = 0
# read_pieces' outcome of a block read whole whose every chunk matches its checksum slot.
VERIFIED = 1

"""How one group array's blocks are read and written: chosen once, when the array opens.

A block can move along several paths, each fastest for some blocks and buffers (one native call
per I/O thread for a batch, checksums computed while the bytes are in the CPU cache, ...).
Which of them an array may take depends only on what is fixed for the store's life: the
array's layout and codec, its checksum algorithm, whether reads are verified, the store's
durability and O_DIRECT outcome, and the capabilities its engine declares
(:class:`~kvstore.io.types.EngineCapabilities`) - never the engine's type. :func:`plan_array`
decides once; the reader (:mod:`kvstore.store.read`) and the publisher
(:mod:`kvstore.store.publish`) build their strategies from the plan and never ask again.
What each request then takes depends only on its buffer (host memory, strided rows, a device
tensor) and whether it asks for chunks.
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass

from kvstore.checksum import XXH3_64
from kvstore.io.engine import Engine
from kvstore.store.format import ShardLayout

# Whole blocks of at least twice this many bytes are read and checksummed in pieces of about
# this size (whole chunks): well inside a core's L2 (1 MiB on the measured VM), large enough
# that the extra preadv per piece costs nothing measurable; 256 KiB and 512 KiB pieces measured
# alike, 64 KiB and whole-block-then-hash slower (docs/notes/tmpfs-rounds.md).
READ_PIECE_NBYTES = 512 << 10
# Raw dense blocks of at least this many bytes in host memory are checksummed group by group
# as they are written, in groups of WRITE_GROUP_NBYTES: hashing a whole block and then writing
# it reads a block larger than the CPU cache from memory twice; below it, one vectored write.
HASHED_WRITE_MIN_NBYTES = 1 << 20
WRITE_GROUP_NBYTES = 256 << 10

_LITTLE_ENDIAN = sys.byteorder == "little"  # checksum slots are u64 little endian


class WholeRead(enum.Enum):
    """How a whole block is read into host memory in one buffer."""

    SMALL = "small"  # raw dense: header and data in one preadv, then one checking call
    HASHED = "hashed"  # raw dense and large: read and checksummed piece by piece
    GENERAL = "general"  # padded or compressed: the general read (chunk runs, codec)


@dataclass(frozen=True)
class ReadPlan:
    """The read paths of one array."""

    whole: WholeRead
    piece_nbytes: int  # HASHED: bytes read and checksummed at a time (whole chunks)
    direct: bool  # O_DIRECT reads of aligned requests (config direct_reads, where it works)
    touches: bool  # a read refreshes the mtime of a block older than the access granularity
    # Batches of whole blocks into pieces of one geometry (the vLLM tier's rows) are read and
    # verified in one native call per I/O thread; ``batch_buffers``: so are batches of whole
    # blocks in one buffer each (small blocks read buffered).
    batch: bool
    batch_buffers: bool


@dataclass(frozen=True)
class WritePlan:
    """The write paths of one array."""

    # Large raw dense blocks of host memory are checksummed group by group as they are written,
    # in groups of ``group_nbytes``.
    hashed: bool
    group_nbytes: int
    # Batches of whole blocks given as pieces are written and named in one native call per I/O
    # thread (stores without durability); ``batch_buffers``: so are batches of small blocks
    # in one buffer each (larger ones are hashed as written, which keeps them in the cache).
    batch: bool
    batch_buffers: bool


@dataclass(frozen=True)
class ArrayPlan:
    """The read and write paths of one array (see the module docstring)."""

    reads: ReadPlan
    writes: WritePlan

    def describe(self) -> str:
        """One line: which paths this array takes."""
        r, w = self.reads, self.writes
        return (
            f"reads: whole blocks {r.whole.value}, native batches "
            f"{_batches(r.batch, r.batch_buffers)}{', O_DIRECT' if r.direct else ''}; writes: "
            f"{'hashed as written' if w.hashed else 'hashed first'}, native batches "
            f"{_batches(w.batch, w.batch_buffers)}"
        )


def _batches(rows: bool, buffers: bool) -> str:
    if not rows:
        return "off"
    return "rows and buffers" if buffers else "rows"


def plan_array(  # noqa: PLR0913 - what fixes an array's paths, each named
    layout: ShardLayout,
    engine: Engine,
    *,
    compressed: bool,
    checksum_algo: int,
    verify_reads: bool,
    read_only: bool,
) -> ArrayPlan:
    """The paths of an array of ``layout`` on ``engine`` (see the module docstring)."""
    caps = engine.capabilities
    config = engine.config
    raw_dense = layout.dense and not compressed
    xxh3 = checksum_algo == XXH3_64 and _LITTLE_ENDIAN  # what the native batches compute
    native_batches = caps.batches and engine.fio.native_piece_batches
    direct = config.direct_reads and engine.direct.enabled
    # Piece by piece: needs verification on (there is nothing to hash otherwise) and buffered
    # reads (O_DIRECT bytes arrive by DMA, not through the CPU cache, and one large request
    # keeps the device busier than a row of small ones issued one after another).
    hashed_reads = (
        raw_dense
        and caps.hashed_io
        and verify_reads
        and not direct
        and layout.block_nbytes >= 2 * READ_PIECE_NBYTES
    )
    if hashed_reads:
        whole = WholeRead.HASHED
    elif raw_dense:
        whole = WholeRead.SMALL
    else:
        whole = WholeRead.GENERAL
    batch_reads = raw_dense and verify_reads and xxh3 and native_batches
    reads = ReadPlan(
        whole=whole,
        piece_nbytes=READ_PIECE_NBYTES,
        direct=direct,
        touches=bool(config.access_granularity_s) and not read_only,
        batch=batch_reads,
        batch_buffers=batch_reads and whole is WholeRead.SMALL and not direct,
    )
    batch_writes = raw_dense and xxh3 and native_batches and not config.durable
    writes = WritePlan(
        hashed=raw_dense
        and caps.hashed_io
        and xxh3
        and layout.block_nbytes >= HASHED_WRITE_MIN_NBYTES,
        group_nbytes=WRITE_GROUP_NBYTES,
        batch=batch_writes,
        batch_buffers=batch_writes and layout.block_nbytes < HASHED_WRITE_MIN_NBYTES,
    )
    return ArrayPlan(reads, writes)

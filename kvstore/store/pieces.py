"""A block given as strided pieces of host memory: where each piece lies, computed once per shape.

A caller may hand a whole block as a non-contiguous ``numpy.ndarray`` whose C-order bytes are
the canonical block (:class:`~kvstore.store.types.BlockWrite` and
:class:`~kvstore.store.types.BlockRead`): the vLLM tier's view of a CPU-tier row, for one. Its
maximal contiguous innermost runs ("pieces") then go to the file as one segment each, written
from (or read into) where they lie, their chunks checksummed in place.

Where the pieces lie relative to the view's first byte depends only on the view's shape,
strides and item size, which repeat for every block of an array: :func:`piece_geometry`
computes them once per geometry (cached), so a block costs a cache lookup, one span over its
memory and its segment list (:meth:`BlockPieces.segments`), not a numpy computation.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from kvstore.checksum import chunk_sums, strided_chunk_sums
from kvstore.errors import KvstoreError
from kvstore.io.align import ALIGN
from kvstore.io.types import PiecePlan, Segment
from kvstore.store import format as fmt


@dataclass(frozen=True, eq=False)
class PieceGeometry:
    """Where the pieces of one view geometry lie: piece ``k`` is bytes
    ``[starts[k], starts[k] + piece_nbytes)`` from the view's first byte (``slices[k]``); the
    pieces come in ``run``s whose starts advance by ``run_stride`` (the innermost strided
    axis); ``extent`` bytes span them all."""

    piece_nbytes: int
    starts: tuple[int, ...]
    run: int
    run_stride: int
    extent: int
    slices: tuple[slice, ...]
    run_starts: tuple[int, ...]  # starts[::run]: the first piece of each run
    # Where the pieces tile the span exactly in whole chunks of the geometry's chunk size
    # (a permutation of the span's chunks: the vLLM tier's rows): ``chunk_order[k]`` is the
    # span's chunk that is the block's chunk ``k``. None: pieces with gaps or of odd sizes.
    chunk_order: np.ndarray | None = field(default=None, repr=False)
    chunk_nbytes: int = 0  # the chunk size chunk_order counts in
    # The inverse of chunk_order (the span's chunk ``s`` is the block's chunk ``slot_of[s]``)
    # and the starts as int64: what a native batch write takes (FileIO.publish_pieces).
    slot_of: np.ndarray | None = field(default=None, repr=False)
    starts_array: np.ndarray | None = field(default=None, repr=False)
    # File offsets of the pieces per data offset (one array's blocks share one): computed once.
    _offsets: dict[int, tuple[int, ...]] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def file_offsets(self, data_offset: int) -> tuple[int, ...]:
        """Where each piece goes in a file whose canonical block starts at ``data_offset``
        (pieces back to back, in order)."""
        offsets = self._offsets.get(data_offset)
        if offsets is None:
            size = self.piece_nbytes
            offsets = tuple(data_offset + k * size for k in range(len(self.starts)))
            with self._lock:
                self._offsets[data_offset] = offsets
        return offsets


@dataclass(frozen=True, slots=True)
class BlockPieces:
    """One block's pieces: its :class:`PieceGeometry` and the bytes from its first piece's
    first byte to its last piece's end (``span``, memory of the caller's view)."""

    geometry: PieceGeometry
    span: memoryview

    @property
    def piece_nbytes(self) -> int:
        return self.geometry.piece_nbytes

    @property
    def starts(self) -> tuple[int, ...]:
        return self.geometry.starts

    @property
    def run(self) -> int:
        return self.geometry.run

    @property
    def run_stride(self) -> int:
        return self.geometry.run_stride

    def chunk_sums(self, algo: int, chunk_nbytes: int) -> np.ndarray:
        """The checksums of the block's inner chunks of ``chunk_nbytes`` bytes, in block
        order, computed where the pieces lie.

        Where the pieces tile their span in whole chunks (:attr:`PieceGeometry.chunk_order`),
        the span is hashed front to back in one call (:func:`~kvstore.checksum.chunk_sums`)
        and the sums are put in block order: a sequential pass over memory, which the
        hardware prefetcher follows, is 2-2.5x cheaper than hashing the same chunks at the
        pieces' stride (llama-3.1-8b 16-token block, 256 chunks of 8 KiB at a 64 KiB stride:
        126 vs 288 us cold, 79 vs 208 us from the cache). Otherwise one native call per run
        of chunks at a constant stride (:func:`~kvstore.checksum.strided_chunk_sums`)."""
        geometry = self.geometry
        order = geometry.chunk_order
        if order is not None and chunk_nbytes == geometry.chunk_nbytes:
            sums: np.ndarray = chunk_sums(algo, self.span, chunk_nbytes, len(order))[order]
            return sums
        size = geometry.piece_nbytes
        if size == chunk_nbytes and geometry.run > 1 and geometry.run_stride >= size:
            # chunks of a run at a constant stride (the native batch takes no stride below a
            # chunk: a stride-0 axis, the same piece repeated, is hashed piece by piece)
            return strided_chunk_sums(
                algo,
                self.span,
                geometry.run_starts,
                geometry.run_stride,
                geometry.run,
                chunk_nbytes,
            )
        return strided_chunk_sums(
            algo, self.span, geometry.starts, chunk_nbytes, size // chunk_nbytes, chunk_nbytes
        )

    def segments(self, data_offset: int) -> list[Segment]:
        """The pieces as file segments, in file order, for a block whose canonical bytes start
        at ``data_offset`` in its file: memory of the caller's view, no copy."""
        geometry = self.geometry
        pieces = map(self.span.__getitem__, geometry.slices)
        return list(zip(geometry.file_offsets(data_offset), pieces, strict=True))


def block_pieces(data: object, block_nbytes: int, chunk_nbytes: int) -> BlockPieces | None:
    """The pieces of a non-contiguous ``numpy.ndarray`` block; None for anything else (one
    buffer: the caller's usual path). :class:`KvstoreError` when they cannot make a block of
    ``block_nbytes`` bytes of whole ``chunk_nbytes`` chunks (never a wrong block)."""
    if not isinstance(data, np.ndarray) or data.flags.c_contiguous:
        return None
    geometry = piece_geometry(data.shape, data.strides, data.dtype, block_nbytes, chunk_nbytes)
    try:
        flat = data.view(np.uint8)  # the last axis is contiguous, so bytes are a view
    except (TypeError, ValueError) as exc:
        raise KvstoreError(
            f"block data as strided pieces ({data.dtype} {data.shape}, strides "
            f"{data.strides}): expected plain bytes ({exc})"
        ) from None
    span = as_strided(flat, shape=(geometry.extent,), strides=(1,), writeable=data.flags.writeable)
    return BlockPieces(geometry, span.data)


@lru_cache(maxsize=64)
def piece_geometry(
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: np.dtype[Any],
    block_nbytes: int,
    chunk_nbytes: int,
) -> PieceGeometry:
    """The pieces of a non-contiguous view of this geometry (see :func:`block_pieces`);
    :class:`KvstoreError` naming what is wrong (an error is not cached)."""
    what = f"block data as strided pieces ({dtype} {shape}, strides {strides})"
    itemsize = dtype.itemsize
    if not shape or strides[-1] != itemsize or min(strides) < 0:
        raise KvstoreError(f"{what}: expected a contiguous last axis and non-negative strides")
    nbytes = itemsize * int(np.prod(shape, dtype=np.int64))
    if nbytes != block_nbytes:
        raise KvstoreError(f"{what}: expected {block_nbytes} bytes, got {nbytes}")
    outer = list(shape[:-1])
    outer_strides = list(strides[:-1])
    piece = shape[-1] * itemsize
    while outer and (outer[-1] == 1 or outer_strides[-1] == piece):  # merge contiguous axes
        piece *= outer.pop()
        outer_strides.pop()
    if piece % chunk_nbytes:
        raise KvstoreError(
            f"{what}: expected pieces of whole {chunk_nbytes}-byte chunks, got {piece}-byte pieces"
        )
    starts = np.zeros(1, dtype=np.int64)
    for n, stride in zip(outer, outer_strides, strict=True):
        starts = (starts[:, None] + np.arange(n, dtype=np.int64) * stride).reshape(-1)
    as_list = tuple(int(s) for s in starts.tolist())
    run = outer[-1] if outer else 1
    extent = max(as_list) + piece
    order = _chunk_order(starts, piece, extent, chunk_nbytes)
    slot_of = None
    if order is not None:
        slot_of = np.empty_like(order)
        slot_of[order] = np.arange(order.size)
        slot_of.flags.writeable = False
    starts.flags.writeable = False
    return PieceGeometry(
        piece_nbytes=piece,
        starts=as_list,
        run=run,
        run_stride=outer_strides[-1] if outer else 0,
        extent=extent,
        slices=tuple(slice(s, s + piece) for s in as_list),
        run_starts=as_list[::run],
        chunk_order=order,
        chunk_nbytes=chunk_nbytes,
        slot_of=slot_of,
        starts_array=starts,
    )


def _chunk_order(
    starts: np.ndarray, piece_nbytes: int, extent: int, chunk_nbytes: int
) -> np.ndarray | None:
    """For pieces at ``starts`` (block order) that tile ``[0, extent)`` in whole chunks: the
    span's chunk index of each of the block's chunks (a permutation); None otherwise (gaps,
    overlaps, or pieces not whole chunks on chunk boundaries), and the sums are taken where
    pieces lie."""
    if (
        piece_nbytes % chunk_nbytes
        or extent != starts.size * piece_nbytes
        or (starts % chunk_nbytes).any()
    ):
        return None
    per_piece = piece_nbytes // chunk_nbytes
    order: np.ndarray = (starts[:, None] // chunk_nbytes + np.arange(per_piece)).reshape(-1)
    if not np.array_equal(np.sort(order), np.arange(order.size)):
        return None
    order.flags.writeable = False  # shared by every block of the geometry
    return order


class PlanCache:
    """One array's :class:`~kvstore.io.types.PiecePlan` per piece geometry, built once.

    Keyed by the geometry object, which each entry keeps alive: :func:`piece_geometry`'s
    cache may drop a geometry, and a new one could then be allocated at its address (a key
    of ``id`` alone would hand it the old geometry's plan: pieces written from the wrong
    places). At most :attr:`LIMIT` entries (a caller cycling through shapes starts over)."""

    LIMIT = 64

    def __init__(self, file_nbytes: int, index: memoryview, index_offset: int) -> None:
        self._file_nbytes = file_nbytes
        self._index = index
        self._index_offset = index_offset
        self._plans: dict[int, tuple[PieceGeometry, PiecePlan]] = {}

    def plan(self, geometry: PieceGeometry) -> PiecePlan:
        entry = self._plans.get(id(geometry))
        if entry is not None and entry[0] is geometry:
            return entry[1]
        plan = piece_plan(geometry, self._file_nbytes, self._index, self._index_offset)
        if len(self._plans) >= self.LIMIT:
            self._plans = {}  # replaced, not cleared: other threads may be reading it
        self._plans[id(geometry)] = (geometry, plan)
        return plan


def piece_plan(
    geometry: PieceGeometry, file_nbytes: int, index: memoryview, index_offset: int
) -> PiecePlan:
    """The :class:`~kvstore.io.types.PiecePlan` of a raw dense array's blocks given as pieces
    of ``geometry`` (one whose pieces tile their span: ``slot_of`` set), for files of
    ``file_nbytes`` bytes whose index (``index``; empty for reads) lies at ``index_offset``."""
    if geometry.slot_of is None or geometry.starts_array is None:
        raise ValueError("piece plan: expected pieces that tile their span in whole chunks")
    return PiecePlan(
        file_nbytes=file_nbytes,
        piece_nbytes=geometry.piece_nbytes,
        starts=geometry.starts_array,
        slot_of=geometry.slot_of,
        chunk_nbytes=geometry.chunk_nbytes,
        slots_offset=fmt.HEADER_FIXED_NBYTES,
        index=index,
        index_offset=index_offset,
        alignment=ALIGN,
    )


@lru_cache(maxsize=16)
def whole_geometry(block_nbytes: int, chunk_nbytes: int) -> PieceGeometry:
    """A block given as one contiguous buffer, as the geometry of a single piece (so one
    native batch call takes it: :func:`piece_plan`)."""
    if block_nbytes <= 0 or block_nbytes % chunk_nbytes:
        raise KvstoreError(
            f"whole block: expected whole {chunk_nbytes}-byte chunks, got {block_nbytes} bytes"
        )
    starts = np.zeros(1, dtype=np.int64)
    starts.flags.writeable = False
    order = np.arange(block_nbytes // chunk_nbytes, dtype=np.int64)
    order.flags.writeable = False
    return PieceGeometry(
        piece_nbytes=block_nbytes,
        starts=(0,),
        run=1,
        run_stride=0,
        extent=block_nbytes,
        slices=(slice(0, block_nbytes),),
        run_starts=(0,),
        chunk_order=order,
        chunk_nbytes=chunk_nbytes,
        slot_of=order,
        starts_array=starts,
    )


def batch_spans(
    buffers: Sequence[object], block_nbytes: int, chunk_nbytes: int, *, whole: bool, writable: bool
) -> tuple[PieceGeometry, list[memoryview]] | None:
    """The geometry and the spans of a batch of blocks that one native call can take
    (:func:`piece_plan`): every block pieces of one geometry that tiles its span in whole
    chunks (a strided numpy view) or, with ``whole``, one contiguous host buffer of exactly
    ``block_nbytes`` bytes (``writable``: reads). None for any other batch: the caller takes
    its blocks one by one, and reports what is wrong with each."""
    geometry: PieceGeometry | None = None
    spans: list[memoryview] = []
    for data in buffers:
        span = contiguous_span(data, block_nbytes, writable) if whole else None
        if span is not None:
            kind = whole_geometry(block_nbytes, chunk_nbytes)
        else:
            pieces = _strided_pieces(data, block_nbytes, chunk_nbytes, writable)
            if pieces is None:
                return None
            kind, span = pieces.geometry, pieces.span
        if geometry is not None and kind is not geometry:
            return None
        geometry = kind
        spans.append(span)
    if geometry is None or geometry.slot_of is None or geometry.chunk_nbytes != chunk_nbytes:
        return None
    return geometry, spans


def _strided_pieces(
    data: object, block_nbytes: int, chunk_nbytes: int, writable: bool
) -> BlockPieces | None:
    if type(data) is not np.ndarray or data.flags.c_contiguous:
        return None
    if writable and not data.flags.writeable:
        return None
    try:
        return block_pieces(data, block_nbytes, chunk_nbytes)
    except KvstoreError:
        return None


def contiguous_span(data: object, nbytes: int, writable: bool) -> memoryview | None:
    """``data``'s bytes when it is host memory (a C-contiguous numpy array or a memoryview)
    of exactly ``nbytes`` bytes (writable if asked); None for anything else."""
    if type(data) is np.ndarray:
        if not data.flags.c_contiguous or (writable and not data.flags.writeable):
            return None
        return data.reshape(-1).view(np.uint8).data if data.nbytes == nbytes else None
    if type(data) is memoryview and data.c_contiguous and data.nbytes == nbytes:
        if writable and data.readonly:
            return None
        return data.cast("B") if data.format != "B" or data.ndim != 1 else data
    return None

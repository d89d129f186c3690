"""Mapping records: what :func:`~kvstore.layout.parallel.map_rank` derives for one rank.

:class:`CopyRun` is a strided byte correspondence between local pages and the canonical
block, :class:`ShareSegment` places a piece of the rank's share in an inner chunk, and
:class:`RankMapping` is everything one rank needs to move one group's blocks between its pages
and the store (runs, segments and its writer election). See the staging contract in
:mod:`kvstore.layout.parallel`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvstore.layout.geometry import GroupGeometry, LocalForm
from kvstore.layout.parallel_layout import ParallelLayout, RankCoord

__all__ = [
    "CopyRun",
    "RankMapping",
    "ShareSegment",
]


@dataclass(frozen=True)
class CopyRun:
    """A strided byte correspondence between local pages and the canonical block.

    For k in range(count): local bytes ``[local_offset + k*local_stride, +size)`` of local
    region ``local_region`` correspond to canonical bytes
    ``[canonical_offset + k*canonical_stride, +size)``. Region = local layer index for
    per-layer tensors (offsets within that layer's page), 0 for a packed row (offsets within
    the row, ``group_offset`` included). Strides are 0 when count == 1 and may be negative.
    The same run serves both directions (gather = local to canonical, scatter = reverse).
    """

    local_region: int
    local_offset: int
    canonical_offset: int
    size: int
    count: int = 1
    local_stride: int = 0
    canonical_stride: int = 0

    def fragments(self) -> Iterator[tuple[int, int, int]]:
        """``(local_offset, canonical_offset, size)`` of each fragment."""
        for k in range(self.count):
            yield (
                self.local_offset + k * self.local_stride,
                self.canonical_offset + k * self.canonical_stride,
                self.size,
            )

    @property
    def total_bytes(self) -> int:
        return self.size * self.count


@dataclass(frozen=True)
class ShareSegment:
    """``share[share_offset:+size]`` is canonical inner chunk ``chunk`` at ``chunk_offset``."""

    chunk: int  # inner chunk index (h*L + l; MLA: l)
    chunk_offset: int  # byte offset within the inner chunk
    size: int
    share_offset: int  # byte offset within the rank's share buffer
    canonical_offset: int  # = chunk * inner_chunk_bytes + chunk_offset


@dataclass(frozen=True, eq=False)
class RankMapping:
    """Everything one rank needs to move one group's blocks between its pages and the store.

    Invariants (checked for all ranks together by :func:`check_tiling`): ``runs`` cover the
    rank's local pages exactly once; ``segments`` cover the share exactly once, in canonical
    order; over any block key, the elected writers' runs tile the canonical block exactly once.
    """

    geometry: GroupGeometry
    layout: ParallelLayout
    form: LocalForm
    rank: RankCoord
    local_layers: tuple[int, ...]  # positions in geometry.layer_ids held here, in local order
    heads: tuple[int, ...]  # global KV heads held here (consecutive); (0,) for MLA
    local_block_size: int  # bs: token slots per local block
    page_bytes: int  # bytes of one local layer's page of one block
    runs: tuple[CopyRun, ...]
    segments: tuple[ShareSegment, ...]
    num_writers: int  # ranks holding exactly these bytes (this one included)
    writer_index: int  # this rank's position among them
    full_chunks: tuple[int, ...]  # inner chunks whose every byte is in this rank's share
    partial_chunks: tuple[int, ...]  # inner chunks this rank holds only some bytes of

    @property
    def share_bytes(self) -> int:
        """Bytes this rank writes (when elected) and reads per block."""
        return len(self.local_layers) * self.page_bytes

    @property
    def num_regions(self) -> int:
        """How many local tensors the rank passes: local layers, or 1 packed backing tensor."""
        return len(self.local_layers) if self.form.packing == "per_layer" else 1

    def is_writer(self, block_key: int) -> bool:
        """Whether this rank writes the block with rank-consistent key ``block_key``."""
        return block_key % self.num_writers == self.writer_index

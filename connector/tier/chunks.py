"""Where each byte of a primary-tier chunk lives in a stored block, and moving bytes between them.

vLLM's CPU primary tier keeps one row of ``row_bytes`` per chunk in shared memory
(``SharedOffloadRegion``); the secondary tier sees the rows as ``primary_kv_view`` and holds
no other description of them. What a row holds depends on the engine's settings
(vllm/v1/kv_offload/cpu/shared_offload_region.py and tiering/spec.py, vLLM 0.33):

* direct layout (the default): one cell of ``cpu_page_size_per_worker`` bytes per worker,
  worker ``r`` at ``r * cell``; a cell holds that worker's pages of the chunk's KV-cache group
  back to back, one per layer (layer-outer layouts: one page per canonical tensor, and a
  group's layers are the tensors in order; packed layouts: the block row itself). That is
  :mod:`kvstore.layout`'s ``packed`` local form at offset 0, in the page family (HND / NHD) of
  the engine's KV-cache layout, for every rank of the engine's parallel layout;
* ``replicated_layout`` (MLA over TP ranks in one process group): one cell at offset 0 holding
  the latent every rank holds alike: the same form for a single rank;
* ``canonical_layout``: vLLM's canonical pages back to back, one per layer; vLLM's canonical
  page of a layer is ``[H_total][T][K|V]`` (HND), ``[T][H_total][K|V]`` (NHD) or ``[T][latent]``
  (MLA), which is exactly the page of a TP=1 rank: the same form for a single rank of a
  TP=1 layout.

So one :class:`ChunkMap` covers all three: per stored group array, the cells (rank mappings
from :func:`kvstore.layout.verify_tiling`, each with its cell's offset in the row). A store
assembles each canonical block from the cells of the ranks elected to write it (writer index 0:
together they tile the block exactly once); a load scatters the canonical block into every
rank's cell (replicas included, each worker reads its own). The mapping, not this module,
knows TP/DCP/PCP.

One stored block is one chunk, so vLLM's ``blocks_per_chunk`` must be 1 (checked with the
identity by :func:`connector.identity.derive_identity`). Anything else that cannot be mapped is
refused at startup by :func:`build_chunk_map` with a :class:`kvstore.ConfigError` naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from connector.facts import EngineFacts
from connector.rank import family_of
from kvstore import ConfigError, Identity, LayoutError
from kvstore.layout import LocalForm, ParallelLayout, RankMapping, verify_tiling
from kvstore.layout.page import gather_blocks, scatter_blocks
from kvstore.layout.parallel import Family
from kvstore.rank_io import group_geometry


@dataclass(frozen=True)
class ChunkGeometry:
    """What vLLM's offloading spec says about the primary tier's rows."""

    row_bytes: int  # bytes per chunk row (primary_kv_view.strides[0])
    cell_bytes: int  # cpu_page_size_per_worker: one worker's cell in the direct layout
    world_size: int  # workers of the engine
    canonical_layout: bool  # vLLM's canonical pages instead of per-worker cells
    replicated_layout: bool  # one cell shared by every worker (MLA over TP)
    blocks_per_chunk: int


@dataclass(frozen=True)
class _Cell:
    """One rank's cell in a row: its mapping, and where the cell starts."""

    mapping: RankMapping
    offset: int


@dataclass(frozen=True)
class GroupChunks:
    """How the chunks of one stored group array sit in the primary rows."""

    block_bytes: int  # canonical block size of the array
    cells: tuple[_Cell, ...]  # every rank's cell (loads fill all)
    sources: tuple[_Cell, ...]  # the cells that together hold every byte once (stores read)


class ChunkMap:
    """Moves chunks between the primary rows and canonical blocks, per stored group array."""

    def __init__(self, rows: torch.Tensor, groups: Sequence[GroupChunks]) -> None:
        self._rows = rows  # (num_chunks, row_bytes) uint8 over the shared region
        self.groups = tuple(groups)
        self._cells = {
            (g, c.offset): rows[:, c.offset :]
            for g, group in enumerate(groups)
            for c in group.cells
        }

    def to_blocks(self, array: int, chunk_ids: Sequence[int]) -> torch.Tensor:
        """The canonical blocks of ``chunk_ids`` (rows of group array ``array``), as a new
        ``(len(chunk_ids), block_bytes)`` uint8 tensor."""
        group = self.groups[array]
        out = torch.empty((len(chunk_ids), group.block_bytes), dtype=torch.uint8)
        for cell in group.sources:
            gather_blocks(cell.mapping, [self._cells[(array, cell.offset)]], chunk_ids, out)
        return out

    def from_blocks(self, array: int, blocks: torch.Tensor, chunk_ids: Sequence[int]) -> None:
        """Write canonical ``blocks`` into every rank's cell of rows ``chunk_ids``."""
        for cell in self.groups[array].cells:
            scatter_blocks(cell.mapping, blocks, [self._cells[(array, cell.offset)]], chunk_ids)

    def release(self) -> None:
        """Drop every view of the shared region (vLLM unmaps it after the tiers shut down)."""
        self._cells.clear()
        self._rows = torch.empty(0, dtype=torch.uint8)


def rows_of(primary_kv_view: memoryview) -> torch.Tensor:
    """The primary rows as a ``(num_chunks, row_bytes)`` uint8 tensor sharing their memory."""
    if primary_kv_view.ndim != 2 or primary_kv_view.strides is None:
        raise ConfigError(
            f"primary_kv_view: expected vLLM's (num_chunks, row_bytes) view of the CPU tier, "
            f"got {primary_kv_view.ndim} dimensions"
        )
    array = np.asarray(primary_kv_view)
    return torch.from_numpy(array).view(torch.uint8)


def build_chunk_map(
    rows: torch.Tensor, identity: Identity, facts: EngineFacts, chunk: ChunkGeometry
) -> ChunkMap:
    """The chunk map of an engine; :class:`ConfigError` naming what cannot be mapped."""
    if chunk.blocks_per_chunk != 1:  # derive_identity refuses it first; kept as a contract
        raise ConfigError(f"blocks_per_chunk={chunk.blocks_per_chunk}: expected 1")
    try:
        family = family_of(facts.kv_cache_layout)
        if chunk.canonical_layout or chunk.replicated_layout:
            layout = ParallelLayout()
            offsets = [0]
            width = chunk.row_bytes if chunk.canonical_layout else chunk.cell_bytes
        else:
            layout = ParallelLayout(
                tp=facts.tp, pp=facts.pp, dcp=facts.dcp, pcp=facts.pcp, interleave=facts.interleave
            )
            offsets = [r * chunk.cell_bytes for r in range(layout.world_size)]
            width = chunk.cell_bytes
            if layout.world_size != chunk.world_size:
                raise ConfigError(
                    f"{_what(chunk)}: {chunk.world_size} workers, but the parallel layout "
                    f"{layout} has {layout.world_size}"
                )
        if offsets[-1] + width > chunk.row_bytes:
            raise ConfigError(
                f"{_what(chunk)}: {len(offsets)} cells of {width} bytes do not fit the "
                f"{chunk.row_bytes}-byte rows of the CPU tier"
            )
        groups = [
            _group_chunks(identity, k, layout, family, offsets, width, chunk)
            for k in range(len(identity.groups))
        ]
    except LayoutError as err:
        raise ConfigError(f"{_what(chunk)}: cannot map the CPU tier's chunks: {err}") from err
    return ChunkMap(rows, groups)


def _group_chunks(  # noqa: PLR0913 - one group's geometry inputs, each from a different source
    identity: Identity,
    index: int,
    layout: ParallelLayout,
    family: Family,
    offsets: Sequence[int],
    width: int,
    chunk: ChunkGeometry,
) -> GroupChunks:
    layers = identity.groups[index].num_layers
    geometry = group_geometry(identity, index, range(layers), layers)
    form = LocalForm(family=family, packing="packed", group_offset=0)
    mappings = verify_tiling(geometry, layout, form)
    for mapping in mappings:
        if mapping.share_bytes > width:
            raise ConfigError(
                f"{_what(chunk)}: group g{index} needs {mapping.share_bytes} bytes per cell "
                f"({len(mapping.local_layers)} layers x {mapping.page_bytes}-byte pages), the "
                f"CPU tier's cells hold {width}"
            )
    cells = tuple(_Cell(m, off) for m, off in zip(mappings, offsets, strict=True))
    return GroupChunks(
        block_bytes=geometry.canonical_block_bytes,
        cells=cells,
        sources=tuple(c for c in cells if c.mapping.writer_index == 0),
    )


def _what(chunk: ChunkGeometry) -> str:
    if chunk.canonical_layout:
        return "CPU tier with canonical_layout"
    if chunk.replicated_layout:
        return "CPU tier with a replicated layout"
    return f"CPU tier with per-worker cells ({chunk.world_size} workers)"

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

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from connector.facts import EngineFacts
from connector.rank import family_of
from connector.tier.strided import StridedCopy, fit_strided
from kvstore import ConfigError, Identity, KvstoreError, LayoutError
from kvstore.layout import LocalForm, ParallelLayout, RankMapping, verify_tiling
from kvstore.layout.parallel import Family
from kvstore.rank_io import group_geometry
from kvstore.store.pieces import block_pieces


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


@dataclass(frozen=True)
class _UnitPlan:
    """One array's bytes in units of ``unit`` bytes (the gcd of every run, offset and size):
    stores gather canonical unit ``k`` of a block from unit ``source[k]`` of its chunk row;
    loads write row units ``target_rows`` from canonical units ``target_canon`` (every cell)."""

    unit: int
    dtype: torch.dtype  # widest integer type the unit divides (copies move elements)
    width: int  # bytes of one element of dtype
    source: torch.Tensor
    target_rows: torch.Tensor
    target_canon: torch.Tensor
    canon_is_identity: bool  # target_canon == arange: loads need no gather of the block
    store: StridedCopy | None  # ``source`` as strided views (row -> block), None: gather
    load: StridedCopy | None  # the load pairs as strided views (block -> row), None: scatter


_WIDE = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2), (torch.uint8, 1))


def _unit_plan(group: GroupChunks, row_bytes: int) -> _UnitPlan:
    """Index plan of ``group``: one ``index_select`` per store, one ``index_copy_`` per load."""
    fragments = [
        (cell.offset + local, canonical, size, cell in group.sources)
        for cell in group.cells
        for run in cell.mapping.runs
        for local, canonical, size in run.fragments()
    ]
    unit = math.gcd(row_bytes, group.block_bytes)
    for local, canonical, size, _ in fragments:
        unit = math.gcd(unit, local, canonical, size)
    source = np.full(group.block_bytes // unit, -1, dtype=np.int64)
    rows: list[np.ndarray] = []
    canons: list[np.ndarray] = []
    for local, canonical, size, is_source in fragments:
        count = size // unit
        local_units = np.arange(local // unit, local // unit + count)
        canon_units = np.arange(canonical // unit, canonical // unit + count)
        if is_source:
            source[canon_units] = local_units
        rows.append(local_units)
        canons.append(canon_units)
    if (source < 0).any():  # the tiling check makes this unreachable; fail closed anyway
        raise LayoutError("the elected cells do not cover the canonical block")
    target_canon = np.concatenate(canons)
    order = np.argsort(target_canon, kind="stable")  # canonical order: sequential reads
    target_canon, target_rows = target_canon[order], np.concatenate(rows)[order]
    dtype, width = next((d, w) for d, w in _WIDE if unit % w == 0)
    canon_units = np.arange(len(source))
    return _UnitPlan(
        unit=unit,
        dtype=dtype,
        width=width,
        source=torch.from_numpy(source),
        target_rows=torch.from_numpy(target_rows),
        target_canon=torch.from_numpy(target_canon),
        canon_is_identity=bool(np.array_equal(target_canon, canon_units)),
        store=fit_strided(canon_units, source, unit),
        load=fit_strided(target_rows, target_canon, unit),
    )


@dataclass(frozen=True)
class _RowSpan:
    """The bytes ``[lo, hi)`` of a row a strided store view reads, and that view over a copy
    of them (its source starting at 0)."""

    lo: int
    hi: int
    view: StridedCopy

    @classmethod
    def of(cls, strided: StridedCopy | None) -> _RowSpan | None:
        if strided is None:
            return None
        last = sum((n - 1) * s for n, s in zip(strided.shape, strided.src_strides, strict=True))
        lo = strided.src_start * strided.unit
        hi = (strided.src_start + last + 1) * strided.unit
        return cls(lo, hi, dataclasses.replace(strided, src_start=0))


class ChunkMap:
    """Moves chunks between the primary rows and canonical blocks, per stored group array.

    Where an array's plan is an axis permutation (every layout vLLM produces so far), a move
    is one strided copy per block (:mod:`connector.tier.strided`: no index tensor, the GIL
    released, no OpenMP team left spinning); where the plan's runs are whole inner chunks
    (HND pages), a store copies each row's span contiguously instead and hands the store
    strided views of the copy (:meth:`source_views`), which it writes as pieces without a
    gather. Otherwise a move is one vectorised index copy over the plan's units.

    A store always copies out of the rows before its file I/O (and a load the tier may give
    up on copies into them after): vLLM reuses a chunk once its job is reported, and a job
    is reported failed at its deadline while its I/O may still hang (docs/vllm.md)."""

    def __init__(self, rows: torch.Tensor, groups: Sequence[GroupChunks]) -> None:
        self.groups = tuple(groups)
        self._num_chunks, self._row_bytes = rows.shape
        self._rows = rows  # (num_chunks, row_bytes) uint8 over the shared region
        self._row_array = rows.numpy()  # the same memory, for the strided copies
        self._plans = [_unit_plan(g, self._row_bytes) for g in self.groups]
        self._spans = [_RowSpan.of(p.store) for p in self._plans]

    def _units(self, tensor: torch.Tensor, plan: _UnitPlan) -> torch.Tensor:
        """A dense uint8 tensor as ``(bytes / unit, unit / width)`` elements of ``plan.dtype``."""
        return tensor.view(plan.dtype).reshape(-1, plan.unit // plan.width)

    def stores_in_place(self, array: int, chunk_nbytes: int) -> bool:
        """Whether stores of ``array`` can hand the store its blocks as strided views of the
        rows (:meth:`source_views`): where the plan is a product of axes, not a plain slice,
        and each contiguous run of the view is whole inner chunks of ``chunk_nbytes`` bytes
        (what :class:`kvstore.BlockWrite` takes as pieces). Decided once per array, on row 0."""
        plan = self._plans[array]
        strided = plan.store
        if strided is None or strided.is_identity or self._num_chunks == 0:
            return False
        dst, _ = strided.indices()
        if not np.array_equal(dst, np.arange(self.groups[array].block_bytes // plan.unit)):
            return False  # pairs not in canonical order: a view would not read as the block
        view = strided.source_view(self._row_array[0])
        try:
            pieces = block_pieces(view, self.groups[array].block_bytes, chunk_nbytes)
        except KvstoreError:
            return False  # runs that split chunks: the block is gathered
        return pieces is not None

    def source_views(
        self, array: int, chunk_ids: Sequence[int], out: torch.Tensor
    ) -> list[np.ndarray]:
        """The canonical blocks of ``chunk_ids`` as strided views (C order reads as the block)
        of copies of their rows in ``out``, for arrays whose :meth:`stores_in_place` is True:
        one contiguous copy of the span of each row the view reads, into ``out`` (a dense
        uint8 buffer of at least ``len(chunk_ids) * source_span_bytes(array)`` bytes), then
        the same pieces as the row's own view, which the store writes without a gather. A copy:
        a store that outlives its deadline reads only ``out``, never rows vLLM reuses."""
        span = self._spans[array]
        if span is None:
            raise ValueError(f"array {array}: its blocks are gathered by index, not viewed")
        size = span.hi - span.lo
        copies = out.reshape(-1)[: len(chunk_ids) * size].numpy().reshape(len(chunk_ids), size)
        for j, c in enumerate(chunk_ids):
            np.copyto(copies[j], self._row_array[int(c), span.lo : span.hi])
        return [span.view.source_view(copies[j]) for j in range(len(chunk_ids))]

    def source_span_bytes(self, array: int) -> int:
        """Bytes of each row :meth:`source_views` copies."""
        span = self._spans[array]
        return 0 if span is None else span.hi - span.lo

    def loads_in_place(self, array: int, chunk_nbytes: int | None) -> bool:
        """Whether loads of ``array`` can read blocks straight into the rows
        (:meth:`destination_views`): where the load plan is one strided copy whose source side
        is the canonical block in order, each byte once (no replicas: every canonical byte
        has exactly one place in the row), and the view is one contiguous run of the row or
        (``chunk_nbytes`` given: the store reads pieces for the array) runs of whole inner
        chunks of ``chunk_nbytes`` bytes (what :class:`kvstore.BlockRead` takes as pieces).
        Decided once per array, on row 0."""
        plan = self._plans[array]
        strided = plan.load
        if strided is None or self._num_chunks == 0:
            return False
        _, src = strided.indices()
        if not np.array_equal(src, np.arange(self.groups[array].block_bytes // plan.unit)):
            return False  # replicas, or pairs not in canonical order: the staged scatter
        view = strided.destination_view(self._row_array[0])
        if view.flags.c_contiguous:
            return True
        if chunk_nbytes is None:
            return False
        try:
            block_pieces(view, self.groups[array].block_bytes, chunk_nbytes)
        except KvstoreError:
            return False  # runs that split chunks: read into staging, then scattered
        return True

    def destination_views(self, array: int, chunk_ids: Sequence[int]) -> list[np.ndarray]:
        """Where the canonical blocks of ``chunk_ids`` go in their rows, as writable views
        whose C order reads as the block (for arrays whose :meth:`loads_in_place` is True):
        a load reads and verifies each block into its view, no staging, no scatter."""
        strided = self._plans[array].load
        if strided is None:
            raise ValueError(f"array {array}: its blocks are scattered by index, not viewed")
        return [strided.destination_view(self._row_array[int(c)]) for c in chunk_ids]

    def to_blocks(
        self, array: int, chunk_ids: Sequence[int], out: torch.Tensor
    ) -> list[np.ndarray]:
        """The canonical blocks of ``chunk_ids`` (rows of group array ``array``), gathered into
        ``out`` (a dense uint8 buffer of at least ``len(chunk_ids) * block_bytes`` bytes, reused
        across jobs: fresh memory costs a page fault per 4 KiB), one flat uint8 array of
        ``block_bytes`` each. Always a copy, even where the block is one run of its row (the
        identity plan): a store that outlives its deadline reads only ``out``."""
        plan = self._plans[array]
        block_bytes = self.groups[array].block_bytes
        ids = [int(c) for c in chunk_ids]
        flat = out.reshape(-1)[: len(ids) * block_bytes]
        staged = flat.numpy().reshape(len(ids), block_bytes)
        strided = plan.store
        if strided is not None:
            for j, c in enumerate(ids):
                strided.copy(staged[j], self._row_array[c])
            return list(staged)
        index = torch.as_tensor(ids, dtype=torch.int64)
        row_units = self._row_bytes // plan.unit
        index = (index[:, None] * row_units + plan.source[None, :]).reshape(-1)
        torch.index_select(self._units(self._rows, plan), 0, index, out=self._units(flat, plan))
        return list(staged)

    def from_blocks(self, array: int, blocks: torch.Tensor, chunk_ids: Sequence[int]) -> None:
        """Write canonical ``blocks`` (dense ``(n, block_bytes)`` uint8) into every rank's
        cell of rows ``chunk_ids``."""
        plan = self._plans[array]
        blocks = blocks.contiguous()
        if plan.load is not None:
            staged = blocks.numpy()
            for j, c in enumerate(chunk_ids):
                plan.load.copy(self._row_array[int(c)], staged[j])
            return
        ids = torch.as_tensor(list(chunk_ids), dtype=torch.int64)
        row_units = self._row_bytes // plan.unit
        block_units = self.groups[array].block_bytes // plan.unit
        dst = (ids[:, None] * row_units + plan.target_rows[None, :]).reshape(-1)
        src = self._units(blocks, plan)
        if not plan.canon_is_identity:
            pick = torch.arange(len(ids))[:, None] * block_units + plan.target_canon[None, :]
            src = src.index_select(0, pick.reshape(-1))
        self._units(self._rows, plan).index_copy_(0, dst, src)

    def release(self) -> None:
        """Drop every view of the shared region (vLLM unmaps it after the tiers shut down)."""
        self._rows = torch.empty((0, self._row_bytes), dtype=torch.uint8)
        self._row_array = self._rows.numpy()


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
    if form.packing != "packed" or any(r.local_region for m in mappings for r in m.runs):
        raise LayoutError("expected packed cells with one local region")  # runs are row offsets
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

"""One rank's reads and writes of one KV-cache group, in its own parallel layout.

:class:`RankIO` joins a :class:`~kvstore.layout.parallel.RankMapping` (which bytes of a
block this rank holds, and whether it is the elected writer) to a
:class:`~kvstore.store.group_store.GroupStore` (where those bytes live on disk):

* :meth:`RankIO.store` gathers the rank's share of each block from its local KV tensors into a
  staging buffer and, for the blocks it is elected to write, writes its inner chunks into the
  block's pending file (multi-writer protocol, docs/design.md §5). Whole inner chunks go with their
  checksums; chunks split over token shards (DCP) go as byte ranges and are checksummed at
  commit (:attr:`RankIO.commit_checksum_chunks`), which also requires the completion marker
  of every range writer (:attr:`RankIO.commit_range_writers`).
* :meth:`RankIO.load` reads only the inner chunks the rank holds (verified against their
  checksums), and scatters the rank's share into its local tensors for the hits.

I/O volume: a TP or PP rank reads exactly its share. A DCP rank holds part of every token row
of its chunks but checksums cover whole chunks, so it reads whole chunks (``dcp`` times its
share) - the price of verifying every byte it serves.

Staging comes from the store's engine (:mod:`kvstore.io.staging`, ``group.staging``): one
batched gather per batch into host rows (host engine), into pooled pinned rows on a side stream
with one event per batch (pinned engine), or into device rows handed to the GDS engine as they
are; loads read into the same kind of rows and scatter them back (H2D on a side stream for
pinned rows). With CPU tensors every kind behaves like host rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.errors import LayoutError
from kvstore.identity import Identity
from kvstore.io.deadline import DeliveryGate
from kvstore.io.device import DONE, Event
from kvstore.io.staging import Staged
from kvstore.keys import writer_election_key
from kvstore.layout.page import gather_blocks, scatter_blocks
from kvstore.layout.parallel import GroupGeometry, RankMapping, map_all_ranks
from kvstore.models import ModelGeometry
from kvstore.store.group_store import GroupStore
from kvstore.store.types import (
    BlockRead,
    ChunkWrite,
    PendingBlock,
    RangeWrite,
    ReadResult,
    ReadStatus,
)


def group_geometry(
    identity: Identity, index: int, layer_ids: Sequence[int], num_hidden_layers: int
) -> GroupGeometry:
    """The layout-free geometry of group ``index`` of ``identity`` for the parallel mapping.

    ``layer_ids`` are the model layer ids of the group's layers (in the group's order), which
    decide the pipeline stage of each layer.
    """
    spec = identity.groups[index]
    return GroupGeometry(
        kind=spec.kind,
        layer_ids=tuple(layer_ids),
        num_hidden_layers=num_hidden_layers,
        tokens_per_block=identity.tokens_per_block,
        elem_size=identity.dtype.itemsize,
        num_kv_heads=1 if spec.kind == "mla" else spec.num_kv_heads,
        head_dim=0 if spec.kind == "mla" else spec.head_dim,
        latent_dim=spec.latent_dim,
    )


def model_group_geometry(model: ModelGeometry, identity: Identity, index: int) -> GroupGeometry:
    """:func:`group_geometry` with the layer ids of a catalogued model."""
    return group_geometry(identity, index, model.groups[index].layer_ids, model.num_hidden_layers)


@dataclass
class StagedShares:
    """A batch of this rank's shares gathered by :meth:`RankIO.stage`, not yet written."""

    pendings: Sequence[PendingBlock]
    mine: list[int]  # indices into ``pendings`` this rank writes
    staged: Staged | None  # the rows (None: nothing for this rank to write)

    @property
    def ready(self) -> Event:
        """Passes when the gather has read the KV pages (they may be reused from then on)."""
        return self.staged.ready if self.staged is not None else DONE

    def release(self) -> None:
        """Give the staging rows back (idempotent); :meth:`RankIO.write_staged` does it."""
        if self.staged is not None:
            self.staged.release()


@dataclass(frozen=True)
class _ShareExtract:
    """How to cut a rank's share out of the whole chunks it read: unit-sized index."""

    unit: int  # bytes per index entry (gcd of all segment sizes and offsets)
    index: torch.Tensor  # int64, share unit k = chunk-buffer unit index[k]


class RankIO:
    """Moves one rank's share of blocks of one group between its KV tensors and the store."""

    def __init__(self, group: GroupStore, mapping: RankMapping) -> None:
        layout, geometry = group.layout, mapping.geometry
        expected = (layout.num_chunks, layout.chunk_nbytes)
        got = (geometry.num_inner_chunks, geometry.inner_chunk_bytes)
        if expected != got:
            raise LayoutError(
                f"rank mapping does not fit group g{group.index}: (inner chunks, chunk bytes) "
                f"expected {expected}, got {got}"
            )
        self.group = group
        self.mapping = mapping
        self.read_chunks = sorted({s.chunk for s in mapping.segments})
        # Chunks written by ranges (token-split) have no checksum until commit. All ranks of a
        # layout agree: token shards > 1 makes every rank's chunks partial.
        self.commit_checksum_chunks: tuple[int, ...] = (
            tuple(range(layout.num_chunks)) if mapping.partial_chunks else ()
        )
        # Range writers leave a completion marker in their slot; the committer requires all.
        self.range_writer_slot, self.commit_range_writers = _range_writer_slot(mapping)
        if not mapping.partial_chunks and not _chunks_in_share_order(mapping):
            # Whole-chunk writes send the share as the chunks back to back; the mapping
            # guarantees canonical order, so anything else is a mapping bug: fail closed.
            raise LayoutError(
                f"rank {mapping.rank}: whole chunks are not back to back in its share"
            )
        self._extract = (
            None
            if not mapping.partial_chunks
            else _share_extract(mapping, layout.chunk_nbytes, self.read_chunks)
        )

    @property
    def read_nbytes(self) -> int:
        """Bytes read from the store per block by :meth:`load`."""
        return len(self.read_chunks) * self.group.layout.chunk_nbytes

    # -- writes --------------------------------------------------------------------------------

    def elected(self, pendings: Sequence[PendingBlock]) -> list[bool]:
        """Whether this rank writes each pending block (rank-consistent election)."""
        return [self.mapping.is_writer(writer_election_key(p.block_hash)) for p in pendings]

    def store(
        self,
        local_tensors: Sequence[torch.Tensor],
        pendings: Sequence[PendingBlock],
        block_ids: Sequence[int],
    ) -> list[BaseException | None]:
        """Write this rank's share of the blocks it is elected for into their pending files.

        Returns one entry per block: None (written, or not this rank's to write) or the error.
        The block becomes visible only when the committer publishes it after every rank is
        done (:meth:`GroupStore.commit_blocks` with :attr:`commit_checksum_chunks`).
        Same as :meth:`stage` then :meth:`write_staged`.
        """
        return self.write_staged(self.stage(local_tensors, pendings, block_ids))

    def stage(
        self,
        local_tensors: Sequence[torch.Tensor],
        pendings: Sequence[PendingBlock],
        block_ids: Sequence[int],
    ) -> StagedShares:
        """Gather this rank's share of the blocks it is elected for into the engine's staging
        (one batched gather, queued on a side stream on GPUs). The KV pages may be reused once
        :attr:`StagedShares.ready` has passed: the connector's store snapshot is this call."""
        if len(pendings) != len(block_ids):
            raise LayoutError(f"store: {len(pendings)} blocks but {len(block_ids)} block ids")
        mine = [i for i, e in enumerate(self.elected(pendings)) if e]
        if not mine or self.mapping.share_bytes == 0:
            return StagedShares(pendings, [], None)
        ids = [block_ids[i] for i in mine]
        device = local_tensors[0].device if local_tensors else torch.device("cpu")
        staged = self.group.staging.store_rows(
            len(mine),
            self.mapping.share_bytes,
            device,
            lambda out: gather_blocks(self.mapping, local_tensors, ids, out),
        )
        return StagedShares(pendings, mine, staged)

    def write_staged(self, shares: StagedShares) -> list[BaseException | None]:
        """Write staged shares into their pending files and release the staging rows.

        One entry per block: None (written, or not this rank's to write) or the error."""
        results: list[BaseException | None] = [None] * len(shares.pendings)
        if shares.staged is None:
            return results
        try:
            shares.staged.ready.synchronize()  # the batch's gather and copy have run
            errors = self._write_rows(shares.staged.rows, shares.pendings, shares.mine)
        finally:
            shares.release()
        for i, error in zip(shares.mine, errors, strict=True):
            results[i] = error
        return results

    def _write_rows(
        self, staged: torch.Tensor, pendings: Sequence[PendingBlock], mine: Sequence[int]
    ) -> list[BaseException | None]:
        """Write staged share rows (host numpy views, or device tensors for a GDS engine)."""
        rows: np.ndarray | torch.Tensor = staged if self.group.staging.on_device else staged.numpy()
        if self.commit_checksum_chunks:
            errors = self.group.write_ranges(
                [
                    RangeWrite(
                        pendings[i],
                        [
                            (
                                s.canonical_offset,
                                rows[row, s.share_offset : s.share_offset + s.size],
                            )
                            for s in self.mapping.segments
                        ],
                        self.range_writer_slot,
                    )
                    for row, i in enumerate(mine)
                ]
            )
        else:
            chunks = [s.chunk for s in self.mapping.segments]
            errors = self.group.write_chunks(
                [ChunkWrite(pendings[i], chunks, rows[row]) for row, i in enumerate(mine)]
            )
        return errors

    # -- reads ---------------------------------------------------------------------------------

    def load(
        self,
        local_tensors: Sequence[torch.Tensor],
        block_hashes: Sequence[bytes],
        block_ids: Sequence[int],
        gate: DeliveryGate | None = None,
    ) -> list[ReadResult]:
        """Read the blocks' chunks this rank holds and scatter the hits into its tensors.

        Misses and corrupt blocks leave the rank's tensors for those blocks untouched; the
        results say which (a load error for the engine, which then recomputes).

        ``gate``: the caller may stop waiting (a load past its deadline). The reads go into
        staging rows of the store's own; the scatter into ``local_tensors`` happens only once
        the gate is claimed. A gate abandoned first - before the reads, or while they hung -
        leaves the tensors untouched and every block an ERROR (timed out).
        """
        if len(block_hashes) != len(block_ids):
            raise LayoutError(f"load: {len(block_hashes)} hashes but {len(block_ids)} block ids")
        n = len(block_hashes)
        if gate is not None and gate.abandoned:
            return _timed_out(n)
        if self.mapping.share_bytes == 0:  # a stage holding none of this group's layers
            present = self.group.contains(block_hashes)
            return [ReadResult(ReadStatus.HIT if p else ReadStatus.MISS) for p in present]
        device = local_tensors[0].device if local_tensors else torch.device("cpu")
        staging = self.group.staging
        with staging.load_rows(n, self.read_nbytes, device) as staged:
            chunk_buf = staged.rows
            rows: np.ndarray | torch.Tensor = chunk_buf if staging.on_device else chunk_buf.numpy()
            results = self.group.read_blocks(
                [BlockRead(h, rows[i], self.read_chunks) for i, h in enumerate(block_hashes)]
            )
            hits = [i for i, r in enumerate(results) if r.ok]
            if not hits:
                return results
            ids = [block_ids[i] for i in hits]
            extract = self._extract

            def consume(on_device: torch.Tensor) -> None:
                share = on_device if extract is None else _extract_share(on_device, extract)
                scatter_blocks(self.mapping, share, local_tensors, ids)

            hit_rows = chunk_buf[hits] if len(hits) < n else chunk_buf
            if gate is not None and not gate.claim():
                return _timed_out(n)
            try:
                staging.deliver(hit_rows, consume, device)
            finally:
                if gate is not None:
                    gate.release()
        return results


def _timed_out(n: int) -> list[ReadResult]:
    """The results of a load whose caller gave up before its bytes were delivered."""
    error = "not delivered: the load passed its deadline"
    return [ReadResult(ReadStatus.ERROR, error) for _ in range(n)]


def _share_class(mapping: RankMapping) -> tuple[int, tuple[int, ...], int]:
    """Ranks with equal class hold identical bytes; exactly one of them writes each block."""
    return (mapping.rank.pp_rank, mapping.heads, mapping.layout.token_shard(mapping.rank))


def _range_writer_slot(mapping: RankMapping) -> tuple[int, int]:
    """(this rank's slot, number of range writers per block); (0, 0) without range writes."""
    if not mapping.partial_chunks:
        return 0, 0
    everyone = map_all_ranks(mapping.geometry, mapping.layout, mapping.form)
    classes = sorted({_share_class(m) for m in everyone if m.share_bytes})
    return classes.index(_share_class(mapping)), len(classes)


def _chunks_in_share_order(mapping: RankMapping) -> bool:
    """True when the share is exactly the rank's whole chunks back to back, in chunk order."""
    position = 0
    previous = -1
    for s in mapping.segments:
        if s.share_offset != position or s.chunk <= previous or s.chunk_offset != 0:
            return False
        if s.size != mapping.geometry.inner_chunk_bytes:
            return False
        position += s.size
        previous = s.chunk
    return True


def _share_extract(
    mapping: RankMapping, chunk_nbytes: int, read_chunks: Sequence[int]
) -> _ShareExtract:
    """Index cutting the share out of whole chunks read in ``read_chunks`` order."""
    slot = {c: i for i, c in enumerate(read_chunks)}
    unit = chunk_nbytes
    for s in mapping.segments:
        unit = math.gcd(unit, s.size, s.chunk_offset, s.share_offset)
    index = np.empty(mapping.share_bytes // unit, dtype=np.int64)
    for s in mapping.segments:
        src = (slot[s.chunk] * chunk_nbytes + s.chunk_offset) // unit
        dst = s.share_offset // unit
        count = s.size // unit
        index[dst : dst + count] = np.arange(src, src + count)
    return _ShareExtract(unit, torch.from_numpy(index))


def _extract_share(chunk_rows: torch.Tensor, extract: _ShareExtract) -> torch.Tensor:
    n = chunk_rows.shape[0]
    units = chunk_rows.reshape(n, -1, extract.unit)
    index = extract.index.to(chunk_rows.device)  # no copy on the CPU
    return units.index_select(1, index).reshape(n, -1)

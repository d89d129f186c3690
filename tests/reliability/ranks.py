"""The engine's view of a store: every rank of a parallel layout, storing and loading through
:class:`~kvstore.rank_io.RankIO`, with a scheduler that commits (what the vLLM connector does)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.identity import Identity
from kvstore.layout import LocalForm, ParallelLayout, map_rank
from kvstore.layout.page import gather_blocks, scatter_blocks
from kvstore.rank_io import RankIO, group_geometry
from kvstore.store.group_store import GroupStore
from kvstore.store.types import ReadStatus, WriteStatus
from tests.helpers import block_bytes

FORM = LocalForm(family="hnd", packing="per_layer")


@dataclass
class Loaded:
    """Outcome of one block's load over all ranks."""

    statuses: list[ReadStatus]  # one per rank
    exact: bool  # every rank that hit holds exactly the block's bytes


class World:
    """All ranks of ``layout`` over one group, plus the committing scheduler."""

    def __init__(self, group: GroupStore, identity: Identity, layout: str) -> None:
        layers = group.layout.num_layers
        geometry = group_geometry(identity, group.index, list(range(layers)), layers)
        parallel = ParallelLayout.parse(layout)
        self.group = group
        self.rios = [RankIO(group, map_rank(geometry, parallel, FORM, c)) for c in parallel.ranks()]

    def _canonical(self, seeds: Sequence[int]) -> torch.Tensor:
        rows = np.stack([block_bytes(self.group.layout, s) for s in seeds])
        return torch.from_numpy(rows)

    def _tensors(self, rio: RankIO, n: int) -> list[torch.Tensor]:
        return [
            torch.zeros(n, rio.mapping.page_bytes, dtype=torch.uint8)
            for _ in range(len(rio.mapping.local_layers))
        ]

    def store(self, hashes: Sequence[bytes], seeds: Sequence[int]) -> list[WriteStatus]:
        """Every rank stores its elected share; blocks whose every writer succeeded are
        committed, the others aborted (FAILED)."""
        group = self.group
        pendings = group.begin_blocks(list(hashes))
        ids = list(range(len(hashes)))
        canonical = self._canonical(seeds)
        failed = [False] * len(hashes)
        for rio in self.rios:
            tensors = self._tensors(rio, len(hashes))
            scatter_blocks(rio.mapping, canonical, tensors, ids)
            for i, error in enumerate(rio.store(tensors, pendings, ids)):
                failed[i] |= error is not None
        out = [WriteStatus.FAILED] * len(hashes)
        group.abort_blocks([p for p, bad in zip(pendings, failed, strict=True) if bad])
        todo = [i for i, bad in enumerate(failed) if not bad]
        if todo:
            rio = self.rios[0]
            results = group.commit_blocks(
                [pendings[i] for i in todo],
                [rio.commit_checksum_chunks] * len(todo),
                rio.commit_range_writers,
            )
            for i, r in zip(todo, results, strict=True):
                out[i] = r.status
        return out

    def load(self, hashes: Sequence[bytes], seeds: Sequence[int]) -> list[Loaded]:
        """Every rank loads the blocks; per block, the ranks' statuses and whether the bytes
        of every hit are exact."""
        ids = list(range(len(hashes)))
        expected = self._canonical(seeds)
        loaded = [Loaded([], True) for _ in hashes]
        for rio in self.rios:
            tensors = self._tensors(rio, len(hashes))
            results = rio.load(tensors, list(hashes), ids)
            got = torch.zeros(len(hashes), rio.mapping.share_bytes, dtype=torch.uint8)
            want = torch.zeros_like(got)
            gather_blocks(rio.mapping, tensors, ids, got)
            want_tensors = self._tensors(rio, len(hashes))
            scatter_blocks(rio.mapping, expected, want_tensors, ids)
            gather_blocks(rio.mapping, want_tensors, ids, want)
            for i, r in enumerate(results):
                loaded[i].statuses.append(r.status)
                if r.ok and not torch.equal(got[i], want[i]):
                    loaded[i].exact = False
        return loaded

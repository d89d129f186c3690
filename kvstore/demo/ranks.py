"""The demo's parallel-layout mode: each rank of a layout is its own process, on CPU tensors.

Writing (layout A): the parent plays vLLM's scheduler. Per batch it begins the blocks
(pending descriptors), every rank process builds its local KV cache - the block's bytes as that
rank holds them in vLLM's HND per-layer layout - and writes the share it is elected for; the
parent commits once all ranks reported. Reading (layout B, in the restarted process): every
rank process loads the hit blocks into its own KV cache through the chunks it holds, then
checks its pages byte for byte against the deterministic content of the blocks.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from multiprocessing.pool import Pool
from pathlib import Path

import numpy as np
import torch

from kvstore.config import StoreConfig
from kvstore.demo.data import demo_identity, fill_block
from kvstore.layout.page import gather_blocks, scatter_blocks
from kvstore.layout.parallel import (
    LocalForm,
    ParallelLayout,
    RankCoord,
    RankMapping,
    map_rank,
    verify_tiling,
)
from kvstore.models import load_model
from kvstore.rank_io import RankIO, model_group_geometry
from kvstore.store.group_store import GroupStore
from kvstore.store.page_store import KVStore
from kvstore.store.types import PendingBlock

FORM = LocalForm(family="hnd", packing="per_layer")


@dataclass(frozen=True)
class RankTask:
    """What one rank process does for one batch (small and picklable)."""

    root: str
    model: str
    tokens: int
    threads: int
    layout: str
    coord: tuple[int, int, int]  # (tp_rank, pp_rank, pcp_rank)
    group: int


def make_pool(world_size: int) -> Pool:
    """One process per rank (spawned: nothing inherited, as separate GPU workers would be)."""
    return mp.get_context("spawn").Pool(world_size)


def certify(model: str, tokens: int, layout: str) -> None:
    """Raise LayoutError naming the reason if ``layout`` cannot map every group of ``model``."""
    geometry_source = load_model(model)
    identity = demo_identity(model, tokens)
    for index in range(len(identity.groups)):
        geometry = model_group_geometry(geometry_source, identity, index)
        verify_tiling(geometry, ParallelLayout.parse(layout), FORM)


def rank_coords(layout: str) -> list[tuple[int, int, int]]:
    return [(c.tp_rank, c.pp_rank, c.pcp_rank) for c in ParallelLayout.parse(layout).ranks()]


@cache
def _store(root: str, threads: int) -> KVStore:
    # One store per rank process, kept across batches (closed when the process exits).
    return KVStore(StoreConfig(root=Path(root), io_threads=threads), create=False)


def _rank(task: RankTask) -> tuple[GroupStore, RankMapping]:
    model = load_model(task.model)
    identity = demo_identity(task.model, task.tokens)
    group = _store(task.root, task.threads).namespace(identity, create=False).group(task.group)
    geometry = model_group_geometry(model, identity, task.group)
    mapping = map_rank(geometry, ParallelLayout.parse(task.layout), FORM, RankCoord(*task.coord))
    return group, mapping


def _local_cache(mapping: RankMapping, n: int) -> list[torch.Tensor]:
    """A rank's per-layer KV tensors for ``n`` blocks (uint8 pages, HND)."""
    return [torch.zeros(n, mapping.page_bytes, dtype=torch.uint8) for _ in mapping.local_layers]


def _canonical(hashes: Sequence[bytes], group: GroupStore) -> torch.Tensor:
    rows = np.empty((len(hashes), group.layout.block_nbytes), dtype=np.uint8)
    for row, h in zip(rows, hashes, strict=True):
        fill_block(row, h, group.index)
    return torch.from_numpy(rows)


def write_rank(task: RankTask, pendings: Sequence[PendingBlock]) -> tuple[int, float]:
    """Build this rank's KV pages for the blocks and write its elected share.

    Returns (failed writes, seconds spent in the store call).
    """
    group, mapping = _rank(task)
    tensors = _local_cache(mapping, len(pendings))
    ids = list(range(len(pendings)))
    # The rank's "GPU" cache: the blocks' canonical content as this rank holds it.
    scatter_blocks(mapping, _canonical([p.block_hash for p in pendings], group), tensors, ids)
    t0 = time.perf_counter()
    errors = RankIO(group, mapping).store(tensors, pendings, ids)
    return sum(e is not None for e in errors), time.perf_counter() - t0


def read_rank(task: RankTask, hashes: Sequence[bytes]) -> tuple[int, int, int, float]:
    """Load the blocks into this rank's cache and verify its pages.

    Returns (verified blocks, bad blocks, bytes read, seconds spent in the load call).
    """
    group, mapping = _rank(task)
    rio = RankIO(group, mapping)
    tensors = _local_cache(mapping, len(hashes))
    ids = list(range(len(hashes)))
    t0 = time.perf_counter()
    results = rio.load(tensors, hashes, ids)
    seconds = time.perf_counter() - t0
    expected = _local_cache(mapping, len(hashes))
    scatter_blocks(mapping, _canonical(hashes, group), expected, ids)
    got_share = torch.empty(len(hashes), mapping.share_bytes, dtype=torch.uint8)
    want_share = torch.empty_like(got_share)
    gather_blocks(mapping, tensors, ids, got_share)
    gather_blocks(mapping, expected, ids, want_share)
    ok = bad = 0
    for i, result in enumerate(results):
        if result.ok and torch.equal(got_share[i], want_share[i]):
            ok += 1
        else:
            bad += 1
    return ok, bad, ok * rio.read_nbytes, seconds


def commit_plan(task: RankTask) -> tuple[tuple[int, ...], int]:
    """(chunks the committer checksums, range writers it waits for), as the ranks compute it."""
    group, mapping = _rank(task)
    rio = RankIO(group, mapping)
    return rio.commit_checksum_chunks, rio.commit_range_writers

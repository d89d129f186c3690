"""Blocks written by every rank of one parallel layout are read byte-exact by every other.

The reference (tests/layout/layout_reference.py) shards a full KV tensor the way vLLM holds it
on each rank, independently of kvstore's mapping; here the bytes go through the real store:
multi-writer pending files, commit, verified chunk reads.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from kvstore import KVStore, StoreConfig
from kvstore.identity import GroupSpec, Identity
from kvstore.io.deadline import DeliveryGate
from kvstore.layout import GroupGeometry, LocalForm, ParallelLayout, RankCoord, map_rank
from kvstore.layout.parallel import Family
from kvstore.rank_io import RankIO, group_geometry
from kvstore.store.group_store import GroupStore
from kvstore.store.types import BlockRead, PendingBlock, ReadResult, ReadStatus, WriteStatus

from .layout.layout_reference import (
    _expected_pages,
    build_cache,
    cache_pages,
    canonical_bytes,
    full_kv,
    page_bytes,
    rank_view,
)

N_BLOCKS = 3
NUM_BLOCKS = 6


def _identity(kind: str, heads: int, layers: int, tokens: int, dtype: str = "bfloat16") -> Identity:
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers))
    if kind == "mla":
        group = GroupSpec(kind="mla", layer_names=names, latent_dim=72)
    else:
        group = GroupSpec(kind="full", layer_names=names, num_kv_heads=heads, head_dim=32)
    return Identity(
        model=f"test/{kind}-{heads}h", kv_dtype=dtype, tokens_per_block=tokens, groups=(group,)
    )


def _hashes(n: int, salt: int) -> list[bytes]:
    return [bytes([salt, i]) + bytes(30) for i in range(n)]


def _write_rank(
    group: GroupStore,
    geometry: GroupGeometry,
    layout: ParallelLayout,
    form: LocalForm,
    coord: RankCoord,
    kv: torch.Tensor,
    pendings: list[PendingBlock],
    seed: int,
) -> list[BaseException | None]:
    mapping = map_rank(geometry, layout, form, coord)
    view = rank_view(geometry, layout, coord)
    pages = _expected_pages(kv, geometry, view, form.family)
    block_ids = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed))[
        : len(pendings)
    ]
    cache = build_cache(pages, form, NUM_BLOCKS, block_ids, seed)
    return RankIO(group, mapping).store(cache.tensors, pendings, block_ids.tolist())


def write_with_layout(
    group: GroupStore,
    geometry: GroupGeometry,
    layout: ParallelLayout,
    form: LocalForm,
    kv: torch.Tensor,
    hashes: list[bytes],
) -> None:
    pendings = group.begin_blocks(hashes)
    rio = None
    for r, coord in enumerate(layout.ranks()):
        errors = _write_rank(group, geometry, layout, form, coord, kv, pendings, seed=r)
        assert errors == [None] * len(hashes)
        rio = RankIO(group, map_rank(geometry, layout, form, coord))
    assert rio is not None
    results = group.commit_blocks(
        pendings, [rio.commit_checksum_chunks] * len(pendings), rio.commit_range_writers
    )
    assert [r.status for r in results] == [WriteStatus.WRITTEN] * len(hashes), results


def read_with_layout(
    group: GroupStore,
    geometry: GroupGeometry,
    layout: ParallelLayout,
    form: LocalForm,
    kv: torch.Tensor,
    hashes: list[bytes],
) -> None:
    for r, coord in enumerate(layout.ranks()):
        mapping = map_rank(geometry, layout, form, coord)
        view = rank_view(geometry, layout, coord)
        expected = _expected_pages(kv, geometry, view, form.family)
        noise = torch.randint_like(expected.view(torch.uint8), 0, 256).view(expected.dtype)
        block_ids = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(50 + r))[
            : len(hashes)
        ]
        cache = build_cache(noise, form, NUM_BLOCKS, block_ids, 77 + r)
        results = RankIO(group, mapping).load(cache.tensors, hashes, block_ids.tolist())
        assert all(res.ok for res in results), results
        got = cache_pages(cache, mapping, block_ids)
        assert torch.equal(got, page_bytes(expected)), f"rank {coord} of {layout}: pages differ"


CASES = [
    # (kind, heads, layers, tokens, write layout, read layouts)
    ("full", 4, 4, 16, "tp=2", ["tp=1", "tp=4", "tp=8", "tp=2,pp=2", "tp=4,pp=3"]),
    ("full", 8, 6, 16, "tp=4,pp=2", ["tp=1", "tp=2", "tp=8,pp=3"]),
    ("full", 2, 3, 16, "tp=8", ["tp=1", "tp=4,dcp=2", "tp=8,dcp=2,interleave=4"]),
    ("full", 1, 2, 16, "tp=2,dcp=2", ["tp=1", "tp=4"]),
    ("full", 2, 3, 32, "tp=4,dcp=2,interleave=2", ["tp=1", "tp=2", "tp=8,dcp=4"]),
    ("mla", 1, 3, 16, "tp=4", ["tp=1", "tp=2,dcp=2", "tp=2,pp=2"]),
]


@pytest.mark.parametrize(("kind", "heads", "layers", "tokens", "write", "reads"), CASES)
@pytest.mark.parametrize("family", ["hnd", "nhd"])
def test_written_by_one_layout_read_by_others(
    tmp_path: Path,
    kind: str,
    heads: int,
    layers: int,
    tokens: int,
    write: str,
    reads: list[str],
    family: Family,
) -> None:
    identity = _identity(kind, heads, layers, tokens)
    geometry = group_geometry(identity, 0, range(layers), layers)
    kv = full_kv(geometry, N_BLOCKS, seed=heads * 10 + layers)
    hashes = _hashes(N_BLOCKS, salt=heads)
    with KVStore(StoreConfig(root=tmp_path, durability="none")) as store:
        group = store.namespace(identity).group(0)
        write_with_layout(
            group, geometry, ParallelLayout.parse(write), LocalForm(family=family), kv, hashes
        )
        # The stored block is the canonical closed form, whoever wrote it.
        out = bytearray(group.layout.block_nbytes)
        for i, h in enumerate(hashes):
            assert group.read_blocks([BlockRead(h, out)])[0].ok
            assert bytes(out) == canonical_bytes(kv)[i].numpy().tobytes()
        for read in reads:
            for packing in ("per_layer", "packed"):
                read_with_layout(
                    group,
                    geometry,
                    ParallelLayout.parse(read),
                    LocalForm(family=family, packing=packing),
                    kv,
                    hashes,
                )


def test_rank_reads_only_its_share(tmp_path: Path) -> None:
    identity = _identity("full", 8, 4, 16)
    geometry = group_geometry(identity, 0, range(4), 4)
    kv = full_kv(geometry, N_BLOCKS, seed=3)
    hashes = _hashes(N_BLOCKS, salt=9)
    with KVStore(StoreConfig(root=tmp_path, durability="none")) as store:
        group = store.namespace(identity).group(0)
        write_with_layout(group, geometry, ParallelLayout(tp=1), LocalForm(), kv, hashes)
        layout = ParallelLayout(tp=4, pp=2)
        for coord in layout.ranks():
            mapping = map_rank(geometry, layout, LocalForm(), coord)
            before = store.stats.snapshot()["bytes_read"]
            read_with_layout_one = RankIO(group, mapping)
            view = rank_view(geometry, layout, coord)
            pages = _expected_pages(kv, geometry, view, "hnd")
            cache = build_cache(
                torch.zeros_like(pages), LocalForm(), NUM_BLOCKS, torch.arange(N_BLOCKS), 1
            )
            assert all(
                r.ok
                for r in read_with_layout_one.load(cache.tensors, hashes, list(range(N_BLOCKS)))
            )
            moved = store.stats.snapshot()["bytes_read"] - before
            assert moved == N_BLOCKS * mapping.share_bytes
            assert mapping.share_bytes * layout.world_size == geometry.canonical_block_bytes


def test_missing_and_corrupt_blocks_leave_rank_tensors_untouched(tmp_path: Path) -> None:
    identity = _identity("full", 4, 2, 16)
    geometry = group_geometry(identity, 0, range(2), 2)
    kv = full_kv(geometry, 2, seed=5)
    hashes = _hashes(2, salt=1)
    with KVStore(StoreConfig(root=tmp_path, durability="none")) as store:
        group = store.namespace(identity).group(0)
        write_with_layout(group, geometry, ParallelLayout(tp=2), LocalForm(), kv[:1], hashes[:1])
        path = Path(group.path_of(hashes[0]))
        raw = bytearray(path.read_bytes())
        raw[group.layout.data_offset + 5] ^= 0xFF
        path.write_bytes(bytes(raw))
        mapping = map_rank(geometry, ParallelLayout(tp=2), LocalForm(), RankCoord(0))
        cache = build_cache(
            torch.zeros(2, 2, 2, 16, 64, dtype=torch.int16),
            LocalForm(),
            NUM_BLOCKS,
            torch.arange(2),
            1,
        )
        before = [t.clone() for t in cache.tensors]
        results = RankIO(group, mapping).load(cache.tensors, hashes, [0, 1])
        assert [r.status for r in results] == [ReadStatus.CORRUPT, ReadStatus.MISS]
        assert all(torch.equal(a, b) for a, b in zip(cache.tensors, before, strict=True))


def _process_writer(
    root: str, write: str, coord: tuple[int, int, int], pendings: list[PendingBlock]
) -> None:
    identity = _identity("full", 4, 4, 16)
    geometry = group_geometry(identity, 0, range(4), 4)
    kv = full_kv(geometry, N_BLOCKS, seed=42)
    with KVStore(StoreConfig(root=Path(root), durability="full")) as store:
        group = store.namespace(identity).group(0)
        errors = _write_rank(
            group,
            geometry,
            ParallelLayout.parse(write),
            LocalForm(),
            RankCoord(*coord),
            kv,
            pendings,
            seed=sum(coord),
        )
        if any(errors):
            raise SystemExit(f"rank {coord} failed: {errors}")


def test_ranks_as_processes(tmp_path: Path) -> None:
    """Each rank of tp=2,pp=2 writes from its own process; tp=4 then reads byte-exact."""
    identity = _identity("full", 4, 4, 16)
    geometry = group_geometry(identity, 0, range(4), 4)
    kv = full_kv(geometry, N_BLOCKS, seed=42)
    hashes = _hashes(N_BLOCKS, salt=42)
    write = ParallelLayout.parse("tp=2,pp=2")
    with KVStore(StoreConfig(root=tmp_path, durability="full")) as store:
        group = store.namespace(identity).group(0)
        pendings = group.begin_blocks(hashes)
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(
                target=_process_writer,
                args=(str(tmp_path), str(write), (c.tp_rank, c.pp_rank, c.pcp_rank), pendings),
            )
            for c in write.ranks()
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        assert not any(group.contains(hashes)), "visible before commit"
        results = group.commit_blocks(pendings)
        assert all(r.status is WriteStatus.WRITTEN for r in results), results
        read_with_layout(group, geometry, ParallelLayout(tp=4), LocalForm(), kv, hashes)


def test_a_load_abandoned_while_its_reads_hang_never_touches_the_rank_tensors(
    tmp_path: Path,
) -> None:
    """The caller gives up (the load passed its deadline) while the read is blocked in the
    file system; when the read returns, the rank's tensors stay as they were and every block
    is an ERROR. A gate abandoned before the load starts reads nothing."""
    identity = _identity("full", 4, 2, 16)
    geometry = group_geometry(identity, 0, range(2), 2)
    kv = full_kv(geometry, 2, seed=6)
    hashes = _hashes(2, salt=2)
    with KVStore(StoreConfig(root=tmp_path, durability="none")) as store:
        group = store.namespace(identity).group(0)
        write_with_layout(group, geometry, ParallelLayout(tp=1), LocalForm(), kv, hashes)
        mapping = map_rank(geometry, ParallelLayout(tp=1), LocalForm(), RankCoord(0))
        rank = RankIO(group, mapping)
        pages = torch.zeros(2, 2, 4, 16, 64, dtype=torch.int16)
        cache = build_cache(pages, LocalForm(), NUM_BLOCKS, torch.arange(2), 1)
        before = [t.clone() for t in cache.tensors]

        entered, thaw = threading.Event(), threading.Event()
        real_read = group.read_blocks

        def frozen_read(reads: Sequence[BlockRead]) -> list[ReadResult]:
            entered.set()
            assert thaw.wait(30)
            return real_read(reads)

        group.read_blocks = frozen_read  # type: ignore[method-assign]
        gate = DeliveryGate()
        results: list[list[ReadResult]] = []
        loader = threading.Thread(
            target=lambda: results.append(rank.load(cache.tensors, hashes, [0, 1], gate))
        )
        loader.start()
        assert entered.wait(10)
        assert gate.abandon()  # the deadline passed while the read hung
        thaw.set()
        loader.join(10)
        assert not loader.is_alive()
        assert [r.status for r in results[0]] == [ReadStatus.ERROR, ReadStatus.ERROR]
        assert "deadline" in results[0][0].error
        assert all(torch.equal(a, b) for a, b in zip(cache.tensors, before, strict=True))

        # Abandoned before it starts: no read at all.
        entered.clear()
        late = rank.load(cache.tensors, hashes, [0, 1], gate)
        assert not entered.is_set()
        assert [r.status for r in late] == [ReadStatus.ERROR, ReadStatus.ERROR]

        # Control: the same load with an open gate delivers and closes the gate.
        group.read_blocks = real_read  # type: ignore[method-assign]
        open_gate = DeliveryGate()
        assert all(r.ok for r in rank.load(cache.tensors, hashes, [0, 1], open_gate))
        assert not all(torch.equal(a, b) for a, b in zip(cache.tensors, before, strict=True))
        assert not open_gate.abandon()

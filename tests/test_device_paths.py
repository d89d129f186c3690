"""The integrations' device paths without an engine, on every I/O engine, against the host one.

A GPU machine has neither vLLM nor SGLang (no network to install them), so this drives what
their adapters hand kvstore, through kvstore's own API:

* **vLLM 0.34's worker.** Each rank's KV cache as vLLM holds it (per-layer tensors, or one
  packed tensor with a group offset and row padding), the job's GPU side as the
  ``DevicePointers`` vLLM resolves (``tensor.data_ptr() + block * row stride`` per data ref),
  turned back into rows by :class:`connector.offload.job_blocks.BlockResolver`, then stored at
  TP=2 and loaded at TP=4 and TP=1 by :class:`kvstore.rank_io.RankIO` -- what
  ``KVStoreWorker`` does with them.
* **SGLang's backend.** :class:`connector.sglang.pool_store.PoolStore` on a host pool (pinned
  where CUDA is), written at TP=2 and read at TP=1: the store gets host memory whatever engine
  ``io_mode`` picked.

On the CPU the pinned and gds engines are their CPU stand-ins; with CUDA (marked ``gpu``) the
real engines on device memory. Loaded bytes must equal the reference shards
(tests/layout/layout_reference.py) and the published files must equal the host engine's,
byte for byte.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from connector.offload.job_blocks import BlockResolver
from connector.sglang.pool_store import PoolStore, block_hash
from connector.sglang.stats import BackendStats
from kvstore import LayoutError
from kvstore.identity import GroupSpec, Identity
from kvstore.layout import LocalForm, ParallelLayout, RankMapping, map_rank
from kvstore.rank_io import RankIO, group_geometry
from kvstore.store.group_store import GroupStore
from kvstore.store.types import WriteStatus
from tests.helpers import shard_files
from tests.io.engines import CPU_KINDS, EngineKind, kind_params
from tests.layout.layout_reference import (
    _expected_pages,
    build_cache,
    cache_pages,
    full_kv,
    page_bytes,
    rank_view,
)
from tests.sglang.fakes import FakeMHAPool, FakeStorageConfig

HOST = CPU_KINDS[0]
HEADS, LAYERS, TOKENS = 4, 3, 16
NUM_BLOCKS = 7  # rows of each rank's cache; the job's blocks are a scattered subset
JOB = [5, 1, 3]  # rows of the writers' caches, in the job's order
KEYS = [bytes([0xD0, i]) + bytes(30) for i in range(len(JOB))]
FORMS = {
    "per_layer_hnd": LocalForm(family="hnd"),
    "per_layer_nhd": LocalForm(family="nhd"),
    "packed_hnd": LocalForm(family="hnd", packing="packed", group_offset=64),
}


@pytest.fixture(params=kind_params())
def kind(request: pytest.FixtureRequest) -> EngineKind:
    k: EngineKind = request.param
    return k


def _identity() -> Identity:
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
    group = GroupSpec(kind="full", layer_names=names, num_kv_heads=HEADS, head_dim=32)
    return Identity(
        model="test/device-paths", kv_dtype="bfloat16", tokens_per_block=TOKENS, groups=(group,)
    )


def _group(kind: EngineKind, root: Path) -> GroupStore:
    # wsum64 on every engine: the gds engine's own checksum, so all files can be compared.
    store = kind.open(root, checksum="wsum64")
    return store.namespace(_identity()).group(0)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in shard_files(root)}


# -- vLLM 0.34's worker: DevicePointers -> rows -> RankIO -----------------------------------


def _canonical_caches(tensors: list[torch.Tensor], page: int) -> Any:
    """``CanonicalKVCaches`` of one KV-cache group as vLLM 0.34 registers it: one tensor per
    layer (or the packed one), each a data ref of ``page`` bytes per block."""
    return SimpleNamespace(
        tensors=[SimpleNamespace(tensor=t) for t in tensors],
        group_data_refs=[
            [SimpleNamespace(tensor_idx=i, page_size_bytes=page) for i in range(len(tensors))]
        ],
    )


def _device_pointers(tensors: list[torch.Tensor], page: int, block_ids: list[int]) -> Any:
    """The job's ``DevicePointers``, built as vLLM 0.34's ``resolve_device_pointers`` does."""
    ptrs = [t.data_ptr() + b * t.stride(0) * t.element_size() for t in tensors for b in block_ids]
    return SimpleNamespace(
        ptrs=np.asarray(ptrs, dtype=np.uint64),
        sizes=np.full(len(ptrs), page, dtype=np.uint64),
        group_block_counts=[len(block_ids)],
        group_data_ref_counts=[len(tensors)],
    )


def _ref_page(mapping: RankMapping) -> int:
    """The page size vLLM gives a data ref: a layer's page, or the packed group's row share."""
    return mapping.share_bytes if mapping.form.packing == "packed" else mapping.page_bytes


def _worker_store(kind: EngineKind, root: Path, form: LocalForm, kv: torch.Tensor) -> None:
    """Store the job's blocks with every rank of TP=2, each from its cache on ``kind``'s
    device through the pointers of its job."""
    group = _group(kind, root)
    geometry = group_geometry(_identity(), 0, range(LAYERS), LAYERS)
    layout = ParallelLayout.parse("tp=2")
    pendings = group.begin_blocks(KEYS)
    rio = None
    for r, coord in enumerate(layout.ranks()):
        mapping = map_rank(geometry, layout, form, coord)
        pages = _expected_pages(kv, geometry, rank_view(geometry, layout, coord), form.family)
        cache = build_cache(pages, form, NUM_BLOCKS, torch.tensor(JOB), seed=10 + r)
        tensors = [t.to(kind.device) for t in cache.tensors]
        page = _ref_page(mapping)
        blocks = BlockResolver(_canonical_caches(tensors, page)).resolve(
            _device_pointers(tensors, page, JOB)
        )
        assert list(blocks.block_ids) == JOB and blocks.group_sizes == (len(JOB),)
        rio = RankIO(group, mapping)
        assert rio.store(tensors, pendings, list(blocks.block_ids)) == [None] * len(KEYS)
    assert rio is not None
    results = group.commit_blocks(
        pendings, [rio.commit_checksum_chunks] * len(KEYS), rio.commit_range_writers
    )
    assert [r.status for r in results] == [WriteStatus.WRITTEN] * len(KEYS)
    group.engine.close()


def _worker_load(
    kind: EngineKind, root: Path, form: LocalForm, kv: torch.Tensor, read: str
) -> None:
    """Load the blocks into every rank of ``read`` (caches on ``kind``'s device, rows named by
    pointers); each rank's pages must be the reference shard, its other rows untouched."""
    group = _group(kind, root)
    geometry = group_geometry(_identity(), 0, range(LAYERS), LAYERS)
    layout = ParallelLayout.parse(read)
    targets = [6, 0, 2]
    for r, coord in enumerate(layout.ranks()):
        mapping = map_rank(geometry, layout, form, coord)
        expected = _expected_pages(kv, geometry, rank_view(geometry, layout, coord), form.family)
        noise = torch.randint_like(expected.view(torch.uint8), 0, 256).view(expected.dtype)
        cache = build_cache(noise, form, NUM_BLOCKS, torch.tensor(targets), seed=40 + r)
        before = [t.clone() for t in cache.tensors]
        tensors = [t.to(kind.device) for t in cache.tensors]
        page = _ref_page(mapping)
        blocks = BlockResolver(_canonical_caches(tensors, page)).resolve(
            _device_pointers(tensors, page, targets)
        )
        results = RankIO(group, mapping).load(tensors, KEYS, list(blocks.block_ids))
        assert all(res.ok for res in results), (read, coord, results)
        cache.tensors = [t.cpu() for t in tensors]
        got = cache_pages(cache, mapping, torch.tensor(targets))
        assert torch.equal(got, page_bytes(expected)), f"rank {coord} of {read}: pages differ"
        others = [b for b in range(NUM_BLOCKS) if b not in targets]
        for now, old in zip(cache.tensors, before, strict=True):
            assert torch.equal(now[others], old[others]), f"rank {coord}: other rows changed"
    group.engine.close()


@pytest.mark.parametrize("form_name", sorted(FORMS))
def test_vllm_worker_pointers_store_at_tp2_load_at_tp4_and_tp1(
    kind: EngineKind, tmp_path: Path, frozen_time: int, form_name: str
) -> None:
    form = FORMS[form_name]
    geometry = group_geometry(_identity(), 0, range(LAYERS), LAYERS)
    kv = full_kv(geometry, len(KEYS), seed=3)
    _worker_store(kind, tmp_path / kind.name, form, kv)
    _worker_store(HOST, tmp_path / "reference", form, kv)
    written, reference = _files(tmp_path / kind.name), _files(tmp_path / "reference")
    assert len(reference) == len(KEYS)
    assert written == reference, f"{kind.name} published other bytes than the host engine"
    for read in ("tp=4", "tp=1"):
        _worker_load(kind, tmp_path / kind.name, form, kv, read)


def test_pointers_into_another_tensor_are_refused_on_the_device(kind: EngineKind) -> None:
    """A pointer that is not a page of this worker's tensors fails the job before any I/O."""
    tensors = [torch.zeros(NUM_BLOCKS, 256, dtype=torch.uint8, device=kind.device)]
    stranger = [torch.zeros(NUM_BLOCKS, 256, dtype=torch.uint8, device=kind.device)]
    resolver = BlockResolver(_canonical_caches(tensors, 256))
    with pytest.raises(LayoutError, match=r"outside the KV tensor|not the start"):
        resolver.resolve(_device_pointers(stranger, 256, [1]))


# -- SGLang's backend: PoolStore on a (pinned) host pool ------------------------------------

SG_T, SG_L, SG_H, SG_D, SG_PAGES = 4, 3, 2, 8, 6
SG_KEYS = [f"{i:02x}" * 32 for i in range(1, 4)]


def _pool(layout: str, heads: slice, pinned: bool, seed: int | None) -> FakeMHAPool:
    full = FakeMHAPool(layout, SG_T, SG_L, SG_H, SG_D, pages=SG_PAGES)
    if seed is not None:
        full.fill_random(seed)
    nh = len(range(SG_H)[heads])
    part = FakeMHAPool(layout, SG_T, SG_L, nh, SG_D, pages=SG_PAGES)
    head_axis = {"layer_first": 3, "page_first": 3, "page_first_direct": 4, "page_head": 2}
    index: list[slice] = [slice(None)] * full.kv_buffer.dim()
    index[head_axis[layout]] = heads
    part.kv_buffer.copy_(full.kv_buffer[tuple(index)])
    if pinned:
        part.kv_buffer = part.kv_buffer.pin_memory()
    return part


def _pool_store(kind: EngineKind, root: Path, pool: FakeMHAPool, tp: tuple[int, int]) -> PoolStore:
    store = kind.open(root, checksum="wsum64")
    storage = FakeStorageConfig(tp_rank=tp[0], tp_size=tp[1])
    return PoolStore(store, "kv", pool, storage, "test/model", (0, 0))


def _sglang_write(kind: EngineKind, root: Path, layout: str) -> None:
    hashes = [block_hash(k) for k in SG_KEYS]
    for r in range(2):
        pool = _pool(layout, slice(r, r + 1), kind.gpu, seed=5)
        ps = _pool_store(kind, root, pool, (r, 2))
        done = ps.write_pages(hashes, [None, *hashes[:-1]], torch.tensor([4, 0, 2]), BackendStats())
        assert done == [True] * len(hashes)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_sglang_pool_written_at_tp2_read_at_tp1(
    kind: EngineKind, tmp_path: Path, frozen_time: int, layout: str
) -> None:
    _sglang_write(kind, tmp_path / kind.name, layout)
    _sglang_write(HOST, tmp_path / "reference", layout)
    written, reference = _files(tmp_path / kind.name), _files(tmp_path / "reference")
    assert len(reference) == len(SG_KEYS)
    assert written == reference, f"{kind.name} published other bytes than the host engine"
    blank = _pool(layout, slice(None), kind.gpu, seed=None)
    reader = _pool_store(kind, tmp_path / kind.name, blank, (0, 1))
    hashes = [block_hash(k) for k in SG_KEYS]
    assert reader.read(hashes, torch.tensor([1, 5, 3]), BackendStats()) == [True] * 3
    truth = _pool(layout, slice(None), pinned=False, seed=5)
    truth_store = _pool_store(HOST, tmp_path / "truth", truth, (0, 1))
    assert torch.equal(
        reader.pages.gather(torch.tensor([1, 5, 3])),
        truth_store.pages.gather(torch.tensor([4, 0, 2])),
    )

"""BlockResolver: a job's GPU blocks from either form vLLM hands the worker.

The pointers are built the way vLLM 0.34's ``pointer_utils.resolve_device_pointers`` builds
them (and, where that vLLM is installed, by it): the resolver is its checked inverse. Anything
that is not exactly a page of this worker's KV tensors is a :class:`LayoutError`.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the connector tests need vllm (0.33 or 0.34)")

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)

from connector.offload.job_blocks import BlockResolver, JobBlocks
from kvstore import LayoutError

from .harness import VLLM_PASSES_POINTERS

ROWS = 32


def _caches() -> CanonicalKVCaches:
    """Group 0: two layers in two tensors (256-byte pages in 320-byte rows); group 1: one
    packed tensor (512-byte rows, the whole row a page)."""
    tensors = [
        CanonicalKVCacheTensor(torch.zeros(ROWS, 320, dtype=torch.int8), 320),
        CanonicalKVCacheTensor(torch.zeros(ROWS, 320, dtype=torch.int8), 320),
        CanonicalKVCacheTensor(torch.zeros(ROWS, 512, dtype=torch.int8), 512),
    ]
    refs = [
        [CanonicalKVCacheRef(0, 256), CanonicalKVCacheRef(1, 256)],
        [CanonicalKVCacheRef(2, 512)],
    ]
    return CanonicalKVCaches(tensors, refs)


def _pointers(caches: CanonicalKVCaches, block_ids: list[int], sizes: list[int]) -> Any:
    """DevicePointers of a job, as vLLM 0.34 resolves them (its own function where present)."""
    spec = GPULoadStoreSpec(block_ids, group_sizes=sizes, block_indices=[0] * len(sizes))
    if VLLM_PASSES_POINTERS:
        from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers  # noqa: PLC0415

        return resolve_device_pointers(spec, caches)
    ptrs, page_sizes, start = [], [], 0
    for size, refs in zip(sizes, caches.group_data_refs, strict=True):
        ids = block_ids[start : start + size]
        for ref in refs:
            tensor = caches.tensors[ref.tensor_idx].tensor
            ptrs += [tensor.data_ptr() + b * tensor.stride(0) for b in ids]
            page_sizes += [ref.page_size_bytes] * len(ids)
        start += size
    return SimpleNamespace(
        ptrs=np.array(ptrs, dtype=np.uint64),
        sizes=np.array(page_sizes, dtype=np.uint64),
        group_block_counts=tuple(sizes),
        group_data_ref_counts=tuple(len(r) for r in caches.group_data_refs),
        block_indices=(0,) * len(sizes),
    )


def test_pointers_resolve_to_the_block_ids_they_were_made_from() -> None:
    caches = _caches()
    resolver = BlockResolver(caches)
    rng = np.random.default_rng(7)
    for _ in range(50):
        sizes = [int(n) for n in rng.integers(0, 6, size=2)]
        ids = [int(b) for b in rng.integers(0, ROWS, size=sum(sizes))]
        assert resolver.resolve(_pointers(caches, ids, sizes)) == JobBlocks(
            tuple(ids), tuple(sizes)
        )
        spec = GPULoadStoreSpec(ids, group_sizes=sizes, block_indices=[0, 0])
        assert resolver.resolve(spec) == JobBlocks(tuple(ids), tuple(sizes))


def _set(field: str, index: int, value: int) -> Any:
    def mutate(p: Any, caches: CanonicalKVCaches) -> None:
        getattr(p, field)[index] = np.uint64(value)

    return mutate


CASES = {
    "page size": (_set("sizes", 1, 255), "expected 256-byte pages, got 255 bytes"),
    "off a row start": (
        lambda p, c: p.ptrs.__setitem__(0, p.ptrs[0] + np.uint64(8)),
        "is not the start of a 320-byte row",
    ),
    "below the tensor": (_set("ptrs", 4, 4096), "lies outside the KV tensor"),
    "past the tensor": (
        lambda p, c: p.ptrs.__setitem__(4, p.ptrs[4] + np.uint64(ROWS * 512)),
        "lies outside the KV tensor",
    ),
    "refs disagree": (
        lambda p, c: p.ptrs.__setitem__(2, p.ptrs[2] + np.uint64(320)),
        "names other blocks than ref 0",
    ),
    "one pointer short": (
        lambda p, c: setattr(p, "ptrs", p.ptrs[:-1]),
        "expected 5 pointers and sizes",
    ),
    "group count": (
        lambda p, c: setattr(p, "group_block_counts", (2, 1, 0)),
        "device pointers list 3 KV groups, this worker has 2",
    ),
    "data refs": (
        lambda p, c: setattr(p, "group_data_ref_counts", (1, 3)),  # same total
        "group 0 has 1 data refs, this worker 2",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pointers_that_are_not_exactly_this_workers_pages_are_refused(case: str) -> None:
    mutate, message = CASES[case]
    caches = _caches()
    pointers = _pointers(caches, [1, 2, 3], [2, 1])
    pointers.ptrs = np.array(pointers.ptrs, dtype=np.uint64)  # writable copies
    pointers.sizes = np.array(pointers.sizes, dtype=np.uint64)
    mutate(pointers, caches)
    resolver = BlockResolver(caches)
    with pytest.raises(LayoutError, match=message):
        resolver.resolve(pointers)
    # what a failure report can still name never raises
    assert set(resolver.rows_touched(pointers)) <= {1, 2, 3}


def test_block_id_lists_that_do_not_add_up_are_refused() -> None:
    resolver = BlockResolver(_caches())
    spec = SimpleNamespace(block_ids=np.array([1, 2, 3]), group_sizes=(2, 2))
    with pytest.raises(LayoutError, match=r"job lists 3 GPU blocks but group sizes \[2, 2\]"):
        resolver.resolve(spec)


def test_rows_touched_names_what_it_can_and_never_raises() -> None:
    caches = _caches()
    resolver = BlockResolver(caches)
    pointers = _pointers(caches, [1, 2, 3], [2, 1])
    pointers.ptrs = np.array(pointers.ptrs, dtype=np.uint64)
    pointers.ptrs[1] += np.uint64(8)  # off its row start: still inside row 2
    assert resolver.rows_touched(pointers) == [1, 2, 3]
    assert resolver.rows_touched(object()) == []

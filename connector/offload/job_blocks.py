"""The GPU blocks of a transfer job, from what vLLM hands the worker.

vLLM 0.32 and 0.33 pass the job's GPU side as a ``GPULoadStoreSpec`` (block ids, group-major,
and the number of blocks per offloaded group). vLLM 0.34 resolves it once into
``DevicePointers`` (``pointer_utils.resolve_device_pointers``): for each group, for each of the
group's data refs, for each block, the address ``tensor.data_ptr() + block * row stride`` and
the ref's page size. kvstore's engines work on rows of the KV tensors registered at start-up
(:func:`connector.offload.worker.build_worker`), so :class:`BlockResolver` turns the pointers
back into those rows, and checks on the way that every pointer is the start of a row of the
tensor its data ref names, with that ref's page size, and that all refs of a group name the
same rows: a pointer that is not exactly a KV page of this worker fails the job, it is never
read or written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore import LayoutError

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import CanonicalKVCaches


@dataclass(frozen=True)
class JobBlocks:
    """A job's GPU block ids, group-major, and how many belong to each offloaded group."""

    block_ids: tuple[int, ...]
    group_sizes: tuple[int, ...]


@dataclass(frozen=True)
class _Ref:
    """One data ref of a group: the tensor's base address, row stride and rows, the page."""

    base: int
    stride: int  # bytes from one block's row to the next
    rows: int
    page_bytes: int


class BlockResolver:
    """Block ids of a job's GPU side, given either form vLLM uses (see the module docstring)."""

    def __init__(self, kv_caches: CanonicalKVCaches) -> None:
        tensors = [t.tensor for t in kv_caches.tensors]
        self._groups: tuple[tuple[_Ref, ...], ...] = tuple(
            tuple(
                _Ref(
                    base=int(tensors[ref.tensor_idx].data_ptr()),
                    stride=int(tensors[ref.tensor_idx].stride(0))
                    * tensors[ref.tensor_idx].element_size(),
                    rows=int(tensors[ref.tensor_idx].shape[0]),
                    page_bytes=int(ref.page_size_bytes),
                )
                for ref in refs
            )
            for refs in kv_caches.group_data_refs
        )

    def resolve(self, gpu: Any) -> JobBlocks:
        """The job's blocks; :class:`LayoutError` naming what does not fit this worker."""
        if hasattr(gpu, "ptrs"):
            return self._from_pointers(gpu)
        block_ids = tuple(int(b) for b in np.asarray(gpu.block_ids).reshape(-1))
        sizes = tuple(int(n) for n in gpu.group_sizes)
        if sum(sizes) != len(block_ids):
            raise LayoutError(
                f"job lists {len(block_ids)} GPU blocks but group sizes {list(sizes)}"
            )
        return JobBlocks(block_ids, sizes)

    def rows_touched(self, gpu: Any) -> list[int]:
        """The block ids the job names, as far as they can be read (for failure reports).

        Used when :meth:`resolve` refused the job: pointers are mapped through each group's
        first data ref, and what lies outside that tensor is left out. Never raises."""
        try:
            return self._rows_touched(gpu)
        except Exception:  # a malformed job: no block can be named
            return []

    def _rows_touched(self, gpu: Any) -> list[int]:
        if not hasattr(gpu, "ptrs"):
            return [int(b) for b in np.asarray(gpu.block_ids).reshape(-1)]
        out: list[int] = []
        ptrs = np.asarray(gpu.ptrs, dtype=np.uint64).reshape(-1)
        offset = 0
        for refs, count, n_refs in zip(
            self._groups, gpu.group_block_counts, gpu.group_data_ref_counts, strict=False
        ):
            if count and refs:
                ref = refs[0]
                for ptr in ptrs[offset : offset + count]:
                    delta = int(ptr) - ref.base
                    if 0 <= delta < ref.rows * ref.stride:
                        out.append(delta // ref.stride)
            offset += int(count) * int(n_refs)
        return out

    def _from_pointers(self, pointers: Any) -> JobBlocks:
        counts = tuple(int(n) for n in pointers.group_block_counts)
        ref_counts = tuple(int(n) for n in pointers.group_data_ref_counts)
        if len(counts) != len(self._groups) or len(ref_counts) != len(self._groups):
            raise LayoutError(
                f"device pointers list {len(counts)} KV groups, this worker has {len(self._groups)}"
            )
        ptrs = np.asarray(pointers.ptrs, dtype=np.uint64).reshape(-1)
        sizes = np.asarray(pointers.sizes, dtype=np.uint64).reshape(-1)
        expected = sum(c * r for c, r in zip(counts, ref_counts, strict=True))
        if len(ptrs) != expected or len(sizes) != expected:
            raise LayoutError(
                f"device pointers: expected {expected} pointers and sizes for groups of "
                f"{list(counts)} blocks x {list(ref_counts)} data refs, got {len(ptrs)} and "
                f"{len(sizes)}"
            )
        block_ids: list[int] = []
        offset = 0
        for position, (refs, count, n_refs) in enumerate(
            zip(self._groups, counts, ref_counts, strict=True)
        ):
            if count == 0:
                continue
            if n_refs != len(refs):
                raise LayoutError(
                    f"device pointers: group {position} has {n_refs} data refs, this worker "
                    f"{len(refs)}"
                )
            rows = None
            for k, ref in enumerate(refs):
                span = slice(offset, offset + count)
                these = _rows_of(ref, ptrs[span], sizes[span], f"group {position} ref {k}")
                if rows is None:
                    rows = these
                elif not np.array_equal(rows, these):
                    raise LayoutError(
                        f"device pointers: group {position} ref {k} names other blocks than "
                        "ref 0 (every layer of a block is one block id)"
                    )
                offset += count
            assert rows is not None
            block_ids.extend(int(r) for r in rows)
        return JobBlocks(tuple(block_ids), counts)


def _rows_of(ref: _Ref, ptrs: np.ndarray, sizes: np.ndarray, where: str) -> np.ndarray:
    """Row indices of ``ptrs`` in ``ref``'s tensor; :class:`LayoutError` unless each is the
    start of a row and each size is the ref's page."""
    bad_size = np.flatnonzero(sizes != np.uint64(ref.page_bytes))
    if bad_size.size:
        i = int(bad_size[0])
        raise LayoutError(
            f"device pointers, {where}: expected {ref.page_bytes}-byte pages, got "
            f"{int(sizes[i])} bytes at entry {i}"
        )
    base = np.uint64(ref.base)
    below = np.flatnonzero(ptrs < base)
    if below.size:
        raise LayoutError(_outside(ref, ptrs, int(below[0]), where))
    delta = ptrs - base
    stride = np.uint64(ref.stride)
    rows = delta // stride
    off_row = np.flatnonzero(delta % stride)
    if off_row.size:
        i = int(off_row[0])
        raise LayoutError(
            f"device pointers, {where}: 0x{int(ptrs[i]):x} is not the start of a "
            f"{ref.stride}-byte row of the KV tensor at 0x{ref.base:x}"
        )
    past = np.flatnonzero(rows >= np.uint64(ref.rows))
    if past.size:
        raise LayoutError(_outside(ref, ptrs, int(past[0]), where))
    return rows.astype(np.int64)


def _outside(ref: _Ref, ptrs: np.ndarray, i: int, where: str) -> str:
    end = ref.base + ref.rows * ref.stride
    return (
        f"device pointers, {where}: 0x{int(ptrs[i]):x} lies outside the KV tensor "
        f"[0x{ref.base:x}, 0x{end:x}) of {ref.rows} blocks"
    )

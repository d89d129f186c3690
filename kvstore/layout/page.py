"""Move one group's blocks between a rank's KV cache tensors and staging buffers.

:func:`gather_blocks` copies blocks out of the local KV cache into a staging buffer and
:func:`scatter_blocks` copies them back, following a :class:`~kvstore.layout.parallel.RankMapping`.
Both are vectorised: a precomputed index over units of ``unit`` bytes (the gcd of every run
size and offset, at least one token row) drives one ``index_select`` / ``index_copy_`` per
call, plus one row gather per local tensor. There is no Python loop over fragments or blocks,
so the same code runs on CUDA tensors.

Staging buffers are uint8 (or int8) tensors with one row per block, of either width:

* ``mapping.share_bytes``: the rank's share, canonical bytes in canonical order, placed in the
  block by ``mapping.segments`` (what the store writes with pwritev / reads with preadv);
* ``mapping.geometry.canonical_block_bytes``: the full canonical block; gather fills only this
  rank's bytes, scatter reads only them.

When a rank holds the whole block the two coincide, byte for byte.

Local tensors: per-layer form, one tensor per entry of ``mapping.local_layers`` whose block
``b`` is row ``b``: either a byte-row tensor ``(num_blocks, >= page_bytes)`` (vLLM's int8
``CanonicalKVCacheTensor`` views) or a typed view whose per-block page is dense in the family's
order, e.g. ``(num_blocks, H_local, bs, 2*D)`` for "hnd", ``(num_blocks, bs, H_local, 2*D)``
for "nhd", ``(num_blocks, bs, Cl)`` for MLA (dimension order is read from the strides, so
vLLM's logical ``(num_blocks, H, bs, 2*D)`` view with NHD strides is accepted as "nhd").
Packed form, one 2-D tensor ``(num_blocks, bytes_per_block)`` of any dtype.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import torch

from kvstore.errors import LayoutError
from kvstore.layout.parallel import RankMapping

__all__ = ["gather_blocks", "scatter_blocks"]


class _Plan:
    """Unit indices of one mapping, built once on the CPU and copied once per device."""

    def __init__(self, mapping: RankMapping) -> None:
        fragments = sorted(
            (canonical, _concat_offset(mapping, run.local_region, local), size)
            for run in mapping.runs
            for local, canonical, size in run.fragments()
        )  # canonical order = share order
        geometry = mapping.geometry
        unit = math.gcd(geometry.canonical_block_bytes, mapping.share_bytes)
        for canonical, local, size in fragments:
            unit = math.gcd(unit, canonical, local, size)
        self.unit = unit
        canonical_starts = torch.tensor([f[0] // unit for f in fragments], dtype=torch.int64)
        local_starts = torch.tensor([f[1] // unit for f in fragments], dtype=torch.int64)
        lengths = torch.tensor([f[2] // unit for f in fragments], dtype=torch.int64)
        # share unit k -> local-concat unit / canonical unit
        self.share_to_local = _expand(local_starts, lengths)
        self.share_to_canonical = _expand(canonical_starts, lengths)
        self.local_to_share = torch.empty_like(self.share_to_local)
        self.local_to_share[self.share_to_local] = torch.arange(len(self.share_to_local))
        self.local_is_share = bool(
            torch.equal(self.share_to_local, torch.arange(len(self.share_to_local)))
        )
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(share_to_local, local_to_share, share_to_canonical)`` on ``device``."""
        if device not in self._on_device:
            self._on_device[device] = (
                self.share_to_local.to(device),
                self.local_to_share.to(device),
                self.share_to_canonical.to(device),
            )
        return self._on_device[device]


_PLANS: weakref.WeakKeyDictionary[RankMapping, _Plan] = weakref.WeakKeyDictionary()


def _plan(mapping: RankMapping) -> _Plan:
    plan = _PLANS.get(mapping)
    if plan is None:
        plan = _PLANS[mapping] = _Plan(mapping)
    return plan


def _expand(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of ``arange(start, start + length)`` for each pair."""
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    first_of_piece = torch.cumsum(lengths, 0) - lengths
    position = torch.arange(total) - torch.repeat_interleave(first_of_piece, lengths)
    return torch.repeat_interleave(starts, lengths) + position


def _concat_offset(mapping: RankMapping, region: int, local: int) -> int:
    """Offset of a run's local byte in the rank's local pages laid end to end."""
    if mapping.form.packing == "packed":
        return local - mapping.form.group_offset
    return region * mapping.page_bytes + local


def gather_blocks(
    mapping: RankMapping,
    local_tensors: Sequence[torch.Tensor],
    block_ids: torch.Tensor | Sequence[int],
    out: torch.Tensor,
) -> torch.Tensor:
    """Copy blocks ``block_ids`` of the local KV cache into ``out`` and return it.

    ``out`` is ``(len(block_ids), share_bytes)`` (the rank's share) or
    ``(len(block_ids), canonical_block_bytes)`` (only this rank's bytes are written), a 1-byte
    dtype on the tensors' device, rows dense. Writer election is the caller's business: every
    rank can gather, only ``mapping.is_writer(key)`` ranks should store.
    """
    ids = _block_ids(block_ids, local_tensors)
    staging = _staging_rows(mapping, out, len(ids), "out")
    if mapping.share_bytes == 0 or len(ids) == 0:
        return out
    plan = _plan(mapping)
    share_to_local, _, share_to_canonical = plan.indices(staging.device)
    local = _read_local(mapping, local_tensors, ids)  # (n, share_bytes), local-concat order
    n, unit = len(ids), plan.unit
    staging_units, local_units = _wide_units((staging, local), n, unit)
    if staging.shape[1] == mapping.share_bytes:
        if plan.local_is_share:
            staging_units.copy_(local_units)
        else:
            staging_units.copy_(local_units.index_select(1, share_to_local))
        return out
    share = local_units
    if not plan.local_is_share:
        share = share.index_select(1, share_to_local)
    staging_units.index_copy_(1, share_to_canonical, share)
    return out


def scatter_blocks(
    mapping: RankMapping,
    src: torch.Tensor,
    local_tensors: Sequence[torch.Tensor],
    block_ids: torch.Tensor | Sequence[int],
) -> None:
    """Copy staged blocks ``src`` into blocks ``block_ids`` of the local KV cache.

    ``src`` has the shapes :func:`gather_blocks` accepts for ``out``. Only the group's page bytes
    of each listed block are written (packed-row padding and other groups' bytes are left
    alone). ``block_ids`` must not repeat.
    """
    ids = _block_ids(block_ids, local_tensors)
    staging = _staging_rows(mapping, src, len(ids), "src")
    if mapping.share_bytes == 0 or len(ids) == 0:
        return
    plan = _plan(mapping)
    _, local_to_share, share_to_canonical = plan.indices(staging.device)
    n, unit = len(ids), plan.unit
    (units,) = _wide_units((staging,), n, unit)
    if staging.shape[1] == mapping.share_bytes:
        share = units
    else:
        share = units.index_select(1, share_to_canonical)
    local = share if plan.local_is_share else share.index_select(1, local_to_share)
    _write_local(mapping, local_tensors, ids, local.reshape(n, -1))


# --------------------------------------------------------------------------------------------
# Local tensors
# --------------------------------------------------------------------------------------------


def _read_local(
    mapping: RankMapping, tensors: Sequence[torch.Tensor], ids: torch.Tensor
) -> torch.Tensor:
    """The listed blocks' local pages laid end to end: ``(n, share_bytes)`` uint8."""
    if mapping.form.packing == "packed":
        (span,) = _wide((_span(mapping, tensors),))
        return span.index_select(0, ids).view(torch.uint8)
    layers = _wide(tuple(_layer_pages(mapping, tensors)))
    pages = [page.index_select(0, ids) for page in layers]
    local = pages[0] if len(pages) == 1 else torch.cat(pages, dim=1)
    return local.view(torch.uint8)


def _write_local(
    mapping: RankMapping, tensors: Sequence[torch.Tensor], ids: torch.Tensor, local: torch.Tensor
) -> None:
    """Write ``local`` (n, share_bytes) - bytes, or the same bytes viewed as a wider integer
    type - into the listed blocks' pages."""
    local = local if local.dtype == torch.uint8 else local.view(torch.uint8)
    if mapping.form.packing == "packed":
        span, src = _wide((_span(mapping, tensors), local))
        span.index_copy_(0, ids, src)
        return
    page = mapping.page_bytes
    for li, pages in enumerate(_layer_pages(mapping, tensors)):
        dst, src = _wide((pages, local[:, li * page : (li + 1) * page]))
        dst.index_copy_(0, ids, src)


# Byte tensors are reinterpreted as the widest integer type their sizes, offsets and strides
# allow: torch's CPU copy kernels move elements, so int64 elements run ~8x faster than bytes.
_WIDE = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2))


def _wide_width(tensors: Sequence[torch.Tensor], unit: int) -> int:
    for _, width in _WIDE:
        if unit % width == 0 and all(
            t.stride(-1) == 1
            and t.storage_offset() % width == 0
            and all(s % width == 0 for s in t.stride()[:-1])
            and t.shape[-1] % width == 0
            for t in tensors
        ):
            return width
    return 1


def _as_width(t: torch.Tensor, width: int) -> torch.Tensor:
    if width == 1:
        return t
    dtype = next(d for d, w in _WIDE if w == width)
    return t.view(dtype)


def _wide(tensors: tuple[torch.Tensor, ...], unit: int = 8) -> tuple[torch.Tensor, ...]:
    """uint8 2-D tensors as one common wider integer type (or unchanged)."""
    width = _wide_width(tensors, unit)
    return tuple(_as_width(t, width) for t in tensors)


def _wide_units(tensors: tuple[torch.Tensor, ...], n: int, unit: int) -> tuple[torch.Tensor, ...]:
    """``(n, units, unit/width)`` views of dense ``(n, k*unit)`` byte rows, widened alike."""
    width = _wide_width(tensors, unit)
    return tuple(_as_width(t, width).view(n, -1, unit // width) for t in tensors)


def _span(mapping: RankMapping, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The group's bytes of every packed row: ``(num_blocks, share_bytes)`` uint8 view."""
    if len(tensors) != 1:
        raise LayoutError(f"packed form: expected 1 backing tensor, got {len(tensors)}")
    backing = tensors[0]
    if backing.dim() != 2:
        raise LayoutError(
            f"packed form: expected a 2-D (num_blocks, bytes_per_block) tensor, got shape "
            f"{tuple(backing.shape)}"
        )
    rows = _byte_rows(backing, backing.shape[1] * backing.element_size())
    end = mapping.form.group_offset + mapping.share_bytes
    if rows.shape[1] < end:
        raise LayoutError(
            f"packed form: rows of {rows.shape[1]} bytes cannot hold group_offset="
            f"{mapping.form.group_offset} + {len(mapping.local_layers)} layers x "
            f"{mapping.page_bytes} bytes"
        )
    return rows.narrow(1, mapping.form.group_offset, mapping.share_bytes)


def _layer_pages(mapping: RankMapping, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One ``(num_blocks, page_bytes)`` uint8 view per local layer."""
    if len(tensors) != len(mapping.local_layers):
        raise LayoutError(
            f"per-layer form: expected {len(mapping.local_layers)} tensors (local layers "
            f"{mapping.local_layers}), got {len(tensors)}"
        )
    return [_page_rows(mapping, t, li) for li, t in enumerate(tensors)]


def _page_rows(mapping: RankMapping, tensor: torch.Tensor, li: int) -> torch.Tensor:
    page = mapping.page_bytes
    if tensor.dim() == 2:
        rows = _byte_rows(tensor, tensor.shape[1] * tensor.element_size())
    else:
        _check_page_order(mapping, tensor, li)
        rows = _byte_rows(tensor, page)
    if rows.shape[1] < page:
        raise LayoutError(
            f"local layer {li}: expected at least {page} bytes per block, got {rows.shape[1]}"
        )
    return rows.narrow(1, 0, page)


def _check_page_order(mapping: RankMapping, tensor: torch.Tensor, li: int) -> None:
    """A typed per-layer tensor must hold each block's page densely in the family's order."""
    strides = tensor.stride()
    dims = [d for d in range(1, tensor.dim()) if tensor.shape[d] != 1]
    dims.sort(key=lambda d: -strides[d])  # physical order, outermost first
    sizes = [tensor.shape[d] for d in dims]
    dense = all(
        strides[d] == (strides[dims[k + 1]] * sizes[k + 1] if k + 1 < len(dims) else 1)
        for k, d in enumerate(dims)
    )
    # Compare in the tensor's own elements, so any dtype view of the page is accepted.
    h_local, bs = len(mapping.heads), mapping.local_block_size
    row, elem = mapping.geometry.token_row_bytes, tensor.element_size()
    order = (
        (h_local, bs, row // elem) if mapping.form.family == "hnd" else (bs, h_local, row // elem)
    )
    expected = [s for s in order if s != 1]
    if not dense or sizes != expected or row % elem:
        raise LayoutError(
            f"local layer {li}: expected each block's page as dense [{', '.join(map(str, order))}]"
            f" elements of {tensor.dtype} ({mapping.form.family}), got shape "
            f"{tuple(tensor.shape)} strides {tensor.stride()}"
        )


def _byte_rows(tensor: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """``(num_blocks, row_bytes)`` uint8 view of the same memory; row b starts at block b."""
    elem = tensor.element_size()
    if tensor.dim() == 2 and tensor.shape[1] > 1 and tensor.stride(1) != 1:
        raise LayoutError(f"expected rows with unit stride, got strides {tensor.stride()}")
    view = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    view.set_(
        tensor.untyped_storage(),
        tensor.storage_offset() * elem,
        (tensor.shape[0], row_bytes),
        (tensor.stride(0) * elem, 1),
    )
    return view


def _block_ids(
    block_ids: torch.Tensor | Sequence[int], tensors: Sequence[torch.Tensor]
) -> torch.Tensor:
    if not tensors:
        return torch.as_tensor(block_ids, dtype=torch.int64).reshape(-1)
    device = tensors[0].device
    ids = torch.as_tensor(block_ids, dtype=torch.int64).reshape(-1).to(device)
    num_blocks = tensors[0].shape[0]
    # Bounds are checked where it costs no device synchronisation.
    if (
        ids.device.type == "cpu"
        and len(ids)
        and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks)
    ):
        raise LayoutError(f"block ids: expected values in [0, {num_blocks}), got {ids.tolist()}")
    return ids


def _staging_rows(mapping: RankMapping, buffer: torch.Tensor, n: int, name: str) -> torch.Tensor:
    """``buffer`` as a uint8 ``(n, width)`` tensor, checking the width is a known one."""
    widths = (mapping.share_bytes, mapping.geometry.canonical_block_bytes)
    if (
        buffer.dim() != 2
        or buffer.element_size() != 1
        or buffer.shape[0] != n
        or buffer.shape[1] not in widths
        or (buffer.shape[1] > 1 and buffer.stride(1) != 1)
    ):
        raise LayoutError(
            f"{name}: expected a 1-byte tensor ({n}, {widths[0]}) (rank share) or ({n}, "
            f"{widths[1]}) (canonical block) with dense rows, got {tuple(buffer.shape)} "
            f"{buffer.dtype} strides {buffer.stride()}"
        )
    return buffer if buffer.dtype == torch.uint8 else buffer.view(torch.uint8)

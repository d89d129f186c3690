"""This worker's place in the parallel layout and the form of its KV tensors.

Everything here feeds :mod:`kvstore.layout.parallel`, the only code that knows what TP, DCP and
PCP do to KV bytes; vLLM's own ``CanonicalPageMapping`` objects are not used (they are absent
for packed rows and for some layouts, and their canonical page differs from the store's).

* :func:`rank_context`: ``ParallelLayout(tp, pp, dcp, pcp, interleave)`` from the engine facts
  and this worker's ``RankCoord`` from its global rank (vLLM orders ranks PP, PCP, TP).
* :func:`group_tensors`: the local form of one group from ``CanonicalKVCaches``:
  - per-layer: one int8 ``(num_blocks, page)`` view per layer of the group, in group order
    (vLLM's layer-outer layouts ``LBHNC`` / ``LBNHC``);
  - packed: the single full-row tensor vLLM builds for block-outer layouts (``BLHNC`` /
    ``BLNHC``), one ref per group with no mapping. The group's layers lie back to back in each
    row from ``group_offset``, found from the layer views' addresses.
  The page order (HND or NHD) comes from the resolved layout name and is checked against the
  strides of vLLM's typed layer views when they are available.
* :func:`certify`: every rank's mapping is derived and tiled (``verify_tiling``) at startup; a
  layout that cannot be certified is a :class:`kvstore.LayoutError` naming the reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from connector.facts import EngineFacts, GroupFacts
from kvstore import Identity, LayoutError
from kvstore.layout import LocalForm, ParallelLayout, RankCoord, RankMapping, verify_tiling
from kvstore.layout.parallel import Family, Packing
from kvstore.rank_io import group_geometry

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import CanonicalKVCaches

# Resolved vLLM KVCacheLayout name -> page family (axis order of one layer's page).
FAMILIES: dict[str, Family] = {"LBHNC": "hnd", "BLHNC": "hnd", "LBNHC": "nhd", "BLNHC": "nhd"}


@dataclass(frozen=True)
class RankContext:
    """Where one worker sits: the engine's parallel layout and its coordinate in it."""

    layout: ParallelLayout
    coord: RankCoord

    @property
    def global_rank(self) -> int:
        return self.layout.global_rank(self.coord)


@dataclass(frozen=True)
class GroupTensors:
    """One group's local KV tensors on this worker, in the form the mapping expects."""

    form: LocalForm
    tensors: tuple[torch.Tensor, ...]  # per-layer byte views, or the one packed backing tensor


def rank_context(facts: EngineFacts, rank: int) -> RankContext:
    """The layout of the engine and the coordinate of global rank ``rank`` in it."""
    layout = ParallelLayout(
        tp=facts.tp, pp=facts.pp, dcp=facts.dcp, pcp=facts.pcp, interleave=facts.interleave
    )
    return RankContext(layout, layout.coord_of(rank))


def family_of(kv_cache_layout: str) -> Family:
    """HND or NHD page order of a resolved vLLM KV-cache layout name."""
    try:
        return FAMILIES[kv_cache_layout]
    except KeyError:
        raise LayoutError(
            f"kv cache layout {kv_cache_layout!r}: expected one of {sorted(FAMILIES)} (a "
            "contiguous HND or NHD page per layer and block); set VLLM_KV_CACHE_LAYOUT or let "
            "the connector choose (LBHNC)"
        ) from None


def group_tensors(
    kv_caches: CanonicalKVCaches,
    position: int,
    group: GroupFacts,
    family: Family,
    layer_views: Mapping[str, torch.Tensor] | None,
) -> GroupTensors:
    """The local form and tensors of the group at ``position`` in ``kv_caches``."""
    refs = kv_caches.group_data_refs[position]
    names = group.layer_names
    where = f"KV-cache group {group.group_id}"
    if len(refs) == len(names) and all(r.page_size_bytes == group.page_bytes for r in refs):
        tensors = tuple(kv_caches.tensors[r.tensor_idx].tensor for r in refs)
        for name, tensor in zip(names, tensors, strict=True):
            _check_rows(tensor, group.page_bytes, f"{where} layer {name}")
            if layer_views is not None and name in layer_views:
                _check_view(layer_views[name], tensor.shape[0], group, family, f"{where} {name}")
        return GroupTensors(LocalForm(family=family, packing="per_layer"), tensors)
    if len(refs) == 1 and refs[0].mapping is None:
        backing = kv_caches.tensors[refs[0].tensor_idx].tensor
        _check_rows(backing, refs[0].page_size_bytes, f"{where} packed rows")
        offset = _packed_offset(backing, names, group.page_bytes, layer_views, where)
        for name in names:
            if layer_views is not None:
                _check_view(layer_views[name], backing.shape[0], group, family, f"{where} {name}")
        packing: Packing = "packed"
        form = LocalForm(family=family, packing=packing, group_offset=offset)
        return GroupTensors(form, (backing,))
    raise LayoutError(
        f"{where}: expected one page ref per layer ({len(names)}) or one packed row ref, got "
        f"{len(refs)} refs with pages {[r.page_size_bytes for r in refs]}"
    )


def certify(identity: Identity, index: int, context: RankContext, form: LocalForm) -> RankMapping:
    """Derive and tile every rank's mapping of group ``index``; return this rank's."""
    layers = identity.groups[index].num_layers
    geometry = group_geometry(identity, index, range(layers), layers)
    mappings = verify_tiling(geometry, context.layout, form)
    return mappings[context.global_rank]


def check_mapping(mapping: RankMapping, group: GroupTensors, page_bytes: int, where: str) -> None:
    """The mapping's page size must be the page vLLM allocated; rows must hold the group."""
    if mapping.page_bytes != page_bytes:
        raise LayoutError(
            f"{where}: the canonical mapping expects {mapping.page_bytes}-byte pages, vLLM "
            f"allocated {page_bytes}"
        )
    if group.form.packing == "packed":
        row = group.tensors[0].shape[1] * group.tensors[0].element_size()
        end = group.form.group_offset + mapping.share_bytes
        if end > row:
            raise LayoutError(f"{where}: packed rows of {row} bytes end before byte {end}")


def _check_rows(tensor: torch.Tensor, page: int, where: str) -> None:
    if tensor.dim() != 2 or tensor.shape[1] * tensor.element_size() < page:
        raise LayoutError(
            f"{where}: expected a (num_blocks, >= {page} bytes) tensor, got shape "
            f"{tuple(tensor.shape)} {tensor.dtype}"
        )
    if tensor.shape[1] > 1 and tensor.stride(1) != 1:
        raise LayoutError(f"{where}: expected rows with unit stride, got {tensor.stride()}")


def _packed_offset(
    backing: torch.Tensor,
    names: Sequence[str],
    page: int,
    layer_views: Mapping[str, torch.Tensor] | None,
    where: str,
) -> int:
    """Byte offset of the group's first layer in a packed row; layers must be back to back."""
    if layer_views is None or any(n not in layer_views for n in names):
        raise LayoutError(
            f"{where}: a packed KV layout needs vLLM's layer views to place the group in its "
            "rows (load the spec through connector.KVStoreConnector)"
        )
    row_bytes = backing.stride(0) * backing.element_size()
    base = backing.data_ptr()
    offsets = [layer_views[n].data_ptr() - base for n in names]
    expected = [offsets[0] + i * page for i in range(len(names))]
    if offsets != expected or not 0 <= offsets[0] < row_bytes:
        raise LayoutError(
            f"{where}: expected the group's layers back to back in each packed row "
            f"({page}-byte pages from one offset), got offsets {offsets} in {row_bytes}-byte rows"
        )
    return offsets[0]


def _check_view(
    view: torch.Tensor, num_blocks: int, group: GroupFacts, family: Family, where: str
) -> None:
    """vLLM's typed layer view must hold each block's page densely in the family's order."""
    if view.shape[0] != num_blocks:
        raise LayoutError(
            f"{where}: the layer view has {view.shape[0]} blocks, the offloaded tensor "
            f"{num_blocks} (kernel block size differs from the block size?); not certifiable"
        )
    elem = view.element_size()
    heads = 1 if group.kind == "mla" else group.num_kv_heads
    row_elems = group.page_bytes // (heads * group.block_size * elem)
    order = (
        (heads, group.block_size, row_elems)
        if family == "hnd"
        else (
            group.block_size,
            heads,
            row_elems,
        )
    )
    strides = view.stride()
    dims = sorted(
        (d for d in range(1, view.dim()) if view.shape[d] != 1), key=lambda d: -strides[d]
    )
    sizes = [view.shape[d] for d in dims]
    dense = all(
        strides[d] == (strides[dims[k + 1]] * sizes[k + 1] if k + 1 < len(dims) else 1)
        for k, d in enumerate(dims)
    )
    if not dense or sizes != [s for s in order if s != 1]:
        raise LayoutError(
            f"{where}: expected each block's page as dense {list(order)} elements ({family}), "
            f"got shape {tuple(view.shape)} strides {view.stride()}"
        )

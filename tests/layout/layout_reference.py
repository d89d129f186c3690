"""Reference model of vLLM's KV sharding, written independently of kvstore's runs.

A block's full KV is a tensor ``kv[n][L][H][T][X]`` (X = 2*D elements, K then V, or the MLA
latent), stored as raw integer bits (uint16 for 2-byte dtypes, uint8 for fp8). From it this
module derives (a) the canonical block bytes by the closed form ``[H][L][T][X]`` and (b) each
rank's local pages exactly as vLLM would hold them, by slicing heads, tokens and layers with
the formulas of vLLM 0.33 (QKVParallelLinear head replication, the block table's token
interleave, get_pp_indices, initialize_model_parallel's DCP groups). Nothing here calls
kvstore.layout.parallel's derivation, so the two can disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstore.layout import (
    GroupGeometry,
    LocalForm,
    ParallelLayout,
    RankCoord,
    RankMapping,
    gather_blocks,
    map_rank,
    scatter_blocks,
)

ELEMENT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def full_kv(geometry: GroupGeometry, n_blocks: int, seed: int) -> torch.Tensor:
    """Random KV of ``n_blocks`` blocks: ``(n, L, H, T, X)`` raw element bits."""
    gen = torch.Generator().manual_seed(seed)
    x = geometry.token_row_bytes // geometry.elem_size
    shape = (n_blocks, geometry.num_layers, geometry.num_kv_heads, geometry.tokens_per_block, x)
    raw = torch.randint(0, 256, (*shape[:-1], x * geometry.elem_size), generator=gen)
    return raw.to(torch.uint8).view(ELEMENT_DTYPES[geometry.elem_size])


def canonical_bytes(kv: torch.Tensor) -> torch.Tensor:
    """Closed form of format v1: C-order bytes of ``[H][L][T][X]`` per block, ``(n, bytes)``."""
    n = kv.shape[0]
    return kv.permute(0, 2, 1, 3, 4).contiguous().view(torch.uint8).reshape(n, -1)


def stage_layer_range(
    num_hidden_layers: int, pp_rank: int, pp: int, partition: tuple[int, ...] | None = None
) -> tuple[int, int]:
    """vLLM get_pp_indices, restated: remainder layers go to the stages before the last."""
    base, extra = divmod(num_hidden_layers, pp)
    counts = [base + (1 if pp - 1 - extra <= s < pp - 1 else 0) for s in range(pp)]
    if partition is not None:
        counts = list(partition)
    return sum(counts[:pp_rank]), sum(counts[: pp_rank + 1])


@dataclass(frozen=True)
class RankView:
    """What one rank holds of a group: its layers (group positions), heads and token slots."""

    layers: tuple[int, ...]
    heads: tuple[int, ...]
    tokens: tuple[int, ...]  # canonical token of each local slot


def rank_view(geometry: GroupGeometry, layout: ParallelLayout, coord: RankCoord) -> RankView:
    heads_total, tp = geometry.num_kv_heads, layout.tp
    if heads_total >= tp:
        per_rank = heads_total // tp
        heads = tuple(range(coord.tp_rank * per_rank, (coord.tp_rank + 1) * per_rank))
    else:  # each head replicated on tp // H consecutive TP ranks
        heads = (coord.tp_rank // (tp // heads_total),)
    if layout.pcp_kv == "sharded":
        shards = layout.dcp * layout.pcp
        shard = coord.pcp_rank * layout.dcp + coord.tp_rank % layout.dcp
    else:  # DCP groups cut from ranks ordered tp-major, pcp-minor
        shards = layout.dcp
        shard = (coord.tp_rank * layout.pcp + coord.pcp_rank) % layout.dcp
    bs = geometry.tokens_per_block // shards
    step = layout.interleave if shards > 1 else bs
    tokens = tuple((i // step * shards + shard) * step + i % step for i in range(bs))
    start, end = stage_layer_range(
        geometry.num_hidden_layers, coord.pp_rank, layout.pp, layout.pp_partition
    )
    layers = tuple(i for i, lid in enumerate(geometry.layer_ids) if start <= lid < end)
    return RankView(layers, heads, tokens)


def rank_pages(kv: torch.Tensor, view: RankView, family: str) -> torch.Tensor:
    """The rank's pages per block and local layer: ``(n, Ll, Hl, bs, X)`` (hnd) or
    ``(n, Ll, bs, Hl, X)`` (nhd)."""
    layers = torch.tensor(view.layers, dtype=torch.int64)
    heads = torch.tensor(view.heads, dtype=torch.int64)
    tokens = torch.tensor(view.tokens, dtype=torch.int64)
    pages = kv.index_select(1, layers).index_select(2, heads).index_select(3, tokens)
    return pages if family == "hnd" else pages.permute(0, 1, 3, 2, 4)


def page_bytes(pages: torch.Tensor) -> torch.Tensor:
    """``(n, Ll, page_bytes)`` uint8 of :func:`rank_pages` output."""
    n, n_layers = pages.shape[:2]
    per_layer = pages[0, 0].numel() * pages.element_size() if pages.numel() else 0
    if not n_layers:
        per_layer = pages.element_size() * int(torch.tensor(pages.shape[2:]).prod())
    return pages.contiguous().view(torch.uint8).reshape(n, n_layers, per_layer)


@dataclass
class LocalCache:
    """A rank's KV cache tensors, filled with noise except for the blocks under test."""

    tensors: list[torch.Tensor]
    block_ids: torch.Tensor


def build_cache(
    pages: torch.Tensor,
    form: LocalForm,
    num_blocks: int,
    block_ids: torch.Tensor,
    seed: int,
    row_padding: int = 40,
    vllm_logical_view: bool = False,
) -> LocalCache:
    """Local tensors holding ``pages`` (from :func:`rank_pages`) at rows ``block_ids``.

    per_layer: one typed tensor per layer, shaped as the family's physical order, or (with
    ``vllm_logical_view``) vLLM's logical (num_blocks, H, bs, X) view with family strides.
    packed: one uint8 (num_blocks, group_offset + Ll*page + row_padding) tensor.
    """
    gen = torch.Generator().manual_seed(seed)
    n, n_layers = pages.shape[:2]
    if form.packing == "packed":
        flat = page_bytes(pages).reshape(n, -1)
        width = form.group_offset + flat.shape[1] + row_padding
        backing = torch.randint(0, 256, (num_blocks, width), generator=gen).to(torch.uint8)
        backing[block_ids, form.group_offset : form.group_offset + flat.shape[1]] = flat
        return LocalCache([backing], block_ids)
    tensors = []
    for li in range(n_layers):
        layer = pages[:, li]
        noise = torch.randint(0, 256, (num_blocks, *layer.shape[1:]), generator=gen)
        tensor = noise.to(layer.dtype)
        tensor[block_ids] = layer
        if vllm_logical_view and form.family == "nhd" and tensor.dim() == 4:
            tensor = tensor.permute(0, 2, 1, 3)  # logical (nb, H, bs, X), NHD strides
        tensors.append(tensor)
    return LocalCache(tensors, block_ids)


def cache_pages(cache: LocalCache, mapping: RankMapping, block_ids: torch.Tensor) -> torch.Tensor:
    """Read back ``(n, Ll, page_bytes)`` from a cache built by :func:`build_cache`."""
    page = mapping.page_bytes
    if mapping.form.packing == "packed":
        start = mapping.form.group_offset
        rows = cache.tensors[0][block_ids, start : start + len(mapping.local_layers) * page]
        return rows.reshape(len(block_ids), -1, page)
    if not mapping.local_layers:
        return torch.zeros(len(block_ids), 0, page, dtype=torch.uint8)
    layers = []
    for tensor in cache.tensors:
        physical = (
            tensor.permute(0, 2, 1, 3)
            if tensor.dim() == 4 and not tensor.is_contiguous()
            else tensor
        )
        layers.append(
            physical[block_ids].contiguous().view(torch.uint8).reshape(len(block_ids), -1)
        )
    return torch.stack(layers, dim=1)


# --------------------------------------------------------------------------------------------
# Harness: store a block with every rank of one layout, load it into every rank of another
# --------------------------------------------------------------------------------------------


def _expected_pages(
    kv: torch.Tensor, geometry: GroupGeometry, view: RankView, family: str
) -> torch.Tensor:
    pages = rank_pages(kv, view, family)
    if geometry.kind == "mla":  # vLLM's MLA cache is (num_blocks, bs, Cl): no head axis
        pages = pages.squeeze(2) if family == "hnd" else pages.squeeze(3)
    return pages


def _check_view(mapping: RankMapping, view: RankView) -> None:
    assert mapping.local_layers == view.layers, (mapping.local_layers, view.layers)
    assert mapping.heads == view.heads, (mapping.heads, view.heads)
    assert mapping.local_block_size == len(view.tokens)


def _block_ids(n: int, num_blocks: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(num_blocks, generator=gen)[:n]


def store_with_layout(
    geometry: GroupGeometry,
    layout: ParallelLayout,
    form: LocalForm,
    kv: torch.Tensor,
    keys: list[int],
    seed: int = 0,
    full_width: bool = False,
) -> torch.Tensor:
    """Gather with every rank of ``layout``; elected writers place their share in a canonical
    buffer. Asserts every canonical byte is written exactly once; returns the buffer."""
    n, size = kv.shape[0], geometry.canonical_block_bytes
    canonical = torch.zeros(n, size, dtype=torch.uint8)
    coverage = torch.zeros(n, size, dtype=torch.int32)
    num_blocks = n + 3
    for r, coord in enumerate(layout.ranks()):
        mapping = map_rank(geometry, layout, form, coord)
        view = rank_view(geometry, layout, coord)
        _check_view(mapping, view)
        block_ids = _block_ids(n, num_blocks, seed + r)
        pages = _expected_pages(kv, geometry, view, form.family)
        cache = build_cache(pages, form, num_blocks, block_ids, seed + 100 + r)
        writers = torch.tensor([mapping.is_writer(k) for k in keys], dtype=torch.bool)
        if full_width:
            staged = torch.full((n, size), 0xAB, dtype=torch.uint8)
            gather_blocks(mapping, cache.tensors, block_ids, staged)
            mine = torch.zeros(size, dtype=torch.bool)
            for seg in mapping.segments:
                mine[seg.canonical_offset : seg.canonical_offset + seg.size] = True
            assert bool((staged[:, ~mine] == 0xAB).all()), "gather wrote outside the rank's share"
            canonical[writers.unsqueeze(1) & mine] = staged[writers.unsqueeze(1) & mine]
            coverage += (writers.unsqueeze(1) & mine).int()
            continue
        share = torch.empty(n, mapping.share_bytes, dtype=torch.uint8)
        gather_blocks(mapping, cache.tensors, block_ids, share)
        for seg in mapping.segments:
            dst = slice(seg.canonical_offset, seg.canonical_offset + seg.size)
            src = slice(seg.share_offset, seg.share_offset + seg.size)
            canonical[writers, dst] = share[writers, src]
            coverage[writers, dst] += 1
    assert bool((coverage == 1).all()), (
        f"canonical bytes written {coverage.min().item()}..{coverage.max().item()} times"
    )
    return canonical


def load_with_layout(
    geometry: GroupGeometry,
    layout: ParallelLayout,
    form: LocalForm,
    kv: torch.Tensor,
    canonical: torch.Tensor,
    seed: int = 0,
    full_width: bool = False,
) -> None:
    """Scatter ``canonical`` into every rank of ``layout``; assert each rank's pages equal the
    reference shard and that nothing else in its cache changed."""
    n = kv.shape[0]
    num_blocks = n + 3
    for r, coord in enumerate(layout.ranks()):
        mapping = map_rank(geometry, layout, form, coord)
        view = rank_view(geometry, layout, coord)
        _check_view(mapping, view)
        block_ids = _block_ids(n, num_blocks, seed + 7 * r + 1)
        expected = _expected_pages(kv, geometry, view, form.family)
        noise = torch.randint_like(expected.view(torch.uint8), 0, 256).view(expected.dtype)
        cache = build_cache(noise, form, num_blocks, block_ids, seed + 200 + r)
        before = [t.clone() for t in cache.tensors]
        if full_width:
            src = canonical.clone()
        else:
            src = torch.empty(n, mapping.share_bytes, dtype=torch.uint8)
            for seg in mapping.segments:
                src[:, seg.share_offset : seg.share_offset + seg.size] = canonical[
                    :, seg.canonical_offset : seg.canonical_offset + seg.size
                ]
        scatter_blocks(mapping, src, cache.tensors, block_ids)
        got = cache_pages(cache, mapping, block_ids)
        assert torch.equal(got, page_bytes(expected)), f"rank {coord}: loaded pages differ"
        _check_untouched(mapping, cache, before, block_ids, num_blocks)


def _check_untouched(
    mapping: RankMapping,
    cache: LocalCache,
    before: list[torch.Tensor],
    block_ids: torch.Tensor,
    num_blocks: int,
) -> None:
    others = torch.tensor([b for b in range(num_blocks) if b not in set(block_ids.tolist())])
    for tensor, old in zip(cache.tensors, before, strict=True):
        assert torch.equal(tensor[others], old[others]), "scatter touched other blocks"
    if mapping.form.packing == "packed":
        start = mapping.form.group_offset
        end = start + mapping.share_bytes
        row, old = cache.tensors[0][block_ids], before[0][block_ids]
        assert torch.equal(row[:, :start], old[:, :start]), "scatter touched bytes before the group"
        assert torch.equal(row[:, end:], old[:, end:]), "scatter touched row padding"


def roundtrip(
    geometry: GroupGeometry,
    store: tuple[ParallelLayout, LocalForm],
    load: tuple[ParallelLayout, LocalForm],
    n_blocks: int = 3,
    seed: int = 0,
    full_width: bool = False,
) -> None:
    """Store with one (layout, form), compare with the closed form, load with another."""
    kv = full_kv(geometry, n_blocks, seed)
    gen = torch.Generator().manual_seed(seed)
    keys = [int(k) for k in torch.randint(0, 2**62, (n_blocks,), generator=gen)]
    canonical = store_with_layout(geometry, *store, kv, keys, seed, full_width)
    assert torch.equal(canonical, canonical_bytes(kv)), "stored bytes differ from the closed form"
    load_with_layout(geometry, *load, kv, canonical, seed, full_width)

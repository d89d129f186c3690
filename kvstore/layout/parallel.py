"""Canonical mapping between a rank's local KV pages and a block's canonical bytes.

This module and the ones it builds on are the only code of kvstore that knows what TP, PP,
DCP and PCP are. It turns (group geometry, parallel layout, local tensor form, rank) into
plain byte runs plus a writer election; everything downstream moves bytes by those runs
(see :mod:`kvstore.layout.page`). It is pure integer arithmetic: no torch, no vLLM.

Modules: :mod:`kvstore.layout.parallel_layout` (:class:`ParallelLayout`, :class:`RankCoord`,
:func:`pp_layer_range`), :mod:`kvstore.layout.geometry` (:class:`GroupGeometry`,
:class:`LocalForm`), :mod:`kvstore.layout.records` (:class:`CopyRun`, :class:`ShareSegment`,
:class:`RankMapping`), :mod:`kvstore.layout.tiling` (:func:`check_tiling`), and this one
(:func:`map_rank`, :func:`map_all_ranks`, :func:`verify_tiling`), which re-exports them all.

Canonical block (on-disk format v1, fixed)
    Attention group (kind "full" / "sliding"), L layers in the group's layer order, H KV heads,
    T tokens per block (natural order), head dim D, element size E: the C-order bytes of
    ``[H][L][T][2][D]`` (K then V per token). Inner chunk ``(h, l)`` has index ``h*L + l`` and
    spans canonical bytes ``[(h*L + l) * T*2*D*E, +T*2*D*E)``.
    MLA group: ``[L][T][Cl]``; inner chunk ``l`` spans ``[l * T*Cl*E, +T*Cl*E)``. This is the
    attention formula with H = 1 and a token row of Cl elements instead of 2*D, which is how the
    code treats it: one "token row" of R bytes per (head, token), R = 2*D*E or Cl*E.

Local pages (what vLLM holds on one rank)
    bs = tokens per GPU block on the rank, H_local = max(1, H // tp). One layer's page is
    ``[H_local][bs][R]`` (family "hnd", vLLM LBHNC) or ``[bs][H_local][R]`` ("nhd", LBNHC);
    for MLA both are ``[bs][R]``. Tensor forms: "per_layer" (one tensor per local layer, block
    b's page at row b) or "packed" (one byte tensor, row b holds the local layers of the group
    back to back from ``group_offset``, each ``page`` bytes; rows may be longer, padding).

Parallelism model (vLLM 0.33)
    * Rank order: ``global_rank = (pp_rank * pcp + pcp_rank) * tp + tp_rank``
      (vLLM ``initialize_model_parallel``: ExternalDP x DP x PP x PCP x TP).
    * TP: ``H >= tp`` splits heads evenly (``H % tp == 0``); ``H < tp`` replicates each head
      on ``tp // H`` ranks (``tp % H == 0``). Rank holds heads
      ``[head_shard * H_local, +H_local)`` with ``head_shard = tp_rank // replication``. MLA's
      latent is replicated on every TP rank.
    * PP: a stage holds the group layers whose *model* layer id lies in its range, in group
      order; ranges follow vLLM ``get_pp_indices`` (see :func:`pp_layer_range`).
    * DCP shards tokens: local slot i of token shard c holds canonical token
      ``((i // I) * S + c) * I + i % I`` (S token shards, I = interleave). A DCP group must hold
      identical KV heads, otherwise the layout is refused (vLLM's ``replication % dcp`` gate).
    * PCP has two models, chosen by :attr:`ParallelLayout.pcp_kv`:
      - ``"replicated"`` (default): what vLLM 0.33's model runner does. PCP ranks gather the KV
        back to every PCP rank ("PCP-only execution replicates the KV cache",
        ``ParallelConfig.pcp_shard_decode_requests``); only DCP shards tokens, with DCP groups
        formed over ``tp_rank * pcp + pcp_rank`` (``dcp in {1, pcp, tp*pcp}`` when pcp > 1), and
        the offloaded block spans ``bs * dcp`` tokens (``resolve_dcp_kv_block_size``).
      - ``"sharded"``: the model of vLLM's ``canonical_mapping.py`` (``_RankContext``): tokens
        interleaved over ``dcp * pcp`` shards, shard ``pcp_rank * dcp + tp_rank % dcp``, block
        span ``bs * dcp * pcp``. vLLM 0.33 never uses it at run time (its offloading config
        requires pcp == 1 for canonical pages); kept for byte-exact parity with that module.
    * Writer election: ranks of one pipeline stage holding the same heads and the same token
      shard hold identical bytes. They form a class ordered by global rank; ``num_writers`` is
      the class size and ``writer_index`` the rank's position, and a block is written by the
      member with ``block_key % num_writers == writer_index``. For vLLM-certified layouts this
      equals vLLM's ``replication // dcp`` and ``(tp_rank % replication) // dcp``. The key must be
      rank-consistent, e.g. ``int.from_bytes(block_hash[:8], "big")``. Every elected writer of a
      block writes its whole share, so exactly one rank writes each canonical byte.

Staging contract ("rank share")
    A rank's share of a block is the canonical bytes its local pages hold, concatenated in
    canonical order (``share_bytes`` = local layers x page). :attr:`RankMapping.segments` places
    the share: ``share[share_offset:+size]`` is inner chunk ``chunk`` at ``chunk_offset``. Reads
    and writes use the same share: a writer writes all of it, every rank reads all of it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvstore.errors import LayoutError
from kvstore.layout.geometry import Family, GroupGeometry, GroupKind, LocalForm, Packing
from kvstore.layout.parallel_layout import ParallelLayout, PcpKv, RankCoord, pp_layer_range
from kvstore.layout.records import CopyRun, RankMapping, ShareSegment
from kvstore.layout.tiling import check_tiling

__all__ = [
    "CopyRun",
    "Family",
    "GroupGeometry",
    "GroupKind",
    "LayoutError",
    "LocalForm",
    "Packing",
    "ParallelLayout",
    "PcpKv",
    "RankCoord",
    "RankMapping",
    "ShareSegment",
    "check_tiling",
    "map_all_ranks",
    "map_rank",
    "pp_layer_range",
    "verify_tiling",
]


# --------------------------------------------------------------------------------------------
# Deriving a rank's mapping
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _HeadSplit:
    """How TP spreads the KV heads."""

    num_shards: int  # distinct head sets
    replication: int  # TP ranks holding each head set
    heads_per_rank: int  # H_local

    def shard_of(self, tp_rank: int) -> int:
        return tp_rank // self.replication


def map_rank(
    geometry: GroupGeometry, layout: ParallelLayout, form: LocalForm, rank: RankCoord
) -> RankMapping:
    """The certified mapping of ``rank``; :class:`LayoutError` naming the reason otherwise."""
    layout.check_rank(rank)
    split = _split_heads(geometry, layout)
    bs = _local_block_size(geometry, layout)
    _certify_dcp_groups(geometry, layout, split)
    num_writers, writer_index = _elect(layout, split, rank)

    shard = split.shard_of(rank.tp_rank)
    heads = tuple(range(shard * split.heads_per_rank, (shard + 1) * split.heads_per_rank))
    local_layers = _stage_layers(geometry, layout, rank.pp_rank)
    page = split.heads_per_rank * bs * geometry.token_row_bytes
    fragments = _merge_contiguous(
        _granules(
            geometry=geometry,
            layout=layout,
            form=form,
            rank=rank,
            heads=heads,
            local_layers=local_layers,
            bs=bs,
        ),
        form,
        page,
    )
    segments = _share_segments(geometry, fragments)
    full, partial = _chunk_coverage(geometry, segments)
    return RankMapping(
        geometry=geometry,
        layout=layout,
        form=form,
        rank=rank,
        local_layers=local_layers,
        heads=heads,
        local_block_size=bs,
        page_bytes=page,
        runs=_to_runs(fragments, form, page),
        segments=segments,
        num_writers=num_writers,
        writer_index=writer_index,
        full_chunks=full,
        partial_chunks=partial,
    )


def map_all_ranks(
    geometry: GroupGeometry, layout: ParallelLayout, form: LocalForm
) -> tuple[RankMapping, ...]:
    """The mapping of every rank of ``layout``, in global rank order."""
    return tuple(map_rank(geometry, layout, form, coord) for coord in layout.ranks())


def _split_heads(geometry: GroupGeometry, layout: ParallelLayout) -> _HeadSplit:
    heads, tp = geometry.num_kv_heads, layout.tp
    if heads >= tp:
        if heads % tp:
            raise LayoutError(
                f"{layout}: kv_heads={heads} cannot be split evenly over tp={tp} ranks "
                "(expected kv_heads % tp == 0)"
            )
        return _HeadSplit(num_shards=tp, replication=1, heads_per_rank=heads // tp)
    if tp % heads:
        raise LayoutError(
            f"{layout}: tp={tp} is not a multiple of kv_heads={heads}, so heads cannot be "
            "replicated evenly (expected tp % kv_heads == 0)"
        )
    return _HeadSplit(num_shards=heads, replication=tp // heads, heads_per_rank=1)


def _local_block_size(geometry: GroupGeometry, layout: ParallelLayout) -> int:
    shards, tokens = layout.token_shards, geometry.tokens_per_block
    if tokens % shards:
        raise LayoutError(
            f"{layout}: tokens_per_block={tokens} cannot be spread over {shards} token shards "
            "(expected a multiple)"
        )
    bs = tokens // shards
    if shards > 1 and (layout.interleave > bs or bs % layout.interleave):
        raise LayoutError(
            f"{layout}: interleave={layout.interleave} must divide the local block size {bs} "
            f"(tokens_per_block={tokens} / {shards} token shards)"
        )
    return bs


def _stage_ranks(layout: ParallelLayout) -> list[RankCoord]:
    """The ranks of one pipeline stage; every stage has the same TP x PCP structure."""
    return [RankCoord(tp_rank=t, pcp_rank=p) for p in range(layout.pcp) for t in range(layout.tp)]


def _certify_dcp_groups(geometry: GroupGeometry, layout: ParallelLayout, split: _HeadSplit) -> None:
    """A DCP group shards the tokens of one head set; its ranks must hold identical heads."""
    if layout.dcp == 1:
        return
    shards_by_group: dict[int, set[int]] = {}
    for coord in _stage_ranks(layout):
        group, _ = layout.dcp_position(coord)
        shards_by_group.setdefault(group, set()).add(split.shard_of(coord.tp_rank))
    for group, shards in sorted(shards_by_group.items()):
        if len(shards) > 1:
            detail = (
                f" (replication tp // kv_heads = {split.replication} is not a multiple of "
                f"dcp={layout.dcp})"
                if layout.pcp == 1 or layout.pcp_kv == "sharded"
                else ""
            )
            raise LayoutError(
                f"{layout}: DCP group {group} spans ranks holding different KV heads (head "
                f"shards {sorted(shards)} of kv_heads={geometry.num_kv_heads}); tokens can be "
                f"sharded only across ranks holding identical heads{detail}; not certifiable"
            )


def _elect(layout: ParallelLayout, split: _HeadSplit, rank: RankCoord) -> tuple[int, int]:
    """``(num_writers, writer_index)``: ranks with identical bytes, ordered by global rank."""
    stage = _stage_ranks(layout)
    classes: dict[tuple[int, int], list[RankCoord]] = {}
    for coord in stage:  # stage order is global rank order
        key = (split.shard_of(coord.tp_rank), layout.token_shard(coord))
        classes.setdefault(key, []).append(coord)
    expected = split.num_shards * layout.token_shards
    if len(classes) != expected:  # unreachable once DCP groups are certified; fail closed
        raise LayoutError(
            f"{layout}: ranks hold {len(classes)} distinct (head shard, token shard) pairs, "
            f"expected {expected}; some bytes would have no holder"
        )
    me = RankCoord(tp_rank=rank.tp_rank, pcp_rank=rank.pcp_rank)
    members = classes[(split.shard_of(rank.tp_rank), layout.token_shard(rank))]
    return len(members), members.index(me)


def _stage_layers(geometry: GroupGeometry, layout: ParallelLayout, pp_rank: int) -> tuple[int, ...]:
    start, end = layout.layer_range(geometry.num_hidden_layers, pp_rank)
    return tuple(i for i, lid in enumerate(geometry.layer_ids) if start <= lid < end)


# A fragment: (local offset in the rank's concatenated local pages, canonical offset, size).
_Fragment = tuple[int, int, int]


def _granules(  # noqa: PLR0913 - keyword-only inputs of the granule walk, each a distinct piece of the rank mapping
    *,
    geometry: GroupGeometry,
    layout: ParallelLayout,
    form: LocalForm,
    rank: RankCoord,
    heads: tuple[int, ...],
    local_layers: tuple[int, ...],
    bs: int,
) -> list[_Fragment]:
    """Smallest pieces that are contiguous on both sides, in local order.

    Local offsets are in the rank's "local concat" coordinates: local layer ``li`` occupies
    ``[li*page, (li+1)*page)``. A token shard's interleave chunk of one head is contiguous in
    an HND page (and in any page with one head); in an NHD page with several heads only one
    (head, token) row is.
    """
    row, tokens, layers = geometry.token_row_bytes, geometry.tokens_per_block, geometry.num_layers
    shards, shard = layout.token_shards, layout.token_shard(rank)
    step = layout.interleave if shards > 1 else bs  # tokens per contiguous canonical run
    h_local = len(heads)
    page = h_local * bs * row
    rows_contiguous = form.family == "hnd" or h_local == 1

    def canonical_token(slot: int) -> int:
        return ((slot // step) * shards + shard) * step + slot % step

    out: list[_Fragment] = []
    for li, layer in enumerate(local_layers):
        for hl, head in enumerate(heads):
            chunk_base = (head * layers + layer) * tokens * row
            if rows_contiguous:
                for first in range(0, bs, step):
                    local = li * page + (hl * bs + first) * row
                    out.append((local, chunk_base + canonical_token(first) * row, step * row))
            else:
                for slot in range(bs):
                    local = li * page + (slot * h_local + hl) * row
                    out.append((local, chunk_base + canonical_token(slot) * row, row))
    out.sort()
    return out


def _merge_contiguous(fragments: list[_Fragment], form: LocalForm, page: int) -> list[_Fragment]:
    """Join local-order neighbours that are contiguous on both sides (never across separate
    per-layer tensors)."""
    merged: list[_Fragment] = []
    for local, canonical, size in fragments:
        if merged:
            p_local, p_canonical, p_size = merged[-1]
            same_region = form.packing == "packed" or local % page != 0
            if same_region and p_local + p_size == local and p_canonical + p_size == canonical:
                merged[-1] = (p_local, p_canonical, p_size + size)
                continue
        merged.append((local, canonical, size))
    return merged


def _to_runs(fragments: list[_Fragment], form: LocalForm, page: int) -> tuple[CopyRun, ...]:
    """Compress fragments into strided runs; the fewer of local-order and canonical-order."""

    def region_of(local: int) -> tuple[int, int]:
        if form.packing == "packed":
            return 0, form.group_offset + local
        return divmod(local, page)

    placed = [(*region_of(local), canonical, size) for local, canonical, size in fragments]
    by_local = _compress(placed)
    by_canonical = _compress(sorted(placed, key=lambda f: f[2]))
    return tuple(by_local if len(by_local) <= len(by_canonical) else by_canonical)


def _compress(placed: list[tuple[int, int, int, int]]) -> list[CopyRun]:
    """Greedy: extend the current run while region, size and both strides stay the same."""
    runs: list[CopyRun] = []
    for region, local, canonical, size in placed:
        if runs:
            cur = runs[-1]
            if cur.local_region == region and cur.size == size:
                if cur.count == 1:
                    runs[-1] = replace(
                        cur,
                        count=2,
                        local_stride=local - cur.local_offset,
                        canonical_stride=canonical - cur.canonical_offset,
                    )
                    continue
                if (
                    local == cur.local_offset + cur.count * cur.local_stride
                    and canonical == cur.canonical_offset + cur.count * cur.canonical_stride
                ):
                    runs[-1] = replace(cur, count=cur.count + 1)
                    continue
        runs.append(CopyRun(region, local, canonical, size))
    return runs


def _share_segments(
    geometry: GroupGeometry, fragments: list[_Fragment]
) -> tuple[ShareSegment, ...]:
    """The share in canonical order, one segment per contiguous piece of one inner chunk."""
    chunk_bytes = geometry.inner_chunk_bytes
    pieces: list[tuple[int, int]] = []  # (canonical offset, size), merged when contiguous
    for _, canonical, size in sorted(fragments, key=lambda f: f[1]):
        if pieces and pieces[-1][0] + pieces[-1][1] == canonical:
            pieces[-1] = (pieces[-1][0], pieces[-1][1] + size)
        else:
            pieces.append((canonical, size))
    segments: list[ShareSegment] = []
    share_offset = 0
    for start, size in pieces:
        position, end = start, start + size
        while position < end:  # split at inner chunk boundaries
            chunk, chunk_offset = divmod(position, chunk_bytes)
            piece = min(end, (chunk + 1) * chunk_bytes) - position
            segments.append(ShareSegment(chunk, chunk_offset, piece, share_offset, position))
            share_offset += piece
            position += piece
    return tuple(segments)


def _chunk_coverage(
    geometry: GroupGeometry, segments: tuple[ShareSegment, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    covered: dict[int, int] = {}
    for segment in segments:
        covered[segment.chunk] = covered.get(segment.chunk, 0) + segment.size
    full = tuple(c for c, n in sorted(covered.items()) if n == geometry.inner_chunk_bytes)
    partial = tuple(c for c, n in sorted(covered.items()) if n < geometry.inner_chunk_bytes)
    return full, partial


# --------------------------------------------------------------------------------------------
# Tiling verification
# --------------------------------------------------------------------------------------------


def verify_tiling(
    geometry: GroupGeometry, layout: ParallelLayout, form: LocalForm
) -> tuple[RankMapping, ...]:
    """Startup check: derive every rank's mapping and :func:`check_tiling` them.

    Returns the mappings (global rank order). Raises :class:`LayoutError` naming the reason when
    the layout is not certifiable or the runs do not tile.
    """
    mappings = map_all_ranks(geometry, layout, form)
    check_tiling(mappings)
    return mappings

"""Canonical mapping between a rank's local KV pages and a block's canonical bytes.

This is the only module of kvstore that knows what TP, PP, DCP and PCP are. It turns
(group geometry, parallel layout, local tensor form, rank) into plain byte runs plus a writer
election; everything downstream moves bytes by those runs (see :mod:`kvstore.layout.page`).
It is pure integer arithmetic: no torch, no vLLM.

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

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal, get_args

from kvstore.errors import LayoutError

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

GroupKind = Literal["full", "sliding", "mla"]
Family = Literal["hnd", "nhd"]
Packing = Literal["per_layer", "packed"]
PcpKv = Literal["replicated", "sharded"]

_LAYOUT_INT_KEYS = ("tp", "pp", "dcp", "pcp", "interleave")
_LAYOUT_KEYS = (*_LAYOUT_INT_KEYS, "pcp_kv", "pp_partition")


# --------------------------------------------------------------------------------------------
# Parallel layout and rank coordinates
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankCoord:
    """Position of one worker in a :class:`ParallelLayout` (DCP ranks live inside TP x PCP)."""

    tp_rank: int
    pp_rank: int = 0
    pcp_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("tp_rank", "pp_rank", "pcp_rank"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise LayoutError(f"rank: expected {name} to be an int >= 0, got {value!r}")


@dataclass(frozen=True)
class ParallelLayout:
    """How vLLM spreads one model over ranks. Validated on construction."""

    tp: int = 1  # tensor-parallel size: splits (or replicates) KV heads
    pp: int = 1  # pipeline stages: split layers
    dcp: int = 1  # decode-context-parallel size: shards the tokens of a block
    pcp: int = 1  # prefill-context-parallel size: see pcp_kv
    interleave: int = 1  # cp_kv_cache_interleave_size: consecutive tokens per token shard
    pcp_kv: PcpKv = "replicated"  # PCP ranks hold replicas (vLLM 0.33) or token shards
    pp_partition: tuple[int, ...] | None = None  # layers per stage (VLLM_PP_LAYER_PARTITION)

    def __post_init__(self) -> None:
        for name in _LAYOUT_INT_KEYS:
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise LayoutError(f"parallel layout: expected {name} >= 1, got {value!r}")
        if self.pcp_kv not in get_args(PcpKv):
            raise LayoutError(
                f"parallel layout: expected pcp_kv in {get_args(PcpKv)}, got {self.pcp_kv!r}"
            )
        self._check_dcp()
        if self.pp_partition is not None:
            parts = self.pp_partition
            if len(parts) != self.pp or any(not _is_int(p) or p < 1 for p in parts):
                raise LayoutError(
                    f"parallel layout: expected pp_partition to hold pp={self.pp} layer counts "
                    f">= 1, got {parts!r}"
                )

    def _check_dcp(self) -> None:
        """DCP ranks are carved out of existing ranks; vLLM's ParallelConfig rules."""
        if self.pcp_kv == "sharded" or self.pcp == 1:
            if self.tp % self.dcp:
                raise LayoutError(
                    f"parallel layout {self}: expected dcp to divide tp (DCP groups are made of "
                    f"TP ranks), got tp={self.tp}, dcp={self.dcp}"
                )
        elif self.dcp not in (1, self.pcp, self.tp * self.pcp):
            raise LayoutError(
                f"parallel layout {self}: with pcp > 1, expected dcp in "
                f"{sorted({1, self.pcp, self.tp * self.pcp})} (disabled, spanning PCP, or "
                f"spanning TP x PCP, as vLLM requires), got dcp={self.dcp}"
            )

    # -- sizes ---------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Number of ranks (workers) of this layout."""
        return self.tp * self.pp * self.pcp

    @property
    def token_shards(self) -> int:
        """Number of ranks a block's tokens are spread over (the canonical T / local bs)."""
        return self.dcp * self.pcp if self.pcp_kv == "sharded" else self.dcp

    # -- ranks ---------------------------------------------------------------------------------

    def ranks(self) -> tuple[RankCoord, ...]:
        """Every rank, in global rank order."""
        return tuple(self.coord_of(r) for r in range(self.world_size))

    def global_rank(self, coord: RankCoord) -> int:
        """vLLM's global rank of ``coord`` (PP outermost, then PCP, then TP)."""
        self.check_rank(coord)
        return (coord.pp_rank * self.pcp + coord.pcp_rank) * self.tp + coord.tp_rank

    def coord_of(self, global_rank: int) -> RankCoord:
        """Inverse of :meth:`global_rank`."""
        if not _is_int(global_rank) or not 0 <= global_rank < self.world_size:
            raise LayoutError(
                f"rank: expected a global rank in [0, {self.world_size}) for {self}, "
                f"got {global_rank!r}"
            )
        stage, tp_rank = divmod(global_rank, self.tp)
        pp_rank, pcp_rank = divmod(stage, self.pcp)
        return RankCoord(tp_rank=tp_rank, pp_rank=pp_rank, pcp_rank=pcp_rank)

    def check_rank(self, coord: RankCoord) -> None:
        """Raise :class:`LayoutError` unless ``coord`` is a rank of this layout."""
        limits = (("tp_rank", self.tp), ("pp_rank", self.pp), ("pcp_rank", self.pcp))
        for name, size in limits:
            value = getattr(coord, name)
            if value >= size:
                raise LayoutError(f"rank: expected {name} < {size} for {self}, got {value}")

    def dcp_position(self, coord: RankCoord) -> tuple[int, int]:
        """``(dcp_group, dcp_rank)`` of ``coord`` within its pipeline stage.

        Replicated PCP follows vLLM's group construction (ranks ordered by
        ``tp_rank * pcp + pcp_rank``, cut into groups of ``dcp``); sharded PCP follows
        ``canonical_mapping.py`` (DCP groups inside each PCP rank's TP group).
        """
        if self.pcp_kv == "sharded":
            group_in_tp, dcp_rank = divmod(coord.tp_rank, self.dcp)
            return coord.pcp_rank * (self.tp // self.dcp) + group_in_tp, dcp_rank
        return divmod(coord.tp_rank * self.pcp + coord.pcp_rank, self.dcp)

    def token_shard(self, coord: RankCoord) -> int:
        """Which of the :attr:`token_shards` interleaved token sets ``coord`` holds."""
        _, dcp_rank = self.dcp_position(coord)
        if self.pcp_kv == "sharded":
            return coord.pcp_rank * self.dcp + dcp_rank
        return dcp_rank

    def layer_range(self, num_hidden_layers: int, pp_rank: int) -> tuple[int, int]:
        """Model layer ids ``[start, end)`` of pipeline stage ``pp_rank``."""
        return pp_layer_range(num_hidden_layers, pp_rank, self.pp, self.pp_partition)

    # -- text form -----------------------------------------------------------------------------

    def __str__(self) -> str:
        parts = [f"tp={self.tp}"]
        parts += [f"{k}={getattr(self, k)}" for k in _LAYOUT_INT_KEYS[1:] if getattr(self, k) != 1]
        if self.pcp_kv != "replicated":
            parts.append(f"pcp_kv={self.pcp_kv}")
        if self.pp_partition is not None:
            parts.append("pp_partition=" + ":".join(str(p) for p in self.pp_partition))
        return ",".join(parts)

    @classmethod
    def parse(cls, text: str) -> ParallelLayout:
        """Parse ``"tp=4,pp=2"``, ``"tp=2,dcp=2,interleave=4"``, ... (the :meth:`__str__` form).

        Keys: tp, pp, dcp, pcp, interleave (ints), pcp_kv (replicated|sharded), pp_partition
        (layer counts joined by ':'). Unset keys take their defaults; ``""`` is TP=1.
        """
        values: dict[str, object] = {}
        items = [item.strip() for item in text.split(",")] if text.strip() else []
        for item in items:
            key, sep, raw = (part.strip() for part in item.partition("="))
            if not sep or not key or not raw:
                raise LayoutError(f"parallel layout {text!r}: expected key=value, got {item!r}")
            if key not in _LAYOUT_KEYS:
                raise LayoutError(
                    f"parallel layout {text!r}: unknown key {key!r}; accepted keys are "
                    f"{', '.join(_LAYOUT_KEYS)}"
                )
            if key in values:
                raise LayoutError(f"parallel layout {text!r}: key {key!r} given twice")
            values[key] = _parse_layout_value(text, key, raw)
        return cls(**values)  # type: ignore[arg-type]


def _parse_layout_value(text: str, key: str, raw: str) -> object:
    if key == "pcp_kv":
        return raw
    try:
        if key == "pp_partition":
            return tuple(int(p) for p in raw.split(":"))
        return int(raw)
    except ValueError:
        expected = "layer counts joined by ':'" if key == "pp_partition" else "an integer"
        raise LayoutError(
            f"parallel layout {text!r}: expected {key} to be {expected}, got {raw!r}"
        ) from None


def pp_layer_range(
    num_hidden_layers: int, pp_rank: int, pp_size: int, partition: Sequence[int] | None = None
) -> tuple[int, int]:
    """Model layer ids ``[start, end)`` held by pipeline stage ``pp_rank``.

    Same partition as vLLM 0.33 ``vllm.distributed.utils.get_pp_indices``: each stage gets
    ``num_hidden_layers // pp_size`` layers and the remainder ``r`` goes one each to the ``r``
    stages just before the last one (``partitions[-2], partitions[-3], ...``), since the last
    stage carries the final norm. ``partition`` is the explicit override vLLM reads from
    ``VLLM_PP_LAYER_PARTITION`` (passed in here, never read from the environment).
    """
    if not 0 <= pp_rank < pp_size:
        raise LayoutError(f"pipeline: expected pp_rank in [0, {pp_size}), got {pp_rank}")
    if partition is not None:
        parts = list(partition)
        if len(parts) != pp_size or sum(parts) != num_hidden_layers:
            raise LayoutError(
                f"pipeline: expected pp_partition of {pp_size} counts summing to "
                f"num_hidden_layers={num_hidden_layers}, got {parts}"
            )
    else:
        if num_hidden_layers < pp_size:
            raise LayoutError(
                f"pipeline: pp={pp_size} exceeds num_hidden_layers={num_hidden_layers}; a stage "
                "would hold no layers"
            )
        parts = [num_hidden_layers // pp_size] * pp_size
        for i in range(2, num_hidden_layers % pp_size + 2):
            parts[-i] += 1
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]


# --------------------------------------------------------------------------------------------
# Group geometry and local tensor form
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupGeometry:
    """Layout-free shape of one KV-cache group's canonical block (mirrors ``GroupSpec``)."""

    kind: GroupKind  # "full" / "sliding" attention, or "mla"
    layer_ids: tuple[int, ...]  # global model layer id of each group layer, in canonical order
    num_hidden_layers: int  # layers of the whole model (all groups): the PP partition input
    tokens_per_block: int  # T: canonical tokens per block (local block size x token shards)
    elem_size: int  # E: bytes per KV element (2 for bf16/fp16, 1 for fp8)
    num_kv_heads: int = 1  # H: all KV heads of the model (never a TP shard); 1 for MLA
    head_dim: int = 0  # attention: D, elements of K (and of V) per head and token
    latent_dim: int = 0  # MLA: Cl, elements of the latent per token

    def __post_init__(self) -> None:
        if self.kind not in get_args(GroupKind):
            raise LayoutError(f"group: expected kind in {get_args(GroupKind)}, got {self.kind!r}")
        ids = self.layer_ids
        if not ids or len(set(ids)) != len(ids):
            raise LayoutError(f"group: expected unique layer ids, got {ids!r}")
        if any(not _is_int(i) or not 0 <= i < self.num_hidden_layers for i in ids):
            raise LayoutError(
                f"group: expected layer ids in [0, num_hidden_layers={self.num_hidden_layers}), "
                f"got {ids!r}"
            )
        for name in ("tokens_per_block", "elem_size", "num_kv_heads"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise LayoutError(f"group: expected {name} >= 1, got {getattr(self, name)!r}")
        if self.kind == "mla":
            if self.latent_dim < 1 or self.num_kv_heads != 1 or self.head_dim != 0:
                raise LayoutError(
                    "mla group: expected latent_dim >= 1, num_kv_heads == 1 and head_dim == 0, "
                    f"got latent_dim={self.latent_dim}, num_kv_heads={self.num_kv_heads}, "
                    f"head_dim={self.head_dim}"
                )
        elif self.head_dim < 1 or self.latent_dim != 0:
            raise LayoutError(
                f"{self.kind} group: expected head_dim >= 1 and latent_dim == 0, got "
                f"head_dim={self.head_dim}, latent_dim={self.latent_dim}"
            )

    @property
    def num_layers(self) -> int:
        """L: layers of the group."""
        return len(self.layer_ids)

    @property
    def token_row_bytes(self) -> int:
        """R: bytes of one (head, token) row: K then V (attention) or the latent (MLA)."""
        elems = self.latent_dim if self.kind == "mla" else 2 * self.head_dim
        return elems * self.elem_size

    @property
    def inner_chunk_bytes(self) -> int:
        """Bytes of one inner chunk (one head of one layer, all T tokens)."""
        return self.tokens_per_block * self.token_row_bytes

    @property
    def num_inner_chunks(self) -> int:
        """H x L inner chunks per block (L for MLA)."""
        return self.num_kv_heads * self.num_layers

    @property
    def canonical_block_bytes(self) -> int:
        """Bytes of the whole canonical block."""
        return self.num_inner_chunks * self.inner_chunk_bytes

    def inner_chunk_index(self, head: int, layer: int) -> int:
        """Index of inner chunk ``(head, layer)``; ``layer`` is the position in ``layer_ids``."""
        return head * self.num_layers + layer


@dataclass(frozen=True)
class LocalForm:
    """How a rank's KV cache tensors lay out its pages."""

    family: Family = "hnd"  # page order: "hnd" [H][N][C] (LBHNC/BLHNC) or "nhd" [N][H][C]
    packing: Packing = "per_layer"  # one tensor per local layer, or one packed row per block
    group_offset: int = 0  # packed: byte offset of the group's first local layer in a row

    def __post_init__(self) -> None:
        if self.family not in get_args(Family):
            raise LayoutError(f"form: expected family in {get_args(Family)}, got {self.family!r}")
        if self.packing not in get_args(Packing):
            raise LayoutError(
                f"form: expected packing in {get_args(Packing)}, got {self.packing!r}"
            )
        if not _is_int(self.group_offset) or self.group_offset < 0:
            raise LayoutError(f"form: expected group_offset >= 0, got {self.group_offset!r}")
        if self.packing == "per_layer" and self.group_offset:
            raise LayoutError(
                f"form: group_offset applies to packed rows only, got {self.group_offset} "
                "with per_layer tensors"
            )


# --------------------------------------------------------------------------------------------
# Mapping records
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CopyRun:
    """A strided byte correspondence between local pages and the canonical block.

    For k in range(count): local bytes ``[local_offset + k*local_stride, +size)`` of local
    region ``local_region`` correspond to canonical bytes
    ``[canonical_offset + k*canonical_stride, +size)``. Region = local layer index for
    per-layer tensors (offsets within that layer's page), 0 for a packed row (offsets within
    the row, ``group_offset`` included). Strides are 0 when count == 1 and may be negative.
    The same run serves both directions (gather = local to canonical, scatter = reverse).
    """

    local_region: int
    local_offset: int
    canonical_offset: int
    size: int
    count: int = 1
    local_stride: int = 0
    canonical_stride: int = 0

    def fragments(self) -> Iterator[tuple[int, int, int]]:
        """``(local_offset, canonical_offset, size)`` of each fragment."""
        for k in range(self.count):
            yield (
                self.local_offset + k * self.local_stride,
                self.canonical_offset + k * self.canonical_stride,
                self.size,
            )

    @property
    def total_bytes(self) -> int:
        return self.size * self.count


@dataclass(frozen=True)
class ShareSegment:
    """``share[share_offset:+size]`` is canonical inner chunk ``chunk`` at ``chunk_offset``."""

    chunk: int  # inner chunk index (h*L + l; MLA: l)
    chunk_offset: int  # byte offset within the inner chunk
    size: int
    share_offset: int  # byte offset within the rank's share buffer
    canonical_offset: int  # = chunk * inner_chunk_bytes + chunk_offset


@dataclass(frozen=True, eq=False)
class RankMapping:
    """Everything one rank needs to move one group's blocks between its pages and the store.

    Invariants (checked for all ranks together by :func:`check_tiling`): ``runs`` cover the
    rank's local pages exactly once; ``segments`` cover the share exactly once, in canonical
    order; over any block key, the elected writers' runs tile the canonical block exactly once.
    """

    geometry: GroupGeometry
    layout: ParallelLayout
    form: LocalForm
    rank: RankCoord
    local_layers: tuple[int, ...]  # positions in geometry.layer_ids held here, in local order
    heads: tuple[int, ...]  # global KV heads held here (consecutive); (0,) for MLA
    local_block_size: int  # bs: token slots per local block
    page_bytes: int  # bytes of one local layer's page of one block
    runs: tuple[CopyRun, ...]
    segments: tuple[ShareSegment, ...]
    num_writers: int  # ranks holding exactly these bytes (this one included)
    writer_index: int  # this rank's position among them
    full_chunks: tuple[int, ...]  # inner chunks whose every byte is in this rank's share
    partial_chunks: tuple[int, ...]  # inner chunks this rank holds only some bytes of

    @property
    def share_bytes(self) -> int:
        """Bytes this rank writes (when elected) and reads per block."""
        return len(self.local_layers) * self.page_bytes

    @property
    def num_regions(self) -> int:
        """How many local tensors the rank passes: local layers, or 1 packed backing tensor."""
        return len(self.local_layers) if self.form.packing == "per_layer" else 1

    def is_writer(self, block_key: int) -> bool:
        """Whether this rank writes the block with rank-consistent key ``block_key``."""
        return block_key % self.num_writers == self.writer_index


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


def check_tiling(mappings: Sequence[RankMapping]) -> None:
    """Check that ``mappings`` (one per rank of one layout) move every byte exactly once.

    * each rank's runs cover its local pages exactly once (per layer page, or the group's span
      of the packed row), and its segments cover its share exactly once with the same
      canonical bytes as its runs;
    * for every residue of the writer election, the elected ranks' runs tile the canonical
      block exactly once.
    """
    if not mappings:
        raise LayoutError("tiling: expected the mappings of every rank, got none")
    first = mappings[0]
    what = f"{first.geometry.kind} group under {first.layout}"
    for mapping in mappings:
        if (mapping.geometry, mapping.layout, mapping.form) != (
            first.geometry,
            first.layout,
            first.form,
        ):
            raise LayoutError(f"tiling: mappings of {what} mix geometries, layouts or forms")
    ranks = sorted(first.layout.global_rank(m.rank) for m in mappings)
    if ranks != list(range(first.layout.world_size)):
        raise LayoutError(
            f"tiling: expected one mapping per rank 0..{first.layout.world_size - 1} of {what}, "
            f"got ranks {ranks}"
        )
    for mapping in mappings:
        _check_local_cover(mapping, what)
        _check_share_cover(mapping, what)
    canonical_size = first.geometry.canonical_block_bytes
    for residue in range(math.lcm(*(m.num_writers for m in mappings))):
        intervals = [
            (canonical, canonical + size)
            for m in mappings
            if m.is_writer(residue)
            for run in m.runs
            for _, canonical, size in run.fragments()
        ]
        problem = _partition_problem(intervals, 0, canonical_size)
        if problem:
            raise LayoutError(
                f"tiling: writers of election residue {residue} of {what} {problem} of the "
                f"canonical block ({canonical_size} bytes)"
            )


def _check_local_cover(mapping: RankMapping, what: str) -> None:
    by_region: dict[int, list[tuple[int, int]]] = {}
    for run in mapping.runs:
        for local, _, size in run.fragments():
            by_region.setdefault(run.local_region, []).append((local, local + size))
    n_local = len(mapping.local_layers)
    if mapping.form.packing == "packed":
        start = mapping.form.group_offset
        expected = {0: (start, start + n_local * mapping.page_bytes)} if n_local else {}
    else:
        expected = dict.fromkeys(range(n_local), (0, mapping.page_bytes))
    if set(by_region) != set(expected):
        raise LayoutError(
            f"tiling: rank {mapping.rank} of {what} has runs for local regions "
            f"{sorted(by_region)}, expected {sorted(expected)}"
        )
    for region, (start, end) in expected.items():
        problem = _partition_problem(by_region[region], start, end)
        if problem:
            raise LayoutError(
                f"tiling: runs of rank {mapping.rank} of {what} {problem} of local region {region}"
            )


def _check_share_cover(mapping: RankMapping, what: str) -> None:
    chunk_bytes = mapping.geometry.inner_chunk_bytes
    share = [(s.share_offset, s.share_offset + s.size) for s in mapping.segments]
    problem = _partition_problem(share, 0, mapping.share_bytes)
    run_bytes = sorted(
        (canonical, canonical + size)
        for run in mapping.runs
        for _, canonical, size in run.fragments()
    )
    segment_bytes = sorted(
        (s.canonical_offset, s.canonical_offset + s.size) for s in mapping.segments
    )
    inconsistent = any(
        s.canonical_offset != s.chunk * chunk_bytes + s.chunk_offset
        or not 0 <= s.chunk_offset < s.chunk_offset + s.size <= chunk_bytes
        for s in mapping.segments
    )
    if problem or inconsistent or _merged(run_bytes) != _merged(segment_bytes):
        raise LayoutError(
            f"tiling: segments of rank {mapping.rank} of {what} do not place its share "
            f"({problem or 'canonical bytes differ from its runs'})"
        )


def _merged(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in intervals:
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def _partition_problem(intervals: list[tuple[int, int]], start: int, end: int) -> str | None:
    """None when ``intervals`` tile ``[start, end)`` exactly once, else what is wrong."""
    position = start
    for a, b in sorted(intervals):
        if a < position:
            return f"cover bytes [{a}, {min(b, position)}) twice"
        if a > position:
            return f"leave bytes [{position}, {a}) uncovered"
        position = b
    if position > end:
        return f"reach past the end, to byte {position} of [{start}, {end})"
    if position < end:
        return f"leave bytes [{position}, {end}) uncovered"
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

"""Group geometry and local tensor form.

:class:`GroupGeometry` is the layout-free shape of one KV-cache group's canonical block
(attention or MLA; the canonical block format is described in :mod:`kvstore.layout.parallel`);
:class:`LocalForm` is how a rank's KV cache tensors lay out its pages (page order and tensor
packing). Plain validated records: no torch, no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from kvstore.errors import LayoutError
from kvstore.layout.parallel_layout import _is_int

__all__ = [
    "Family",
    "GroupGeometry",
    "GroupKind",
    "LocalForm",
    "Packing",
]

GroupKind = Literal["full", "sliding", "mla"]
Family = Literal["hnd", "nhd"]
Packing = Literal["per_layer", "packed"]


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

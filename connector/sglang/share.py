"""Which part of each canonical block an SGLang rank holds, and the namespace it lives in.

SGLang hands every rank the same page keys (chained SHA-256 of the page's tokens) and its own
slice of the KV: TP ranks hold ``H / tp`` KV heads (or, with fewer heads than ranks, one head
replicated on ``tp / H`` ranks, rank ``r`` holding head ``r // (tp / H)``, as SGLang's QKV
projection splits them), pipeline stages hold the layers ``[start_layer, end_layer)`` of their
host pool, MLA's latent is whole on every rank. A rank's share of block ``key`` is the inner
chunks ``(h, l)`` of its heads and layers (MLA: ``l``) of the one canonical block: no rank,
TP size or stage in the key or the namespace, so a page written at TP=2 is read at TP=1.

The namespace identity (:class:`kvstore.Identity`) holds what changes the bytes or the meaning:
the model name SGLang keys storage on (with the host pool's format tag), the dtype, the page
size, the model's KV heads and head size (or latent), its layers, and the pool (``kv``,
``swa``, ...) through the layer names; ``hash_algo`` ``sglang_sha256`` marks the namespace as
written by SGLang (its keys never match vLLM's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from connector.sglang.pages import PoolGeometry
from kvstore import ConfigError, GroupSpec, Identity
from kvstore.identity import GroupKind

HASH_ALGO = "sglang_sha256"  # SGLang's get_storage_hash_str chain; also names the engine
DTYPE_NAMES = {
    "torch.float16": "float16",
    "torch.bfloat16": "bfloat16",
    "torch.float32": "float32",
    "torch.float8_e4m3fn": "float8_e4m3fn",
    "torch.float8_e5m2": "float8_e5m2",
    "torch.int8": "int8",
    "torch.uint8": "uint8",
}


@dataclass(frozen=True)
class RankShare:
    """One rank's inner chunks of every block of one pool, and the block's geometry."""

    total_heads: int  # the model's KV heads (1 for MLA)
    total_layers: int  # the model's layers in this pool
    heads: tuple[int, ...]  # this rank's heads
    layers: tuple[int, ...]  # this rank's layers (model layer ids of the pool's layers)
    chunks: tuple[int, ...]  # inner chunks of the share, in the order of its bytes

    @property
    def whole(self) -> bool:
        """True when the share is the whole block (one writer publishes it alone)."""
        return len(self.chunks) == self.total_heads * self.total_layers


def rank_share(
    geometry: PoolGeometry,
    storage: Any,
    start_layer: int,
    num_kv_heads: int = 0,
    num_layers: int = 0,
) -> RankShare:
    """The share of the rank ``storage`` (SGLang's ``HiCacheStorageConfig``) describes.

    ``num_kv_heads`` / ``num_layers``: the model's totals when the pool cannot tell them (KV
    heads replicated over TP ranks; pipeline stages); 0 derives them from the pool.
    """
    tp_size, tp_rank = int(storage.tp_size), int(storage.tp_rank)
    pp_size = int(getattr(storage, "pp_size", 1))
    for name in ("dcp_size", "attn_cp_size"):
        if int(getattr(storage, name, 1) or 1) > 1:
            raise ConfigError(
                f"kvstore HiCache backend: {name} > 1 is not supported yet (its pages are "
                "sharded by token); run without context parallelism or use another backend"
            )
    if not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tp_rank: expected 0..{tp_size - 1}, got {tp_rank}")
    local_layers = geometry.num_layers
    if num_layers == 0:
        if pp_size > 1:
            raise ConfigError(
                "kvstore HiCache backend: with pipeline parallelism (pp_size "
                f"{pp_size}) set 'num_layers' (the model's layers) in the extra config"
            )
        num_layers = local_layers
    if not 0 <= start_layer <= start_layer + local_layers <= num_layers:
        raise ConfigError(
            f"layers: this pool holds layers {start_layer}..{start_layer + local_layers - 1}, "
            f"outside the model's {num_layers} (num_layers)"
        )
    layers = tuple(range(start_layer, start_layer + local_layers))
    if geometry.kind == "mla":
        return RankShare(1, num_layers, (0,), layers, layers)
    heads = _rank_heads(geometry.num_heads, tp_size, tp_rank, num_kv_heads)
    total = num_kv_heads or geometry.num_heads * tp_size
    chunks = tuple(h * num_layers + layer for h in heads for layer in layers)
    return RankShare(total, num_layers, heads, layers, chunks)


def _rank_heads(local: int, tp_size: int, tp_rank: int, num_kv_heads: int) -> tuple[int, ...]:
    total = num_kv_heads or local * tp_size
    if total >= tp_size:
        if total % tp_size or local != total // tp_size:
            raise ConfigError(
                f"KV heads: a TP={tp_size} rank of a model with {total} KV heads holds "
                f"{total / tp_size:g}; this pool holds {local} (set 'num_kv_heads' to the "
                "model's KV heads if it is not pool heads x tp_size)"
            )
        return tuple(range(tp_rank * local, (tp_rank + 1) * local))
    if tp_size % total or local != 1:
        raise ConfigError(
            f"KV heads: {total} heads over TP={tp_size} ranks must replicate evenly with one "
            f"head per rank; got tp_size % heads = {tp_size % total}, pool heads {local}"
        )
    return (tp_rank // (tp_size // total),)


def pool_identity(model: str, pool_name: str, geometry: PoolGeometry, share: RankShare) -> Identity:
    """The namespace identity of one pool of a model (see the module docstring)."""
    dtype = DTYPE_NAMES.get(str(geometry.dtype))
    if dtype is None:
        raise ConfigError(f"kv dtype: expected one of {sorted(DTYPE_NAMES)}, got {geometry.dtype}")
    names = tuple(f"{pool_name}.{layer}" for layer in range(share.total_layers))
    if geometry.kind == "mla":
        group = GroupSpec(kind="mla", layer_names=names, latent_dim=sum(geometry.latent_dims))
    else:
        kind: GroupKind = (
            "sliding" if pool_name in ("swa", "draft_swa", "auxiliary_swa") else "full"
        )
        group = GroupSpec(
            kind=kind,
            layer_names=names,
            num_kv_heads=share.total_heads,
            head_dim=geometry.head_dim,
        )
    return Identity(
        model=model,
        kv_dtype=dtype,
        tokens_per_block=geometry.page_size,
        groups=(group,),
        hash_algo=HASH_ALGO,
    )


def model_name(storage: Any, override: str) -> str:
    """The model name in the identity: ``model_name`` from the extra config, else the name
    SGLang keys storage on (``--served-model-name`` or the path, tagged with the host pool's
    format); a clear error when neither is set."""
    name = override or getattr(storage, "model_name", None) or ""
    if not name:
        raise ConfigError(
            "kvstore HiCache backend: no model name (SGLang passed none); set 'model_name' "
            "in --hicache-storage-backend-extra-config"
        )
    return str(name)

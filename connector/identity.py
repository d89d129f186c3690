"""The store namespace of a vLLM engine, and where each ``OffloadKey`` lives in it.

Identity fields (kvstore.Identity; never a parallel size):

* ``model``: ``model_name`` from the connector config, else vLLM's ``--model``;
  ``revision``: ``model_revision``, else vLLM's ``--revision``;
* ``kv_dtype``: the cache element type (``--kv-cache-dtype``, ``auto`` = model dtype);
* ``tokens_per_block``: the offloaded block span, ``block_size x dcp`` in vLLM 0.33
  (``OffloadingGroupConfig.tokens_per_block``; PCP replicates the KV and adds nothing). One
  stored block is one offload chunk, so ``blocks_per_chunk`` must be 1;
* ``hash_algo`` and ``hash_seed``: ``--prefix-caching-hash-algo`` and the seed of the hash
  chain: ``PYTHONHASHSEED`` when set (only its digest is stored), else vLLM's fixed default
  (sha256 / sha256_cbor). xxhash without ``PYTHONHASHSEED`` is refused: vLLM then seeds the
  chain from ``os.urandom`` in every process, so no key could ever be found again;
* ``hash_lookahead_tokens`` (vLLM 0.34 with speculative decoding, when > 0): the tokens past
  each block vLLM hashes into the block's hash, so its keys match only servers with the same
  lookahead;
* per offloaded KV-cache group, in vLLM group-id order: kind (full / sliding / mla), layer
  names, the model's KV heads (not a rank's share), head size (MLA: latent size), window.

Key mapping: ``OffloadKey = block_hash + 4-byte big-endian vLLM group id``. The block hash is
the store key as is; the group id selects array ``g<k>`` where ``k`` is the group's position
among the offloaded groups sorted by group id (:class:`KeyMap`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from connector.config import ConnectorConfig
from connector.facts import EngineFacts
from kvstore import ConfigError, GroupSpec, Identity
from kvstore.identity import DTYPES

if TYPE_CHECKING:
    from vllm.v1.kv_offload.config import OffloadingConfig

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
# vLLM 0.33 (v1/core/kv_cache_utils.py init_none_hash): seed of sha256* chains without
# PYTHONHASHSEED.
VLLM_DEFAULT_SEED = "vllm-none-hash"
GROUP_ID_BYTES = 4


@dataclass(frozen=True)
class KeyMap:
    """vLLM KV-cache group ids <-> store array indices, and OffloadKey decoding."""

    group_ids: tuple[int, ...]  # vLLM group id of array g<k> at position k (ascending)

    def array_of(self, group_id: int) -> int:
        """Array index of vLLM group ``group_id``; KeyError for a group not offloaded."""
        return self.group_ids.index(group_id)

    def split(self, key: bytes) -> tuple[int, bytes]:
        """``(array index, block hash)`` of an ``OffloadKey``."""
        group_id = int.from_bytes(key[-GROUP_ID_BYTES:], "big", signed=False)
        return self.array_of(group_id), bytes(key[:-GROUP_ID_BYTES])


def hash_seed_id(hash_algo: str, environ: Mapping[str, str] | None = None) -> str:
    """The seed id of vLLM's hash chain; :class:`ConfigError` when it is random per process."""
    env = os.environ if environ is None else environ
    seed = env.get("PYTHONHASHSEED")
    if seed is not None:
        return "PYTHONHASHSEED:" + hashlib.sha256(seed.encode()).hexdigest()[:16]
    if hash_algo.startswith("xxhash"):
        raise ConfigError(
            f"prefix_caching_hash_algo={hash_algo!r} without PYTHONHASHSEED: vLLM seeds xxhash "
            "chains with os.urandom in every process, so no stored block could be found by "
            "another process or after a restart. Set PYTHONHASHSEED to the same value for "
            "every server sharing this store, or use sha256 / sha256_cbor."
        )
    return VLLM_DEFAULT_SEED


def derive_identity(
    config: OffloadingConfig,
    facts: EngineFacts,
    options: ConnectorConfig,
    environ: Mapping[str, str] | None = None,
) -> tuple[Identity, KeyMap]:
    """The namespace identity and key map; :class:`ConfigError` on what cannot be stored."""
    if facts.hash_algo not in HASH_ALGOS:
        raise ConfigError(
            f"prefix_caching_hash_algo: expected one of {list(HASH_ALGOS)}, got {facts.hash_algo!r}"
        )
    if config.cache.blocks_per_chunk != 1:
        raise ConfigError(
            f"blocks_per_chunk={config.cache.blocks_per_chunk}: kvstore stores one GPU block "
            "(block_size x dcp tokens) per stored block; remove 'block_size' / "
            "'blocks_per_chunk' from kv_connector_extra_config and choose the span with "
            "vLLM's --block-size instead"
        )
    if facts.pp != 1:
        raise ConfigError(
            f"pipeline_parallel_size={facts.pp}: not supported yet (each vLLM process sees "
            "only its stage's layer names, so no process knows the whole namespace)"
        )
    if not facts.kv_dtype:
        raise ConfigError(facts.kv_dtype_problem)
    itemsize = DTYPES[facts.kv_dtype].itemsize
    offloaded = sorted(config.groups, key=lambda g: g.group_id)
    spans = {g.tokens_per_block for g in offloaded}
    if len(spans) != 1:
        raise ConfigError(
            f"KV-cache groups with different block spans {sorted(spans)}: a namespace has one "
            "tokens_per_block"
        )
    specs = []
    for group in offloaded:
        facts_g = facts.group(group.group_id)
        if facts_g.kind is None:
            raise ConfigError(f"KV-cache group {group.group_id}: {facts_g.unsupported}")
        if tuple(group.layer_names) != facts_g.layer_names:
            raise ConfigError(
                f"KV-cache group {group.group_id}: layer names differ between the offloading "
                f"config {list(group.layer_names)} and the KV-cache config "
                f"{list(facts_g.layer_names)}"
            )
        if facts_g.itemsize != itemsize:
            raise ConfigError(
                f"KV-cache group {group.group_id}: {facts_g.itemsize}-byte elements, but the "
                f"cache dtype {facts.kv_dtype} has {itemsize}"
            )
        if group.tokens_per_block != facts_g.block_size * facts.dcp:
            raise ConfigError(
                f"KV-cache group {group.group_id}: block span {group.tokens_per_block} is not "
                f"block_size {facts_g.block_size} x dcp {facts.dcp}"
            )
        specs.append(_group_spec(facts, facts_g.kind, group.group_id))
    identity = Identity(
        model=options.model_name or config.model.name,
        revision=options.model_revision or facts.model_revision,
        kv_dtype=facts.kv_dtype,
        tokens_per_block=spans.pop(),
        hash_algo=facts.hash_algo,
        hash_seed=hash_seed_id(facts.hash_algo, environ),
        groups=tuple(specs),
        hash_lookahead_tokens=facts.hash_lookahead_tokens,
    )
    return identity, KeyMap(tuple(g.group_id for g in offloaded))


def _group_spec(facts: EngineFacts, kind: str, group_id: int) -> GroupSpec:
    group = facts.group(group_id)
    if kind == "mla":
        return GroupSpec(kind="mla", layer_names=group.layer_names, latent_dim=group.latent_dim)
    total = facts.total_kv_heads
    if group.num_kv_heads != max(1, total // facts.tp):
        raise ConfigError(
            f"KV-cache group {group_id}: a rank holds {group.num_kv_heads} KV heads, expected "
            f"max(1, {total} // tp={facts.tp}); uneven head sharding has no canonical form"
        )
    return GroupSpec(
        kind="sliding" if kind == "sliding" else "full",
        layer_names=group.layer_names,
        num_kv_heads=total,
        head_dim=group.head_size,
        sliding_window=group.sliding_window,
    )

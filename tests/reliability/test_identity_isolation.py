"""Threat 6, identity: pages of one identity are never served to another, nor across tenants.

For every identity field (model, revision, a KV dtype of the same size, tokens per block, hash
algorithm, hash seed, canonical format version, and the group structure: layer names, layer
order, head split of the same bytes, kind, sliding window, an extra group) a store holding the
base identity's blocks is opened with the changed identity: every lookup (``contains``,
``longest_prefix``), every read and every RankIO load is a miss (100 %). Then, where the changed
identity has the same shard geometry, the base blocks are copied under the changed namespace's
paths (what a careless copy or a rename of directories would do): every read is a CORRUPT miss
(foreign block), never a hit. The same in the other direction.

Cache salts: vLLM mixes the request's ``cache_salt`` into the first block's hash, so the chain
of every tenant differs from the first block on. Two tenants with the same prompt in one
namespace never hit each other's blocks, by lookup or by read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.identity import GroupSpec, Identity, attention_group
from kvstore.store.group_store import GroupStore
from kvstore.store.types import BlockRead, BlockWrite, ReadStatus, WriteStatus
from tests.helpers import (
    StoreFactory,
    block_bytes,
    chain_hashes,
    layer_names,
    make_small_identity,
    shard_files,
)
from tests.reliability.common import figure, tier
from tests.reliability.ranks import World

BASE = make_small_identity()
NAMES = layer_names(3)


def _group(**changes: Any) -> tuple[GroupSpec, ...]:
    spec: dict[str, Any] = {
        "kind": "full",
        "layer_names": NAMES,
        "num_kv_heads": 2,
        "head_dim": 64,
        "sliding_window": 0,
    }
    spec.update(changes)
    return (attention_group(**spec),)


VARIANTS: dict[str, Identity] = {
    "model": dataclasses.replace(BASE, model="test/tiny-llama-2"),
    "revision": dataclasses.replace(BASE, revision="0123abcd"),
    "dtype (same size)": dataclasses.replace(BASE, kv_dtype="float16"),
    "tokens per block": dataclasses.replace(BASE, tokens_per_block=32),
    "hash algorithm": dataclasses.replace(BASE, hash_algo="sha256_cbor"),
    "hash seed": dataclasses.replace(BASE, hash_seed="42"),
    "format version": dataclasses.replace(BASE, format_version=2),
    "layer names": dataclasses.replace(
        BASE, groups=_group(layer_names=[*NAMES[:2], "model.layers.9.self_attn.attn"])
    ),
    "layer order": dataclasses.replace(BASE, groups=_group(layer_names=NAMES[::-1])),
    "heads x head_dim (same bytes)": dataclasses.replace(
        BASE, groups=_group(num_kv_heads=1, head_dim=128)
    ),
    "kind (sliding)": dataclasses.replace(BASE, groups=_group(kind="sliding", sliding_window=128)),
    "sliding window": dataclasses.replace(BASE, groups=_group(kind="sliding", sliding_window=64)),
    "extra group": dataclasses.replace(
        BASE,
        groups=(
            *_group(),
            attention_group("sliding", ["model.layers.3.self_attn.attn"], 2, 64, 128),
        ),
    ),
}


def _write(g: GroupStore, hashes: Sequence[bytes], salt: int) -> None:
    results = g.write_blocks(
        [BlockWrite(h, block_bytes(g.layout, salt + i)) for i, h in enumerate(hashes)]
    )
    assert all(r.status is WriteStatus.WRITTEN for r in results)


def _reads(g: GroupStore, hashes: Sequence[bytes]) -> list[ReadStatus]:
    outs = [np.zeros(g.layout.block_nbytes, dtype=np.uint8) for _ in hashes]
    return [
        r.status
        for r in g.read_blocks([BlockRead(h, o) for h, o in zip(hashes, outs, strict=True)])
    ]


def _copy_blocks(src: GroupStore, dst: GroupStore) -> int:
    copied = 0
    for path in shard_files(src.array_path):
        target = Path(str(path).replace(str(src.array_path), str(dst.array_path), 1))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        copied += 1
    return copied


def test_every_identity_field_isolates(make_store: StoreFactory) -> None:
    n = tier(24, 200)
    hashes = chain_hashes(n, "identity")
    store = make_store()
    base = store.namespace(BASE).group(0)
    _write(base, hashes, 0)
    probes = hits = corrupt_served = copied_reads = 0
    for name, variant in VARIANTS.items():
        assert variant.namespace != BASE.namespace, name
        for index, other in enumerate(store.namespace(variant).groups):
            found = other.contains(hashes)
            prefix = other.longest_prefix(hashes)
            statuses = _reads(other, hashes)
            probes += 2 * n
            hits += sum(found) + prefix + statuses.count(ReadStatus.HIT)
            assert found == [False] * n and prefix == 0, name
            assert statuses == [ReadStatus.MISS] * n, (name, index)
            if other.layout != base.layout:
                continue
            # Same geometry: copy the base blocks under this namespace's names.
            assert _copy_blocks(base, other) == n
            statuses = _reads(other, hashes)
            copied_reads += n
            hits += statuses.count(ReadStatus.HIT)
            corrupt_served += statuses.count(ReadStatus.CORRUPT)
            assert statuses == [ReadStatus.CORRUPT] * n, (name, statuses)
    # The other direction: a variant's own blocks are invisible to the base identity.
    for name, variant in VARIANTS.items():
        other = store.namespace(variant).group(0)
        mine = [hashlib.sha256(name.encode() + h).digest() for h in hashes]
        _write(other, mine, 1000)
        assert _reads(base, mine) == [ReadStatus.MISS] * n
        probes += n
    # Engine view: RankIO loads of the base blocks under a same-geometry variant all miss.
    variant = VARIANTS["dtype (same size)"]
    world = World(store.namespace(variant).group(0), variant, "tp=2")
    fresh = chain_hashes(n, "identity-rankio")
    _write(base, fresh, 2000)
    loaded = world.load(fresh, list(range(2000, 2000 + n)))
    assert all(s is ReadStatus.MISS for one in loaded for s in one.statuses)
    probes += n * len(world.rios)
    figure(
        "identity isolation",
        identity_variants=len(VARIANTS),
        lookups_and_reads=probes,
        copied_foreign_blocks_read=copied_reads,
        refused_as_corrupt=corrupt_served,
        hits=hits,
    )
    assert hits == 0


def vllm_like_chain(tokens: Sequence[int], block: int, salt: str | None) -> list[bytes]:
    """Block hashes chained like vLLM's: parent hash, the block's tokens, extra keys (the
    cache salt goes into the first block's extra keys)."""
    parent = hashlib.sha256(b"NONE_HASH").digest()
    out = []
    for start in range(0, len(tokens) - block + 1, block):
        extra = (salt,) if salt is not None and start == 0 else ()
        payload = repr((parent, tuple(tokens[start : start + block]), extra)).encode()
        parent = hashlib.sha256(payload).digest()
        out.append(parent)
    return out


@pytest.mark.parametrize("tenants", [("alice", "bob"), (None, "bob")])
def test_cache_salts_never_hit_across_tenants(
    make_store: StoreFactory, tenants: tuple[str | None, str | None]
) -> None:
    g = make_store().namespace(BASE).group(0)
    rng = np.random.default_rng(3)
    prompts = tier(20, 200)
    block = BASE.tokens_per_block
    probes = hits = 0
    for p in range(prompts):
        tokens = rng.integers(0, 32000, size=block * 8).tolist()
        owner, other = (vllm_like_chain(tokens, block, salt) for salt in tenants)
        assert not set(owner) & set(other)
        _write(g, owner, 10 * p)
        assert g.longest_prefix(owner) == len(owner)  # the owner hits its own prefix
        hits += g.longest_prefix(other) + sum(g.contains(other))
        hits += _reads(g, other).count(ReadStatus.HIT)
        probes += 3 * len(other)
    figure(f"cache salts {tenants}", prompts=prompts, cross_tenant_probes=probes, hits=hits)
    assert hits == 0
    assert os.path.isdir(g.array_path)

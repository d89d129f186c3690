"""How the connector classifies each KV-cache group's spec (``connector.facts._group_facts``):
what it can store, with the geometry it stores, and a refusal naming the reason otherwise."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from connector.facts import _group_facts

LAYERS = ("layer.0", "layer.1")
FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)


@dataclasses.dataclass(frozen=True)
class _OtherSpec(FullAttentionSpec):
    """A spec kind the connector does not know (its type, not its fields, decides)."""


def test_full_attention_group() -> None:
    facts = _group_facts(3, LAYERS, FULL)
    assert (facts.group_id, facts.layer_names, facts.kind, facts.unsupported) == (
        3,
        LAYERS,
        "full",
        "",
    )
    assert (facts.num_kv_heads, facts.head_size, facts.block_size, facts.itemsize) == (2, 64, 16, 2)
    assert facts.page_bytes == 2 * 16 * 2 * 64 * 2
    assert facts.sliding_window == 0


def test_sliding_window_group() -> None:
    spec = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=32
    )
    facts = _group_facts(0, LAYERS, spec)
    assert (facts.kind, facts.sliding_window, facts.page_bytes) == (
        "sliding",
        32,
        2 * 16 * 2 * 64 * 2,
    )


def test_mla_group() -> None:
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float16)
    facts = _group_facts(1, LAYERS, spec)
    assert (facts.kind, facts.latent_dim, facts.block_size, facts.itemsize) == ("mla", 576, 16, 2)
    assert facts.page_bytes == 16 * 576 * 2
    assert facts.num_kv_heads == 1 and facts.head_size == 0


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (
            _OtherSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16),
            "_OtherSpec: only full attention, sliding-window attention and MLA groups",
        ),
        (
            dataclasses.replace(FULL, tokens_per_state=2),
            "FullAttentionSpec: tokens_per_state=2 (expected 1 state per token)",
        ),
        (
            dataclasses.replace(FULL, num_head_slots=4),
            "FullAttentionSpec: packed head slots / state content are backend-specific",
        ),
        (
            dataclasses.replace(FULL, head_size_v=32),
            "FullAttentionSpec: head_size_v=32 differs from head_size=64",
        ),
    ],
    ids=["unknown-kind", "tokens-per-state", "head-slots", "head-size-v"],
)
def test_refused_groups_name_the_reason(spec: KVCacheSpec, reason: str) -> None:
    facts = _group_facts(2, LAYERS, spec)
    assert facts.kind is None
    assert facts.unsupported.startswith(reason), facts.unsupported

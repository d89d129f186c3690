"""Store with every rank of layout A, check the closed form, load into every rank of layout B.

The reference shards come from tests/layout/layout_reference.py, which slices a full KV tensor
the way vLLM does without using kvstore's runs.
"""

from __future__ import annotations

import pytest
import torch

from kvstore.layout import (
    GroupGeometry,
    LocalForm,
    ParallelLayout,
    gather_blocks,
    map_rank,
    scatter_blocks,
)
from kvstore.models import load_model

from .layout_reference import canonical_bytes, full_kv, rank_pages, rank_view, roundtrip

P = ParallelLayout.parse
HND = LocalForm("hnd")
NHD = LocalForm("nhd")
HND_PACKED = LocalForm("hnd", "packed", group_offset=0)
NHD_PACKED = LocalForm("nhd", "packed", group_offset=96)


def attention(
    heads: int, head_dim: int = 4, layers: int = 3, tokens: int = 16, elem: int = 2
) -> GroupGeometry:
    return GroupGeometry(
        "full", tuple(range(layers)), layers, tokens, elem, num_kv_heads=heads, head_dim=head_dim
    )


def model_groups(name: str, tokens: int = 16) -> list[GroupGeometry]:
    """The groups of a models.json model, geometry kept (heads, head dim, layer ids)."""
    model = load_model(name)
    elem = 2 if model.kv_dtype in ("bfloat16", "float16") else 1
    return [
        GroupGeometry(
            g.kind,
            g.layer_ids,
            model.num_hidden_layers,
            tokens,
            elem,
            num_kv_heads=1 if g.kind == "mla" else g.num_kv_heads,
            head_dim=0 if g.kind == "mla" else g.head_dim,
            latent_dim=g.latent_dim,
        )
        for g in model.groups
    ]


CASES: list[tuple[str, GroupGeometry, str, LocalForm, str, LocalForm]] = [
    # one KV head: TP replicates it, writers rotate
    ("1 head tp1->tp4", attention(1), "tp=1", HND, "tp=4", NHD),
    ("1 head tp4->tp2 packed", attention(1), "tp=4", NHD_PACKED, "tp=2", HND_PACKED),
    # tp 8 over 2 heads: 4 replicas per head
    ("tp8 over 2 heads", attention(2), "tp=8", HND, "tp=1", NHD_PACKED),
    ("tp2 -> tp8 over 2 heads nhd", attention(2), "tp=2", NHD, "tp=8", NHD),
    # DCP, interleave 1 and > 1
    ("dcp2 i1", attention(2), "tp=4,dcp=2", HND, "tp=1", HND),
    ("dcp2 i4 nhd", attention(2), "tp=4,dcp=2,interleave=4", NHD, "tp=2", HND_PACKED),
    ("dcp4 1 head", attention(1), "tp=4,dcp=4", HND_PACKED, "tp=4,dcp=2,interleave=2", NHD),
    ("tp8 dcp2 i4 4 heads", attention(4), "tp=8,dcp=2,interleave=4", NHD, "tp=4", HND),
    # PCP: vLLM 0.33 replicates KV over PCP; canonical_mapping.py's model shards it
    ("pcp2 replicated", attention(2), "tp=2,pcp=2", HND, "tp=1", NHD),
    ("pcp2 dcp2 replicated", attention(4), "tp=2,pcp=2,dcp=2,interleave=2", NHD, "tp=4", HND),
    ("pcp2 dcp4 over tp x pcp", attention(1), "tp=2,pcp=2,dcp=4", HND, "tp=1", HND_PACKED),
    ("pcp2 sharded", attention(2), "tp=1,pcp=2,pcp_kv=sharded", HND, "tp=2", HND),
    ("pcp2 sharded tp2", attention(2), "tp=2,pcp=2,pcp_kv=sharded", NHD_PACKED, "tp=1", NHD),
    ("pcp2 dcp2 sharded", attention(1), "tp=2,pcp=2,dcp=2,pcp_kv=sharded", HND, "tp=2", NHD),
    # PP: 3 stages over 32 layers (11, 11, 10)
    ("pp3 over 32 layers", attention(8, 2, 32, 8), "tp=2,pp=3", HND, "tp=4,pp=2", NHD_PACKED),
    ("pp3 partition", attention(8, 2, 32, 8), "pp=3,pp_partition=5:20:7", NHD, "tp=8", HND),
    # fp8-sized elements
    ("fp8 tp2 -> tp1", attention(4, 8, 2, 16, 1), "tp=2", HND, "tp=1", NHD),
]


@pytest.mark.parametrize(
    ("name", "geometry", "a", "form_a", "b", "form_b"), CASES, ids=[c[0] for c in CASES]
)
def test_roundtrip(
    name: str, geometry: GroupGeometry, a: str, form_a: LocalForm, b: str, form_b: LocalForm
) -> None:
    roundtrip(geometry, (P(a), form_a), (P(b), form_b), seed=len(name))


@pytest.mark.parametrize(
    ("a", "form_a", "b", "form_b"),
    [
        ("tp=1", HND_PACKED, "tp=8,pp=2", NHD),
        ("tp=4,pp=3", NHD, "tp=2", HND_PACKED),
        ("tp=8,pp=2", HND, "tp=1,pp=3", NHD_PACKED),
    ],
)
def test_gpt_oss_20b_groups(a: str, form_a: LocalForm, b: str, form_b: LocalForm) -> None:
    """Sliding = even layers, full = odd layers of 24; 8 KV heads of 64; each group alone."""
    for geometry in model_groups("gpt-oss-20b"):
        roundtrip(geometry, (P(a), form_a), (P(b), form_b), n_blocks=2)


@pytest.mark.parametrize(
    ("a", "form_a", "b", "form_b"),
    [
        ("tp=2", HND, "tp=1,pp=2", NHD_PACKED),
        ("tp=4,dcp=2,pp=3", NHD_PACKED, "tp=1", HND),
    ],
)
def test_gemma_3_1b_groups(a: str, form_a: LocalForm, b: str, form_b: LocalForm) -> None:
    """22 sliding + 4 full layers (5:1 pattern), 1 KV head of 256: heads replicate under TP."""
    for geometry in model_groups("gemma-3-1b"):
        roundtrip(geometry, (P(a), form_a), (P(b), form_b), n_blocks=2)


@pytest.mark.parametrize(
    ("a", "form_a", "b", "form_b"),
    [
        ("tp=4", HND, "tp=1", NHD_PACKED),
        ("tp=4,dcp=2", NHD_PACKED, "tp=8,dcp=4,interleave=2", HND),
        ("tp=2,pp=2", HND, "tp=2,pcp=2,dcp=2", HND),
    ],
)
def test_mla(a: str, form_a: LocalForm, b: str, form_b: LocalForm) -> None:
    """DeepSeek-V3 latent (576), layers shrunk to 6: replicated on every TP rank."""
    (deepseek,) = model_groups("deepseek-v3")
    geometry = GroupGeometry(
        "mla", tuple(range(6)), 6, 16, deepseek.elem_size, latent_dim=deepseek.latent_dim
    )
    roundtrip(geometry, (P(a), form_a), (P(b), form_b), n_blocks=2)


@pytest.mark.parametrize("layout", ["tp=1", "tp=4,dcp=2", "tp=4,pp=2", "tp=2,pcp=2"])
@pytest.mark.parametrize("form", [HND, NHD, HND_PACKED, NHD_PACKED], ids=str)
def test_full_canonical_width_staging(layout: str, form: LocalForm) -> None:
    """Gather into / scatter from a full canonical block instead of the rank share."""
    roundtrip(attention(2), (P(layout), form), (P(layout), form), full_width=True)


def test_packed_hma_groups_alias_one_backing_tensor() -> None:
    """gpt-oss packed (BLHNC): both groups' layers start at byte 0 of the block rows they own;
    gathering each group's blocks from one shared backing tensor yields each group's bytes."""
    layout, form = P("tp=2,pp=2"), HND_PACKED
    groups = model_groups("gpt-oss-20b")
    coord = layout.ranks()[3]  # tp_rank 1 of the second stage
    mappings = [map_rank(g, layout, form, coord) for g in groups]
    row_bytes = max(m.share_bytes for m in mappings) + 64  # planner pads rows
    backing = torch.randint(0, 256, (8, row_bytes), dtype=torch.uint8)
    owners = {0: torch.tensor([1, 6]), 1: torch.tensor([3, 0])}  # group -> block ids it owns
    for k, (geometry, mapping) in enumerate(zip(groups, mappings, strict=True)):
        kv = full_kv(geometry, 2, seed=k)
        pages = rank_pages(kv, rank_view(geometry, layout, coord), "hnd")
        flat = pages.contiguous().view(torch.uint8).reshape(2, -1)
        backing[owners[k], : flat.shape[1]] = flat
        share = torch.empty(2, mapping.share_bytes, dtype=torch.uint8)
        gather_blocks(mapping, [backing], owners[k], share)
        expected = canonical_bytes(kv)
        for seg in mapping.segments:
            got = share[:, seg.share_offset : seg.share_offset + seg.size]
            want = expected[:, seg.canonical_offset : seg.canonical_offset + seg.size]
            assert torch.equal(got, want)
        snapshot = backing.clone()
        scatter_blocks(mapping, share, [backing], owners[k])
        assert torch.equal(backing, snapshot)

"""ParallelLayout: validation, text form, rank order, PP partition, and refusals."""

from __future__ import annotations

import pytest

from kvstore.errors import KvstoreError
from kvstore.layout import (
    GroupGeometry,
    LayoutError,
    LocalForm,
    ParallelLayout,
    RankCoord,
    map_all_ranks,
    pp_layer_range,
    verify_tiling,
)

from .layout_reference import stage_layer_range


def attention(heads: int, tokens: int = 16, layers: int = 2) -> GroupGeometry:
    return GroupGeometry(
        "full", tuple(range(layers)), layers, tokens, 2, num_kv_heads=heads, head_dim=4
    )


# -- parsing ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", ParallelLayout()),
        ("tp=2", ParallelLayout(tp=2)),
        ("tp=4,pp=2", ParallelLayout(tp=4, pp=2)),
        (" tp = 2 , dcp=2, interleave=4 ", ParallelLayout(tp=2, dcp=2, interleave=4)),
        ("pcp=2,pcp_kv=sharded", ParallelLayout(pcp=2, pcp_kv="sharded")),
        ("pp=3,pp_partition=5:20:7", ParallelLayout(pp=3, pp_partition=(5, 20, 7))),
    ],
)
def test_parse(text: str, expected: ParallelLayout) -> None:
    assert ParallelLayout.parse(text) == expected


@pytest.mark.parametrize(
    "layout",
    [
        ParallelLayout(),
        ParallelLayout(tp=8, pp=2, dcp=4, interleave=16),
        ParallelLayout(tp=2, pcp=2, dcp=2),
        ParallelLayout(tp=2, pcp=4, pcp_kv="sharded"),
        ParallelLayout(pp=2, pp_partition=(3, 1)),
    ],
)
def test_text_form_round_trips(layout: ParallelLayout) -> None:
    assert ParallelLayout.parse(str(layout)) == layout


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("tp=2,ep=4", "unknown key 'ep'; accepted keys are tp, pp, dcp, pcp, interleave"),
        ("tp=two", "expected tp to be an integer, got 'two'"),
        ("tp=2,tp=4", "key 'tp' given twice"),
        ("tp", "expected key=value, got 'tp'"),
        ("tp=2,", "expected key=value, got ''"),
        ("tp=0", "expected tp >= 1, got 0"),
        ("pcp_kv=maybe", "expected pcp_kv in ('replicated', 'sharded')"),
        ("pp=2,pp_partition=3", "expected pp_partition to hold pp=2 layer counts"),
        ("pp=2,pp_partition=a:b", "expected pp_partition to be layer counts joined by ':'"),
    ],
)
def test_parse_errors_name_the_problem(text: str, fragment: str) -> None:
    with pytest.raises(LayoutError) as info:
        ParallelLayout.parse(text)
    assert fragment in str(info.value)


def test_layout_error_is_a_kvstore_value_error() -> None:
    assert issubclass(LayoutError, KvstoreError)
    assert issubclass(LayoutError, ValueError)


# -- rank order ---------------------------------------------------------------------------------


def test_ranks_follow_vllm_order_pp_then_pcp_then_tp() -> None:
    layout = ParallelLayout(tp=2, pp=2, pcp=2)
    assert layout.ranks() == (
        RankCoord(0, 0, 0),
        RankCoord(1, 0, 0),
        RankCoord(0, 0, 1),
        RankCoord(1, 0, 1),
        RankCoord(0, 1, 0),
        RankCoord(1, 1, 0),
        RankCoord(0, 1, 1),
        RankCoord(1, 1, 1),
    )
    for rank, coord in enumerate(layout.ranks()):
        assert layout.global_rank(coord) == rank
        assert layout.coord_of(rank) == coord


def test_rank_outside_layout_is_refused() -> None:
    with pytest.raises(LayoutError, match="expected tp_rank < 2"):
        ParallelLayout(tp=2).global_rank(RankCoord(2))
    with pytest.raises(LayoutError, match=r"expected a global rank in \[0, 4\)"):
        ParallelLayout(tp=4).coord_of(4)
    with pytest.raises(LayoutError, match="expected pp_rank to be an int >= 0"):
        RankCoord(0, -1)


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        # pcp == 1: DCP groups are consecutive TP ranks
        (ParallelLayout(tp=4, dcp=2), [0, 1, 0, 1]),
        # DCP spanning PCP: the PCP ranks of one TP rank
        (ParallelLayout(tp=2, pcp=2, dcp=2), [0, 0, 1, 1]),
        # DCP spanning TP x PCP, ordered tp-major
        (ParallelLayout(tp=2, pcp=2, dcp=4), [0, 2, 1, 3]),
        # canonical_mapping.py's model: pcp_rank * dcp + tp_rank % dcp
        (ParallelLayout(tp=2, pcp=2, dcp=2, pcp_kv="sharded"), [0, 1, 2, 3]),
        (ParallelLayout(tp=2, pcp=2), [0, 0, 0, 0]),
        (ParallelLayout(tp=2, pcp=2, pcp_kv="sharded"), [0, 0, 1, 1]),
    ],
)
def test_token_shard_of_each_rank(layout: ParallelLayout, expected: list[int]) -> None:
    assert [layout.token_shard(c) for c in layout.ranks()] == expected


# -- pipeline partition -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "pp", "expected"),
    [
        (32, 3, [(0, 11), (11, 22), (22, 32)]),
        (32, 5, [(0, 6), (6, 12), (12, 19), (19, 26), (26, 32)]),  # 6,6,7,7,6
        (24, 2, [(0, 12), (12, 24)]),
        (26, 4, [(0, 6), (6, 13), (13, 20), (20, 26)]),
        (3, 3, [(0, 1), (1, 2), (2, 3)]),
    ],
)
def test_pp_partition_matches_vllm_get_pp_indices(
    layers: int, pp: int, expected: list[tuple[int, int]]
) -> None:
    assert [pp_layer_range(layers, r, pp) for r in range(pp)] == expected
    assert [stage_layer_range(layers, r, pp) for r in range(pp)] == expected


def test_pp_partition_override_and_its_errors() -> None:
    assert pp_layer_range(10, 1, 2, (3, 7)) == (3, 10)
    with pytest.raises(LayoutError, match="summing to num_hidden_layers=10"):
        pp_layer_range(10, 0, 2, (3, 3))
    with pytest.raises(LayoutError, match="pp=4 exceeds num_hidden_layers=3"):
        pp_layer_range(3, 0, 4)


def test_pp_stage_holds_group_layers_by_model_layer_id() -> None:
    """gpt-oss-20b: sliding = even, full = odd model layers; pp=3 splits 24 layers 8/8/8."""
    layout = ParallelLayout(pp=3)
    sliding = GroupGeometry("sliding", tuple(range(0, 24, 2)), 24, 16, 2, 8, 64)
    full = GroupGeometry("full", tuple(range(1, 24, 2)), 24, 16, 2, 8, 64)
    assert [m.local_layers for m in map_all_ranks(sliding, layout, LocalForm())] == [
        (0, 1, 2, 3),
        (4, 5, 6, 7),
        (8, 9, 10, 11),
    ]
    assert [m.local_layers for m in map_all_ranks(full, layout, LocalForm())] == [
        (0, 1, 2, 3),
        (4, 5, 6, 7),
        (8, 9, 10, 11),
    ]


def test_stage_without_layers_of_a_group_moves_nothing() -> None:
    """gemma-3-1b's full layers are 5, 11, 17, 23; with pp=8 some stages hold none of them."""
    full = GroupGeometry("full", (5, 11, 17, 23), 26, 16, 2, 1, 8)
    mappings = verify_tiling(full, ParallelLayout(pp=8), LocalForm())
    empty = [m for m in mappings if not m.local_layers]
    assert empty
    assert all(m.runs == () and m.segments == () and m.share_bytes == 0 for m in empty)


# -- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("geometry", "layout", "fragment"),
    [
        (attention(6), "tp=4", "kv_heads=6 cannot be split evenly over tp=4"),
        (attention(4), "tp=6", "tp=6 is not a multiple of kv_heads=4"),
        (attention(4), "tp=4,dcp=2", "replication tp // kv_heads = 1 is not a multiple of dcp=2"),
        (attention(2), "tp=4,dcp=4", "DCP group 0 spans ranks holding different KV heads"),
        (attention(1), "tp=2,dcp=2,interleave=3", "interleave=3 must divide the local block size"),
        (
            attention(1),
            "tp=2,dcp=2,interleave=16",
            "interleave=16 must divide the local block size",
        ),
        (attention(1, tokens=6), "tp=4,dcp=4", "tokens_per_block=6 cannot be spread over 4"),
        (attention(8, layers=2), "pp=3", "pp=3 exceeds num_hidden_layers=2"),
        (attention(2), "tp=2,pcp=2,dcp=4", "DCP group 0 spans ranks holding different KV heads"),
    ],
)
def test_uncertifiable_layouts_are_refused_with_the_reason(
    geometry: GroupGeometry, layout: str, fragment: str
) -> None:
    with pytest.raises(LayoutError) as info:
        verify_tiling(geometry, ParallelLayout.parse(layout), LocalForm())
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"tp": 6, "dcp": 4}, "expected dcp to divide tp"),
        ({"tp": 2, "pcp": 2, "dcp": 3}, "with pcp > 1, expected dcp in [1, 2, 4]"),
        ({"tp": 4, "pcp": 2, "dcp": 4, "pcp_kv": "sharded"}, None),
        ({"tp": 2, "pcp": 2, "dcp": 4, "pcp_kv": "sharded"}, "expected dcp to divide tp"),
        ({"interleave": 0}, "expected interleave >= 1, got 0"),
        ({"tp": True}, "expected tp >= 1, got True"),
    ],
)
def test_layout_validation(kwargs: dict[str, object], fragment: str | None) -> None:
    if fragment is None:
        ParallelLayout(**kwargs)  # type: ignore[arg-type]
        return
    with pytest.raises(LayoutError) as info:
        ParallelLayout(**kwargs)  # type: ignore[arg-type]
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"kind": "mamba"}, "expected kind in ('full', 'sliding', 'mla')"),
        ({"layer_ids": (0, 0)}, "expected unique layer ids"),
        ({"layer_ids": (0, 9)}, "expected layer ids in [0, num_hidden_layers=4)"),
        ({"head_dim": 0}, "expected head_dim >= 1"),
        ({"kind": "mla", "head_dim": 0}, "expected latent_dim >= 1, num_kv_heads == 1"),
        ({"kind": "mla", "head_dim": 0, "latent_dim": 8, "num_kv_heads": 2}, "num_kv_heads == 1"),
        ({"latent_dim": 8}, "expected head_dim >= 1 and latent_dim == 0"),
        ({"elem_size": 0}, "expected elem_size >= 1"),
    ],
)
def test_geometry_validation(kwargs: dict[str, object], fragment: str) -> None:
    fields: dict[str, object] = {
        "kind": "full",
        "layer_ids": (0, 1),
        "num_hidden_layers": 4,
        "tokens_per_block": 16,
        "elem_size": 2,
        "num_kv_heads": 1,
        "head_dim": 4,
    }
    fields.update(kwargs)
    with pytest.raises(LayoutError) as info:
        GroupGeometry(**fields)  # type: ignore[arg-type]
    assert fragment in str(info.value)


def test_form_validation() -> None:
    with pytest.raises(LayoutError, match="expected family in"):
        LocalForm("hdn")  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="group_offset applies to packed rows only"):
        LocalForm("hnd", "per_layer", 64)
    with pytest.raises(LayoutError, match="expected group_offset >= 0"):
        LocalForm("hnd", "packed", -1)

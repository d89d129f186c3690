"""Property tests: any layout is either refused for a stated reason, or round-trips exactly."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from kvstore.layout import (
    GroupGeometry,
    LayoutError,
    LocalForm,
    ParallelLayout,
    gather_blocks,
    map_all_ranks,
    scatter_blocks,
    verify_tiling,
)
from kvstore.layout.parallel import GroupKind, PcpKv

from .layout_reference import roundtrip

FAST = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


PCP_MODELS: tuple[PcpKv, ...] = ("replicated", "sharded")
KINDS: tuple[GroupKind, ...] = ("full", "sliding", "mla")


@dataclass(frozen=True)
class Scenario:
    geometry: GroupGeometry
    layout: ParallelLayout
    store_form: LocalForm
    load_form: LocalForm


forms = st.builds(
    lambda family, packing, offset: LocalForm(
        family, packing, offset if packing == "packed" else 0
    ),
    st.sampled_from(["hnd", "nhd"]),
    st.sampled_from(["per_layer", "packed"]),
    st.sampled_from([0, 8, 24]),
)


@st.composite
def layouts(draw: st.DrawFn) -> ParallelLayout:
    tp = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    pp = draw(st.integers(1, 3))
    pcp = draw(st.sampled_from([1, 1, 2]))
    pcp_kv = draw(st.sampled_from(PCP_MODELS))
    if pcp > 1 and pcp_kv == "replicated":
        dcp = draw(st.sampled_from(sorted({1, pcp, tp * pcp})))
    else:
        dcp = draw(st.sampled_from([d for d in (1, 2, 3, 4, 8) if tp % d == 0]))
    interleave = draw(st.sampled_from([1, 2, 4]))
    return ParallelLayout(tp=tp, pp=pp, dcp=dcp, pcp=pcp, interleave=interleave, pcp_kv=pcp_kv)


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    layout = draw(layouts().filter(lambda lay: lay.world_size <= 16))
    kind = draw(st.sampled_from(KINDS))
    num_hidden = draw(st.integers(1, 7))
    layer_ids = tuple(
        draw(st.lists(st.integers(0, num_hidden - 1), min_size=1, max_size=4, unique=True))
    )  # any order: the group's canonical layer order need not be ascending
    local_block = draw(st.sampled_from([1, 2, 4, 8]))
    geometry = GroupGeometry(
        kind,
        layer_ids,
        num_hidden,
        local_block * layout.token_shards,
        draw(st.sampled_from([1, 2])),
        num_kv_heads=1 if kind == "mla" else draw(st.sampled_from([1, 2, 3, 4, 6, 8])),
        head_dim=0 if kind == "mla" else draw(st.integers(1, 3)),
        latent_dim=draw(st.integers(1, 5)) if kind == "mla" else 0,
    )
    return Scenario(geometry, layout, draw(forms), draw(forms))


def certifiable(geometry: GroupGeometry, layout: ParallelLayout) -> bool:
    """vLLM's gates, restated independently of kvstore."""
    heads, tp, dcp = geometry.num_kv_heads, layout.tp, layout.dcp
    if heads >= tp:
        if heads % tp:
            return False
        head_shards, replication = tp, 1
    else:
        if tp % heads:
            return False
        head_shards, replication = heads, tp // heads
    if layout.pcp > 1 and layout.pcp_kv == "replicated" and dcp > 1:
        dcp_ok = dcp == layout.pcp or head_shards == 1  # spans PCP, or spans all of TP x PCP
    else:
        dcp_ok = replication % dcp == 0
    bs = geometry.tokens_per_block // layout.token_shards
    interleave_ok = layout.token_shards == 1 or bs % layout.interleave == 0
    return dcp_ok and interleave_ok and layout.pp <= geometry.num_hidden_layers


@FAST
@given(scenarios())
def test_layout_is_refused_exactly_when_vllm_would_refuse_it(scenario: Scenario) -> None:
    geometry, layout = scenario.geometry, scenario.layout
    try:
        mappings = verify_tiling(geometry, layout, scenario.store_form)
    except LayoutError as error:
        event("refused")
        assert not certifiable(geometry, layout), f"refused a certifiable layout: {error}"
        reasons = ("cannot be split evenly", "is not a multiple of kv_heads", "DCP group",
                   "must divide the local block size", "exceeds num_hidden_layers")  # fmt: skip
        assert any(r in str(error) for r in reasons), str(error)
        return
    assert certifiable(geometry, layout)
    event("certified")
    # the shares of one election residue add up to the canonical block
    for residue in range(max(m.num_writers for m in mappings)):
        writers = [m for m in mappings if m.is_writer(residue)]
        assert sum(m.share_bytes for m in writers) == geometry.canonical_block_bytes


@FAST
@given(scenarios())
def test_certified_layout_round_trips_through_the_closed_form(scenario: Scenario) -> None:
    geometry, layout = scenario.geometry, scenario.layout
    assume(certifiable(geometry, layout))
    event(f"world size {layout.world_size}, token shards {layout.token_shards}")
    roundtrip(
        geometry, (layout, scenario.store_form), (layout, scenario.load_form), n_blocks=2, seed=7
    )


@FAST
@given(scenarios(), st.booleans())
def test_scatter_then_gather_is_identity(scenario: Scenario, full_width: bool) -> None:
    """For any staged bytes: scatter into a rank's cache, gather back, get the same bytes."""
    geometry, layout, form = scenario.geometry, scenario.layout, scenario.store_form
    assume(certifiable(geometry, layout))
    for mapping in map_all_ranks(geometry, layout, form):
        if form.packing == "packed":
            width = form.group_offset + mapping.share_bytes + 5
            tensors = [torch.zeros(4, width, dtype=torch.uint8)]
        else:
            tensors = [
                torch.zeros(4, mapping.page_bytes, dtype=torch.uint8) for _ in mapping.local_layers
            ]
        width = geometry.canonical_block_bytes if full_width else mapping.share_bytes
        staged = torch.randint(0, 256, (2, width), dtype=torch.uint8)
        scatter_blocks(mapping, staged, tensors, [3, 1])
        back = torch.zeros_like(staged)
        gather_blocks(mapping, tensors, [3, 1], back)
        if full_width:
            for seg in mapping.segments:
                span = slice(seg.canonical_offset, seg.canonical_offset + seg.size)
                assert torch.equal(back[:, span], staged[:, span])
        else:
            assert torch.equal(back, staged)

"""Shape of the mappings: runs, segments, chunk ownership, election, tiling check, tensor checks."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch

from kvstore.layout import (
    CopyRun,
    GroupGeometry,
    LayoutError,
    LocalForm,
    ParallelLayout,
    RankCoord,
    check_tiling,
    gather_blocks,
    map_all_ranks,
    map_rank,
    scatter_blocks,
    verify_tiling,
)

from .layout_reference import build_cache, canonical_bytes, full_kv, rank_pages, rank_view

P = ParallelLayout.parse


def llama(tokens: int = 16, layers: int = 4, heads: int = 8, head_dim: int = 128) -> GroupGeometry:
    return GroupGeometry(
        "full", tuple(range(layers)), layers, tokens, 2, num_kv_heads=heads, head_dim=head_dim
    )


# -- runs ---------------------------------------------------------------------------------------


def test_tp1_hnd_is_at_most_one_run_per_layer() -> None:
    geometry = llama()
    (mapping,) = verify_tiling(geometry, P("tp=1"), LocalForm("hnd"))
    assert len(mapping.runs) == geometry.num_layers
    chunk = geometry.inner_chunk_bytes
    for li, run in enumerate(mapping.runs):
        # the whole page, one head chunk after another, each chunk at its (h, l) offset
        assert run == CopyRun(li, 0, li * chunk, chunk, 8, chunk, geometry.num_layers * chunk)


def test_tp1_single_head_packed_is_one_contiguous_run() -> None:
    geometry = llama(heads=1)
    (mapping,) = verify_tiling(geometry, P("tp=1"), LocalForm("hnd", "packed", 128))
    assert mapping.runs == (CopyRun(0, 128, 0, geometry.canonical_block_bytes),)
    assert mapping.share_bytes == geometry.canonical_block_bytes


def test_tp_split_hnd_keeps_whole_inner_chunks() -> None:
    geometry = llama()
    mappings = verify_tiling(geometry, P("tp=2"), LocalForm("hnd"))
    for mapping in mappings:
        assert all(run.size % geometry.inner_chunk_bytes == 0 for run in mapping.runs)
        assert len(mapping.full_chunks) == 4 * geometry.num_layers
        assert mapping.partial_chunks == ()


def test_nhd_runs_stride_over_tokens() -> None:
    geometry = llama(tokens=16, layers=1, heads=8, head_dim=2)
    (mapping,) = verify_tiling(geometry, P("tp=1"), LocalForm("nhd"))
    row = geometry.token_row_bytes
    assert mapping.runs[0] == CopyRun(0, 0, 0, row, 16, 8 * row, row)  # head 0, all tokens
    assert len(mapping.runs) == 8


def test_dcp_splits_chunks_between_ranks() -> None:
    geometry = llama(heads=2, head_dim=2)
    mappings = verify_tiling(geometry, P("tp=4,dcp=2,interleave=4"), LocalForm("hnd"))
    row = geometry.token_row_bytes
    for mapping in mappings:
        assert mapping.full_chunks == ()
        assert len(mapping.partial_chunks) == geometry.num_layers
        assert mapping.share_bytes == geometry.num_layers * 8 * row
        # every segment is one interleave chunk of 4 tokens, 8 tokens apart
        assert {seg.size for seg in mapping.segments} == {4 * row}
        shard = mapping.layout.token_shard(mapping.rank)
        assert {seg.chunk_offset % (8 * row) for seg in mapping.segments} == {shard * 4 * row}


def test_segments_place_the_share_in_canonical_order_per_inner_chunk() -> None:
    geometry = llama(heads=4, head_dim=2)
    for mapping in verify_tiling(geometry, P("tp=2,pp=2"), LocalForm("nhd")):
        offsets = [seg.canonical_offset for seg in mapping.segments]
        assert offsets == sorted(offsets)
        assert [seg.share_offset for seg in mapping.segments] == [
            sum(s.size for s in mapping.segments[:k]) for k in range(len(mapping.segments))
        ]
        heads, layers = mapping.heads, mapping.local_layers
        chunks = sorted(geometry.inner_chunk_index(h, layer) for h in heads for layer in layers)
        assert [seg.chunk for seg in mapping.segments] == chunks
        assert all(seg.size == geometry.inner_chunk_bytes for seg in mapping.segments)


def test_segments_split_at_inner_chunk_boundaries() -> None:
    """TP=1 with one head: the share is the whole block, one segment per layer's chunk."""
    geometry = llama(heads=1, head_dim=2)
    (mapping,) = verify_tiling(geometry, P("tp=1"), LocalForm("hnd", "packed"))
    assert [seg.chunk for seg in mapping.segments] == list(range(geometry.num_layers))


# -- election -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("geometry", "layout", "writers"),
    [
        (llama(heads=2), "tp=8", [(4, 0), (4, 1), (4, 2), (4, 3), (4, 0), (4, 1), (4, 2), (4, 3)]),
        (llama(heads=2), "tp=8,dcp=2", [(2, 0), (2, 0), (2, 1), (2, 1)] * 2),
        (llama(heads=8), "tp=2", [(1, 0), (1, 0)]),
        (llama(heads=2), "tp=2,pcp=2", [(2, 0), (2, 0), (2, 1), (2, 1)]),
        (llama(heads=2), "tp=2,pcp=2,pcp_kv=sharded", [(1, 0)] * 4),
    ],
)
def test_writer_election_matches_vllm_formula(
    geometry: GroupGeometry, layout: str, writers: list[tuple[int, int]]
) -> None:
    mappings = map_all_ranks(geometry, P(layout), LocalForm())
    assert [(m.num_writers, m.writer_index) for m in mappings] == writers


def test_mla_writers_are_tp_over_dcp() -> None:
    mla = GroupGeometry("mla", (0, 1), 2, 16, 1, latent_dim=576)
    mappings = verify_tiling(mla, P("tp=8,dcp=2"), LocalForm())
    assert [(m.num_writers, m.writer_index) for m in mappings] == [(4, r // 2) for r in range(8)]


def test_exactly_one_replica_writes_each_block_key() -> None:
    geometry = llama(heads=1)
    mappings = verify_tiling(geometry, P("tp=4"), LocalForm())
    for i in range(64):
        key = int.from_bytes(hashlib.sha256(str(i).encode()).digest()[:8], "big")
        assert sum(m.is_writer(key) for m in mappings) == 1


# -- tiling check -------------------------------------------------------------------------------


def test_check_tiling_catches_a_missing_writer() -> None:
    mappings = list(map_all_ranks(llama(heads=1), P("tp=2"), LocalForm()))
    mappings[1] = dataclasses.replace(mappings[1], writer_index=0)
    with pytest.raises(LayoutError, match=r"writers of election residue 0 .* twice"):
        check_tiling(mappings)


def test_check_tiling_catches_a_run_that_misses_bytes() -> None:
    mappings = list(map_all_ranks(llama(heads=2), P("tp=2"), LocalForm()))
    mappings[0] = dataclasses.replace(mappings[0], runs=mappings[0].runs[1:])
    with pytest.raises(LayoutError, match="has runs for local regions"):
        check_tiling(mappings)


def test_check_tiling_catches_overlapping_local_bytes() -> None:
    mappings = list(map_all_ranks(llama(heads=2, layers=1), P("tp=2"), LocalForm()))
    run = mappings[0].runs[0]
    shifted = dataclasses.replace(run, local_offset=run.local_offset + 4)
    mappings[0] = dataclasses.replace(mappings[0], runs=(shifted,))
    with pytest.raises(LayoutError, match="leave bytes"):
        check_tiling(mappings)


def test_check_tiling_catches_segments_that_disagree_with_runs() -> None:
    mappings = list(map_all_ranks(llama(heads=2), P("tp=2"), LocalForm()))
    segments = mappings[1].segments
    wrong = (dataclasses.replace(segments[0], chunk_offset=2, canonical_offset=2), *segments[1:])
    mappings[1] = dataclasses.replace(mappings[1], segments=wrong)
    with pytest.raises(LayoutError, match="segments of rank"):
        check_tiling(mappings)


def test_check_tiling_needs_every_rank() -> None:
    mappings = map_all_ranks(llama(), P("tp=2"), LocalForm())
    with pytest.raises(LayoutError, match="expected one mapping per rank"):
        check_tiling(mappings[:1])
    with pytest.raises(LayoutError, match="got none"):
        check_tiling([])


# -- tensors ------------------------------------------------------------------------------------


def _rank_setup(
    family: str, layout: str = "tp=2"
) -> tuple[GroupGeometry, ParallelLayout, RankCoord]:
    return llama(heads=4, head_dim=2, layers=2), P(layout), RankCoord(1)


def test_vllm_logical_nhd_view_and_int8_rows_are_accepted() -> None:
    """vLLM hands (num_blocks, H, bs, 2D) views with NHD strides, or int8 (num_blocks, page)."""
    geometry, layout, coord = _rank_setup("nhd")
    form = LocalForm("nhd")
    mapping = map_rank(geometry, layout, form, coord)
    kv = full_kv(geometry, 2, seed=3)
    pages = rank_pages(kv, rank_view(geometry, layout, coord), "nhd")
    ids = torch.tensor([4, 1])
    logical = build_cache(pages, form, 6, ids, seed=1, vllm_logical_view=True)
    assert logical.tensors[0].shape == (6, 2, 16, 4)  # (nb, H_local, bs, 2D), NHD strides
    int8_rows = [
        t.permute(0, 2, 1, 3).contiguous().view(torch.int8).view(6, -1) for t in logical.tensors
    ]
    expected = canonical_bytes(kv)
    for tensors in (logical.tensors, int8_rows):
        out = torch.empty(2, geometry.canonical_block_bytes, dtype=torch.int8)
        out.fill_(0)
        gather_blocks(mapping, tensors, ids, out)
        for seg in mapping.segments:
            span = slice(seg.canonical_offset, seg.canonical_offset + seg.size)
            assert torch.equal(out.view(torch.uint8)[:, span], expected[:, span])


def test_wrong_family_tensor_is_refused() -> None:
    geometry, layout, coord = _rank_setup("hnd")
    mapping = map_rank(geometry, layout, LocalForm("hnd"), coord)
    nhd_shaped = [torch.zeros(3, 16, 2, 4, dtype=torch.int16) for _ in range(2)]
    out = torch.empty(1, mapping.share_bytes, dtype=torch.uint8)
    with pytest.raises(
        LayoutError,
        match=r"expected each block.s page as dense \[2, 16, 4\] elements of torch.int16",
    ):
        gather_blocks(mapping, nhd_shaped, [0], out)


def test_staging_buffer_and_tensor_count_are_checked() -> None:
    geometry, layout, coord = _rank_setup("hnd")
    mapping = map_rank(geometry, layout, LocalForm("hnd"), coord)
    tensors = [torch.zeros(3, 2, 16, 4, dtype=torch.int16) for _ in range(2)]
    with pytest.raises(LayoutError, match="rank share"):
        gather_blocks(mapping, tensors, [0], torch.empty(1, 7, dtype=torch.uint8))
    with pytest.raises(LayoutError, match="rank share"):
        gather_blocks(mapping, tensors, [0], torch.empty(1, mapping.share_bytes, dtype=torch.int16))
    with pytest.raises(LayoutError, match="expected 2 tensors"):
        gather_blocks(
            mapping, tensors[:1], [0], torch.empty(1, mapping.share_bytes, dtype=torch.uint8)
        )
    with pytest.raises(LayoutError, match=r"expected values in \[0, 3\)"):
        gather_blocks(mapping, tensors, [3], torch.empty(1, mapping.share_bytes, dtype=torch.uint8))


def test_packed_row_too_short_is_refused() -> None:
    geometry, layout, coord = _rank_setup("hnd")
    mapping = map_rank(geometry, layout, LocalForm("hnd", "packed", 64), coord)
    backing = torch.zeros(3, 64 + mapping.share_bytes - 1, dtype=torch.uint8)
    share = torch.zeros(1, mapping.share_bytes, dtype=torch.uint8)
    with pytest.raises(LayoutError, match="cannot hold group_offset=64"):
        scatter_blocks(mapping, share, [backing], [0])


def test_empty_block_list_is_a_no_op() -> None:
    geometry, layout, coord = _rank_setup("hnd")
    mapping = map_rank(geometry, layout, LocalForm("hnd"), coord)
    tensors = [torch.zeros(3, 2, 16, 4, dtype=torch.int16) for _ in range(2)]
    out = torch.empty(0, mapping.share_bytes, dtype=torch.uint8)
    assert gather_blocks(mapping, tensors, [], out) is out
    scatter_blocks(mapping, out, tensors, [])

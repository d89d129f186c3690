"""The tier's chunk moves: strided copies and the zero-copy store give the index plan's bytes.

:class:`connector.tier.chunks.ChunkMap` moves a block with one strided copy (or, for an
identity plan, none: the block is a slice of the row) where the plan's unit permutation is a
product of axes, and with an index gather otherwise. The index plan is the reference (the
tier's end-to-end tests check it against the direct connector at other layouts); here every
fast path must move exactly its bytes, on every layout, and must not be taken where it does
not apply.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from connector.facts import EngineFacts
from connector.tier.chunks import ChunkGeometry, ChunkMap, build_chunk_map
from connector.tier.strided import StridedCopy, fit_strided
from kvstore import Identity
from kvstore.identity import GroupSpec, attention_group
from tests.helpers import layer_names

UNIT = 16  # bytes per unit in the fit_strided tests


def _identity(mla: bool = False, heads: int = 4, layers: int = 3) -> Identity:
    group = (
        GroupSpec(kind="mla", layer_names=tuple(layer_names(layers)), latent_dim=64)
        if mla
        else attention_group("full", layer_names(layers), num_kv_heads=heads, head_dim=32)
    )
    return Identity(model="test/chunks", kv_dtype="bfloat16", tokens_per_block=16, groups=(group,))


def _facts(layout: str = "LBHNC", heads: int = 4, **parallel: int) -> EngineFacts:
    p = {"tp": 1, "pp": 1, "dcp": 1, "pcp": 1, "interleave": 1, **parallel}
    return EngineFacts(
        "sha256", "", "bfloat16", "", "recompute", layout, heads, p["tp"], p["pp"], p["dcp"],
        p["pcp"], p["interleave"], (),
    )  # fmt: skip


def _chunk_map(
    identity: Identity,
    facts: EngineFacts,
    chunks: int = 6,
    canonical: bool = False,
    replicated: bool = False,
    pad: int = 0,
) -> ChunkMap:
    """A chunk map over random rows; ``pad`` extra bytes per cell (cells larger than the
    share, as vLLM's may be)."""
    workers = facts.tp * facts.pp * facts.pcp  # DCP ranks are TP ranks
    block = max(1, -(-identity.groups[0].num_layers * 2 * 16 * 64 * 4 // 4096)) * 4096
    cell = block + pad
    row = cell if canonical or replicated else workers * cell
    geometry = ChunkGeometry(row, cell, workers, canonical, replicated, 1)
    rng = np.random.default_rng(7)
    rows = torch.from_numpy(rng.integers(0, 256, (chunks, row), dtype=np.uint8))
    return build_chunk_map(rows, identity, facts, geometry)


def _reference_blocks(chunk_map: ChunkMap, ids: list[int]) -> np.ndarray:
    """The stored blocks by the index plan alone (unit ``k`` from row unit ``source[k]``)."""
    plan = chunk_map._plans[0]
    rows = chunk_map._rows.numpy().reshape(chunk_map._num_chunks, -1, plan.unit)
    blocks: np.ndarray = rows[np.asarray(ids)[:, None], plan.source.numpy()[None, :]]
    return blocks.reshape(len(ids), -1)


LAYOUTS: dict[str, dict[str, Any]] = {
    "tp1-hnd": {"facts": _facts()},
    "tp1-nhd": {"facts": _facts("LBNHC")},
    "tp2-hnd": {"facts": _facts(tp=2)},
    "tp2-nhd-padded-cells": {"facts": _facts("LBNHC", tp=2), "pad": 4096},
    "tp4-replicated-heads": {"identity": _identity(heads=2), "facts": _facts(heads=2, tp=4)},
    "dcp2": {"identity": _identity(heads=1), "facts": _facts(heads=1, tp=2, dcp=2)},
    "pp2": {"identity": _identity(layers=4), "facts": _facts(pp=2)},
    "pp2-uneven": {"facts": _facts(pp=2)},  # 2 + 1 layers: no product of axes, index gather
    "canonical": {"facts": _facts(tp=2), "canonical": True},
    "mla-replicated": {"identity": _identity(mla=True), "facts": _facts(tp=2), "replicated": True},
    "mla-tp1": {"identity": _identity(mla=True), "facts": _facts()},
}


def _build(case: str) -> ChunkMap:
    spec = dict(LAYOUTS[case])
    identity = spec.pop("identity", _identity())
    return _chunk_map(identity, spec.pop("facts"), **spec)


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_stored_blocks_are_the_index_plans_bytes(case: str) -> None:
    chunk_map = _build(case)
    ids = [4, 0, 5, 2]  # out of order, and not all chunks
    block_bytes = chunk_map.groups[0].block_bytes
    out = torch.full((len(ids) * block_bytes,), 0xAB, dtype=torch.uint8)
    staging = out if chunk_map.copies_on_store(0) else None
    blocks = chunk_map.to_blocks(0, ids, staging)
    assert np.array_equal(np.stack(blocks), _reference_blocks(chunk_map, ids))


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_loaded_rows_hold_every_cell_as_the_index_plan_writes_them(case: str) -> None:
    chunk_map = _build(case)
    ids = [3, 1]
    block_bytes = chunk_map.groups[0].block_bytes
    rng = np.random.default_rng(1)
    blocks = torch.from_numpy(rng.integers(0, 256, (len(ids), block_bytes), dtype=np.uint8))
    before = chunk_map._rows.numpy().copy()
    chunk_map.from_blocks(0, blocks, ids)
    expected = before.copy()
    plan = chunk_map._plans[0]
    units = expected.reshape(chunk_map._num_chunks, -1, plan.unit)
    canon = blocks.numpy().reshape(len(ids), -1, plan.unit)
    units[np.asarray(ids)[:, None], plan.target_rows.numpy()[None, :]] = canon[
        :, plan.target_canon.numpy()
    ]
    assert np.array_equal(chunk_map._rows.numpy(), expected)  # other rows, padding untouched


def test_the_layouts_vllm_produces_take_the_strided_paths() -> None:
    """Guards the speed-up itself: only the uneven pipeline split falls back to an index
    gather (its rank 0 holds two layers of each head, rank 1 one)."""
    gathered = {case for case in LAYOUTS if _build(case)._plans[0].store is None}
    scattered = {case for case in LAYOUTS if _build(case)._plans[0].load is None}
    assert gathered == scattered == {"pp2-uneven"}


def test_only_an_identity_plan_stores_without_a_copy() -> None:
    """The zero-copy store hands out slices of the rows: only where the canonical block is
    one run of its row (MLA: one latent page per layer, as the block holds them). Everywhere
    else it must copy: a TP=1 HND row is [layer][head] pages, the block [head][layer]; vLLM's
    canonical_layout pages are [layer][head] too."""
    zero_copy = {case for case in LAYOUTS if not _build(case).copies_on_store(0)}
    assert zero_copy == {"mla-tp1", "mla-replicated"}
    chunk_map = _build("mla-tp1")
    blocks = chunk_map.to_blocks(0, [2], None)
    assert np.shares_memory(blocks[0], chunk_map._rows.numpy())
    with pytest.raises(ValueError, match="expected a buffer"):
        _build("tp1-hnd").to_blocks(0, [2], None)


def _pairs(plan: StridedCopy) -> list[tuple[int, int]]:
    dst, src = plan.indices()
    return list(zip(dst.tolist(), src.tolist(), strict=True))


def test_fit_strided_finds_a_transpose_and_moves_its_bytes() -> None:
    layers, heads = 5, 3
    src = (np.arange(layers)[None, :] * heads + np.arange(heads)[:, None]).reshape(-1)
    dst = np.arange(src.size)
    plan = fit_strided(dst, src, UNIT)
    assert plan is not None and plan.shape == (heads, layers) and not plan.is_identity
    data = np.random.default_rng(0).integers(0, 256, src.size * UNIT, dtype=np.uint8)
    out = np.zeros_like(data)
    plan.copy(out, data)
    expected = data.reshape(-1, UNIT)[src].reshape(-1)
    assert np.array_equal(out, expected)


def test_fit_strided_with_replicas_and_offsets() -> None:
    """A load: each canonical unit to two cells (source stride 0), cells at an offset."""
    canon = np.repeat(np.arange(6), 2)
    rows = 100 + (np.tile([0, 40], 6) + np.repeat(np.arange(6), 2))
    plan = fit_strided(rows, canon, UNIT)
    assert plan is not None
    assert _pairs(plan) == list(zip(rows.tolist(), canon.tolist(), strict=True))


@pytest.mark.parametrize(
    ("dst", "src"),
    [
        (np.arange(6), np.array([0, 1, 2, 3, 5, 4])),  # a swap at the end: no product of axes
        (np.arange(6), np.array([0, 1, 2, 10, 11, 13])),  # runs of 3, second one broken
        (np.arange(5), np.array([0, 1, 2, 3, 5])),  # run of 4 does not divide 5
        (np.arange(4), np.array([3, 2, 1, 0])),  # negative step
        (np.array([0, 1, 0, 1]), np.arange(4)),  # a destination unit written twice
        (np.arange(8), np.array([0, 5, 2, 7, 4, 1, 6, 3])),  # a scramble
    ],
)
def test_fit_strided_refuses_what_is_not_strided(dst: np.ndarray, src: np.ndarray) -> None:
    assert fit_strided(dst, src, UNIT) is None


def test_fit_strided_is_exact_or_refuses_random_permutations() -> None:
    rng = np.random.default_rng(5)
    for n in (2, 6, 12, 24):
        for _ in range(50):
            src = rng.permutation(n)
            plan = fit_strided(np.arange(n), src, UNIT)
            if plan is not None:
                assert _pairs(plan) == list(zip(range(n), src.tolist(), strict=True))


def test_fit_strided_identity_is_a_slice() -> None:
    plan = fit_strided(np.arange(8), 3 + np.arange(8), UNIT)
    assert plan is not None and plan.is_identity and plan.src_start == 3
    shifted = fit_strided(2 + np.arange(8), np.arange(8), UNIT)
    assert shifted is not None and not shifted.is_identity  # destination offset: a copy


def test_strided_views_refuse_a_short_buffer() -> None:
    plan = fit_strided(np.arange(4), np.arange(4), UNIT)
    assert plan is not None
    with pytest.raises(ValueError, match="at least 64 bytes"):
        plan.source_view(np.zeros(63, dtype=np.uint8))

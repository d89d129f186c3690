"""The tier's chunk moves: strided copies and the zero-copy store give the index plan's bytes.

:class:`connector.tier.chunks.ChunkMap` moves a block with one strided copy (or, for an
identity plan, none: the block is a slice of the row) where the plan's unit permutation is a
product of axes, and with an index gather otherwise. The index plan is the reference (the
tier's end-to-end tests check it against the direct connector at other layouts); here every
fast path must move exactly its bytes, on every layout, and must not be taken where it does
not apply.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from connector.facts import EngineFacts
from connector.tier.chunks import ChunkGeometry, ChunkMap, build_chunk_map
from connector.tier.strided import StridedCopy, fit_strided
from kvstore import Identity
from kvstore.identity import GroupSpec, attention_group
from kvstore.store.types import BlockRead, BlockWrite, WriteStatus
from tests.helpers import StoreFactory, block_hash, layer_names, shard_files

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
    blocks = chunk_map.to_blocks(0, ids, out)
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


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_stored_blocks_are_copies_never_the_rows(case: str) -> None:
    """A store may outlive its deadline while vLLM reuses its chunks: its blocks are copies
    in the tier's buffer, even where the block is one run of its row (MLA's identity plan),
    so whatever vLLM writes into the rows afterwards, the blocks stay what they were."""
    chunk_map = _build(case)
    ids = [2, 5]
    out = torch.zeros(len(ids) * chunk_map.groups[0].block_bytes, dtype=torch.uint8)
    blocks = chunk_map.to_blocks(0, ids, out)
    assert not any(np.shares_memory(b, chunk_map._rows.numpy()) for b in blocks)
    chunk_map._row_array[ids] ^= 0xFF  # vLLM reuses the chunks
    assert np.array_equal(np.stack(blocks), _reference_blocks(chunk_map, ids) ^ 0xFF)


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


def test_strided_views_of_contiguous_and_strided_buffers_read_and_write_alike() -> None:
    """Views over a contiguous buffer (built by the ndarray constructor) and over a strided
    one (as_strided) enumerate the same units, and are writable exactly when the data is."""
    layers, heads = 5, 3
    src = (np.arange(layers)[None, :] * heads + np.arange(heads)[:, None]).reshape(-1)
    plan = fit_strided(np.arange(src.size), src, UNIT)
    assert plan is not None
    data = np.random.default_rng(6).integers(0, 256, src.size * UNIT, dtype=np.uint8)
    expected = data.reshape(-1, UNIT)[src].reshape(-1)
    spaced = np.zeros(2 * data.size, dtype=np.uint8)
    spaced[::2] = data  # the same bytes at a 2-byte stride: not contiguous
    for given in (data, spaced[::2], np.frombuffer(data.tobytes(), dtype=np.uint8)):
        view = plan.source_view(given)
        assert np.array_equal(np.ascontiguousarray(view).reshape(-1), expected)
        assert view.flags.writeable == given.flags.writeable
    for out in (np.zeros_like(data), np.zeros(2 * data.size, dtype=np.uint8)[::2]):
        plan.copy(out, data)  # through a destination view of contiguous / strided memory
        assert np.array_equal(out, expected)


# Layouts whose inner chunks are 4 KiB (head_dim 64): raw dense arrays, where stores write
# the rows as pieces. Cells hold a rank's share exactly (pad brings _chunk_map's cell to it).
DENSE = {"heads": 4, "head_dim": 64, "layers": 3}
DENSE_LAYOUTS: dict[str, dict[str, Any]] = {
    "dense-tp1-hnd": {"facts": _facts(), "pad": 24576},
    "dense-tp2-hnd": {"facts": _facts(tp=2)},
    "dense-canonical": {"facts": _facts(tp=2), "canonical": True, "pad": 24576},
    "dense-tp1-nhd": {"facts": _facts("LBNHC"), "pad": 24576},
}


# Where stores write views of the rows (the others gather: see the test below).
IN_PLACE = {
    "canonical", "pp2", "tp1-hnd", "tp2-hnd", "tp4-replicated-heads",
    "dense-tp1-hnd", "dense-tp2-hnd", "dense-canonical",
}  # fmt: skip


def _dense_identity() -> Identity:
    group = attention_group(
        "full",
        layer_names(DENSE["layers"]),
        num_kv_heads=DENSE["heads"],
        head_dim=DENSE["head_dim"],
    )
    return Identity(model="test/dense", kv_dtype="bfloat16", tokens_per_block=16, groups=(group,))


def _any_case(case: str) -> tuple[Identity, ChunkMap]:
    if case in LAYOUTS:
        return LAYOUTS[case].get("identity", _identity()), _build(case)
    spec = dict(DENSE_LAYOUTS[case])
    identity = _dense_identity()
    return identity, _chunk_map(identity, spec.pop("facts"), **spec)


@pytest.mark.parametrize("direct_io", ["off", "auto"])
@pytest.mark.parametrize("case", sorted(IN_PLACE))
def test_blocks_written_from_the_rows_are_the_gathered_files(
    make_store: StoreFactory, tmp_path: Path, frozen_time: int, case: str, direct_io: str
) -> None:
    """Where views apply, the store's files are byte for byte those of the gathered blocks
    (the index plan's bytes); each view is memory of the row's copy in the tier's buffer,
    never of the rows (a store may outlive its deadline while vLLM reuses them)."""
    identity, chunk_map = _any_case(case)
    groups = {
        way: make_store(tmp_path / way, direct_io=direct_io).namespace(identity).group(0)
        for way in ("gathered", "views")
    }
    layout = groups["views"].layout
    assert layout.dense == case.startswith("dense")  # dense: pieces written in place
    assert chunk_map.stores_in_place(0, layout.chunk_nbytes)
    ids = [4, 0, 5, 2]
    hashes = [block_hash(c, case) for c in ids]
    reference = _reference_blocks(chunk_map, ids)
    out = torch.zeros(len(ids) * chunk_map.source_span_bytes(0), dtype=torch.uint8)
    views = chunk_map.source_views(0, ids, out)
    for view in views:
        assert not view.flags.c_contiguous
        assert np.shares_memory(view, out.numpy())
        assert not np.shares_memory(view, chunk_map._rows.numpy())
    for way, blocks in (("gathered", list(reference)), ("views", views)):
        writes = [
            BlockWrite(h, b, hashes[j - 1] if j else None)
            for j, (h, b) in enumerate(zip(hashes, blocks, strict=True))
        ]
        results = groups[way].write_blocks(writes)
        assert [r.status for r in results] == [WriteStatus.WRITTEN] * len(ids), results
    files = {
        way: {
            str(p.relative_to(tmp_path / way)): p.read_bytes() for p in shard_files(tmp_path / way)
        }
        for way in groups
    }
    assert len(files["views"]) == len(ids)
    assert files["views"] == files["gathered"]


def test_views_apply_exactly_where_pieces_are_whole_chunks(
    make_store: StoreFactory, tmp_path: Path
) -> None:
    """Views need a product-of-axes plan (not the uneven PP split), no plain slice (MLA: the
    zero-copy slice already), and runs of whole chunks: NHD pages interleave heads per token
    (128-byte runs), DCP splits a chunk's tokens between ranks; those still gather."""
    in_place = set()
    for case in sorted(LAYOUTS) + sorted(DENSE_LAYOUTS):
        identity, chunk_map = _any_case(case)
        group = make_store(tmp_path / case).namespace(identity).group(0)
        if chunk_map.stores_in_place(0, group.layout.chunk_nbytes):
            in_place.add(case)
    assert in_place == IN_PLACE
    with pytest.raises(ValueError, match="gathered by index"):
        _build("pp2-uneven").source_views(0, [1], torch.zeros(1 << 20, dtype=torch.uint8))


# Where loads read blocks straight into the rows: each canonical byte has one place in the
# row, and that place is one run (MLA) or runs of whole chunks (pieces: raw dense arrays).
# NHD pages split chunks per token, DCP splits a chunk's tokens, replicated heads put a byte
# in two cells, the uneven PP split has no strided plan: those are staged and scattered.
LOADS_IN_PLACE = {
    "canonical", "mla-replicated", "mla-tp1", "pp2", "tp1-hnd", "tp2-hnd",
    "dense-canonical", "dense-tp1-hnd", "dense-tp2-hnd",
}  # fmt: skip


def test_loads_read_into_the_rows_exactly_where_each_byte_has_one_place(
    make_store: StoreFactory, tmp_path: Path
) -> None:
    in_place = set()
    for case in sorted(LAYOUTS) + sorted(DENSE_LAYOUTS):
        identity, chunk_map = _any_case(case)
        layout = make_store(tmp_path / case).namespace(identity).group(0).layout
        if chunk_map.loads_in_place(0, layout.chunk_nbytes):
            in_place.add(case)
        if not chunk_map.loads_in_place(0, None):  # only one contiguous run of the row
            assert case not in {"mla-tp1", "mla-replicated"}
    assert in_place == LOADS_IN_PLACE
    replicas = _chunk_map(_dense_identity(), _facts(tp=8))  # 4 heads over 8 ranks
    assert not replicas.loads_in_place(0, 4096)
    with pytest.raises(ValueError, match="scattered by index"):
        _build("pp2-uneven").destination_views(0, [1])


@pytest.mark.parametrize("case", ["mla-tp1", "dense-tp1-hnd", "dense-tp2-hnd", "dense-canonical"])
def test_blocks_read_into_the_rows_are_the_scattered_bytes(
    make_store: StoreFactory, tmp_path: Path, case: str
) -> None:
    """A load read by the store straight into the rows' views leaves the rows byte for byte
    as reading into a buffer and scattering (ChunkMap.from_blocks) does: every cell of the
    chunks loaded, other rows and the cells' padding untouched."""
    identity, chunk_map = _any_case(case)
    group = make_store(tmp_path).namespace(identity).group(0)
    layout = group.layout
    assert chunk_map.loads_in_place(0, layout.chunk_nbytes if layout.dense else None)
    ids = [3, 1]
    rng = np.random.default_rng(11)
    blocks = rng.integers(0, 256, (len(ids), layout.block_nbytes), dtype=np.uint8)
    hashes = [block_hash(c, case) for c in ids]
    group.write_blocks([BlockWrite(h, b) for h, b in zip(hashes, blocks, strict=True)])
    before = chunk_map._row_array.copy()
    views = chunk_map.destination_views(0, ids)
    assert all(np.shares_memory(v, chunk_map._row_array) for v in views)
    results = group.read_blocks([BlockRead(h, v) for h, v in zip(hashes, views, strict=True)])
    assert all(r.ok for r in results), results
    read_in_place = chunk_map._row_array.copy()
    chunk_map._row_array[:] = before
    chunk_map.from_blocks(0, torch.from_numpy(blocks), ids)
    assert np.array_equal(read_in_place, chunk_map._row_array)
    assert not np.array_equal(read_in_place, before)

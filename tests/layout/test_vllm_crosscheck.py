"""Cross-check kvstore.layout against vLLM 0.33's own canonical-mapping derivation.

Runs only where vllm==0.33.0 is importable (a separate venv; the project does not depend on it).
What is called, all pure functions that need no engine, GPU or distributed setup:

* ``_layer_mapping(spec, kv_cache, num_blocks, ctx)`` and ``_RankContext`` from
  ``vllm/distributed/kv_transfer/kv_connector/v1/offloading/canonical_mapping.py``: the
  per-layer, per-rank derivation that ``derive_canonical_mappings`` runs for every rank of the
  TP x PCP grid. ``derive_canonical_mappings`` itself only adds reading tp / dcp / pcp /
  interleave / total heads / rank out of a ``VllmConfig``; those are passed here directly.
  ``_verify_tiling`` is run on vLLM's per-rank mappings as a sanity check of the setup.
  Specs are real ``FullAttentionSpec`` / ``MLAAttentionSpec``; caches are CPU tensors shaped
  ``(num_blocks, H_local, bs, 2*D)`` with HND (contiguous) or NHD strides, as vLLM allocates.
* ``get_pp_indices`` from ``vllm/distributed/utils.py`` for the pipeline partition.

vLLM's canonical page is per layer (``[H][N][C]`` for "hnd", ``[N][H][C]`` for "nhd",
``[N][Cl]`` for MLA) while ours is per block (``[H][L][T][C]``), so the test compares
*positions*: for every byte of a rank's local page, the (head, token, byte-in-row) it lands on.
Where vLLM certifies a layout, ours must map every byte to the same position and elect the same
writers; where vLLM refuses (returns None), ours must raise LayoutError. PCP is compared with
``pcp_kv="sharded"``, the model of ``canonical_mapping.py`` (vLLM 0.33's runner instead
replicates KV over PCP, which that module does not model; see kvstore.layout.parallel).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

pytest.importorskip(
    "vllm", reason="vllm==0.33.0 is not installed here; the cross-check runs in a vLLM venv"
)

from vllm.distributed.kv_transfer.kv_connector.v1.offloading import (
    canonical_mapping as vcm,
)
from vllm.distributed.utils import get_pp_indices
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from kvstore.layout import (
    GroupGeometry,
    LayoutError,
    LocalForm,
    ParallelLayout,
    RankCoord,
    RankMapping,
    map_rank,
    pp_layer_range,
)

DTYPES = {2: torch.bfloat16, 1: torch.float8_e4m3fn}
NUM_BLOCKS = 3


def _positions_from_runs(
    runs: list[tuple[int, int, int, int, int, int]], page: int
) -> torch.Tensor:
    """Canonical offset of each local byte; runs are (local, canonical, size, count, strides)."""
    out = torch.full((page,), -1, dtype=torch.int64)
    for local, canonical, size, count, local_stride, canonical_stride in runs:
        for k in range(count):
            start = local + k * local_stride
            assert bool((out[start : start + size] == -1).all()), "run covers a byte twice"
            out[start : start + size] = torch.arange(size) + canonical + k * canonical_stride
    assert bool((out >= 0).all()), "runs leave local bytes uncovered"
    return out


def _decode(offsets: torch.Tensor, order: str, heads: int, tokens: int, row: int) -> torch.Tensor:
    """(head, token, byte) of canonical offsets in a page of the given axis order."""
    byte, cell = offsets % row, offsets // row
    if order == "hnt":  # [H][T][row]: ours with one layer, vLLM "hnd", MLA (H = 1)
        head, token = cell // tokens, cell % tokens
    else:  # "nht": [T][H][row], vLLM "nhd"
        token, head = cell // heads, cell % heads
    return torch.stack([head, token, byte], dim=1)


def _vllm_kv_cache(
    heads_local: int, bs: int, head_dim: int, dtype: torch.dtype, family: str
) -> torch.Tensor:
    if family == "hnd":
        return torch.empty(NUM_BLOCKS, heads_local, bs, 2 * head_dim, dtype=dtype)
    return torch.empty(NUM_BLOCKS, bs, heads_local, 2 * head_dim, dtype=dtype).permute(0, 2, 1, 3)


def _ours(
    geometry: GroupGeometry, layout: ParallelLayout, family: str, coord: RankCoord
) -> RankMapping | None:
    try:
        return map_rank(geometry, layout, LocalForm(family), coord)  # type: ignore[arg-type]
    except LayoutError:
        return None


def _compare_rank(
    vmap: Any, ours: RankMapping, family: str, heads: int, tokens: int, row: int
) -> None:
    page = ours.page_bytes
    assert vmap.local_page_size_bytes == page
    v_runs = [
        (r.local_offset, r.canonical_offset, r.fragment_size, r.num_fragments, r.local_stride,
         r.canonical_stride)
        for r in vmap.runs
    ]  # fmt: skip
    o_runs = [
        (r.local_offset, r.canonical_offset, r.size, r.count, r.local_stride, r.canonical_stride)
        for r in ours.runs
    ]
    v_order = "hnt" if family == "hnd" or ours.geometry.kind == "mla" else "nht"
    v_pos = _decode(_positions_from_runs(v_runs, page), v_order, heads, tokens, row)
    o_pos = _decode(_positions_from_runs(o_runs, page), "hnt", heads, tokens, row)
    assert torch.equal(v_pos, o_pos), "a local byte lands on a different (head, token, byte)"
    assert (vmap.num_writers, vmap.writer_index) == (ours.num_writers, ours.writer_index)


def _layouts() -> list[tuple[int, int, int, int]]:
    """(tp, dcp, pcp, interleave) combinations vLLM's ParallelConfig can express."""
    grid = itertools.product((1, 2, 4, 8), (1, 2, 4), (1, 2), (1, 2, 4))
    return [
        (tp, dcp, pcp, interleave)
        for tp, dcp, pcp, interleave in grid
        if tp % dcp == 0 and (interleave == 1 or dcp * pcp > 1)
    ]


def _pcp_models(pcp: int) -> tuple[str, ...]:
    return ("sharded",) if pcp > 1 else ("replicated", "sharded")


@pytest.mark.parametrize("family", ["hnd", "nhd"])
@pytest.mark.parametrize("heads", [1, 2, 4, 8, 6])
@pytest.mark.parametrize(("bs", "elem"), [(8, 2), (4, 1)])
def test_attention_matches_vllm(family: str, heads: int, bs: int, elem: int) -> None:
    head_dim = 4
    compared = refused = 0
    for tp, dcp, pcp, interleave in _layouts():
        tokens = bs * dcp * pcp
        geometry = GroupGeometry(
            "full", (0,), 1, tokens, elem, num_kv_heads=heads, head_dim=head_dim
        )
        heads_local = max(1, heads // tp)
        spec = FullAttentionSpec(
            block_size=bs, num_kv_heads=heads_local, head_size=head_dim, dtype=DTYPES[elem]
        )
        cache = _vllm_kv_cache(heads_local, bs, head_dim, DTYPES[elem], family)
        for pcp_kv in _pcp_models(pcp):
            layout = ParallelLayout(tp=tp, dcp=dcp, pcp=pcp, interleave=interleave, pcp_kv=pcp_kv)  # type: ignore[arg-type]
            v_maps = []
            for rank in range(tp * pcp):
                ctx = vcm._RankContext(tp, dcp, pcp, interleave, heads, rank)
                v_maps.append(vcm._layer_mapping(spec, cache, NUM_BLOCKS, ctx))
                ours = _ours(geometry, layout, family, RankCoord(rank % tp, 0, rank // tp))
                assert (v_maps[-1] is None) == (ours is None), (
                    f"{layout} heads={heads}: vLLM certifies={v_maps[-1] is not None}, "
                    f"kvstore certifies={ours is not None}"
                )
                if ours is not None:
                    _compare_rank(v_maps[-1], ours, family, heads, tokens, geometry.token_row_bytes)
            if v_maps[0] is None:
                refused += 1
            else:
                vcm._verify_tiling("layer", [m for m in v_maps if m is not None])
                compared += 1
    assert compared > 0
    if heads > 1:
        assert refused > 0  # some DCP layouts (replication % dcp != 0) must be refused


@pytest.mark.parametrize(("bs", "elem"), [(8, 2), (4, 1)])
def test_mla_matches_vllm(bs: int, elem: int) -> None:
    latent = 576
    spec = MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=latent, dtype=DTYPES[elem])
    for tp, dcp, pcp, interleave in _layouts():
        tokens = bs * dcp * pcp
        geometry = GroupGeometry("mla", (0,), 1, tokens, elem, latent_dim=latent)
        for pcp_kv in _pcp_models(pcp):
            layout = ParallelLayout(tp=tp, dcp=dcp, pcp=pcp, interleave=interleave, pcp_kv=pcp_kv)  # type: ignore[arg-type]
            v_maps = []
            for rank in range(tp * pcp):
                ctx = vcm._RankContext(tp, dcp, pcp, interleave, 1, rank)
                v_maps.append(vcm._layer_mapping(spec, None, NUM_BLOCKS, ctx))
                ours = _ours(geometry, layout, "hnd", RankCoord(rank % tp, 0, rank // tp))
                assert v_maps[-1] is not None and ours is not None, str(layout)
                _compare_rank(v_maps[-1], ours, "hnd", 1, tokens, geometry.token_row_bytes)
            vcm._verify_tiling("mla", [m for m in v_maps if m is not None])


def test_pp_partition_matches_get_pp_indices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    for layers in range(1, 81):
        for pp in range(1, min(layers, 9) + 1):
            for rank in range(pp):
                assert pp_layer_range(layers, rank, pp) == get_pp_indices(layers, rank, pp)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "5,20,7")
    for rank in range(3):
        assert pp_layer_range(32, rank, 3, (5, 20, 7)) == get_pp_indices(32, rank, 3)

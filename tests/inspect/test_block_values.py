"""``block``, ``values`` and ``stats``: every number equals one computed from the reference."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvstore.inspect.render import sanitize
from tests.inspect.conftest import FOREST, INF_AT, NAN_AT, Reference, Run, Space, hash_of, run_json


def expected_stats(
    values: np.ndarray, mla: bool, heads: range, layers: range
) -> list[dict[str, Any]]:
    """Stats rows computed directly from reference float values (the documented convention)."""
    rows = []

    def row(x: np.ndarray, layer: int, head: int, part: str) -> dict[str, Any]:
        x = x.reshape(-1).astype(np.float64)
        finite = x[np.isfinite(x)]
        return {
            "layer": layer, "head": head, "part": part, "count": x.size,
            "absmax": float(np.max(np.abs(finite))), "mean": float(np.mean(finite)),
            "std": float(np.std(finite)),
            "nan": int(np.isnan(x).sum()), "inf": int(np.isinf(x).sum()),
        }  # fmt: skip

    for layer in layers:
        if mla:
            rows.append(row(values[layer], layer, 0, "latent"))
            continue
        for head in heads:
            rows.append(row(values[head, layer, :, 0], layer, head, "K"))
            rows.append(row(values[head, layer, :, 1], layer, head, "V"))
    return rows


def assert_rows_equal(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert {k: g[k] for k in ("layer", "head", "part", "count", "nan", "inf")} == {
            k: w[k] for k in ("layer", "head", "part", "count", "nan", "inf")
        }
        for k in ("absmax", "mean", "std"):
            assert g[k] == pytest.approx(w[k], rel=1e-12, abs=1e-12), (g, k)


@pytest.mark.parametrize("which", ["bf16", "f16", "fp8", "mla"])
def test_stats_equal_direct_computation(reference: Reference, run: Run, which: str) -> None:
    space: Space = getattr(reference, which)
    for block_hash in space.tensors:
        doc: dict[str, Any] = run_json(run, "stats", reference.root, space.ns, block_hash.hex())
        assert doc["check"]["ok"] and doc["kv_dtype"] == space.identity.kv_dtype
        g = space.identity.groups[0]
        heads = range(1 if g.kind == "mla" else g.num_kv_heads)
        want = expected_stats(space.floats(block_hash), g.kind == "mla", heads, range(g.num_layers))
        assert_rows_equal(doc["rows"], want)


def test_stats_count_nan_and_inf_and_skip_them(reference: Reference, run: Run) -> None:
    space = reference.bf16
    doc: dict[str, Any] = run_json(
        run,
        "stats",
        reference.root,
        space.ns,
        space.names["a1"].hex(),
        "--heads",
        "0",
        "--layers",
        "1",
    )
    k, v = doc["rows"]
    assert (k["part"], k["nan"], k["inf"]) == ("K", 1, 0)
    assert (v["part"], v["nan"], v["inf"]) == ("V", 0, 1)
    assert np.isfinite(k["absmax"]) and np.isfinite(v["std"])
    assert NAN_AT[0] == INF_AT[0] == "a1"


def test_stats_selection_and_text_table(reference: Reference, run: Run) -> None:
    space = reference.bf16
    h = space.names["c1"]
    doc: dict[str, Any] = run_json(
        run, "stats", reference.root, space.ns, h.hex()[:10], "--heads", "1:2", "--layers=-2:"
    )
    want = expected_stats(space.floats(h), False, range(1, 2), range(1, 3))
    assert_rows_equal(doc["rows"], want)
    assert doc["selection"] == {"heads": [1, 2], "layers": [1, 3]}
    code, out, _ = run("stats", reference.root, space.ns, h.hex(), "--heads", "1", "--layers", "2")
    assert code == 0
    lines = out.splitlines()
    assert lines[1].split() == ["layer", "head", "part", "absmax", "mean", "std", "nan", "inf"]
    k_row = lines[2].split()
    assert k_row[:3] == ["2", "1", "K"]
    assert float(k_row[3]) == pytest.approx(want[2]["absmax"], rel=1e-3)


@pytest.mark.parametrize("which", ["bf16", "f16", "fp8", "mla"])
def test_values_json_equal_reference(reference: Reference, run: Run, which: str) -> None:
    space: Space = getattr(reference, which)
    h = next(iter(space.tensors))
    doc: dict[str, Any] = run_json(run, "values", reference.root, space.ns, h.hex())
    assert doc["values"] == sanitize(space.floats(h).tolist())


def test_values_selection_and_tokens(reference: Reference, run: Run) -> None:
    space = reference.bf16
    h = space.names["a1"]
    doc: dict[str, Any] = run_json(
        run,
        "values",
        reference.root,
        space.ns,
        h.hex(),
        "--heads",
        "0",
        "--layers",
        "1",
        "--tokens",
        "2:5",
    )
    want = space.floats(h)[0:1, 1:2, 2:5]
    assert doc["values"] == sanitize(want.tolist())
    assert doc["values"][0][0][1][0][5] == "nan"  # token 3 (row 1 of 2:5), K, dim 5
    code, out, _ = run("values", reference.root, space.ns, h.hex(), "--layers", "1", "--heads", "0")
    assert code == 0
    assert (
        "layer 1 (model.layers.1.self_attn.attn), head 0 K: tokens 0..15 x 64  (1 nan, 0 inf)"
        in out
    )
    assert "head 0 V: tokens 0..15 x 64  (0 nan, 1 inf)" in out
    assert "..." in out  # summarized by default
    code, out, _ = run(
        "values", reference.root, space.ns, h.hex(), "--layers", "1", "--heads", "0", "--full"
    )
    assert code == 0 and "..." not in out and " nan " in out and " inf" in out


def test_block_header_checksums_and_parent_chain(reference: Reference, run: Run) -> None:
    space = reference.bf16
    h = space.names["c2"]
    doc: dict[str, Any] = run_json(run, "block", reference.root, space.ns, h.hex()[:6])
    assert doc["ok"] and doc["problems"] == []
    header = doc["header"]
    assert header["block_hash"] == h.hex()
    assert header["parent_hash"] == hash_of("c1").hex()
    assert header["namespace_digest"] == space.identity.digest.hex()
    assert (header["tokens"], header["num_chunks"], header["checksum_algo"]) == (16, 6, "xxh3_64")
    assert [(c["head"], c["layer"]) for c in doc["chunks"]] == [
        (hd, ly) for hd in range(2) for ly in range(3)
    ]
    assert all(c["ok"] and c["stored"] == c["computed"] for c in doc["chunks"])
    chain = doc["parent_chain"]
    assert chain["hashes"] == [hash_of(n).hex() for n in ("c1", "c0", "s2", "s1", "s0")]
    assert (chain["depth"], chain["ends"]) == (6, "chain start")


def test_block_parent_chain_stops_at_an_evicted_parent(reference: Reference, run: Run) -> None:
    space = reference.bf16
    doc: dict[str, Any] = run_json(run, "block", reference.root, space.ns, space.names["o2"].hex())
    assert doc["parent_chain"]["hashes"] == [hash_of("o1").hex()]
    assert doc["parent_chain"]["ends"] == "evicted"
    assert FOREST["o1"] == "o0"


def test_block_text(reference: Reference, run: Run) -> None:
    space = reference.bf16
    code, out, _ = run("block", reference.root, space.ns, space.names["s0"].hex())
    assert code == 0
    assert "status ok" in out and "6 of 6 verified ok" in out
    assert "(none: first block of a chain)" in out and "ends: chain start" in out


# -- rank view (kvstore.layout.parallel) ----------------------------------------------------


def test_rank_view_tp_holds_its_heads(reference: Reference, run: Run) -> None:
    space = reference.bf16
    h = space.names["b0"]
    doc: dict[str, Any] = run_json(
        run, "values", reference.root, space.ns, h.hex(), "--layout", "tp=2", "--rank", "1"
    )
    assert doc["rank"]["heads"] == [1] and doc["rank"]["layers"] == [0, 1, 2]
    assert doc["rank"]["local_block_size"] == 16
    assert doc["values"] == sanitize(space.floats(h)[1:2].tolist())
    assert doc["slots"] == [[list(range(16))]] * 3


def test_rank_view_pp_holds_its_layers(reference: Reference, run: Run) -> None:
    space = reference.mla
    h = next(iter(space.tensors))
    doc: dict[str, Any] = run_json(
        run, "values", reference.root, space.ns, h.hex(), "--layout", "tp=2,pp=2", "--rank", "2"
    )
    assert doc["rank"]["coord"] == {"tp_rank": 0, "pp_rank": 1, "pcp_rank": 0}
    assert doc["rank"]["layers"] == [2, 3]
    assert doc["values"] == sanitize(space.floats(h)[2:4].tolist())


def test_rank_view_dcp_holds_interleaved_tokens(reference: Reference, run: Run) -> None:
    space = reference.bf16
    h = space.names["a0"]
    # 2 KV heads over tp=4: each head replicated twice; dcp=2 shards tokens within the pair.
    doc: dict[str, Any] = run_json(
        run, "values", reference.root, space.ns, h.hex(), "--layout", "tp=4,dcp=2", "--rank", "3"
    )
    assert doc["rank"]["heads"] == [1] and doc["rank"]["local_block_size"] == 8
    tokens = list(range(1, 16, 2))
    assert doc["slots"] == [[tokens]] * 3
    want = space.floats(h)[1:2][:, :, tokens]
    assert doc["values"] == sanitize(want.tolist())
    stats: dict[str, Any] = run_json(
        run, "stats", reference.root, space.ns, h.hex(), "--layout", "tp=4,dcp=2", "--rank", "3"
    )
    want_rows = [{**r, "head": 1} for r in expected_stats(want, False, range(1), range(3))]
    assert_rows_equal(stats["rows"], want_rows)


def test_rank_view_nhd_family_is_the_same_logical_values(reference: Reference, run: Run) -> None:
    space = reference.f16
    h = next(iter(space.tensors))
    argv = ("values", reference.root, space.ns, h.hex(), "--layout", "tp=2", "--rank", "0")
    hnd: dict[str, Any] = run_json(run, *argv)
    nhd: dict[str, Any] = run_json(run, *argv, "--family", "nhd")
    assert hnd["values"] == nhd["values"] == sanitize(space.floats(h)[0:1].tolist())
    assert nhd["rank"]["form"]["family"] == "nhd"


def test_rank_view_rejects_a_layout_the_mapping_refuses(reference: Reference, run: Run) -> None:
    space = reference.bf16
    code, _, err = run(
        "values",
        reference.root,
        space.ns,
        space.names["s0"].hex(),
        "--layout",
        "tp=3",
        "--rank",
        "0",
    )
    assert code == 2 and "kvstore-inspect: error:" in err and len(err.strip().splitlines()) == 1

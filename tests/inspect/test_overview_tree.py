"""``overview`` and ``tree``: counts, bytes and prefix-forest numbers of the reference store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvstore.inspect.tree import Forest, summarize
from kvstore.store.format import ShardLayout
from tests.inspect.conftest import FOREST, Reference, Run, hash_of, run_json
from tests.inspect.png import png_size


def test_overview_counts_every_namespace_and_block(reference: Reference, run: Run) -> None:
    doc: dict[str, Any] = run_json(run, "overview", reference.root, "--check")
    by_name = {ns["name"]: ns for ns in doc["namespaces"]}
    assert sorted(by_name) == sorted(s.ns for s in reference.spaces)
    for space in reference.spaces:
        ns = by_name[space.ns]
        assert ns["identity"] == space.identity.to_json()
        assert ns["problems"] == [] and ns["quarantined"] == 0
        (g,) = ns["groups"]
        ident = space.identity
        layout = ShardLayout.for_group(
            ident.groups[0], ident.tokens_per_block, ident.dtype.itemsize
        )
        assert g["blocks"] == len(space.tensors)
        assert g["bytes_on_disk"] == len(space.tensors) * layout.file_nbytes
        assert g["kv_bytes"] == sum(t.numel() * t.element_size() for t in space.tensors.values())
        assert g["bad_size"] == 0 and g["damaged"] == [] and g["temp_files"] == 0
    assert doc["totals"]["blocks"] == sum(len(s.tensors) for s in reference.spaces)


def test_overview_text_names_identity_and_sizes(reference: Reference, run: Run) -> None:
    code, out, _ = run("overview", reference.root)
    assert code == 0
    assert reference.bf16.ns in out
    assert "model test/tiny-llama, kv dtype bfloat16, 16 tokens/block" in out
    assert "3L x 2H x 64" in out and "4L x latent 576" in out
    assert "--check verifies every block" in out


def test_tree_numbers_match_the_written_forest(reference: Reference, run: Run) -> None:
    doc: dict[str, Any] = run_json(run, "tree", reference.root, reference.bf16.ns)
    s = doc["summary"]
    assert s["blocks"] == len(FOREST) == 13
    assert (s["trees"], s["chain_starts"], s["orphan_roots"]) == (3, 2, 1)
    # leaves: a1 (depth 5), b0 (4), c2 (6), x1 (2), o2 (2)
    assert s["chains"] == 5
    assert s["chain_length"]["histogram"] == {"2": 2, "4": 1, "5": 1, "6": 1}
    assert (s["chain_length"]["min"], s["chain_length"]["max"]) == (2, 6)
    assert s["chain_blocks"] == 19 and s["saved_blocks"] == 6
    assert s["reuse"] == pytest.approx(19 / 13)
    assert s["shared_blocks"] == 3  # s0, s1, s2
    assert (s["branch_points"], s["max_fanout"]) == (1, 3)
    assert s["blocks_per_depth"] == [3, 3, 1, 3, 2, 1]  # s2 alone at depth 3
    top = s["largest_trees"][0]
    assert top["root"] == hash_of("s0").hex()
    assert (top["blocks"], top["chains"], top["depth"], top["shared_blocks"]) == (9, 3, 6, 3)
    orphan = next(t for t in s["largest_trees"] if t["root"] == hash_of("o1").hex())
    assert orphan["root_kind"] == "orphan"
    branch = s["top_branch_points"][0]
    assert branch["block"] == hash_of("s2").hex()
    assert (branch["depth"], branch["children"], branch["chains"]) == (3, 3, 3)
    assert s["unreachable"] == 0 and s["damaged"] == []


def test_tree_png_is_a_valid_image_of_the_requested_size(
    reference: Reference, run: Run, tmp_path: Path
) -> None:
    png = tmp_path / "forest.png"
    code, out, _ = run("tree", reference.root, reference.bf16.ns, "--png", png, "--size", "640x480")
    assert code == 0 and str(png) in out
    assert png_size(png) == (640, 480)
    assert "13 blocks in 3 tree(s)" in out and "reuse                  1.46x" in out


def test_forest_with_a_cycle_counts_it_unreachable() -> None:
    a, b, c = (bytes([i]) * 32 for i in range(3))
    forest = Forest.build({a: None, b: c, c: b})
    s = summarize(forest)
    assert (s["blocks"], s["unreachable"], s["trees"]) == (1, 2, 1)


def test_empty_group_has_an_empty_forest() -> None:
    s = summarize(Forest.build({}))
    assert (s["blocks"], s["chains"], s["reuse"]) == (0, 0, 0.0)

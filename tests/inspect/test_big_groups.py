"""Big groups (issue 34): ``overview`` and ``tree`` stream the listing and hold a bounded number
of blocks, ``tree`` samples above ``--max-blocks`` and says so, exact totals stay exact."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.config import StoreConfig
from kvstore.inspect import blockfile, bounded
from kvstore.inspect import tree as tree_view
from kvstore.inspect.bounded import BoundedList, BoundedProblems
from kvstore.inspect.resolve import find_namespace
from kvstore.store import paths
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockWrite, WriteStatus
from kvstore.store.view import GroupView, StoreView
from tests.helpers import make_small_identity
from tests.inspect.conftest import FOREST, Reference, Run, hash_of, run_json
from tests.inspect.png import png_size
from tests.inspect.test_damage import flip, path_of

CHAIN, FILLER = 120, 180  # the synthetic group: one 120-block chain among 180 lone blocks


def true_depth(name: str) -> int:
    """Depth of a FOREST block in the stored forest (o0 was never written)."""
    parent = FOREST[name]
    return 1 if parent is None or parent not in FOREST else 1 + true_depth(parent)


@pytest.fixture(scope="module")
def big_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("big") / "store"
    with KVStore(StoreConfig(root=root, durability="none", io_threads=2)) as store:
        group = store.namespace(make_small_identity()).group(0)
        data = np.zeros(group.layout.block_nbytes, dtype=np.uint8)
        chain = [hash_of(str(i), "chain") for i in range(CHAIN)]
        writes = [BlockWrite(h, data, p) for h, p in zip(chain, [None, *chain[:-1]], strict=True)]
        writes += [BlockWrite(hash_of(str(i), "filler"), data, None) for i in range(FILLER)]
        assert all(r.status is WriteStatus.WRITTEN for r in group.write_blocks(writes))
    return root


def group_of(root: Path) -> GroupView:
    return find_namespace(StoreView.open(root), make_small_identity().namespace).group(0)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts the headers the tree view reads and the largest parent map it builds a forest
    of: the two things that would grow with the store if the view held every block."""
    seen = {"headers": 0, "largest_forest": 0}
    read, build = blockfile.quick_header, tree_view.Forest.build

    def quick_header(group: GroupView, path: Path) -> Any:
        seen["headers"] += 1
        return read(group, path)

    def forest_build(parent: dict[bytes, bytes | None], *args: Any) -> tree_view.Forest:
        seen["largest_forest"] = max(seen["largest_forest"], len(parent))
        return build(parent, *args)

    monkeypatch.setattr(tree_view, "quick_header", quick_header)
    monkeypatch.setattr(tree_view.Forest, "build", staticmethod(forest_build))
    yield seen


def test_tree_above_max_blocks_samples_and_holds_at_most_max_blocks(
    big_store: Path, run: Run, counted: dict[str, int]
) -> None:
    ns = make_small_identity().namespace
    doc: dict[str, Any] = run_json(run, "tree", big_store, ns, "--max-blocks", 40, "--sample", 10)
    smp, est = doc["sampled"], doc["estimates"]
    files = list(group_of(big_store).iter_files())
    # exact numbers stay exact: every block was listed and sized
    assert doc["blocks"] == CHAIN + FILLER == len(files)
    assert doc["bytes_on_disk"] == sum(os.lstat(f.path).st_size for f in files)
    assert (smp["blocks"], smp["of"], smp["usable"], smp["max_blocks"]) == (10, 300, 10, 40)
    assert smp["nodes"] <= 40 and doc["summary"]["blocks"] == smp["nodes"]
    # bounded work and memory: <= 40 headers before the exact forest was given up, <= 40 nodes
    # after (one header each); no forest built of more than 40 blocks
    assert counted["headers"] <= 80 and smp["headers_read"] <= 40
    assert counted["largest_forest"] <= 40
    assert est["from_sampled_blocks"] == 10 and est["trees"] <= 300
    assert est["trees"] == est["chain_starts"] + est["orphan_roots"]
    code, out, _ = run("tree", big_store, ns, "--max-blocks", 40, "--sample", 10)
    assert code == 0
    assert "SAMPLED: 10 of 300 blocks (more than --max-blocks 40)" in out
    assert "~ trees" in out and "300 (" in out and "exact)" in out


def test_sampled_forest_is_drawn(big_store: Path, run: Run, tmp_path: Path) -> None:
    png = tmp_path / "sampled.png"
    ns = make_small_identity().namespace
    argv = ("tree", big_store, ns, "--max-blocks", 40, "--sample", 10, "--png", png)
    code, out, _ = run(*argv, "--size", "400x300")
    assert code == 0 and f"picture: {png}" in out and png_size(png) == (400, 300)


def test_cut_walks_are_reported_and_their_depths_are_lower_bounds(
    big_store: Path, run: Run
) -> None:
    # sample == max-blocks: no room for any ancestor, so every walk that needs one is cut
    ns = make_small_identity().namespace
    doc: dict[str, Any] = run_json(run, "tree", big_store, ns, "--max-blocks", 15, "--sample", 15)
    smp, est = doc["sampled"], doc["estimates"]
    assert smp["nodes"] == 15 and smp["ancestors"] == 0
    assert smp["cut_walks"] > 0 and est["depth_lower_bounds"] >= smp["cut_walks"]
    assert any(t["root_kind"] == "cut" for t in est["largest_trees"])
    code, out, _ = run("tree", big_store, ns, "--max-blocks", 15, "--sample", 15)
    assert code == 0 and "CUT" in out and "lower bounds" in out


def test_exact_up_to_max_blocks_and_sampled_one_above(big_store: Path, run: Run) -> None:
    ns = make_small_identity().namespace
    exact = run_json(run, "tree", big_store, ns, "--max-blocks", 300)
    assert exact["sampled"] is None and exact["estimates"] is None
    assert exact["summary"]["blocks"] == exact["blocks"] == 300
    assert exact["summary"]["chain_length"]["max"] == CHAIN
    assert exact["summary"]["trees"] == FILLER + 1
    assert exact == run_json(run, "tree", big_store, ns)  # the default limit is above 300
    sampled = run_json(run, "tree", big_store, ns, "--max-blocks", 299)
    assert sampled["sampled"]["of"] == 300 and sampled["blocks"] == 300


def test_sampled_depths_and_estimates_follow_the_forest(reference: Reference) -> None:
    space = reference.bf16
    group = group_of_space(reference.root, space.ns)
    scan = tree_view.scan_group(group, max_blocks=12, sample=4)
    assert scan.sample is not None and scan.estimates is not None
    smp, est, forest = scan.sample, scan.estimates, scan.forest
    assert (smp["of"], smp["blocks"], smp["usable"], smp["cut_walks"]) == (13, 4, 4, 0)
    # every walk reached a root of the stored forest: each node of the sampled forest has its
    # true depth, and its ancestors are all there
    by_hash = {h: name for name, h in space.names.items()}
    assert forest.order and all(forest.depth[n] == true_depth(by_hash[n]) for n in forest.order)
    for node in forest.order:
        up = FOREST[by_hash[node]]
        assert up is None or up == "o0" or space.names[up] in forest.parent
    assert est["depth_lower_bounds"] == 0
    sampled = scan.sampled_blocks
    assert len(sampled) == 4 and set(forest.leaves) <= set(sampled)
    depths = [true_depth(by_hash[b]) for b in sampled]
    assert est["depth"]["histogram"] == {str(d): depths.count(d) for d in sorted(set(depths))}
    assert est["depth"]["mean"] == pytest.approx(sum(depths) / 4)
    # the estimates scale the sampled roots by 13 blocks / 4 sampled, and are never below the
    # roots the walks reached
    starts = sum(FOREST[by_hash[b]] is None for b in sampled)
    orphans = sum(FOREST[by_hash[b]] == "o0" for b in sampled)
    reached = [FOREST[by_hash[r]] for r in forest.roots]
    assert (est["chain_starts"], est["orphan_roots"]) == (
        max(round(starts * 13 / 4), reached.count(None)),
        max(round(orphans * 13 / 4), reached.count("o0")),
    )
    assert est["trees"] == est["chain_starts"] + est["orphan_roots"]


def test_sample_larger_than_max_blocks_is_a_clear_error(reference: Reference, run: Run) -> None:
    code, _, err = run("tree", reference.root, reference.bf16.ns, "--max-blocks", 5, "--sample", 6)
    assert code == 2
    assert "expected 0 < --sample <= --max-blocks (5), got --sample 6" in err
    # a small --max-blocks alone shrinks the default sample to fit
    doc = run_json(run, "tree", reference.root, reference.bf16.ns, "--max-blocks", 5)
    assert doc["sampled"]["blocks"] == 5


def test_overview_and_tree_never_materialise_the_group(
    reference: Reference, run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    def files(*_: object, **__: object) -> None:
        raise AssertionError("GroupView.files holds every block of a group")

    monkeypatch.setattr(GroupView, "files", files)
    doc = run_json(run, "overview", reference.root, "--check")
    assert doc["totals"]["blocks"] == sum(len(s.tensors) for s in reference.spaces)
    assert run_json(run, "tree", reference.root, reference.bf16.ns)["summary"]["blocks"] == 13


def test_overview_lists_each_fanout_directory_once(
    reference: Reference, run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks and temporary files come from one listing (each listing of 256 fan-out
    directories is thousands of round trips on a network file system)."""
    listed: Counter[str] = Counter()
    real = paths.iter_dir_batches  # every listing goes through it

    def iter_dir_batches(directory: Path, *args: Any, **kwargs: Any) -> Any:
        listed[str(directory)] += 1
        return real(directory, *args, **kwargs)

    monkeypatch.setattr(paths, "iter_dir_batches", iter_dir_batches)
    run_json(run, "overview", reference.root)
    assert listed and max(listed.values()) == 1, listed.most_common(3)


def test_damaged_blocks_are_counted_all_and_listed_up_to_the_limit(
    reference: Reference, store_copy: Path, run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    space = reference.bf16
    damaged = {str(path_of(store_copy, space, name)) for name in ("x1", "b0", "c2")}
    for path in damaged:
        flip(Path(path), 60)  # inside the block hash: the header is unusable
    monkeypatch.setattr(bounded, "LISTED", 2)
    doc: dict[str, Any] = run_json(run, "overview", store_copy, "--check", expect=1)
    (g,) = next(ns for ns in doc["namespaces"] if ns["name"] == space.ns)["groups"]
    assert g["damaged_count"] == 3 and len(g["damaged"]) == 2 and g["listed_max"] == 2
    assert {d["path"] for d in g["damaged"]} < damaged
    assert doc["totals"]["damaged"] == 3
    code, out, _ = run("overview", store_copy, "--check")
    assert code == 1 and "1 more damaged block(s) (--json lists the first 2)" in out
    tree = run_json(run, "tree", store_copy, space.ns, expect=1)["summary"]
    assert tree["damaged_count"] == 3 and len(tree["damaged"]) == 2 and tree["blocks"] == 10


def test_listing_problems_are_reported_bounded(
    reference: Reference, store_copy: Path, run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    space = reference.bf16
    fanout = group_of_space(store_copy, space.ns).fanout_dir(7)
    fanout.mkdir(parents=True, exist_ok=True)
    for lo in (11, 12, 13):  # block names holding links: never followed, each a problem
        (fanout / str(lo)).symlink_to("/dev/zero")
    monkeypatch.setattr(bounded, "LISTED", 2)
    doc: dict[str, Any] = run_json(run, "overview", store_copy, expect=1)
    (g,) = next(ns for ns in doc["namespaces"] if ns["name"] == space.ns)["groups"]
    assert g["problems_count"] == 3 and len(g["problems"]) == 2 and g["blocks"] == 13
    code, out, _ = run("overview", store_copy)
    assert code == 1 and "1 more problem(s) counted, not listed" in out
    tree = run_json(run, "tree", store_copy, space.ns)
    assert tree["problems_count"] == 3 and len(tree["problems"]) == 2
    assert tree["summary"]["blocks"] == 13


def group_of_space(root: Path, ns: str) -> GroupView:
    return find_namespace(StoreView.open(root), ns).group(0)


def test_bounded_collectors_keep_the_first_and_count_all() -> None:
    items: BoundedList[int] = BoundedList(2)
    for i in range(5):
        items.add(i)
    assert (items.items, items.total, items.left_out, len(items)) == ([0, 1], 5, 3, 2)
    problems = BoundedProblems(2)
    problems["a"] = "1"
    problems["a"] = "2"  # a kept path recorded again: replaced, counted once
    assert problems.setdefault("b", "3") == "3" and problems.setdefault("b", "4") == "3"
    problems["c"] = "5"
    assert problems.setdefault("d", "6") == "6"  # past the limit: returned, counted, not kept
    assert dict(problems) == {"a": "2", "b": "3"} and problems.total == 4
    with pytest.raises(ValueError, match="expected a count >= 0, got -1"):
        BoundedList(-1)

"""``diff``: two blocks, and two stores (only-one-side, damaged, differing chunks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.inspect.decode import Selection, raw_array
from kvstore.inspect.diff import compare_chunks
from kvstore.inspect.resolve import find_namespace
from kvstore.store.view import StoreView
from tests.inspect.conftest import Reference, Run, run_json, to_bytes


def test_block_diff_lists_differing_chunks(reference: Reference, run: Run) -> None:
    space = reference.bf16
    a, b = space.names["s0"], space.names["s1"]
    doc: dict[str, Any] = run_json(
        run, "diff", reference.root, space.ns, a.hex(), b.hex()[:8], expect=1
    )
    assert len(doc["chunks"]) == 6 and doc["num_chunks"] == 6
    assert any(d.startswith("parent hash") for d in doc["header_differences"])
    first = doc["chunks"][0]
    fa, fb = space.floats(a)[0, 0], space.floats(b)[0, 0]
    assert first["max_abs_diff"] == pytest.approx(float(np.abs(fa - fb).max()))
    assert first["elements_differing"] == int(
        np.count_nonzero(
            to_bytes(space.tensors[a][0, 0]).view("<u2")
            != to_bytes(space.tensors[b][0, 0]).view("<u2")
        )
    )
    code, out, _ = run("diff", reference.root, space.ns, a.hex(), a.hex())
    assert code == 0 and "all inner chunks byte-identical" in out


def test_compare_chunks_pinpoints_one_element(reference: Reference) -> None:
    space = reference.f16
    group = find_namespace(StoreView.open(reference.root), space.ns).group(0)
    tensor = next(iter(space.tensors.values()))
    left = to_bytes(tensor)
    changed = tensor.clone()
    changed[1, 2, 7, 1, 3] += 0.5
    out = compare_chunks(group, left, to_bytes(changed))
    assert [(c["head"], c["layer"], c["elements_differing"], c["first_token"]) for c in out] == [
        (1, 2, 1, 7)
    ]
    assert out[0]["max_abs_diff"] == pytest.approx(0.5, abs=1e-2)
    sel = Selection.all_of(group)
    assert raw_array(left, group, sel).shape == tuple(tensor.shape)


def test_identical_stores_have_no_differences(
    reference: Reference, store_copy: Path, run: Run
) -> None:
    doc: dict[str, Any] = run_json(run, "diff", reference.root, store_copy)
    assert doc["only_left_namespaces"] == doc["only_right_namespaces"] == []
    for ns in doc["namespaces"]:
        for g in ns["groups"]:
            assert g["only_left"] == g["only_right"] == g["differing"] == []


def test_store_diff_finds_missing_extra_changed_and_damaged(
    reference: Reference, store_copy: Path, run: Run
) -> None:
    space = reference.bf16
    group = find_namespace(StoreView.open(store_copy), space.ns).group(0)
    layout = group.layout
    group.path_of(space.names["x1"]).unlink()  # only on the left
    extra = group.path_of(space.names["b0"]).read_bytes()
    # changed chunk (0, 1) of c0 with a valid checksum: rewrite the block via the library
    from kvstore.config import StoreConfig  # noqa: PLC0415
    from kvstore.store.page_store import KVStore  # noqa: PLC0415
    from kvstore.store.types import BlockWrite  # noqa: PLC0415

    c0 = space.names["c0"]
    changed = space.tensors[c0].clone()
    changed[0, 1, 4, 0, 0] = 7.0
    group.path_of(c0).unlink()
    with KVStore(StoreConfig(root=store_copy, durability="none"), create=False) as store:
        g = store.namespace(space.identity, create=False).group(0)
        g.write_blocks([BlockWrite(c0, to_bytes(changed), space.parents[c0])])
    # damaged on the right: flip a byte of s2's chunk (1, 0)
    s2 = group.path_of(space.names["s2"])
    raw = bytearray(s2.read_bytes())
    raw[layout.chunk_offset(layout.chunk_index(1, 0)) + 5] ^= 1
    s2.write_bytes(bytes(raw))
    # an extra namespace on the right
    (store_copy / "other-000000000000").mkdir()
    (store_copy / "other-000000000000" / "zarr.json").write_bytes(
        (reference.root / space.ns / "zarr.json").read_bytes()
    )
    assert extra

    doc: dict[str, Any] = run_json(run, "diff", reference.root, store_copy, expect=1)
    assert doc["only_right_namespaces"] == ["other-000000000000"]
    (ns,) = [n for n in doc["namespaces"] if n["name"] == space.ns]
    (g0,) = ns["groups"]
    assert g0["only_left"] == [space.names["x1"].hex()] and g0["only_right"] == []
    by_block = {d["block"]: d for d in g0["differing"]}
    assert set(by_block) == {c0.hex(), space.names["s2"].hex()}
    assert [(c["head"], c["layer"]) for c in by_block[c0.hex()]["chunks"]] == [(0, 1)]
    assert by_block[c0.hex()]["left"]["ok"] and by_block[c0.hex()]["right"]["ok"]
    damaged = by_block[space.names["s2"].hex()]
    assert not damaged["right"]["ok"] and "checksum mismatch" in damaged["right"]["problem"]
    assert [(c["head"], c["layer"]) for c in damaged["chunks"]] == [(1, 0)]
    for other in doc["namespaces"]:
        if other["name"] != space.ns:
            assert other["groups"][0]["differing"] == []

    code, out, _ = run("diff", reference.root, store_copy)
    assert code == 1
    assert f"only left: {space.names['x1'].hex()}" in out
    assert f"differs: {c0.hex()}: chunks (h0,l1)" in out
    assert "namespace only on the right: other-000000000000" in out


def test_store_diff_lists_are_bounded_and_counted(
    reference: Reference, store_copy: Path, run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two stores that differ in many blocks: each list keeps its first LISTED entries, the
    counts (and the exit code's difference count) cover them all."""
    from kvstore.inspect import bounded  # noqa: PLC0415
    from kvstore.inspect.diff import diff_stores, store_difference_count  # noqa: PLC0415

    space = reference.bf16
    group = find_namespace(StoreView.open(store_copy), space.ns).group(0)
    gone = [name for name in ("x1", "s0", "s1") if name in space.names]
    for name in gone:
        group.path_of(space.names[name]).unlink()
    monkeypatch.setattr(bounded, "LISTED", 1)
    doc = diff_stores(StoreView.open(reference.root), StoreView.open(store_copy))
    (ns,) = [n for n in doc["namespaces"] if n["name"] == space.ns]
    (g0,) = ns["groups"]
    assert len(g0["only_left"]) == 1 and g0["only_left_count"] == len(gone) >= 2
    assert g0["only_left"][0] in {space.names[n].hex() for n in gone}
    assert g0["left_blocks"] - g0["right_blocks"] == len(gone) == g0["left_blocks"] - g0["common"]
    assert store_difference_count(doc) == len(gone)
    code, out, _ = run("diff", reference.root, store_copy)
    assert code == 1 and f"{len(gone)} only left" in out

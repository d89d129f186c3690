"""Damaged blocks are reported (exit 1), never crashed on, and the store is never modified."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.errors import InspectError
from kvstore.inspect.resolve import find_block, find_namespace
from kvstore.store.format import HEADER_FIXED_NBYTES
from kvstore.store.view import GroupView, StoreView
from tests.inspect.conftest import Reference, Run, Space, run_json, snapshot


def group_of(root: Path, space: Space) -> GroupView:
    return find_namespace(StoreView.open(root), space.ns).group(0)


def path_of(root: Path, space: Space, name: str) -> Path:
    return group_of(root, space).path_of(space.names[name])


def flip(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def test_flipped_chunk_byte_is_reported_per_head_and_layer(
    reference: Reference, store_copy: Path, run: Run
) -> None:
    space = reference.bf16
    group = group_of(store_copy, space)
    path = path_of(store_copy, space, "c1")
    flip(path, group.layout.chunk_offset(group.layout.chunk_index(1, 2)) + 100)
    before = snapshot(store_copy)
    h = space.names["c1"].hex()

    doc: dict[str, Any] = run_json(run, "block", store_copy, space.ns, h, expect=1)
    assert not doc["ok"] and doc["problems"] == []
    bad = [(c["head"], c["layer"], c["state"]) for c in doc["chunks"] if not c["ok"]]
    assert bad == [(1, 2, "checksum mismatch")]

    code, out, _ = run("block", store_copy, space.ns, h)
    assert code == 1 and "DAMAGED" in out and "checksum mismatch" in out

    # values / stats / heatmap / export refuse to decode it unless --force ...
    for view in ("values", "stats"):
        doc = run_json(run, view, store_copy, space.ns, h, expect=1)
        assert doc["check"]["bad_chunks"] == [{"head": 1, "layer": 2, "state": "checksum mismatch"}]
        assert "rows" not in doc and "values" not in doc
    code, out, _ = run("export", store_copy, space.ns, h, "--out", store_copy.parent / "x.npy")
    assert code == 1 and "DAMAGED" in out and not (store_copy.parent / "x.npy").exists()
    # ... but a selection that avoids the bad chunk is fine, and --force decodes anyway.
    doc = run_json(run, "stats", store_copy, space.ns, h, "--heads", "0")
    assert doc["check"]["ok"]
    doc = run_json(run, "stats", store_copy, space.ns, h, "--force", expect=1)
    assert len(doc["rows"]) == 12

    doc = run_json(run, "overview", store_copy, "--check", expect=1)
    (bf16,) = [ns for ns in doc["namespaces"] if ns["name"] == space.ns]
    assert [d["path"] for d in bf16["groups"][0]["damaged"]] == [str(path)]
    assert run("overview", store_copy)[0] == 0  # sizes are right: only --check reads chunks

    # the tree still uses the block: its header is intact
    doc = run_json(run, "tree", store_copy, space.ns)
    assert doc["summary"]["blocks"] == 13

    assert snapshot(store_copy) == before  # nothing moved, removed or written


def test_damaged_header_is_found_by_prefix_and_left_out_of_the_tree(
    reference: Reference, store_copy: Path, run: Run
) -> None:
    space = reference.bf16
    path = path_of(store_copy, space, "x1")
    flip(path, 60)  # inside the block hash: header crc fails
    before = snapshot(store_copy)
    prefix = space.names["x1"].hex()[:12]

    doc: dict[str, Any] = run_json(run, "block", store_copy, space.ns, prefix, expect=1)
    assert doc["header"] is None
    assert any("header checksum mismatch" in p for p in doc["problems"])
    assert all(c["state"] == "not verifiable (header unusable)" for c in doc["chunks"])

    doc = run_json(run, "tree", store_copy, space.ns, expect=1)
    s = doc["summary"]
    assert s["blocks"] == 12 and [d["path"] for d in s["damaged"]] == [str(path)]
    code, out, _ = run("tree", store_copy, space.ns)
    assert code == 1 and "DAMAGED (left out)" in out
    assert snapshot(store_copy) == before


def test_truncated_block_is_reported(reference: Reference, store_copy: Path, run: Run) -> None:
    space = reference.mla
    h = next(iter(space.tensors))
    group = group_of(store_copy, space)
    path = group.path_of(h)
    with path.open("r+b") as f:
        f.truncate(group.layout.chunk_offset(2) + 10)

    doc: dict[str, Any] = run_json(run, "block", store_copy, space.ns, h.hex(), expect=1)
    assert any("file size: expected" in p for p in doc["problems"])
    states = [c["state"] for c in doc["chunks"]]
    assert states == ["ok", "ok", "beyond the end of the file", "beyond the end of the file"]

    doc = run_json(run, "overview", store_copy, expect=1)
    (mla,) = [ns for ns in doc["namespaces"] if ns["name"] == space.ns]
    assert mla["groups"][0]["bad_size"] == 1
    doc = run_json(run, "values", store_copy, space.ns, h.hex(), "--layers", "0:2", expect=1)
    assert doc["check"]["bad_chunks"] == []  # the selection is intact, the file is not
    assert "values" not in doc
    doc = run_json(
        run, "values", store_copy, space.ns, h.hex(), "--layers", "0:2", "--force", expect=1
    )
    assert doc["values"] == space.floats(h)[0:2].tolist()


def test_misplaced_block_is_mis_keyed(reference: Reference, store_copy: Path, run: Run) -> None:
    space = reference.bf16
    src, dst = path_of(store_copy, space, "s0"), path_of(store_copy, space, "s1")
    dst.write_bytes(src.read_bytes())  # s1's file now holds s0's block
    doc: dict[str, Any] = run_json(
        run, "block", store_copy, space.ns, space.names["s1"].hex(), expect=1
    )
    assert any("mis-keyed" in p for p in doc["problems"])


def test_foreign_block_is_reported(reference: Reference, store_copy: Path, run: Run) -> None:
    # A block of another namespace with the same geometry copied in: its digest differs.
    space = reference.bf16
    path = path_of(store_copy, space, "b0")
    raw = bytearray(path.read_bytes())
    raw[16:48] = bytes(32)  # namespace digest zeroed, header crc repaired
    from kvstore.checksum import crc32c  # noqa: PLC0415

    raw[168:172] = crc32c(bytes(raw[:168])).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    doc: dict[str, Any] = run_json(
        run, "block", store_copy, space.ns, space.names["b0"].hex(), expect=1
    )
    assert any("foreign block" in p for p in doc["problems"])
    assert all(c["ok"] for c in doc["chunks"])
    assert HEADER_FIXED_NBYTES == 176


def test_reading_every_view_leaves_the_store_unchanged(
    reference: Reference, run: Run, tmp_path: Path
) -> None:
    before = snapshot(reference.root)
    space = reference.bf16
    h = space.names["a1"].hex()
    root = reference.root
    for argv in (
        ("overview", root, "--check"),
        ("tree", root, space.ns, "--png", tmp_path / "t.png"),
        ("block", root, space.ns, h),
        ("values", root, space.ns, h, "--layout", "tp=2", "--rank", "1"),
        ("stats", root, space.ns, h),
        ("heatmap", root, space.ns, h, "--png", tmp_path / "h.png"),
        ("export", root, space.ns, h, "--out", tmp_path / "e.npy"),
        ("diff", root, root),
        ("diff", root, space.ns, h, space.names["s0"].hex()),
    ):
        code, _, err = run(*argv)
        assert code in (0, 1), (argv, err)
    assert snapshot(reference.root) == before


def test_block_values_when_the_header_is_unusable_are_still_decodable(
    reference: Reference, store_copy: Path, run: Run
) -> None:
    space = reference.bf16
    path = path_of(store_copy, space, "x0")
    flip(path, 0)  # magic
    h = space.names["x0"]
    doc: dict[str, Any] = run_json(
        run, "values", store_copy, space.ns, h.hex(), "--force", expect=1
    )
    assert np.array_equal(np.array(doc["values"], dtype=np.float32), space.floats(h))
    g = group_of(store_copy, space)
    assert find_block(g, h.hex()[:8]).block_hash is None  # found by path, header unusable


def test_documents_not_as_prescribed_and_leftovers_are_findings(
    reference: Reference, store_copy: Path, run: Run
) -> None:
    space = reference.f16
    array_doc = store_copy / space.ns / "g0" / "zarr.json"
    array_doc.write_text(array_doc.read_text().replace('"fill_value": 0', '"fill_value": 1'))
    group = group_of(store_copy, space)
    h = next(iter(space.tensors))
    (group.path_of(h).parent / (group.path_of(h).name + ".tmp-deadbeef")).write_bytes(b"x")
    renamed = store_copy / (reference.fp8.ns[:-1] + "0")
    (store_copy / reference.fp8.ns).rename(renamed)

    doc: dict[str, Any] = run_json(run, "overview", store_copy, expect=1)
    by_name = {ns["name"]: ns for ns in doc["namespaces"]}
    (g0,) = by_name[space.ns]["groups"]
    assert g0["temp_files"] == 1 and g0["blocks"] == len(space.tensors)
    assert any("array document" in p for p in g0["problems"])
    assert any("directory name: expected" in p for p in by_name[renamed.name]["problems"])
    code, out, _ = run("overview", store_copy)
    assert code == 1 and out.count("PROBLEM:") == 2


def test_a_full_hash_is_found_with_one_lstat_and_no_listing(
    reference: Reference, store_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full hash names one path: find_block stats it and lists no fan-out directory (at
    10^8 blocks one lists ~390k entries); a damaged header is still found by its full hash,
    and a link at the name is never followed: not found, and reported."""
    from kvstore.store import paths as store_paths  # noqa: PLC0415

    space = reference.bf16
    group = group_of(store_copy, space)
    listed: list[str] = []
    real_batches = store_paths.iter_dir_batches  # every listing goes through it

    def iter_dir_batches(p: Any, *, root: Any = None) -> Any:
        listed.append(str(p))
        return real_batches(p, root=root)

    monkeypatch.setattr(store_paths, "iter_dir_batches", iter_dir_batches)
    full = space.names["x1"]
    ref = find_block(group, full.hex())
    assert ref.block_hash == full and ref.file.path == group.path_of(full)
    flip(ref.file.path, 60)  # the header's crc fails: still found, by the bits of its path
    assert find_block(group, full.hex()).block_hash == full
    assert listed == []
    other = space.names["a1"]
    target = group.path_of(other)
    target.unlink()
    target.symlink_to(ref.file.path)
    with pytest.raises(InspectError, match="found none"):
        find_block(group, other.hex())
    assert any(
        "expected a block file, got a symbolic link" in v for v in group.listing_problems.values()
    )

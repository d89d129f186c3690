"""The read-only store view (kvstore/store/view.py): what it finds, what it refuses, no writes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstore.errors import KvstoreError, StoreFormatError
from kvstore.identity import Identity
from kvstore.store.types import BlockWrite
from kvstore.store.view import StoreView
from tests.helpers import StoreFactory, block_bytes, block_hash, make_mla_identity


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(Path(dirpath) / name)
            out[str(Path(dirpath) / name)] = (st.st_size, st.st_mtime_ns)
    return out


def test_open_refuses_what_is_not_a_store(tmp_path: Path) -> None:
    with pytest.raises(StoreFormatError, match="expected a kvstore store directory, got nothing"):
        StoreView.open(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreFormatError, match=r"expected a kvstore store \(expected zarr.json"):
        StoreView.open(tmp_path / "empty")
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "zarr.json")  # never opened: it would block
    with pytest.raises(StoreFormatError, match="expected a regular file, got a FIFO"):
        StoreView.open(tmp_path / "fifo")


def test_namespaces_groups_and_files(
    make_store: StoreFactory, root: Path, small_identity: Identity
) -> None:
    group = make_store().namespace(small_identity).group(0)
    hashes = [block_hash(i, "view") for i in range(3)]
    group.write_blocks([BlockWrite(h, block_bytes(group.layout, i)) for i, h in enumerate(hashes)])
    Path(group.path_of(hashes[0]) + ".tmp-x").write_bytes(b"t")  # an old-shape temp
    before = snapshot(root)
    view = StoreView.open(root)
    (ns,) = view.namespaces
    assert view.problems == () and view.namespace_names() == [ns.name] == [small_identity.namespace]
    assert ns.identity == small_identity and ns.digest == small_identity.digest
    g = ns.group(0)
    assert g.layout == group.layout and g.problems == () and g.compression == "none"
    assert g.shard.namespace_digest == group.namespace_digest and g.shard.codec is None
    assert [str(g.path_of(h)) for h in hashes] == [group.path_of(h) for h in hashes]
    files = g.files()
    assert sorted(str(f.path) for f in files) == sorted(group.path_of(h) for h in hashes)
    assert files == sorted(files, key=lambda f: (f.hash_hi, f.hash_lo))
    assert [p.name for p in g.temp_files()] == [Path(group.path_of(hashes[0])).name + ".tmp-x"]
    assert ns.quarantined() == []
    with pytest.raises(KvstoreError, match=r"group: expected 0\.\.0"):
        ns.group(1)
    with pytest.raises(KvstoreError, match="expected one of the store's"):
        view.namespace("nope")
    assert snapshot(root) == before  # nothing written, created or touched


def test_unusable_namespaces_are_problems(
    make_store: StoreFactory, root: Path, small_identity: Identity
) -> None:
    store = make_store()
    store.namespace(small_identity)
    mla = make_mla_identity()
    store.namespace(mla)
    renamed = root / (mla.namespace[:-1] + ("0" if mla.namespace[-1] != "0" else "1"))
    (root / mla.namespace).rename(renamed)
    (root / "broken-000000000000").mkdir()
    (root / "broken-000000000000" / "zarr.json").write_text("{not json")
    (root / "linked-000000000000").symlink_to(root / small_identity.namespace)
    (root / small_identity.namespace / "g0" / "zarr.json").write_text(
        '{"zarr_format": 3, "node_type": "array"}'
    )
    view = StoreView.open(root)
    assert [ns.name for ns in view.namespaces] == [small_identity.namespace]
    assert sorted(p.path.name for p in view.problems) == ["broken-000000000000", renamed.name]
    renamed_view = view.namespace(renamed.name)  # still inspectable by name
    assert renamed_view.renamed and any("directory name" in p for p in renamed_view.problems)
    (problem,) = view.namespace(small_identity.namespace).group(0).problems
    assert "expected the format v1 array document" in problem

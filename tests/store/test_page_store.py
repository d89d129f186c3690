"""Opening stores and namespaces: creation, reopening, identity checks, format errors."""

from __future__ import annotations

import errno
import json
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from kvstore.config import StoreConfig
from kvstore.errors import IdentityMismatchError, StoreFormatError
from kvstore.io.fileio import FileIO
from kvstore.io.native_fileio import DEFAULT_FILEIO
from kvstore.store import metadata
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockRead, BlockWrite, ReadStatus, WriteStatus
from tests.helpers import (
    StoreFactory,
    block_bytes,
    block_hash,
    make_mla_identity,
    make_small_identity,
    make_two_group_identity,
    tmp_files,
)


def edit_json(path: Path, edit: object) -> None:
    doc = json.loads(path.read_text())
    edit(doc)  # type: ignore[operator]
    path.write_text(json.dumps(doc))


def test_new_store_layout(make_store: StoreFactory, root: Path) -> None:
    store = make_store()
    identity = make_two_group_identity()
    ns = store.namespace(identity)
    assert ns.name == identity.namespace
    assert ns.path == root.absolute() / identity.namespace
    # Root group: a zarr v3 group tagged kvstore format v1.
    group = zarr.open_group(str(root), mode="r")
    assert dict(group.attrs) == {"kvstore": {"format": "kvstore", "version": 1}}
    # Namespace group: carries the identity and its digest.
    ns_group = zarr.open_group(str(ns.path), mode="r")
    assert ns_group.attrs["kvstore"] == {
        "identity": identity.to_json(),
        "digest": identity.digest.hex(),
    }
    assert sorted(p.name for p in ns.path.iterdir()) == ["g0", "g1", "zarr.json"]
    # Every fan-out directory exists up front.
    fanout = ns.path / "g0" / "c" / "0" / "0" / "0" / "0" / "0"
    assert sorted(int(p.name) for p in fanout.iterdir()) == list(range(256))
    assert store.namespace_names() == [identity.namespace]
    assert tmp_files(root) == []


def test_array_document(make_store: StoreFactory) -> None:
    identity = make_small_identity()
    ns = make_store().namespace(identity)
    doc = json.loads((ns.path / "g0" / "zarr.json").read_text())
    assert doc["zarr_format"] == 3
    assert doc["node_type"] == "array"
    assert doc["shape"] == [2, 3, 16, 2, 64, 256, 2**62]
    assert doc["data_type"] == "uint16"
    assert doc["chunk_grid"]["configuration"]["chunk_shape"] == [2, 3, 16, 2, 64, 1, 1]
    (sharding,) = doc["codecs"]
    assert sharding["name"] == "sharding_indexed"
    assert sharding["configuration"]["chunk_shape"] == [1, 1, 16, 2, 64, 1, 1]
    assert sharding["configuration"]["index_location"] == "end"
    assert [c["name"] for c in sharding["configuration"]["index_codecs"]] == ["bytes", "crc32c"]
    assert [c["name"] for c in sharding["configuration"]["codecs"]] == ["bytes"]
    assert doc["attributes"]["kvstore"] == {
        "dtype": "bfloat16",
        "group": 0,
        "kind": "full",
        "layer_names": list(identity.groups[0].layer_names),
        "tokens_per_block": 16,
        "shard_header_nbytes": 4096,
        "chunk_stride": 4096,
    }
    mla = make_store().namespace(make_mla_identity())
    mla_doc = json.loads((mla.path / "g0" / "zarr.json").read_text())
    assert mla_doc["dimension_names"] == ["layer", "token", "latent", "hash_hi", "hash_lo"]
    assert mla_doc["attributes"]["kvstore"]["chunk_stride"] == 20480


def test_documents_are_deterministic(make_store: StoreFactory, tmp_path: Path) -> None:
    """Two servers creating the same namespace write byte-identical documents."""
    identity = make_small_identity()
    one = make_store(tmp_path / "one").namespace(identity).path
    two = make_store(tmp_path / "two").namespace(identity).path
    for rel in ("zarr.json", "g0/zarr.json", "../zarr.json"):
        assert (one / rel).read_bytes() == (two / rel).read_bytes()


def test_reopen_is_a_restart(make_store: StoreFactory) -> None:
    identity = make_small_identity()
    first = make_store().namespace(identity).group(0)
    data = block_bytes(first.layout, 1)
    h = block_hash(1)
    assert first.write_blocks([BlockWrite(h, data)])[0].status is WriteStatus.WRITTEN
    first.engine.close()
    second = make_store().namespace(identity).group(0)
    out = np.zeros_like(data)
    assert second.read_blocks([BlockRead(h, out)])[0].status is ReadStatus.HIT
    np.testing.assert_array_equal(out, data)
    assert second.write_blocks([BlockWrite(h, data)])[0].status is WriteStatus.EXISTS


def test_same_store_object_caches_namespaces(make_store: StoreFactory) -> None:
    store = make_store()
    identity = make_small_identity()
    assert store.namespace(identity) is store.namespace(make_small_identity())


def test_empty_existing_directory_is_fine(root: Path, make_store: StoreFactory) -> None:
    root.mkdir()
    make_store().namespace(make_small_identity())
    assert (root / "zarr.json").exists()


def test_stored_identity_differs(make_store: StoreFactory, root: Path) -> None:
    identity = make_small_identity()
    ns_path = make_store().namespace(identity).path

    def bump(doc: dict[str, dict[str, dict[str, dict[str, object]]]]) -> None:
        doc["attributes"]["kvstore"]["identity"]["tokens_per_block"] = 32

    edit_json(ns_path / "zarr.json", bump)
    with pytest.raises(IdentityMismatchError) as info:
        make_store().namespace(identity)
    message = str(info.value)
    assert message.startswith(f"namespace {identity.namespace} in ")
    assert message.endswith("holds another identity: tokens_per_block: expected 32, got 16")


def test_stored_identity_differs_in_a_group(make_store: StoreFactory) -> None:
    identity = make_small_identity()
    ns_path = make_store().namespace(identity).path

    def widen(doc: dict[str, dict[str, dict[str, dict[str, list[dict[str, int]]]]]]) -> None:
        doc["attributes"]["kvstore"]["identity"]["groups"][0]["head_dim"] = 128

    edit_json(ns_path / "zarr.json", widen)
    with pytest.raises(IdentityMismatchError) as info:
        make_store().namespace(identity)
    _, difference = str(info.value).split("holds another identity: ")
    assert difference == "groups[0].head_dim: expected 128, got 64"  # stored vs given


def test_namespace_without_identity(make_store: StoreFactory) -> None:
    identity = make_small_identity()
    ns_path = make_store().namespace(identity).path

    def drop(doc: dict[str, dict[str, object]]) -> None:
        doc["attributes"]["kvstore"] = {}

    edit_json(ns_path / "zarr.json", drop)
    with pytest.raises(StoreFormatError, match=r"expected attributes\.kvstore\.identity"):
        make_store().namespace(identity)


def test_non_kvstore_directory(root: Path) -> None:
    root.mkdir()
    (root / "notes.txt").write_text("not a store")
    with pytest.raises(StoreFormatError) as info:
        KVStore(StoreConfig(root=root))
    assert str(info.value) == (
        f"store root {root.absolute()}: expected an empty directory or a kvstore store, "
        "got a non-empty directory without zarr.json"
    )
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt"]  # nothing was written


def test_root_is_a_file(root: Path) -> None:
    root.write_bytes(b"x")
    with pytest.raises(StoreFormatError, match="expected a directory, got a file"):
        KVStore(StoreConfig(root=root))


def test_other_zarr_group_is_refused(root: Path) -> None:
    zarr.open_group(str(root), mode="w", attributes={"project": "climate"})
    with pytest.raises(StoreFormatError, match=r"expected attributes\.kvstore = "):
        KVStore(StoreConfig(root=root))


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"{not json", "got invalid JSON"),
        (b'{"zarr_format": 2}', "zarr_format 3"),
        (b"[]", "zarr_format 3"),
    ],
)
def test_bad_root_document(root: Path, content: bytes, reason: str) -> None:
    root.mkdir()
    (root / "zarr.json").write_bytes(content)
    with pytest.raises(StoreFormatError, match=re.escape(reason)):
        KVStore(StoreConfig(root=root))


def test_future_format_version_is_refused(make_store: StoreFactory, root: Path) -> None:
    make_store()

    def bump(doc: dict[str, dict[str, dict[str, object]]]) -> None:
        doc["attributes"]["kvstore"]["version"] = 2

    edit_json(root / "zarr.json", bump)
    with pytest.raises(StoreFormatError, match="'version': 2"):
        KVStore(StoreConfig(root=root))


@pytest.mark.parametrize(
    ("key", "value"),
    [("fill_value", 7), ("shape", [2, 3, 32, 2, 64, 256, 2**62]), ("data_type", "float16")],
)
def test_edited_array_document(make_store: StoreFactory, key: str, value: object) -> None:
    identity = make_small_identity()
    array_doc = make_store().namespace(identity).path / "g0" / "zarr.json"

    def change(doc: dict[str, object]) -> None:
        doc[key] = value

    edit_json(array_doc, change)
    with pytest.raises(StoreFormatError) as info:
        make_store().namespace(identity)
    assert str(info.value).startswith(f"{array_doc.parent}/zarr.json: expected the array document")


def test_edited_array_attributes(make_store: StoreFactory) -> None:
    identity = make_small_identity()
    array_doc = make_store().namespace(identity).path / "g0" / "zarr.json"

    def change(doc: dict[str, dict[str, dict[str, object]]]) -> None:
        doc["attributes"]["kvstore"]["chunk_stride"] = 8192

    edit_json(array_doc, change)
    with pytest.raises(StoreFormatError, match="expected the array document"):
        make_store().namespace(identity)


def test_create_false(root: Path, make_store: StoreFactory) -> None:
    with pytest.raises(StoreFormatError, match="no kvstore store here"):
        KVStore(StoreConfig(root=root), create=False)
    assert not root.exists()
    store = make_store()
    with pytest.raises(StoreFormatError, match="does not exist"):
        store.namespace(make_small_identity(), create=False)


def test_open_namespace_by_name(make_store: StoreFactory) -> None:
    identity = make_mla_identity()
    make_store().namespace(identity)
    ns = make_store().open_namespace(identity.namespace)
    assert ns.identity == identity
    with pytest.raises(StoreFormatError, match=r"expected .*zarr\.json, found none"):
        make_store().open_namespace("nothing-000000000000")


def test_open_renamed_namespace(make_store: StoreFactory, root: Path) -> None:
    identity = make_small_identity()
    path = make_store().namespace(identity).path
    path.rename(root / "renamed-000000000000")
    with pytest.raises(StoreFormatError, match=f"hashes to {identity.namespace}"):
        make_store().open_namespace("renamed-000000000000")


def test_metadata_write_is_atomic_and_leaves_no_temp(tmp_path: Path) -> None:
    metadata.write_document(DEFAULT_FILEIO, tmp_path / "a" / "b", b'{"zarr_format": 3}', True)
    assert metadata.read_document(tmp_path / "a" / "b") == {"zarr_format": 3}
    assert [p.name for p in (tmp_path / "a" / "b").iterdir()] == ["zarr.json"]
    assert metadata.read_document(tmp_path / "missing") is None


class ShortWrites(FileIO):
    """pwritev transfers at most 100 bytes per call, as POSIX allows."""

    def pwritev(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        first = memoryview(buffers[0]).cast("B")
        return super().pwritev(fd, [first[:100]], offset)


def test_documents_survive_short_writes(make_store: StoreFactory, root: Path) -> None:
    identity = make_small_identity()
    make_store(fio=ShortWrites(), direct_io="off").namespace(identity)
    expected = metadata.namespace_document(identity)
    assert (root / identity.namespace / "zarr.json").read_bytes() == expected
    assert (root / "zarr.json").read_bytes() == metadata.root_document()
    make_store().namespace(identity)  # a clean reopen: every document parses and matches


class FailingDocumentWrite(FileIO):
    def fdatasync(self, fd: int) -> None:
        raise OSError(errno.EIO, "injected EIO in fdatasync")


def test_failed_document_write_leaves_no_temp(root: Path) -> None:
    with pytest.raises(OSError, match="injected EIO"):
        KVStore(StoreConfig(root=root, durability="full"), fio=FailingDocumentWrite())
    assert sorted(p.name for p in root.iterdir()) == []


def test_lost_fanout_directory_is_recreated(make_store: StoreFactory) -> None:
    group = make_store().namespace(make_small_identity()).group(0)
    h = block_hash(40)
    fanout = Path(group.path_of(h)).parent
    fanout.rmdir()
    data = block_bytes(group.layout, 40)
    assert group.write_blocks([BlockWrite(h, data)])[0].status is WriteStatus.WRITTEN
    out = np.zeros_like(data)
    assert group.read_blocks([BlockRead(h, out)])[0].ok
    np.testing.assert_array_equal(out, data)


def test_write_into_removed_namespace_fails(make_store: StoreFactory, root: Path) -> None:
    identity = make_small_identity()
    group = make_store().namespace(identity).group(0)
    shutil.rmtree(root / identity.namespace)  # `kvstore rm` while this server runs
    h = block_hash(41)
    (result,) = group.write_blocks([BlockWrite(h, block_bytes(group.layout, 41))])
    assert result.status is WriteStatus.FAILED
    assert "was removed from the store" in result.error
    assert not (root / identity.namespace).exists()  # not resurrected without metadata

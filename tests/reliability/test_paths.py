"""Threat 8, paths and permissions (extends tests/store/test_safety.py).

* Keys cannot escape: any block hash (hypothesis: bytes that spell ``/``, ``..``, NUL, ...) maps
  to ``<array>/c/0/.../<decimal>/<decimal>``; any model name maps to a namespace directory
  directly below the root.
* Symbolic links inside the store are never followed: a symlinked fan-out directory, array
  directory or namespace directory is refused when the namespace is opened (and reported by
  ``kvstore verify``); a symlink planted at a block's temporary name or at a ``zarr.json`` is
  refused by O_NOFOLLOW; nothing outside the store is read, written or moved.
* Everything kvstore creates is owner-only by default, even under umask 0: the root, namespace,
  array and fan-out directories, documents, blocks, temporary files, the quarantine, and what
  the admin tools create (gc's trash, verify's quarantine). ``group_access=True`` opens group
  bits (the documented setting for servers of one group sharing a store).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.cli import main
from kvstore.config import StoreConfig
from kvstore.errors import KvstoreError, StoreFormatError
from kvstore.identity import Identity
from kvstore.keys import chunk_key
from kvstore.store.page_store import NAMESPACE_NAME, KVStore
from kvstore.store.types import BlockRead, BlockWrite, ChunkWrite, ReadStatus, WriteStatus
from tests.helpers import block_bytes, block_hash, make_small_identity
from tests.reliability.common import FULL, figure, tier

IDENTITY = make_small_identity()


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _quiet(argv: list[str]) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(argv)


@given(h=st.binary(min_size=16, max_size=32))
@settings(max_examples=tier(300, 5000), database=None, derandomize=not FULL, deadline=None)
def test_any_hash_stays_inside_its_array(h: bytes) -> None:
    key = chunk_key(h, 5)
    assert re.fullmatch(r"c/0/0/0/0/0/[0-9]{1,3}/[0-9]+", key), key
    hi, lo = key.rsplit("/", 2)[1:]
    assert 0 <= int(hi) < 256 and 0 <= int(lo) < 2**62


@given(model=st.text(min_size=1, max_size=80))
@settings(max_examples=tier(300, 5000), database=None, derandomize=not FULL, deadline=None)
def test_any_model_name_stays_below_the_root(model: str) -> None:
    identity = Identity(
        model=model, kv_dtype="bfloat16", tokens_per_block=16, groups=IDENTITY.groups
    )
    name = identity.namespace
    assert NAMESPACE_NAME.fullmatch(name), name
    assert os.sep not in name and name not in (".", "..")


def test_path_like_hashes_round_trip(tmp_path: Path) -> None:
    hashes = [
        b"../" * 10 + b"..",
        b"/" * 32,
        b"\x00" * 16,
        b"..\x00/etc/passwd\x00\x00\x00\x00\x00\x00",
    ]
    with KVStore(StoreConfig(root=tmp_path / "s", durability="none")) as store:
        g = store.namespace(IDENTITY).group(0)
        for i, h in enumerate(hashes):
            path = Path(g.path_of(h)).resolve()
            assert g.array_path.resolve() in path.parents
            (r,) = g.write_blocks([BlockWrite(h, block_bytes(g.layout, i))])
            assert r.status is WriteStatus.WRITTEN
            out = np.zeros(g.layout.block_nbytes, dtype=np.uint8)
            assert g.read_blocks([BlockRead(h, out)])[0].ok
            assert np.array_equal(out, block_bytes(g.layout, i))
    outside = [
        p for p in tmp_path.rglob("*") if tmp_path / "s" not in p.parents and p != tmp_path / "s"
    ]
    assert outside == []


def _store_with_block(root: Path) -> tuple[bytes, Path]:
    with KVStore(StoreConfig(root=root, durability="none")) as store:
        g = store.namespace(IDENTITY).group(0)
        h = block_hash(1, "paths")
        g.write_blocks([BlockWrite(h, block_bytes(g.layout, 1))])
        return h, Path(g.path_of(h))


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


@pytest.mark.parametrize("level", ["fanout", "array", "namespace"])
def test_symlinked_directory_is_refused(tmp_path: Path, level: str) -> None:
    root = tmp_path / "s"
    _, block = _store_with_block(root)
    fanout = block.parent
    # fanout = <ns>/g0/c/0/0/0/0/0/<hi>
    target = {"fanout": fanout, "array": fanout.parents[6], "namespace": fanout.parents[7]}[level]
    outside = tmp_path / "outside"
    shutil.copytree(target, outside, symlinks=True)  # a faithful copy, blocks included
    shutil.rmtree(target)
    target.symlink_to(outside)
    before = _snapshot(outside)
    with KVStore(StoreConfig(root=root, durability="none")) as store:
        with pytest.raises(StoreFormatError, match="symbolic link"):
            store.namespace(IDENTITY)
        with pytest.raises(StoreFormatError, match="symbolic link"):
            store.open_namespace(IDENTITY.namespace)
    assert _snapshot(outside) == before  # nothing outside was read-modified, written or moved
    assert _quiet(["verify", str(root)]) == 1  # reported (foreign / bad namespace)
    figure(f"symlinked {level} directory", refused=1, files_outside_changed=0)


def test_symlink_at_a_temporary_name_is_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"do not overwrite")
    with KVStore(StoreConfig(root=tmp_path / "s", durability="none")) as store:
        g = store.namespace(IDENTITY).group(0)
        data = block_bytes(g.layout, 2)
        (pending,) = g.begin_blocks([block_hash(2, "paths")])
        os.symlink(secret, g.temp_path(pending))
        (error,) = g.write_chunks([ChunkWrite(pending, list(range(g.layout.num_chunks)), data)])
        assert isinstance(error, OSError)  # ELOOP from O_NOFOLLOW
        (result,) = g.commit_blocks([pending])
        assert result.status is WriteStatus.FAILED
        out = np.zeros(g.layout.block_nbytes, dtype=np.uint8)
        assert g.read_blocks([BlockRead(pending.block_hash, out)])[0].status is ReadStatus.MISS
    assert secret.read_bytes() == b"do not overwrite"


def test_symlinked_zarr_json_is_not_followed(tmp_path: Path) -> None:
    root = tmp_path / "s"
    _store_with_block(root)
    ns_doc = root / IDENTITY.namespace / "zarr.json"
    elsewhere = tmp_path / "doc.json"
    shutil.copyfile(ns_doc, elsewhere)
    ns_doc.unlink()
    ns_doc.symlink_to(elsewhere)
    with KVStore(StoreConfig(root=root, durability="none")) as store, pytest.raises(KvstoreError):
        store.namespace(IDENTITY)


def _modes(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = stat.S_IMODE(os.lstat(path).st_mode)
    return out


@pytest.mark.parametrize("group_access", [False, True])
def test_everything_created_is_owner_only(tmp_path: Path, group_access: bool) -> None:
    root = tmp_path / "s"
    mask = 0o007 if group_access else 0
    with umask(mask):
        config = StoreConfig(root=root, durability="full", group_access=group_access)
        with KVStore(config) as store:
            g = store.namespace(IDENTITY).group(0)
            hashes = [block_hash(i, "modes") for i in range(6)]
            g.write_blocks([BlockWrite(h, block_bytes(g.layout, i)) for i, h in enumerate(hashes)])
            (pending,) = g.begin_blocks([block_hash(99, "modes")])
            g.write_chunks(
                [ChunkWrite(pending, [0], block_bytes(g.layout, 99)[: g.layout.chunk_nbytes])]
            )
            with open(g.path_of(hashes[0]), "r+b") as f:  # damage one: the reader quarantines it
                f.seek(g.layout.data_offset)
                f.write(b"\xff")
            out = np.zeros(g.layout.block_nbytes, dtype=np.uint8)
            assert g.read_blocks([BlockRead(hashes[0], out)])[0].status is ReadStatus.CORRUPT
            with open(g.path_of(hashes[1]), "r+b") as f:  # and one for verify --fix
                f.seek(g.layout.data_offset)
                f.write(b"\xff")
            old = time.time() - 3600
            for p in (Path(g.path_of(h)) for h in hashes[2:]):
                os.utime(p, (old, old))
        assert _quiet(["verify", str(root), "--fix"]) == 1
        assert _quiet(["gc", str(root), "--max-bytes", "1", "--grace", "1h"]) in (0, 1)
    modes = _modes(root)
    assert any("trash" in p for p in modes) and any("quarantine" in p for p in modes)
    assert any(".tmp-" in p for p in modes)
    file_mode, dir_mode = (0o660, 0o770) if group_access else (0o600, 0o700)
    wrong = {
        p: oct(m) for p, m in modes.items() if m != (dir_mode if (root / p).is_dir() else file_mode)
    }
    figure(
        f"permissions (group_access={group_access}, umask {mask:03o})",
        entries_checked=len(modes),
        not_owner_only=len(wrong) if not group_access else 0,
        wrong_modes=len(wrong),
    )
    assert wrong == {}

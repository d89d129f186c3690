"""Paths, permissions and read-only opening: KV pages encode prompts, and tools must not write."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest

from kvstore import KVStore, StoreConfig
from kvstore.errors import KvstoreError, StoreFormatError
from kvstore.store.types import BlockRead, BlockWrite, ReadStatus, WriteStatus

from ..helpers import block_bytes, block_hash, make_small_identity


def _snapshot(root: Path) -> dict[str, tuple[int, int, int]]:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.join(dirpath, name)] = (st.st_size, st.st_mtime_ns, st.st_mode)
    return out


def test_files_and_directories_are_owner_only_by_default(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with KVStore(StoreConfig(root=root, durability="none")) as store:
        g = store.namespace(make_small_identity()).group(0)
        h = block_hash(1)
        assert (
            g.write_blocks([BlockWrite(h, block_bytes(g.layout, 1))])[0].status
            is WriteStatus.WRITTEN
        )
        block = Path(g.path_of(h))
    assert stat.S_IMODE(block.stat().st_mode) == 0o600
    assert stat.S_IMODE(block.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((root / "zarr.json").stat().st_mode) == 0o600
    for dirpath, dirs, _ in os.walk(root):
        for d in dirs:
            mode = stat.S_IMODE(os.stat(os.path.join(dirpath, d)).st_mode)
            assert mode & 0o077 == 0, (d, oct(mode))


def test_group_access_opens_group_bits(tmp_path: Path) -> None:
    old = os.umask(0o007)
    try:
        with KVStore(
            StoreConfig(root=tmp_path / "s", durability="none", group_access=True)
        ) as store:
            g = store.namespace(make_small_identity()).group(0)
            h = block_hash(2)
            g.write_blocks([BlockWrite(h, block_bytes(g.layout, 2))])
            assert stat.S_IMODE(Path(g.path_of(h)).stat().st_mode) == 0o660
    finally:
        os.umask(old)


def test_symlinked_block_is_never_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 100)
    with KVStore(StoreConfig(root=tmp_path / "s", durability="none")) as store:
        g = store.namespace(make_small_identity()).group(0)
        h = block_hash(3)
        os.symlink(secret, g.path_of(h))
        out = np.zeros(g.layout.block_nbytes, np.uint8)
        (result,) = g.read_blocks([BlockRead(h, out)])
        assert result.status is ReadStatus.ERROR  # ELOOP from O_NOFOLLOW: a miss, not a read
        assert secret.read_bytes() == b"x" * 100


def test_namespace_names_cannot_escape_the_root(tmp_path: Path) -> None:
    with KVStore(StoreConfig(root=tmp_path / "s")) as store:
        for name in ("..", "../etc", "a/b-0123456789ab", "/abs-0123456789ab", "x-0123456789a"):
            with pytest.raises(StoreFormatError, match="namespace name"):
                store.open_namespace(name)


def test_read_only_open_changes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with KVStore(StoreConfig(root=root, durability="none", access_granularity_s=0)) as store:
        g = store.namespace(make_small_identity()).group(0)
        good, bad = block_hash(4), block_hash(5)
        g.write_blocks([BlockWrite(h, block_bytes(g.layout, i)) for i, h in enumerate((good, bad))])
        path = Path(g.path_of(bad))
        data_offset = g.layout.data_offset
    raw = bytearray(path.read_bytes())
    raw[data_offset + 10] ^= 0xFF
    path.write_bytes(bytes(raw))
    os.utime(root / next(p for p in os.listdir(root) if p != "zarr.json"), ns=(1, 1))
    before = _snapshot(root)
    with KVStore(StoreConfig(root=root), read_only=True) as store:
        g = store.namespace(make_small_identity(), create=False).group(0)
        out = np.zeros(g.layout.block_nbytes, np.uint8)
        statuses = [g.read_blocks([BlockRead(h, out)])[0].status for h in (good, bad)]
        assert statuses == [ReadStatus.HIT, ReadStatus.CORRUPT]
        with pytest.raises(KvstoreError, match="read-only"):
            g.write_blocks([BlockWrite(block_hash(6), block_bytes(g.layout, 6))])
        with pytest.raises(KvstoreError, match="read-only"):
            g.delete_blocks([good])
    assert _snapshot(root) == before  # no probe file, no mtime touch, no quarantine


def test_read_only_refuses_missing_store(tmp_path: Path) -> None:
    with pytest.raises(StoreFormatError):
        KVStore(StoreConfig(root=tmp_path / "absent"), read_only=True)
    assert not (tmp_path / "absent").exists()

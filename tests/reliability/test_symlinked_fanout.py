"""A fan-out directory replaced by a symbolic link while the server runs is not followed
(found 2026-12-01).

Opening a namespace checks its directories, fan-out directories included, and refuses a link
there. But block files are then opened, created and renamed by their full path with
``O_NOFOLLOW``, which refuses a link only at the last component: before
:meth:`GroupArray.block_path <kvstore.store.array.GroupArray.block_path>` re-checked the
block's fan-out directory, one replaced by a link to a directory outside the root after the
namespace was opened was followed for good. A write of a block that falls in it created its
file outside the root, and a lookup and a read found blocks there (no wrong page: a read checks
the header against its key, but "nothing outside the root is touched" did not hold). The
swap tests below fail without the re-check.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

import kvstore.store.array as array_module
from kvstore.config import StoreConfig
from kvstore.errors import KvstoreError
from kvstore.store.group_store import GroupStore
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockRead, BlockWrite, ReadStatus, WriteStatus
from tests.admin.util import expected_bytes
from tests.helpers import block_hash, make_small_identity


def _store(root: Path) -> tuple[KVStore, GroupStore]:
    store = KVStore(StoreConfig(root=root, durability="none", io_threads=1))
    return store, store.namespace(make_small_identity()).group(0)


def _linked_fanout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[KVStore, GroupStore, bytes, Path, Path]:
    """A running store with one block whose fan-out directory was then moved outside the root
    and replaced by a link to it, its last check older than FANOUT_RECHECK_S: (store, group,
    the block's hash, its fan-out path, the outside target)."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    store, group = _store(root)
    first = block_hash(0)
    group.write_blocks([BlockWrite(first, expected_bytes(group, first))])
    fanout = Path(group.array.paths.block(first)).parent
    target = outside / "moved"
    os.rename(fanout, target)
    fanout.symlink_to(target)
    later = time.monotonic() + 2 * array_module.FANOUT_RECHECK_S
    monkeypatch.setattr(array_module, "monotonic", lambda: later)
    return store, group, first, fanout, target


def test_opening_refuses_a_symlinked_fanout(tmp_path: Path) -> None:
    store, group = _store(tmp_path / "root")
    with store:
        first = block_hash(0)
        group.write_blocks([BlockWrite(first, expected_bytes(group, first))])
        fanout = Path(group.array.paths.block(first)).parent
    (tmp_path / "outside").mkdir()
    os.rename(fanout, tmp_path / "outside" / "moved")
    fanout.symlink_to(tmp_path / "outside" / "moved")
    with pytest.raises(KvstoreError, match="expected a directory, got a symbolic link"):
        _store(tmp_path / "root")


def test_a_write_into_a_symlinked_fanout_touches_nothing_outside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, group, _first, fanout, target = _linked_fanout(tmp_path, monkeypatch)
    with store:
        before = sorted(os.listdir(target))
        same_dir = next(
            h
            for h in (block_hash(i) for i in range(1, 100_000))
            if Path(group.array.paths.block(h)).parent == fanout
        )
        (result,) = group.write_blocks([BlockWrite(same_dir, expected_bytes(group, same_dir))])
        assert result.status is WriteStatus.FAILED
        assert "expected a directory, got a symbolic link" in result.error, result.error
        assert sorted(os.listdir(target)) == before


def test_a_block_behind_a_symlinked_fanout_is_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, group, first, _fanout, _target = _linked_fanout(tmp_path, monkeypatch)
    with store:
        out = np.zeros(group.layout.block_nbytes, dtype=np.uint8)
        assert group.contains([first]) == [False]
        (result,) = group.read_blocks([BlockRead(first, out)])
        assert result.status is not ReadStatus.HIT
        assert "expected a directory" in result.error, result.error


def test_a_real_fanout_directory_is_not_checked_per_block(tmp_path: Path) -> None:
    """Within FANOUT_RECHECK_S a checked fan-out directory costs no system call."""
    store, group = _store(tmp_path / "root")
    with store:
        first = block_hash(0)
        group.write_blocks([BlockWrite(first, expected_bytes(group, first))])
        array = group.array
        calls: list[str] = []
        real = array.fio.lstat_at

        def counting(dir_fd: int | None, name: str) -> os.stat_result:
            calls.append(name)
            return real(dir_fd, name)

        array.fio.lstat_at = counting  # type: ignore[method-assign]
        out = np.zeros(group.layout.block_nbytes, dtype=np.uint8)
        for _ in range(3):
            assert group.contains([first]) == [True]
            assert group.read_blocks([BlockRead(first, out)])[0].status is ReadStatus.HIT
        fanout = os.fspath(Path(array.paths.block(first)).parent)
        assert calls.count(fanout) == 0  # checked when the block was written

"""Known defect, found 2026-12-01: a fan-out directory replaced by a symbolic link is followed.

Block files are opened, created and renamed by their full path with ``O_NOFOLLOW``, which
refuses a link only at the last component. So when a fan-out directory (``.../c/0/0/0/0/0/<hi>``)
is a link to a directory outside the root, a write of a block that falls in it creates its
file outside the root, and a read or a lookup finds blocks there. No wrong page is served (a
read checks the header against the key it asked for), but "nothing outside the root is touched"
does not hold. tests/reliability/test_hostile_tree.py replaces the fan-out directory too, but
only reads, and its sentinel check sees changes, not reads.

These tests are strict xfails: they record the defect and fail (XPASS) once it is fixed, so
that the marker is removed with the fix. The fix wants block files opened and renamed relative
to a descriptor of their fan-out directory entered with ``O_NOFOLLOW`` (or ``openat2`` with
``RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH``) without giving up lookup and per-block cost (an
attempt with held fan-out descriptors for lookups was reverted for its cold-call cost:
docs/performance.md, "Secondary tier vs vLLM fs tier", second round).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvstore.config import StoreConfig
from kvstore.store.group_store import GroupStore
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockRead, BlockWrite, ReadStatus
from tests.admin.util import expected_bytes
from tests.helpers import block_hash, make_small_identity

DEFECT = "a symlinked fan-out directory is followed (full-path opens; see module docstring)"


def _linked_fanout(tmp_path: Path) -> tuple[KVStore, GroupStore, bytes, Path, Path]:
    """A store with one block whose fan-out directory was moved outside the root and replaced
    by a link to it: (store, group, the block's hash, its fan-out path, the outside target)."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    store = KVStore(StoreConfig(root=root, durability="none", io_threads=1))
    group = store.namespace(make_small_identity()).group(0)
    first = block_hash(0)
    group.write_blocks([BlockWrite(first, expected_bytes(group, first))])
    fanout = Path(group.path_of(first)).parent
    target = outside / "moved"
    os.rename(fanout, target)
    fanout.symlink_to(target)
    return store, group, first, fanout, target


@pytest.mark.xfail(strict=True, reason=DEFECT)
def test_a_write_into_a_symlinked_fanout_touches_nothing_outside(tmp_path: Path) -> None:
    store, group, _first, fanout, target = _linked_fanout(tmp_path)
    with store:
        before = sorted(os.listdir(target))
        same_dir = next(
            h
            for h in (block_hash(i) for i in range(1, 100_000))
            if Path(group.path_of(h)).parent == fanout
        )
        group.write_blocks([BlockWrite(same_dir, expected_bytes(group, same_dir))])
        assert sorted(os.listdir(target)) == before


@pytest.mark.xfail(strict=True, reason=DEFECT)
def test_a_block_behind_a_symlinked_fanout_is_a_miss(tmp_path: Path) -> None:
    store, group, first, _fanout, _target = _linked_fanout(tmp_path)
    with store:
        out = np.zeros(group.layout.block_nbytes, dtype=np.uint8)
        assert group.contains([first]) == [False]
        (result,) = group.read_blocks([BlockRead(first, out)])
        assert result.status is not ReadStatus.HIT

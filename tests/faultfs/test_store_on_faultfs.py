"""kvstore on a faultfs mount: the store works through it as on any FUSE mount, and its
engine-facing calls on a frozen mount wait, then finish correctly, leaving nothing torn.

The frozen-mount cases measure the raw behaviour the engine deadlines (connector/) sit on; they
print how long each call was held and assert only what must hold whatever the deadlines do:
after the thaw every call's result is right and ``kvstore verify`` finds the store clean.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.config import StoreConfig
from kvstore.inspect.cli import main as inspect_main
from kvstore.store.group_store import GroupStore
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockRead, BlockWrite, WriteStatus
from tests.admin.util import cli, expected_bytes, write
from tests.faultfs.handle import FaultFS
from tests.helpers import block_hash, make_small_identity, shard_files, tmp_files

BLOCKS = 6


@contextmanager
def opened(root: Path, **overrides: Any) -> Iterator[GroupStore]:
    """Group 0 of the small identity's namespace in a store at ``root`` (durable by default:
    the fsyncs of files and directories go through the mount too)."""
    values: dict[str, Any] = {"durability": "full", "io_threads": 2, **overrides}
    with KVStore(StoreConfig(root=root).replace(**values)) as store:
        yield store.namespace(make_small_identity()).group(0)


def read_back(group: GroupStore, hashes: list[bytes]) -> list[bool]:
    """Read every block; for each, whether it came back whole and right."""
    outs = [np.empty(group.layout.block_nbytes, dtype=np.uint8) for _ in hashes]
    results = group.read_blocks([BlockRead(h, o) for h, o in zip(hashes, outs, strict=True)])
    return [
        r.ok and np.array_equal(o, expected_bytes(group, h))
        for h, o, r in zip(hashes, outs, results, strict=True)
    ]


def assert_clean(capsys: pytest.CaptureFixture[str], root: Path) -> None:
    """``kvstore verify``, ``du``, ``ls`` and ``kvstore-inspect overview`` on ``root``: all
    succeed, verify finds nothing, no temporary file is left."""
    for command in ("verify", "du", "ls"):
        code, out, err = cli(capsys, command, root)
        assert code == 0, (command, out, err)
    code = inspect_main(["overview", str(root)])
    assert code == 0, capsys.readouterr()
    capsys.readouterr()  # the overview's text
    assert tmp_files(root) == []


@pytest.mark.parametrize(
    "overrides",
    [{}, {"direct_io": "on", "direct_reads": True}, {"durability": "none", "io_threads": 1}],
    ids=["buffered", "o_direct", "not-durable"],
)
def test_the_store_works_through_the_mount(
    faultfs: FaultFS, capsys: pytest.CaptureFixture[str], overrides: dict[str, Any]
) -> None:
    root = faultfs.mount / "store"
    hashes = [block_hash(i) for i in range(BLOCKS)]
    with opened(root, **overrides) as group:
        write(group, hashes)
        assert group.contains(hashes) == [True] * BLOCKS
        assert read_back(group, hashes) == [True] * BLOCKS
        engine = group.engine.describe() if hasattr(group.engine, "describe") else ""
    assert len(shard_files(faultfs.backing / "store")) == BLOCKS
    assert_clean(capsys, root)
    ops = faultfs.stats()["ops"]
    # renameat2(RENAME_NOREPLACE) is refused on this FUSE mount: every block was published by
    # link + unlink (kvstore/io/rename.py), never by a rename that could replace a name
    assert ops.get("link", 0) >= BLOCKS, ops
    print(
        f"{overrides or 'defaults'}: {engine}; for {BLOCKS} blocks and the metadata: creates "
        f"{ops.get('create')}, writes {ops.get('write')}, links {ops.get('link')}, renames "
        f"{ops.get('rename', 0)}, fsyncs {ops.get('fsync', 0)}, dir fsyncs {ops.get('fsyncdir', 0)}"
    )


def test_a_batch_refused_renameat2_is_written_once_from_then_on(
    faultfs: FaultFS, caplog: pytest.LogCaptureFixture
) -> None:
    """Without durability, small whole blocks go through the batch call, which names files
    with renameat2(RENAME_NOREPLACE) alone; this mount refuses it. The first batch's blocks
    are then written again by the step-by-step path (link + unlink), the refusal is logged
    once, and every later batch is written once."""
    caplog.set_level(logging.INFO, logger="kvstore")
    root = faultfs.mount / "store"
    with opened(root, durability="none", io_threads=1) as group:
        write(group, [block_hash(i, "first") for i in range(BLOCKS)])
        before = faultfs.stats()["ops"]
        later = [block_hash(i, "later") for i in range(BLOCKS)]
        write(group, later)
        after = faultfs.stats()["ops"]
        assert read_back(group, later) == [True] * BLOCKS
    creates = after.get("create", 0) - before.get("create", 0)
    links = after.get("link", 0) - before.get("link", 0)
    assert (creates, links) == (BLOCKS, BLOCKS), (before, after)
    refusals = [r for r in caplog.records if "refuses renameat2" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in refusals]
    assert len(shard_files(faultfs.backing / "store")) == 2 * BLOCKS
    assert not tmp_files(faultfs.backing / "store")


# -- the engine's calls on a frozen mount ------------------------------------------------


def _contains(group: GroupStore, hashes: list[bytes]) -> bool:
    return group.contains(hashes) == [True] * len(hashes)


def _read(group: GroupStore, hashes: list[bytes]) -> bool:
    return read_back(group, hashes) == [True] * len(hashes)


def _write(group: GroupStore, hashes: list[bytes]) -> bool:
    fresh = [block_hash(i, "fresh") for i in range(2)]
    writes = [BlockWrite(h, expected_bytes(group, h)) for h in fresh]
    ok = all(r.status is WriteStatus.WRITTEN for r in group.write_blocks(writes))
    return ok and _read(group, fresh)


CALLS: dict[str, Callable[[GroupStore, list[bytes]], bool]] = {
    "contains": _contains,
    "read": _read,
    "write": _write,
}


@pytest.mark.parametrize(
    ("call", "frozen"),
    [
        ("contains", "lookup"),
        ("read", "lookup"),
        ("read", "read"),
        ("write", "lookup"),
        ("write", "write"),
    ],
)
def test_an_engine_call_on_a_frozen_mount_finishes_right_after_thaw(
    faultfs: FaultFS, capsys: pytest.CaptureFixture[str], call: str, frozen: str
) -> None:
    """The call runs in a thread while the block files' directory tree is frozen: it waits
    (measured), publishes nothing half-written meanwhile, and after the thaw returns the right
    result; verify then finds the store clean."""
    root = faultfs.mount / "store"
    hashes = [block_hash(i) for i in range(BLOCKS)]
    with opened(root) as group:
        write(group, hashes)
        published = set(shard_files(faultfs.backing / "store"))
        # the namespace's array: blocks and their fan-out directories, not the root's documents
        glob = f"store/{group.namespace}/*/c/*"
        done: list[bool] = []
        thread = threading.Thread(target=lambda: done.append(CALLS[call](group, hashes)))
        faultfs.freeze(frozen, path_glob=glob)
        start = time.monotonic()
        thread.start()
        held = _held(faultfs, frozen, thread)
        # while frozen: the backing holds no new block file (temporary ones at most)
        assert set(shard_files(faultfs.backing / "store")) == published
        thawed = time.monotonic()
        faultfs.thaw()
        thread.join(60)
        assert not thread.is_alive(), f"{call} still running 60 s after thaw"
        after = time.monotonic() - thawed
        assert done == [True]
    assert_clean(capsys, root)
    what = f"held {thawed - start:.1f} s, done {after:.2f} s after thaw" if held else "not held"
    print(f"{call} with {frozen} frozen: {what}")


def _held(faultfs: FaultFS, frozen: str, thread: threading.Thread) -> bool:
    """Whether the call got held by the freeze (it may finish without touching a frozen
    operation, e.g. a lookup answered from a directory it has open); waits 1 s once held."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and thread.is_alive():
        if faultfs.stats()["blocked"].get(frozen, 0):
            time.sleep(1.0)
            return True
        time.sleep(0.05)
    return thread.is_alive()


@pytest.mark.parametrize("step", ["fsync", "link"])
def test_a_block_held_before_its_publish_is_not_visible(
    faultfs: FaultFS, capsys: pytest.CaptureFixture[str], step: str
) -> None:
    """A block write held at its data sync or at its publish (link): its final name does
    not exist meanwhile; after the thaw it is there whole, and no temporary file is left."""
    root = faultfs.mount / "store"
    with opened(root) as group:
        target = block_hash(7, "held")
        final = faultfs.backing / os.path.relpath(group.path_of(target), faultfs.mount)
        faultfs.freeze(step)
        thread = threading.Thread(target=lambda: write(group, [target]), daemon=True)
        thread.start()
        faultfs.wait_blocked(step)
        assert not final.exists()
        temps = tmp_files(faultfs.backing / "store")
        assert len(temps) == 1 and temps[0].stat().st_size == group.layout.file_nbytes
        faultfs.thaw()
        thread.join(60)
        assert not thread.is_alive()
        assert final.stat().st_size == group.layout.file_nbytes
    assert_clean(capsys, root)

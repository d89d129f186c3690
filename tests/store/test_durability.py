"""Durability: with "full", data is synced before the rename and the directory after it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.store.group_store import GroupStore
from kvstore.store.paths import TMP_MARK, temp_path_for
from kvstore.store.types import (
    BlockRead,
    BlockWrite,
    ChunkWrite,
    RangeWrite,
    ReadStatus,
    WriteStatus,
)
from tests.helpers import (
    RecordingFileIO,
    StoreFactory,
    block_bytes,
    make_small_identity,
)


class WriteRecordingFileIO(RecordingFileIO):
    """RecordingFileIO that also records every ``pwritev`` (with the file written)."""

    def pwritev(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        self._record("pwritev", self.path_of_fd(fd))
        return super().pwritev(fd, buffers, offset)


def recording_group(
    make_store: StoreFactory, durability: str, direct_io: str = "auto"
) -> tuple[GroupStore, RecordingFileIO]:
    fio = WriteRecordingFileIO()
    store = make_store(fio=fio, durability=durability, direct_io=direct_io)
    group = store.namespace(make_small_identity()).group(0)
    fio.clear()  # only the block operations from here on
    return group, fio


def hashes_sharing_a_fanout_dir() -> list[bytes]:
    """Three hashes: two with first byte 0x07, one with 0x08."""
    return [
        bytes([0x07, 1]) + bytes(30),
        bytes([0x07, 2]) + bytes(30),
        bytes([0x08, 3]) + bytes(30),
    ]


def index_of(ops: list[tuple[str, str, str]], op: str, path: str, other: str = "") -> int:
    matches = [
        i for i, o in enumerate(ops) if o[0] == op and o[1] == path and (not other or o[2] == other)
    ]
    assert len(matches) == 1, (op, path, matches)
    return matches[0]


@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_full_durability_whole_blocks(make_store: StoreFactory, direct_io: str) -> None:
    group, fio = recording_group(make_store, "full", direct_io)
    hashes = hashes_sharing_a_fanout_dir()
    data = block_bytes(group.layout, 0)
    results = group.write_blocks([BlockWrite(h, data) for h in hashes])
    assert [r.status for r in results] == [WriteStatus.WRITTEN] * 3
    ops = fio.ops
    for h in hashes:
        final = group.path_of(h)
        # Opened once: written, then (once the whole batch is written) synced on the same
        # descriptor, renamed, and closed only after its directory's sync.
        opens = [o[1] for o in ops if o[0] == "open" and o[1].startswith(temp_path_for(final, ""))]
        (tmp,) = opens
        written = max(i for i, o in enumerate(ops) if o == ("pwritev", tmp, ""))
        synced = index_of(ops, "fdatasync", tmp)
        renamed = index_of(ops, "rename", tmp, final)
        dir_synced = index_of(ops, "fsync_dir", os.path.dirname(final))
        closed = index_of(ops, "close", tmp)
        assert written < synced < renamed < dir_synced < closed
    # The whole batch is written before any of it is synced (one journal commit for many
    # files): every temporary file's last write precedes the first sync.
    last_writes: dict[str, int] = {}
    for i, o in enumerate(ops):
        if o[0] == "pwritev" and TMP_MARK in o[1]:
            last_writes[o[1]] = i
    assert len(last_writes) == len(hashes)
    first_sync = min(i for i, o in enumerate(ops) if o[0] == "fdatasync")
    assert max(last_writes.values()) < first_sync
    assert len([o for o in ops if o[0] == "fdatasync"]) == len(hashes)
    # The directory fsync is batched: once per fan-out directory per call, after all renames.
    dir_syncs = [o[1] for o in ops if o[0] == "fsync_dir"]
    assert sorted(dir_syncs) == sorted({os.path.dirname(group.path_of(h)) for h in hashes})
    assert len(dir_syncs) == 2
    last_rename = max(i for i, o in enumerate(ops) if o[0] == "rename")
    first_dir_sync = min(i for i, o in enumerate(ops) if o[0] == "fsync_dir")
    assert last_rename < first_dir_sync


def test_full_durability_multi_writer(make_store: StoreFactory) -> None:
    group, fio = recording_group(make_store, "full")
    layout = group.layout
    data = block_bytes(layout, 1)
    h = bytes([0x09]) + bytes(31)
    (pending,) = group.begin_blocks([h])
    tmp = group.temp_path(pending)
    final = group.path_of(h)
    size = layout.chunk_nbytes
    token = layout.elems_per_token * layout.itemsize
    group.write_chunks([ChunkWrite(pending, [0, 1, 2, 3], data[: 4 * size])])
    after_chunks = len([o for o in fio.ops if o == ("fdatasync", tmp, "")])
    assert after_chunks == 1  # the writer synced its part before returning
    # Chunks 4 and 5 by token ranges (two writers), checksummed at commit.
    for rank in range(2):
        ranges = [
            (c * size + t * token, data[c * size + t * token : c * size + (t + 1) * token])
            for c in (4, 5)
            for t in range(rank, layout.tokens, 2)
        ]
        assert group.write_ranges([RangeWrite(pending, ranges)]) == [None]
    (result,) = group.commit_blocks([pending], checksum_chunks=[[4, 5]])
    assert result.status is WriteStatus.WRITTEN
    ops = fio.ops
    syncs = [i for i, o in enumerate(ops) if o == ("fdatasync", tmp, "")]
    assert len(syncs) == 4  # chunk writer, two range writers, the commit (slots + truncate)
    renamed = index_of(ops, "rename", tmp, final)
    dir_synced = index_of(ops, "fsync_dir", os.path.dirname(final))
    assert max(syncs) < renamed < dir_synced


@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_no_durability_no_syncs(make_store: StoreFactory, root: Path, direct_io: str) -> None:
    fio = RecordingFileIO()
    store = make_store(fio=fio, durability="none", direct_io=direct_io)
    group = store.namespace(make_small_identity()).group(0)
    data = block_bytes(group.layout, 2)
    hashes = hashes_sharing_a_fanout_dir()
    assert [r.status for r in group.write_blocks([BlockWrite(h, data) for h in hashes])] == [
        WriteStatus.WRITTEN
    ] * 3
    (pending,) = group.begin_blocks([bytes([0x0A]) + bytes(31)])
    group.write_chunks([ChunkWrite(pending, list(range(6)), data)])
    assert group.commit_blocks([pending])[0].status is WriteStatus.WRITTEN
    ops = fio.ops
    # Block files and their directories are never synced; metadata documents always are (a
    # torn zarr.json would keep the store from opening after a power loss).
    syncs = [o for o in ops if o[0] in ("fdatasync", "fsync_dir")]
    assert syncs
    assert all(TMP_MARK not in o[1] or ".zarr.json.tmp-" in o[1] for o in syncs), syncs
    assert all(f"{os.sep}c{os.sep}" not in o[1] + os.sep for o in syncs), syncs
    assert len([o for o in ops if o[0] == "rename" and TMP_MARK in o[1]]) >= 4  # still atomic


def test_full_durability_metadata_documents(make_store: StoreFactory, root: Path) -> None:
    fio = RecordingFileIO()
    store = make_store(fio=fio, durability="full")
    store.namespace(make_small_identity())
    ops = fio.ops
    renames = [(i, o) for i, o in enumerate(ops) if o[0] == "rename" and o[2].endswith("zarr.json")]
    assert len(renames) == 3  # root, namespace, g0
    for i, (_, src, dst) in renames:
        synced = index_of(ops, "fdatasync", src)
        dir_synced = [j for j, o in enumerate(ops) if o == ("fsync_dir", os.path.dirname(dst), "")]
        assert synced < i < min(j for j in dir_synced if j > i)


def test_directory_fsync_failure_is_reported(make_store: StoreFactory) -> None:
    """The renames happened, but without the directory sync the write is not acknowledged."""

    class FailingDirSync(RecordingFileIO):
        def fsync_dir(self, path: str) -> None:
            if "/c/0/0/0/0/0/" in path:  # fan-out directories (block renames) only
                raise OSError(5, "injected EIO in fsync_dir")
            super().fsync_dir(path)

    store = make_store(fio=FailingDirSync(), durability="full")
    group = store.namespace(make_small_identity()).group(0)
    h = bytes([0x0B]) + bytes(31)
    data = block_bytes(group.layout, 3)
    (result,) = group.write_blocks([BlockWrite(h, data)])
    assert result.status is WriteStatus.FAILED
    assert result.error.startswith("directory fsync failed: ")
    assert group.stats.snapshot()["write_failures"] == 1
    # FAILED means not published: the renamed file is withdrawn again.
    out = np.zeros_like(data)
    (read,) = group.read_blocks([BlockRead(h, out)])
    assert read.status is ReadStatus.MISS
    assert group.contains([h]) == [False]

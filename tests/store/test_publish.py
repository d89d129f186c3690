"""Publication is atomic: a failed or in-progress write never exposes a partial block."""

from __future__ import annotations

import errno
import logging
import resource
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.io.fileio import FileIO
from kvstore.store import publish
from kvstore.store.group_store import GroupStore
from kvstore.store.paths import TMP_MARK, ZARR_JSON, temp_path_for
from kvstore.store.types import (
    BlockRead,
    BlockWrite,
    ChunkWrite,
    ReadStatus,
    WriteStatus,
)
from tests.helpers import (
    StoreFactory,
    block_bytes,
    block_hash,
    make_small_identity,
    shard_files,
    tmp_files,
)

FAULTS = ["partial-write", "no-progress", "tail", "fdatasync", "rename"]


class FaultyFileIO(FileIO):
    """Injects one kind of fault into operations on temporary block files.

    Only temporary files whose path contains ``target`` (default: all) are affected, so other
    blocks of the same batch, metadata documents and the O_DIRECT probe work normally.
    """

    def __init__(self, fault: str, target: str = "") -> None:
        self.fault = fault
        self.target = target
        self.armed = True
        self.injected = 0
        self._fds: set[int] = set()
        self._lock = threading.Lock()

    def _targeted(self, path: str) -> bool:
        """A temporary block file (not a metadata document's) under ``target``."""
        return TMP_MARK in path and self.target in path and ZARR_JSON not in path

    def _hit(self, fd: int) -> bool:
        with self._lock:
            return self.armed and fd in self._fds

    def _count(self) -> None:
        with self._lock:
            self.injected += 1

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        fd = super().open(path, flags, mode)
        if self._targeted(path):
            with self._lock:
                self._fds.add(fd)
        return fd

    def close(self, fd: int) -> None:
        with self._lock:
            self._fds.discard(fd)
        super().close(fd)

    def pwritev(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        if self._hit(fd) and self.fault == "partial-write":
            first = memoryview(buffers[0]).cast("B")
            written = super().pwritev(fd, [first[: min(len(first), 4096)]], offset)
            assert written > 0  # some bytes really reached the temporary file
            self._count()
            raise OSError(errno.EIO, "injected EIO mid-write")
        if self._hit(fd) and self.fault == "no-progress":
            self._count()
            return 0
        return super().pwritev(fd, buffers, offset)

    def clear_direct(self, fd: int, open_flags: int | None = None) -> None:
        if self._hit(fd) and self.fault == "tail":
            self._count()
            raise OSError(errno.EIO, "injected EIO before the buffered tail write")
        super().clear_direct(fd, open_flags)

    def fdatasync(self, fd: int) -> None:
        if self._hit(fd) and self.fault == "fdatasync":
            self._count()
            raise OSError(errno.EIO, "injected EIO in fdatasync")
        super().fdatasync(fd)

    def rename(self, src: str, dst: str) -> None:
        if self.armed and self.fault == "rename" and self._targeted(src):
            self._count()
            raise OSError(errno.EIO, "injected EIO in rename")
        super().rename(src, dst)


def faulty_group(
    make_store: StoreFactory, fault: str, direct_io: str, target: str = "", durability: str = ""
) -> tuple[GroupStore, FaultyFileIO]:
    fio = FaultyFileIO(fault, target)
    durability = durability or ("full" if fault == "fdatasync" else "none")
    # "tail": O_DIRECT writes end with a buffered write of the file's unaligned last page
    # (every format v1 file has one: the index ends it); buffered writes have no such step.
    store = make_store(fio=fio, direct_io=direct_io, durability=durability)
    return store.namespace(make_small_identity()).group(0), fio


def assert_invisible(group: GroupStore, hashes: list[bytes], root: Path) -> None:
    assert group.contains(hashes) == [False] * len(hashes)
    outs = [np.zeros(group.layout.block_nbytes, dtype=np.uint8) for _ in hashes]
    results = group.read_blocks([BlockRead(h, o) for h, o in zip(hashes, outs, strict=True)])
    assert [r.status for r in results] == [ReadStatus.MISS] * len(hashes)
    assert tmp_files(root) == []
    for h in hashes:
        assert not Path(group.path_of(h)).exists()


@pytest.mark.parametrize("durability", ["none", "full"])
@pytest.mark.parametrize("direct_io", ["off", "auto"])
@pytest.mark.parametrize("fault", FAULTS)
def test_failed_write_is_invisible(
    make_store: StoreFactory,
    root: Path,
    caplog: pytest.LogCaptureFixture,
    fault: str,
    direct_io: str,
    durability: str,
) -> None:
    if fault == "tail" and direct_io == "off":
        pytest.skip("buffered writes have no separate tail step")
    if fault == "fdatasync" and durability == "none":
        pytest.skip("durability none never syncs a block file")
    group, fio = faulty_group(make_store, fault, direct_io, durability=durability)
    hashes = [block_hash(i, fault) for i in range(3)]
    datas = [block_bytes(group.layout, i) for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        results = group.write_blocks([BlockWrite(h, d) for h, d in zip(hashes, datas, strict=True)])
    assert fio.injected >= 3
    assert [r.status for r in results] == [WriteStatus.FAILED] * 3
    assert all(r.error.startswith("OSError: ") for r in results), results
    assert len(caplog.records) == 1
    assert "3 of 3 block writes failed" in caplog.records[0].getMessage()
    assert group.stats.snapshot()["write_failures"] == 3
    assert group.stats.snapshot()["blocks_written"] == 0
    assert_invisible(group, hashes, root)
    assert shard_files(root) == []
    assert fio._fds == set()  # no temporary file's descriptor is left open

    # Once the fault is gone the same blocks are written normally (no stale leftovers).
    fio.armed = False
    results = group.write_blocks([BlockWrite(h, d) for h, d in zip(hashes, datas, strict=True)])
    assert [r.status for r in results] == [WriteStatus.WRITTEN] * 3
    out = np.zeros(group.layout.block_nbytes, dtype=np.uint8)
    assert group.read_blocks([BlockRead(hashes[1], out)])[0].ok
    np.testing.assert_array_equal(out, datas[1])


@pytest.mark.parametrize("fault", ["partial-write", "rename"])
def test_one_failure_does_not_fail_the_batch(
    make_store: StoreFactory, root: Path, fault: str
) -> None:
    hashes = [block_hash(i, "batch") for i in range(4)]
    # The target is the bad block's temporary file name without its token.
    probe_group = make_store().namespace(make_small_identity()).group(0)
    target = temp_path_for(probe_group.path_of(hashes[2]), "")
    group, _ = faulty_group(make_store, fault, "auto", target=target)
    datas = [block_bytes(group.layout, 10 + i) for i in range(4)]
    results = group.write_blocks([BlockWrite(h, d) for h, d in zip(hashes, datas, strict=True)])
    assert [r.status for r in results] == [
        WriteStatus.WRITTEN,
        WriteStatus.WRITTEN,
        WriteStatus.FAILED,
        WriteStatus.WRITTEN,
    ]
    assert group.contains(hashes) == [True, True, False, True]
    assert tmp_files(root) == []
    assert len(shard_files(root)) == 3


@pytest.mark.parametrize("fault", ["partial-write", "rename"])
def test_failed_multi_writer_commit_is_invisible(
    make_store: StoreFactory, root: Path, fault: str
) -> None:
    group, fio = faulty_group(make_store, fault, "off")
    layout = group.layout
    h = block_hash(0, "mw")
    data = block_bytes(layout, 0)
    (pending,) = group.begin_blocks([h])
    half = layout.num_chunks // 2 * layout.chunk_nbytes
    errors = group.write_chunks(
        [
            ChunkWrite(pending, [0, 1, 2], data[:half]),
            ChunkWrite(pending, [3, 4, 5], data[half:]),
        ]
    )
    if fault == "partial-write":
        assert all(isinstance(e, OSError) for e in errors)
        group.abort_blocks([pending])
    else:
        assert errors == [None, None]
        (result,) = group.commit_blocks([pending])
        assert result.status is WriteStatus.FAILED
        assert "injected EIO in rename" in result.error
    assert fio.injected >= 1
    assert_invisible(group, [h], root)


class SlowFileIO(FileIO):
    """Writes at most 4 KiB per pwritev call and pauses, so writes are long and interleave."""

    def pwritev(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        first = memoryview(buffers[0]).cast("B")
        done = super().pwritev(fd, [first[:4096]], offset)
        time.sleep(0.0002)
        return done


def test_concurrent_reader_sees_miss_or_verified_hit(make_store: StoreFactory) -> None:
    """A reader (another store object: another process in real life) hammers read_blocks
    while a writer publishes blocks in batches: every result is MISS or a HIT with exactly the
    written bytes, never CORRUPT, ERROR or other bytes."""
    identity = make_small_identity()
    writer = make_store(fio=SlowFileIO(), io_threads=2).namespace(identity).group(0)
    reader = make_store(io_threads=2).namespace(identity).group(0)
    layout = writer.layout
    n, batch = 60, 6
    hashes = [block_hash(i, "concurrent") for i in range(n)]
    datas = [block_bytes(layout, 500 + i) for i in range(n)]
    outs = [np.zeros(layout.block_nbytes, dtype=np.uint8) for _ in range(n)]
    problems: list[str] = []
    passes = 0
    pass_done = threading.Condition()
    partial_views = 0
    stop = threading.Event()

    def read_loop() -> None:
        nonlocal passes, partial_views
        while not stop.is_set():
            for out in outs:
                out.fill(0)
            reads = [BlockRead(h, o) for h, o in zip(hashes, outs, strict=True)]
            results = reader.read_blocks(reads)
            hits = 0
            for i, result in enumerate(results):
                if result.status is ReadStatus.HIT:
                    hits += 1
                    if not np.array_equal(outs[i], datas[i]):
                        problems.append(f"block {i}: HIT with wrong bytes")
                elif result.status is not ReadStatus.MISS:
                    problems.append(f"block {i}: {result.status} {result.error}")
            partial_views += 0 < hits < n
            with pass_done:
                passes += 1
                pass_done.notify_all()

    def reader_passed(count: int) -> Callable[[], bool]:
        return lambda: passes >= count

    thread = threading.Thread(target=read_loop)
    thread.start()
    try:
        for start in range(0, n, batch):
            writes = [BlockWrite(hashes[i], datas[i]) for i in range(start, start + batch)]
            with pass_done:
                seen = passes
            results = writer.write_blocks(writes)
            assert [r.status for r in results] == [WriteStatus.WRITTEN] * batch
            with pass_done:  # let the reader see this intermediate state at least once
                assert pass_done.wait_for(reader_passed(seen + 2), timeout=30)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert problems == []
    assert partial_views >= n // batch - 1  # it really read while blocks were appearing
    assert reader.stats.snapshot()["corrupt"] == 0
    assert reader.contains(hashes) == [True] * n


class HeldDescriptors(FileIO):
    """Counts the temporary block files open at once; fails every directory sync on demand."""

    def __init__(self) -> None:
        self.open_now: set[int] = set()
        self.most_open = 0
        self.fail_dir_syncs = False
        self._lock = threading.Lock()

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        fd = super().open(path, flags, mode)
        if TMP_MARK in path and ZARR_JSON not in path:
            with self._lock:
                self.open_now.add(fd)
                self.most_open = max(self.most_open, len(self.open_now))
        return fd

    def close(self, fd: int) -> None:
        with self._lock:
            self.open_now.discard(fd)
        super().close(fd)

    def fsync_dir(self, path: str) -> None:
        if self.fail_dir_syncs:
            raise OSError(errno.EIO, "injected EIO in directory fsync", path)
        super().fsync_dir(path)


@pytest.mark.parametrize("direct_io", ["off", "auto"])
def test_a_large_batch_holds_a_bounded_number_of_descriptors(
    make_store: StoreFactory, root: Path, monkeypatch: pytest.MonkeyPatch, direct_io: str
) -> None:
    """A durable batch keeps its temporary files open from write to directory sync, at most
    MAX_HELD_FILES at once; files of earlier slices (their descriptors given up) and of the
    last one (still held) are all withdrawn when their directory sync fails."""
    monkeypatch.setattr(publish, "MAX_HELD_FILES", 2)
    fio = HeldDescriptors()
    store = make_store(fio=fio, durability="full", direct_io=direct_io)
    group = store.namespace(make_small_identity()).group(0)
    hashes = [block_hash(i, "held") for i in range(5)]
    datas = [block_bytes(group.layout, 20 + i) for i in range(5)]
    writes = [BlockWrite(h, d) for h, d in zip(hashes, datas, strict=True)]

    fio.fail_dir_syncs = True
    results = group.write_blocks(writes)
    assert [r.status for r in results] == [WriteStatus.FAILED] * 5
    assert all("directory fsync failed" in r.error for r in results), results
    assert group.contains(hashes) == [False] * 5
    assert fio.most_open == 2 and fio.open_now == set()
    assert tmp_files(root) == [] and shard_files(root) == []

    fio.fail_dir_syncs = False
    results = group.write_blocks(writes)
    assert [r.status for r in results] == [WriteStatus.WRITTEN] * 5
    assert fio.most_open == 2 and fio.open_now == set()
    for h, d in zip(hashes, datas, strict=True):
        out = np.zeros(group.layout.block_nbytes, dtype=np.uint8)
        assert group.read_blocks([BlockRead(h, out)])[0].ok
        np.testing.assert_array_equal(out, d)


@pytest.mark.parametrize(
    ("soft", "held"),
    [(100, 16), (1024, 64), (20000, 256), (resource.RLIM_INFINITY, 256)],
)
def test_held_descriptors_follow_a_low_descriptor_limit(
    monkeypatch: pytest.MonkeyPatch, soft: int, held: int
) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (soft, resource.RLIM_INFINITY))
    assert publish.max_held_files() == held

"""fileio: vectored full writes and reads survive short transfers and IOV_MAX batching;
published temporary names hash like their final names (GlusterFS placement, issue 10)."""

from __future__ import annotations

import errno
import fcntl
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvstore.config import StoreConfig
from kvstore.io.callcheck import IOV_MAX
from kvstore.io.fileio import O_DIRECT, FileIO
from kvstore.io.vectored import read_fully, write_fully
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockWrite, ChunkWrite, WriteStatus
from tests.helpers import block_bytes, block_hash, make_small_identity
from tests.scaleout.gluster import GLUSTER_RSYNC_HASH_REGEX


class ShortIO(FileIO):
    """pwritev/preadv transfer at most ``limit`` bytes per call (like a signal or a pipe)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.write_calls: list[tuple[int, int]] = []  # (number of buffers, offset)
        self.read_calls = 0

    def pwritev(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        self.write_calls.append((len(buffers), offset))
        remaining = self.limit
        trimmed = []
        for b in buffers:
            view = memoryview(b).cast("B")
            if remaining <= 0:
                break
            trimmed.append(view[:remaining])
            remaining -= len(view[:remaining])
        return os.pwritev(fd, trimmed, offset)

    def preadv(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        self.read_calls += 1
        first = memoryview(buffers[0]).cast("B")
        return os.preadv(fd, [first[: self.limit]], offset)


def payload(n: int, seed: int = 0) -> bytes:
    return bytes((i * 31 + seed) % 256 for i in range(n))


@pytest.fixture
def fd(tmp_path: Path) -> Iterator[int]:
    handle = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    yield handle
    os.close(handle)


@pytest.mark.parametrize("limit", [1, 7, 1000, 4096])
def test_write_fully_retries_short_writes(fd: int, tmp_path: Path, limit: int) -> None:
    buffers = [payload(3000, 1), payload(5, 2), payload(0), payload(6000, 3)]
    fio = ShortIO(limit)
    write_fully(fio, fd, buffers, 100)
    data = (tmp_path / "f").read_bytes()
    assert data[:100] == bytes(100)
    assert data[100:] == b"".join(buffers)
    assert len(fio.write_calls) >= 9005 // limit
    # Each retry continues exactly where the previous call stopped.
    offsets = [offset for _, offset in fio.write_calls]
    assert offsets == sorted(offsets)
    assert offsets[0] == 100


def test_write_fully_batches_by_iov_max(fd: int, tmp_path: Path) -> None:
    buffers = [payload(3, i) for i in range(2 * IOV_MAX + 17)]
    fio = ShortIO(10**9)
    write_fully(fio, fd, buffers, 0)
    assert (tmp_path / "f").read_bytes() == b"".join(buffers)
    assert [n for n, _ in fio.write_calls] == [IOV_MAX, IOV_MAX, 17]
    assert [o for _, o in fio.write_calls] == [0, 3 * IOV_MAX, 6 * IOV_MAX]


def test_write_fully_short_inside_a_batch(fd: int, tmp_path: Path) -> None:
    buffers = [payload(5, i) for i in range(IOV_MAX + 3)]
    fio = ShortIO(5 * IOV_MAX - 2)  # stops 2 bytes before the end of the first batch
    write_fully(fio, fd, buffers, 0)
    assert (tmp_path / "f").read_bytes() == b"".join(buffers)


class NoProgress(FileIO):
    def pwritev(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        return 0


def test_write_without_progress_is_enospc(fd: int) -> None:
    with pytest.raises(OSError) as info:
        write_fully(NoProgress(), fd, [b"abc"], 0)
    assert info.value.errno == errno.ENOSPC


@pytest.mark.parametrize("limit", [1, 100, 5000])
def test_read_fully_retries_short_reads(fd: int, tmp_path: Path, limit: int) -> None:
    content = payload(9000, 4)
    (tmp_path / "f").write_bytes(content)
    outs = [bytearray(4000), bytearray(1), bytearray(4000)]
    fio = ShortIO(limit)
    assert read_fully(fio, fd, outs, 500) == 8001
    assert b"".join(outs) == content[500:8501]
    assert fio.read_calls >= 8001 // limit


def test_read_fully_stops_at_eof(fd: int, tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(payload(100))
    outs = [bytearray(80), bytearray(80)]
    assert read_fully(ShortIO(30), fd, outs, 0) == 100
    assert bytes(outs[0]) + bytes(outs[1][:20]) == payload(100)
    assert outs[1][20:] == bytearray(60)


def test_default_fileio_operations(tmp_path: Path) -> None:
    fio = FileIO()
    nested = tmp_path / "a" / "b"
    fio.makedirs(str(nested))
    fio.makedirs(str(nested))  # exist_ok
    path = str(nested / "x")
    assert not fio.exists(path)
    handle = fio.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        write_fully(fio, handle, [b"hello"], 0)
        fio.ftruncate(handle, 3)
        fio.fdatasync(handle)
        assert fio.fstat_size(handle) == 3
    finally:
        fio.close(handle)
    fio.fsync_dir(str(nested))
    fio.rename(path, path + "2")
    assert not fio.exists(path)
    assert Path(path + "2").read_bytes() == b"hel"
    fio.unlink(path + "2")
    assert not fio.exists(path + "2")


class RecordingRenames(FileIO):
    """Records every rename (kvstore renames only to publish, quarantine or trash)."""

    def __init__(self) -> None:
        self.renames: list[tuple[str, str]] = []

    def rename(self, src: str, dst: str) -> None:
        self.renames.append((src, dst))
        super().rename(src, dst)


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_published_temporary_names_hash_like_their_final_names(
    tmp_path: Path, compression: str
) -> None:
    """On GlusterFS publishing is atomic only if the temporary file lies on the brick of its
    final name. A default volume hashes rsync-style names ``.<name>.<suffix>`` as ``<name>``
    (``cluster.rsync-hash-regex``), so kvstore names every temporary file that way
    (docs/shared-filesystems.md, issue 10). Every publish kvstore makes - metadata documents,
    whole blocks, multi-writer commits - must rename a name that regex maps to the final name,
    in the same directory: a temporary name that stopped matching (a dot in a token, another
    shape) would silently bring the race back."""
    regex = re.compile(GLUSTER_RSYNC_HASH_REGEX)
    fio = RecordingRenames()
    config = StoreConfig(root=tmp_path / "store", compression=compression)
    with KVStore(config, fio=fio) as store:
        group = store.namespace(make_small_identity()).group(0)
        whole = block_hash(1, "names")
        (result,) = group.write_blocks([BlockWrite(whole, block_bytes(group.layout, 1))])
        assert result.status is WriteStatus.WRITTEN
        multi = block_hash(2, "names")
        (pending,) = group.begin_blocks([multi], [whole])
        chunks = list(range(group.layout.num_chunks))
        (error,) = group.write_chunks([ChunkWrite(pending, chunks, block_bytes(group.layout, 2))])
        assert error is None
        (result,) = group.commit_blocks([pending])
        assert result.status is WriteStatus.WRITTEN
        finals = {group.path_of(whole), group.path_of(multi)}
    published = {dst for _, dst in fio.renames}
    assert finals <= published
    assert any(os.path.basename(dst) == "zarr.json" for dst in published)
    for src, dst in fio.renames:
        assert os.path.dirname(src) == os.path.dirname(dst), (src, dst)
        match = regex.match(os.path.basename(src))
        assert match is not None and match.group(1) == os.path.basename(dst), (src, dst)
    # The regex leaves final names alone (they hash as themselves).
    assert all(regex.match(os.path.basename(dst)) is None for dst in published)


@pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT on this platform")
def test_clear_direct_from_known_open_flags_leaves_the_same_status_flags(tmp_path: Path) -> None:
    """One F_SETFL built from the flags the file was opened with (the block write's tail step)
    leaves exactly the status flags that F_GETFL-then-F_SETFL leaves: O_DIRECT off, the
    O_NONBLOCK :meth:`FileIO.open` adds kept."""
    fio = FileIO()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_DIRECT
    status: list[int] = []
    for name, known in (("read", None), ("known", flags)):
        try:
            fd = fio.open(str(tmp_path / name), flags)
        except OSError as exc:  # a file system refusing O_DIRECT (tmpfs before Linux 6.6)
            pytest.skip(f"O_DIRECT open refused here: {exc}")
        try:
            assert fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT
            fio.clear_direct(fd, known)
            status.append(fcntl.fcntl(fd, fcntl.F_GETFL))
        finally:
            fio.close(fd)
    assert status[0] == status[1]
    assert not status[1] & O_DIRECT and status[1] & os.O_NONBLOCK

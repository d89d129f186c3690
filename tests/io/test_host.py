"""Host I/O engine: O_DIRECT probe and fallback, identical bytes on both write paths, map."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.checksum import XXH3_64
from kvstore.config import StoreConfig
from kvstore.errors import BlockMissingError, ConfigError, CorruptBlockError
from kvstore.identity import Identity
from kvstore.io import host
from kvstore.io.buffers import aligned_buffer, is_aligned
from kvstore.io.fileio import O_DIRECT, FileIO, filesystem_type
from kvstore.io.host import HostEngine, probe_direct_io
from kvstore.io.newfile import plan_new_file
from kvstore.io.types import DirectIOProbe, Hashing
from kvstore.store.format import ShardLayout
from kvstore.store.paths import TMP_MARK
from kvstore.store.types import BlockRead, BlockWrite, ReadStatus, WriteStatus
from tests.helpers import (
    StoreFactory,
    block_bytes,
    block_hash,
    make_odd_identity,
    make_small_identity,
)

SELECT = "kvstore.select"  # the engine selection's logger (one line per store opened)
needs_o_direct = pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT on this platform")


class NoDirectIO(FileIO):
    """A filesystem that refuses O_DIRECT (tmpfs, some FUSE mounts): open fails with EINVAL."""

    def __init__(self) -> None:
        self.opens: list[tuple[str, int]] = []

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        self.opens.append((path, flags))
        if O_DIRECT and flags & O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return super().open(path, flags, mode)


class FlagRecorder(FileIO):
    """Records the flags every block temporary file is opened with."""

    def __init__(self) -> None:
        self.tmp_flags: list[int] = []

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        if TMP_MARK in path and "zarr.json" not in path:
            self.tmp_flags.append(flags)
        return super().open(path, flags, mode)


def o_direct_works(directory: Path) -> bool:
    return probe_direct_io(directory, "auto").enabled


@needs_o_direct
def test_probe_falls_back_with_one_log_line(
    make_store: StoreFactory, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fio = NoDirectIO()
    with caplog.at_level(logging.DEBUG, logger="kvstore"):
        store = make_store(fio=fio, direct_io="auto")
    assert store.engine.direct.enabled is False
    assert store.engine.direct.reason.startswith(f"O_DIRECT probe failed in {root.absolute()}")
    # The engine selection's own line (kvstore.select) is tested in tests/io/test_select.py.
    lines = [r for r in caplog.records if r.name.startswith("kvstore") and r.name != SELECT]
    assert len(lines) == 1
    assert lines[0].levelno == logging.INFO
    assert lines[0].getMessage().startswith("kvstore: buffered writes (O_DIRECT probe failed")
    assert "buffered writes" in store.engine.describe()
    # Writes still work, without another O_DIRECT attempt.
    group = store.namespace(make_small_identity()).group(0)
    fio.opens.clear()
    data = block_bytes(group.layout, 1)
    assert group.write_blocks([BlockWrite(block_hash(1), data)])[0].status is WriteStatus.WRITTEN
    assert fio.opens
    assert all(not flags & O_DIRECT for _, flags in fio.opens)
    assert [p.name for p in root.iterdir() if p.name.startswith(".kvstore-probe")] == []


@needs_o_direct
def test_fuse_file_systems_write_buffered_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FUSE passes O_DIRECT on to its servers (GlusterFS bricks then fail odd fragments under
    load): "auto" writes buffered there without probing; "on" still probes and uses it."""
    if not o_direct_works(tmp_path):
        pytest.skip("the test filesystem refuses O_DIRECT")
    monkeypatch.setattr(host, "filesystem_type", lambda _path: "fuse.glusterfs")
    fio = NoDirectIO()
    auto = probe_direct_io(tmp_path, "auto", fio)
    assert auto == DirectIOProbe(
        False, "fuse.glusterfs file system: O_DIRECT is left to its servers"
    )
    assert fio.opens == []  # no probe file
    assert probe_direct_io(tmp_path, "on").enabled


def test_filesystem_type_names_the_mount(tmp_path: Path) -> None:
    kind = filesystem_type(tmp_path)
    if not Path("/proc/self/mountinfo").exists():
        assert kind == ""
        return
    assert kind and " " not in kind
    assert filesystem_type("/proc") == "proc"
    assert filesystem_type(tmp_path / "not" / "there") == kind  # nearest mount above it


@needs_o_direct
def test_direct_io_on_fails_loudly(root: Path) -> None:
    root.mkdir()
    with pytest.raises(ConfigError) as info:
        HostEngine(StoreConfig(root=root, direct_io="on"), NoDirectIO())
    assert str(info.value).startswith("direct_io=on: expected O_DIRECT to work, but O_DIRECT")
    assert list(root.iterdir()) == []  # the probe file was removed


def test_direct_io_off_skips_the_probe(
    make_store: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    fio = NoDirectIO()
    with caplog.at_level(logging.DEBUG, logger="kvstore"):
        store = make_store(fio=fio, direct_io="off")
    assert store.engine.direct.enabled is False
    assert store.engine.direct.reason == "direct_io=off"
    assert all(not flags & O_DIRECT for _, flags in fio.opens)
    assert [r for r in caplog.records if r.name.startswith("kvstore") and r.name != SELECT] == []


@needs_o_direct
def test_probe_passes_here(tmp_path: Path) -> None:
    if not o_direct_works(tmp_path):
        pytest.skip("the test filesystem refuses O_DIRECT")
    probe = probe_direct_io(tmp_path, "on")
    assert probe.enabled
    assert probe.reason == "O_DIRECT probe passed"
    assert list(tmp_path.iterdir()) == []


def write_files(
    make_store: StoreFactory,
    root: Path,
    identity: Identity,
    direct_io: str,
    aligned: bool,
) -> tuple[list[bytes], list[int]]:
    """Write 3 blocks to a fresh root; return the file bytes and the tmp open flags."""
    fio = FlagRecorder()
    group = make_store(root, fio=fio, direct_io=direct_io).namespace(identity).group(0)
    files = []
    for i in range(3):
        data = block_bytes(group.layout, i)
        if aligned:
            buffer = aligned_buffer(len(data))
            buffer[:] = data
            assert is_aligned(buffer.data) == (len(data) % 4096 == 0)
        else:  # a view starting one byte into a bytes object: never page aligned
            buffer = np.frombuffer(b"\0" + data.tobytes(), dtype=np.uint8)[1:]
            assert not is_aligned(buffer.data)
        h = block_hash(i, "paths")
        result = group.write_blocks([BlockWrite(h, buffer, block_hash(i - 1, "paths"))])
        assert result[0].status is WriteStatus.WRITTEN
        files.append(Path(group.path_of(h)).read_bytes())
    return files, fio.tmp_flags


@needs_o_direct
@pytest.mark.usefixtures("frozen_time")
@pytest.mark.parametrize("aligned", [True, False])
def test_direct_and_buffered_files_are_identical(
    make_store: StoreFactory, tmp_path: Path, any_identity: Identity, aligned: bool
) -> None:
    if not o_direct_works(tmp_path):
        pytest.skip("the test filesystem refuses O_DIRECT")
    direct, direct_flags = write_files(make_store, tmp_path / "d", any_identity, "on", aligned)
    buffered, buffered_flags = write_files(make_store, tmp_path / "b", any_identity, "off", aligned)
    assert len(direct_flags) == len(buffered_flags) == 3
    assert all(flags & O_DIRECT for flags in direct_flags)
    assert not any(flags & O_DIRECT for flags in buffered_flags)
    for one, two in zip(direct, buffered, strict=True):
        assert len(one) == len(two)
        assert one == two


@pytest.mark.parametrize("direct_io", ["on", "off"])
def test_round_trip_on_both_paths(
    make_store: StoreFactory, tmp_path: Path, any_identity: Identity, direct_io: str
) -> None:
    if direct_io == "on" and not (O_DIRECT and o_direct_works(tmp_path)):
        pytest.skip("the test filesystem refuses O_DIRECT")
    group = make_store(direct_io=direct_io, io_threads=3).namespace(any_identity).group(0)
    assert group.engine.direct.enabled is (direct_io == "on")
    n = 12
    hashes = [block_hash(i, "rt") for i in range(n)]
    datas = [block_bytes(group.layout, 40 + i) for i in range(n)]
    results = group.write_blocks([BlockWrite(h, d) for h, d in zip(hashes, datas, strict=True)])
    assert [r.status for r in results] == [WriteStatus.WRITTEN] * n
    outs = [np.zeros(group.layout.block_nbytes, dtype=np.uint8) for _ in range(n)]
    results2 = group.read_blocks([BlockRead(h, o) for h, o in zip(hashes, outs, strict=True)])
    assert [r.status for r in results2] == [ReadStatus.HIT] * n
    for out, data in zip(outs, datas, strict=True):
        np.testing.assert_array_equal(out, data)
    stats = group.stats.snapshot()
    assert stats["blocks_written"] == n
    assert stats["bytes_written"] == n * group.layout.block_nbytes
    assert stats["hits"] == n
    assert stats["bytes_read"] == n * group.layout.block_nbytes


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[HostEngine]:
    eng = HostEngine(StoreConfig(root=tmp_path, io_threads=3, durability="none", direct_io="off"))
    yield eng
    eng.close()


def test_map_keeps_order_and_returns_exceptions(engine: HostEngine) -> None:
    def work(i: int) -> int:
        if i % 7 == 3:
            raise ValueError(f"bad {i}")
        return i * i

    results = engine.map(work, list(range(50)))
    for i, result in enumerate(results):
        if i % 7 == 3:
            assert isinstance(result, ValueError)
            assert str(result) == f"bad {i}"
        else:
            assert result == i * i
    assert engine.map(work, []) == []
    single = engine.map(work, [3])
    assert isinstance(single[0], ValueError)


def test_map_after_close_runs_on_the_calling_thread(tmp_path: Path) -> None:
    """A closed engine's threads are gone: a late map must not wait for them."""
    eng = HostEngine(StoreConfig(root=tmp_path, io_threads=3, durability="none", direct_io="off"))
    assert eng.map(lambda i: i + 1, [1, 2, 3]) == [2, 3, 4]  # its threads started and ran
    eng.close()
    assert eng.map(lambda i: i * 2, list(range(6))) == [0, 2, 4, 6, 8, 10]


STUCK_IO_THREAD = """
import sys, threading
from kvstore.config import StoreConfig
from kvstore.io.host import HostEngine

engine = HostEngine(StoreConfig(root=sys.argv[1], io_threads=2, direct_io="off"))
hung, caller_done = threading.Event(), threading.Event()

def work(i):
    if threading.current_thread().name.startswith("kvstore-io"):
        hung.set()
        threading.Event().wait()  # an I/O thread held forever, as by a frozen mount
    caller_done.wait(30)  # the calling thread waits until an I/O thread took an item

def call():
    engine.map(work, [0, 1])

threading.Thread(target=call, daemon=True).start()
assert hung.wait(30), "no I/O thread took an item"
caller_done.set()
engine.close()
print("exiting", flush=True)
"""


def test_a_stuck_io_thread_does_not_hold_up_the_process_exit(tmp_path: Path) -> None:
    """The I/O threads are daemons: a process whose engine has one stuck in a hung mount
    still exits (a ThreadPoolExecutor's threads are joined at exit, forever)."""
    proc = subprocess.run(
        [sys.executable, "-c", STUCK_IO_THREAD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert proc.returncode == 0 and "exiting" in proc.stdout, proc.stderr[-2000:]


def test_write_and_read_segments(engine: HostEngine, tmp_path: Path) -> None:
    path = str(tmp_path / "blk")
    a, b = memoryview(b"A" * 10), memoryview(b"B" * 5)
    engine.write_file(path, [(0, a), (10, b), (100, memoryview(b"C"))], 120, exclusive=True)
    raw = Path(path).read_bytes()
    assert raw == b"A" * 10 + b"B" * 5 + bytes(85) + b"C" + bytes(19)
    with pytest.raises(FileExistsError):
        engine.write_file(path, [(0, a)], 120, exclusive=True)
    engine.write_file(path, [(50, memoryview(b"xy"))], 120, exclusive=False)
    assert Path(path).read_bytes()[48:53] == b"\0\0xy\0"
    out1, out2 = bytearray(3), bytearray(2)
    engine.read_file(path, [(8, memoryview(out1)), (50, memoryview(out2))], 120)
    assert (bytes(out1), bytes(out2)) == (b"AAB", b"xy")
    with pytest.raises(CorruptBlockError, match="file size: expected 121 bytes, got 120"):
        engine.read_file(path, [(0, memoryview(out1))], 121)
    with pytest.raises(BlockMissingError):
        engine.read_file(path + "-missing", [(0, memoryview(out1))], 120)


class ShortFile(FileIO):
    """fstat lies about the size; reads past the real end come back short."""

    def fstat_size(self, fd: int) -> int:
        return 4096

    def fstat(self, fd: int) -> os.stat_result:
        st = os.fstat(fd)
        fields = list(st)
        fields[6] = 4096  # st_size
        return os.stat_result(fields)


def test_short_read_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "short"
    path.write_bytes(b"x" * 100)
    eng = HostEngine(StoreConfig(root=tmp_path, direct_io="off"), ShortFile())
    try:
        out = bytearray(200)
        with pytest.raises(CorruptBlockError, match="short read at 0: expected 200, got 100"):
            eng.read_file(str(path), [(0, memoryview(out))], 4096)
    finally:
        eng.close()


def test_corrupt_reads_name_the_file_read(tmp_path: Path) -> None:
    """Every CorruptBlockError of read_file and read_file_hashed carries the (device, inode)
    of the file it read: wrong size, short read (in one vectored run, and in a hashed group).
    Quarantine moves a file only while its name holds that."""
    path = tmp_path / "blk"
    path.write_bytes(b"x" * 100)
    st = path.stat()
    identity = (st.st_dev, st.st_ino)
    out = bytearray(200)
    plain = HostEngine(StoreConfig(root=tmp_path, direct_io="off", io_threads=1))
    short = HostEngine(StoreConfig(root=tmp_path, direct_io="off", io_threads=1), ShortFile())
    try:
        with pytest.raises(CorruptBlockError, match="file size") as size_error:
            plain.read_file(str(path), [(0, memoryview(out)[:10])], 99)
        two = [(0, memoryview(out)[:50]), (50, memoryview(out)[50:])]
        with pytest.raises(CorruptBlockError, match="short read at 0") as run_error:
            short.read_file(str(path), two, 4096)
        # the second segment as one hashed group of two 75-byte chunks, read after the first
        hashed = [(0, memoryview(out)[:50]), (50, memoryview(out)[50:200])]
        plan = Hashing(1, 2, XXH3_64, 75, 150, np.zeros(2, dtype=np.uint64))
        with pytest.raises(CorruptBlockError, match="short read at 50") as group_error:
            short.read_file_hashed(str(path), hashed, 4096, 0, plan)
        with pytest.raises(CorruptBlockError, match="file size") as hashed_size_error:
            plain.read_file_hashed(str(path), hashed, 200, 0, plan)
        assert plain.read_file(str(path), [(0, memoryview(out)[:100])], 100) == identity
    finally:
        plain.close()
        short.close()
    for error in (size_error, run_error, group_error, hashed_size_error):
        assert error.value.file_id == identity


@needs_o_direct
def test_direct_write_requires_tiling_segments(tmp_path: Path) -> None:
    if not o_direct_works(tmp_path):
        pytest.skip("the test filesystem refuses O_DIRECT")
    eng = HostEngine(StoreConfig(root=tmp_path, direct_io="on", durability="none"))
    try:
        gap: Sequence[tuple[int, memoryview]] = [(0, memoryview(b"a")), (5, memoryview(b"b"))]
        with pytest.raises(ValueError, match="gap at 1"):
            eng.write_file(str(tmp_path / "g"), gap, 6, exclusive=True)
        short = [(0, memoryview(b"abc"))]
        with pytest.raises(ValueError, match="segments end at 3, file is 10"):
            eng.write_file(str(tmp_path / "h"), short, 10, exclusive=True)
        ok = [(0, memoryview(b"x" * 5000)), (5000, memoryview(b"y" * 3))]
        eng.write_file(str(tmp_path / "k"), ok, 5003, exclusive=True)
        assert (tmp_path / "k").read_bytes() == b"x" * 5000 + b"yyy"
    finally:
        eng.close()


class TruncateRecorder(FileIO):
    """Records ftruncate calls and the O_DIRECT state of every write."""

    def __init__(self) -> None:
        self.truncates: list[int] = []
        self.writes: list[tuple[int, int, bool]] = []  # (offset, length, O_DIRECT on)

    def ftruncate(self, fd: int, length: int) -> None:
        self.truncates.append(length)
        super().ftruncate(fd, length)

    def pwritev(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT)
        self.writes.append((offset, sum(memoryview(b).nbytes for b in buffers), direct))
        return super().pwritev(fd, buffers, offset)


@needs_o_direct
@pytest.mark.parametrize("size", [100, 4096, 4096 + 7, 3 * 4096 - 1, 3 * 4096 + 1000])
def test_new_files_end_exactly_without_truncating(tmp_path: Path, size: int) -> None:
    """O_DIRECT writes put the aligned part down directly and the unaligned last page
    buffered on the same descriptor; neither path truncates a new whole file."""
    if not o_direct_works(tmp_path):
        pytest.skip("the test filesystem refuses O_DIRECT")
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    aligned = aligned_buffer(4096)
    aligned[:] = np.frombuffer(payload[:4096].ljust(4096, b"\0"), dtype=np.uint8)
    segments: list[tuple[int, memoryview]] = []
    if size >= 4096:  # a page-aligned first segment goes straight from the caller's memory
        segments.append((0, aligned.data))
        segments.append((4096, memoryview(payload[4096:])))
    else:
        segments.append((0, memoryview(payload)))
    segments = [s for s in segments if len(s[1])]
    for direct_io in ("on", "off"):
        fio = TruncateRecorder()
        eng = HostEngine(StoreConfig(root=tmp_path, direct_io=direct_io, durability="full"), fio)
        fio.truncates.clear()  # the O_DIRECT probe's own truncate
        fio.writes.clear()
        try:
            path = tmp_path / f"f-{direct_io}"
            eng.write_file(str(path), segments, size, exclusive=True)
        finally:
            eng.close()
        assert path.read_bytes() == payload
        assert fio.truncates == []
        if direct_io == "on" and size % 4096:
            tail_offset, tail_len, tail_direct = fio.writes[-1]
            assert (tail_offset, tail_len, tail_direct) == (size - size % 4096, size % 4096, False)
            assert all(direct and off % 4096 == 0 for off, _, direct in fio.writes[:-1])


def test_describe(engine: HostEngine) -> None:
    assert engine.describe() == "host engine, 3 threads, buffered writes (direct_io=off)"


def test_odd_identity_is_non_dense() -> None:
    """Guard: the fixtures really cover the padded (non-dense) layout."""
    identity = make_odd_identity()
    assert not ShardLayout.for_group(identity.groups[0], 16, 2).dense


def test_read_touches_old_files_only(engine: HostEngine, tmp_path: Path) -> None:
    """Readers record last use as mtime, at most once per granularity interval."""
    path = tmp_path / "blk"
    path.write_bytes(b"x" * 10)
    old_ns = 1_000_000_000_000_000_000  # 2001
    os.utime(path, ns=(old_ns, old_ns))
    out = bytearray(4)
    engine.read_file(str(path), [(0, memoryview(out))], 10, touch_if_older_than_ns=old_ns)
    assert path.stat().st_mtime_ns == old_ns  # not older than the bound: untouched
    engine.read_file(str(path), [(0, memoryview(out))], 10)
    assert path.stat().st_mtime_ns == old_ns  # 0: never touch
    engine.read_file(str(path), [(0, memoryview(out))], 10, touch_if_older_than_ns=old_ns + 1)
    assert path.stat().st_mtime_ns > old_ns + 10**18 // 2  # now-ish


@pytest.mark.parametrize(("granularity", "touched"), [(60, True), (0, False)])
def test_block_reads_record_last_use(
    make_store: StoreFactory, granularity: int, touched: bool
) -> None:
    group = make_store(access_granularity_s=granularity).namespace(make_small_identity()).group(0)
    h = block_hash(1, "mtime")
    data = block_bytes(group.layout, 1)
    group.write_blocks([BlockWrite(h, data)])
    path = Path(group.path_of(h))
    old_ns = 1_000_000_000_000_000_000
    os.utime(path, ns=(old_ns, old_ns))
    out = np.zeros_like(data)
    assert group.read_blocks([BlockRead(h, out)])[0].ok
    assert (path.stat().st_mtime_ns != old_ns) is touched


def test_new_file_plan_stages_only_what_is_not_aligned() -> None:
    """The plan both engines write new files by: aligned segments go direct until something
    is staged, staging mirrors file offsets, the unaligned end is the buffered tail."""
    plan = plan_new_file(
        [(0, 100, False), (100, 3996, False), (4096, 8192, True), (12288, 50, False)], 12338
    )
    assert plan.staged == (0, 1, 3)
    assert plan.writes == ((-1, 0, 4096), (2, -1, -1))
    assert plan.tail == (12288, 12338)
    resumed = plan_new_file(
        [(0, 4096, True), (4096, 10, False), (4106, 4086, False), (8192, 4096, True)], 12288
    )
    assert resumed.staged == (1, 2)  # a staged page, then direct writes resume
    assert resumed.writes == ((0, -1, -1), (-1, 4096, 8192), (3, -1, -1))
    assert resumed.tail is None
    with pytest.raises(ValueError, match="gap at 1"):
        plan_new_file([(0, 1, False), (5, 1, False)], 6)
    with pytest.raises(ValueError, match="segments end at 3, file is 10"):
        plan_new_file([(0, 3, False)], 10)

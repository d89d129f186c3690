"""The native file protocol (kvstore/_native/fileproto*.c through FileIO's compound operations): the
same files, results, exception types and words as FileIO's Python reference for every kind of
entry a hostile tree puts at a name, descriptors closed on errors, only NativeFileIO using
it (the binding and its fallback: tests/native/test_fileproto_binding.py)."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.config import StoreConfig
from kvstore.errors import BlockMissingError, CorruptBlockError, EntryKindError, KvstoreError
from kvstore.io import fileproto, host
from kvstore.io.buffers import aligned_buffer
from kvstore.io.fileio import O_DIRECT, FileIO
from kvstore.io.host import HostEngine, probe_direct_io
from kvstore.io.native_fileio import NativeFileIO
from kvstore.native import BindingState

NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL
REPO = Path(__file__).resolve().parents[2]


class Reference(FileIO):
    """FileIO's Python reference: its compound operations run step by step."""


def _native_required() -> None:
    why = fileproto.native_fileproto_unavailable()
    if why is not None:
        pytest.skip(f"native file protocol not active: {why}")


@pytest.fixture
def native() -> FileIO:
    """NativeFileIO, which runs the native calls (skips where the extension is missing)."""
    _native_required()
    return NativeFileIO()


def _noise(n: int, seed: int = 7) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """What ``call`` returned, or its exception's type, words, errno and file names."""
    try:
        return "ok", call()
    except (OSError, KvstoreError) as exc:
        return type(exc).__name__, (
            str(exc),
            getattr(exc, "errno", None),
            getattr(exc, "filename", None),
            getattr(exc, "filename2", None),
            getattr(exc, "file_id", None),
        )


def _aligned(data: bytes) -> memoryview:
    buffer = aligned_buffer(len(data))
    buffer[:] = np.frombuffer(data, dtype=np.uint8)
    return buffer.data


# -- write_new ---------------------------------------------------------------------------------


def _shapes() -> dict[str, tuple[list[tuple[int, bytes]], int, int | None]]:
    """Segment lists, file sizes and O_DIRECT splits (None: buffered) of new files."""
    many = [(i * 3, _noise(3, i)) for i in range(2000)]  # more runs than IOV_MAX
    return {
        "one": ([(0, _noise(100))], 100, None),
        "contiguous": ([(0, _noise(4096)), (4096, _noise(5000)), (9096, _noise(20))], 9116, None),
        "gap then extended": ([(0, _noise(10)), (4096, _noise(10))], 8192, None),
        "cut short": ([(0, _noise(5000))], 4096, None),
        "more than IOV_MAX": (many, 6000, None),
        "direct with a tail": ([(0, _noise(8192)), (8192, _noise(4100))], 12292, 1),
        "direct, no tail": ([(0, _noise(4096)), (4096, _noise(8192))], 12288, 2),
    }


@pytest.mark.parametrize("shape", list(_shapes()))
def test_write_new_gives_the_reference_file(native: FileIO, tmp_path: Path, shape: str) -> None:
    raw, file_nbytes, split = _shapes()[shape]
    flags = NEW
    if split is not None:
        if not probe_direct_io(tmp_path, "auto").enabled:
            pytest.skip("the test file system refuses O_DIRECT")
        flags |= O_DIRECT
    # O_DIRECT segments from aligned memory (read-only views, as headers are given).
    segments = [(offset, _aligned(data).toreadonly()) for offset, data in raw]
    files = {}
    for name, fio in (("native", native), ("reference", Reference())):
        path = str(tmp_path / name)
        fd = fio.write_new(path, flags, 0o600, segments, file_nbytes, split)
        try:
            assert not os.fstat(fd).st_mode & 0o077  # owner-only, as asked
            assert (
                fcntl_flags(fd) & O_DIRECT == 0 if split is not None and split < len(raw) else True
            )
        finally:
            os.close(fd)
        files[name] = Path(path).read_bytes()
    expected = bytearray(file_nbytes)
    for offset, data in raw:
        expected[offset : offset + len(data)] = data[: max(0, file_nbytes - offset)]
    assert files["native"] == files["reference"] == bytes(expected)


def fcntl_flags(fd: int) -> int:
    import fcntl  # noqa: PLC0415 - one test's helper

    return fcntl.fcntl(fd, fcntl.F_GETFL)


def _hostile(tmp_path: Path, kind: str) -> str:
    """A name in ``tmp_path`` holding ``kind`` of entry."""
    path = tmp_path / kind
    if kind == "file":
        path.write_bytes(b"x" * 10)
    elif kind == "symlink":
        (tmp_path / "target").write_bytes(b"y" * 10)
        path.symlink_to(tmp_path / "target")
    elif kind == "dangling symlink":
        path.symlink_to(tmp_path / "nowhere")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
    elif kind == "missing directory":
        path = tmp_path / "gone" / "name"
    return str(path)


KINDS = ["file", "symlink", "dangling symlink", "fifo", "directory", "socket", "missing directory"]


@pytest.mark.parametrize("kind", KINDS)
def test_write_new_errors_match(native: FileIO, tmp_path: Path, kind: str) -> None:
    """A name already taken (by anything) is FileExistsError, a missing directory
    FileNotFoundError (the publisher then recreates the fan-out directory): the same
    exception, words and file name as the reference; nothing blocks on a FIFO."""
    path = _hostile(tmp_path, kind)
    fds_before = _open_fds()
    outcomes = [
        _outcome(partial(fio.write_new, path, NEW, 0o600, [(0, memoryview(b"z"))], 1))
        for fio in (native, Reference())
    ]
    assert outcomes[0] == outcomes[1]
    want = "FileNotFoundError" if kind == "missing directory" else "FileExistsError"
    assert outcomes[0][0] == want
    assert _open_fds() == fds_before


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- read_regular --------------------------------------------------------------------------------


def _read_outcome(
    fio: FileIO, path: str, sizes: list[tuple[int, int]], expected: int, trailer: bool
) -> tuple[str, Any, list[bytes]]:
    buffers = [bytearray(n) for _, n in sizes]
    segments = [(offset, memoryview(b)) for (offset, _), b in zip(sizes, buffers, strict=True)]
    kind, detail = _outcome(
        lambda: fio.read_regular(path, os.O_RDONLY, segments, expected, trailer)
    )
    return kind, detail, [bytes(b) for b in buffers]


@pytest.mark.parametrize("kind", KINDS)
def test_read_regular_refuses_what_the_reference_refuses(
    native: FileIO, tmp_path: Path, kind: str
) -> None:
    path = _hostile(tmp_path, kind)
    fds_before = _open_fds()
    outcomes = [_read_outcome(fio, path, [(0, 10)], 10, False) for fio in (native, Reference())]
    assert outcomes[0][:2] == outcomes[1][:2]
    if kind == "file":
        assert outcomes[0][0] == "ok"
        assert outcomes[0][2] == [b"x" * 10]
    elif kind in ("missing directory", "dangling symlink"):
        # A dangling link: O_NOFOLLOW refuses it (ELOOP), and it is named for what it is.
        expected = "FileNotFoundError" if kind == "missing directory" else "EntryKindError"
        assert outcomes[0][0] == expected
    else:
        assert outcomes[0][0] == "EntryKindError"
        assert "expected a regular file" in outcomes[0][1][0]
    assert _open_fds() == fds_before


@pytest.mark.parametrize(
    ("size", "segments", "expected", "trailer"),
    [
        (100, [(0, 40), (40, 60)], 100, False),  # one run
        (100, [(0, 10), (50, 20)], 100, False),  # two runs
        (99, [(0, 10)], 100, False),  # short file
        (101, [(0, 10)], 100, False),  # long file
        (101, [(0, 100)], 100, True),  # a trailer allowed
        (99, [(0, 10)], 100, True),  # shorter still refused
        (100, [(90, 20)], 100, False),  # the right size, a segment past its end: short read
        (100, [(0, 10), (95, 10)], 100, False),  # the second run short
    ],
)
def test_read_regular_sizes_match(
    native: FileIO,
    tmp_path: Path,
    size: int,
    segments: list[tuple[int, int]],
    expected: int,
    trailer: bool,
) -> None:
    path = tmp_path / "f"
    path.write_bytes(_noise(size))
    st = path.stat()
    outcomes = [
        _read_outcome(fio, str(path), segments, expected, trailer) for fio in (native, Reference())
    ]
    assert outcomes[0] == outcomes[1]
    kind, detail, _ = outcomes[0]
    if kind == "ok":
        assert detail == (st.st_dev, st.st_ino)
    else:
        assert kind == "CorruptBlockError"
        assert detail[4] == (st.st_dev, st.st_ino)  # the file found corrupt is named


def test_read_regular_touches_old_files(native: FileIO, tmp_path: Path) -> None:
    for fio in (native, Reference()):
        path = tmp_path / type(fio).__name__
        path.write_bytes(b"abc")
        os.utime(path, ns=(10**9, 10**9))
        fio.read_regular(str(path), os.O_RDONLY, [(0, memoryview(bytearray(3)))], 3, False, 5)
        assert path.stat().st_mtime_ns == 10**9  # not older than the bound: kept
        fio.read_regular(
            str(path), os.O_RDONLY, [(0, memoryview(bytearray(3)))], 3, False, 2 * 10**9
        )
        assert path.stat().st_mtime_ns > 2 * 10**9


def test_read_regular_needs_writable_memory(native: FileIO, tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    with pytest.raises(TypeError, match="segment 0's memory as a writable contiguous buffer"):
        native.read_regular(str(path), os.O_RDONLY, [(0, memoryview(b"xyz"))], 3)


# -- sync_and_rename -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["free", "taken", "tmp missing", "bad fd", "no fd"])
def test_sync_and_rename_matches(native: FileIO, tmp_path: Path, case: str) -> None:
    results = []
    for fio in (native, Reference()):
        where = tmp_path / type(fio).__name__
        where.mkdir()
        tmp, final = where / ".b.tmp-1", where / "b"
        if case != "tmp missing":
            tmp.write_bytes(b"new")
        if case == "taken":
            final.write_bytes(b"old")
        fd = os.open(tmp, os.O_RDONLY) if tmp.exists() and case != "no fd" else None
        if case == "bad fd":
            fd = 1_000_000
        try:
            kind, detail = _outcome(partial(fio.sync_and_rename, fd, str(tmp), str(final)))
        finally:
            if fd is not None and fd != 1_000_000:
                os.close(fd)
        names = sorted(p.name for p in where.iterdir())
        contents = final.read_bytes() if final.exists() else None
        # Paths differ by directory: compare the words with it taken out.
        results.append((kind, str(detail).replace(str(where), "<dir>"), names, contents))
    assert results[0] == results[1]
    expected = {
        "free": "ok",
        "taken": "FileExistsError",
        "tmp missing": "FileNotFoundError",
        "bad fd": "OSError",
        "no fd": "ok",
    }
    assert results[0][0] == expected[case]
    if case == "taken":
        assert results[0][3] == b"old"  # never replaced


def test_taken_name_is_the_publishers_file_exists(native: FileIO, tmp_path: Path) -> None:
    """publish.finish_writes recognises a lost race by FileExistsError.filename2 == final."""
    tmp, final = tmp_path / ".b.tmp-1", tmp_path / "b"
    tmp.write_bytes(b"new")
    final.write_bytes(b"old")
    with pytest.raises(FileExistsError) as info:
        native.sync_and_rename(None, str(tmp), str(final))
    assert info.value.filename2 == str(final)
    assert info.value.errno == errno.EEXIST


# -- NativeFileIO goes native, the reference FileIO never ------------------------------------


def test_plain_fileio_alone_goes_native(
    native: FileIO, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real = fileproto.native_fileproto()
    assert real is not None

    class Counting:
        def __getattr__(self, name: str) -> Any:
            if name != "first_unaligned":  # no I/O: used for any FileIO
                calls.append(name)
            return getattr(real, name)

    monkeypatch.setattr(fileproto.NATIVE_FILEPROTO, "_state", BindingState(Counting(), None, None))
    config = StoreConfig(root=tmp_path, direct_io="auto", durability="full")
    for fio, native_calls in ((native, ["write_new", "read_regular"]), (Reference(), [])):
        calls.clear()
        engine = HostEngine(config, fio)
        try:
            path = str(tmp_path / f"f-{type(fio).__name__}")
            data = _aligned(_noise(8192))
            engine.write_file(
                path, [(0, data), (8192, memoryview(_noise(10)))], 8202, exclusive=True
            )
            out = memoryview(bytearray(8202))
            engine.read_file(path, [(0, out)], 8202)
            assert bytes(out) == bytes(data) + Path(path).read_bytes()[8192:]
        finally:
            engine.close()
        assert calls == native_calls


def test_engine_missing_file_is_block_missing(native: FileIO, tmp_path: Path) -> None:
    engine = HostEngine(StoreConfig(root=tmp_path), native, probe=False)
    try:
        with pytest.raises(BlockMissingError):
            engine.read_file(str(tmp_path / "nope"), [(0, memoryview(bytearray(4)))], 4)
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        with pytest.raises(EntryKindError, match="expected a regular file, got a FIFO"):
            engine.read_file(str(fifo), [(0, memoryview(bytearray(4)))], 4)
        (tmp_path / "short").write_bytes(b"ab")
        with pytest.raises(CorruptBlockError, match="file size: expected 4 bytes, got 2"):
            engine.read_file(str(tmp_path / "short"), [(0, memoryview(bytearray(4)))], 4)
    finally:
        engine.close()


# -- a write failing inside the native call ----------------------------------------------------

_EFBIG_SCRIPT = textwrap.dedent(
    """
    import json, os, resource, signal, sys
    from kvstore.io import fileproto
    from kvstore.io.fileio import FileIO
    from kvstore.io.native_fileio import NativeFileIO

    class Reference(FileIO):
        pass

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))
    out = {"native": fileproto.native_fileproto_unavailable()}
    data = memoryview(b"q" * 20000)
    for fio in (NativeFileIO(), Reference()):
        path = os.path.join(sys.argv[1], type(fio).__name__)
        before = len(os.listdir("/proc/self/fd"))
        try:
            fio.write_new(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, [(0, data)], 20000)
            result = "written"
        except OSError as exc:
            result = [type(exc).__name__, exc.errno, str(exc)]
        out[type(fio).__name__] = {
            "result": result,
            "fds_leaked": len(os.listdir("/proc/self/fd")) - before,
            "size": os.path.getsize(path),
        }
    print(json.dumps(out))
    """
)


def test_a_write_past_the_file_size_limit_fails_cleanly(tmp_path: Path) -> None:
    """RLIMIT_FSIZE: the first pwritev is cut short at the limit, the next fails EFBIG; the
    native call closes its descriptor and raises what the reference raises."""
    _native_required()
    run = subprocess.run(
        [sys.executable, "-c", _EFBIG_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        timeout=120,
    )
    out = json.loads(run.stdout)
    assert out["native"] is None
    assert out["NativeFileIO"] == out["Reference"]
    assert out["NativeFileIO"]["result"][:2] == ["OSError", errno.EFBIG]
    assert out["NativeFileIO"]["fds_leaked"] == 0
    assert out["NativeFileIO"]["size"] == 8192  # the prefix the short write put down


# -- the O_DIRECT write of a dense block, from where its segments lie --------------------------


class WriteRecorder(FileIO):
    """Records (offset, bytes, O_DIRECT on) of every pwritev, and every truncate."""

    def __init__(self) -> None:
        self.writes: list[tuple[int, int, bool]] = []
        self.truncates: list[int] = []

    def pwritev(self, fd: int, buffers: Any, offset: int) -> int:
        direct = bool(fcntl_flags(fd) & O_DIRECT)
        self.writes.append((offset, sum(memoryview(b).nbytes for b in buffers), direct))
        return super().pwritev(fd, buffers, offset)

    def ftruncate(self, fd: int, length: int) -> None:
        self.truncates.append(length)
        super().ftruncate(fd, length)


@pytest.mark.parametrize("index_nbytes", [100, 4096, 4100, 3 * 4096 + 5])
def test_dense_block_goes_unstaged_with_the_plans_writes(tmp_path: Path, index_nbytes: int) -> None:
    """Header, data and index in aligned memory (the dense block) are written from where
    they lie: the same writes (offsets, lengths, O_DIRECT state) and file as the staged plan
    gives when the index lies in unaligned memory, and no truncate."""
    if not probe_direct_io(tmp_path, "auto").enabled:
        pytest.skip("the test file system refuses O_DIRECT")
    header, data, index = _noise(4096, 1), _noise(3 * 4096, 2), _noise(index_nbytes, 3)
    unaligned_index = memoryview(bytearray(b"\0" + index))[1:]  # an odd address: staged
    size = len(header) + len(data) + index_nbytes
    records = {}
    for name, last in (("in place", _aligned(index).toreadonly()), ("planned", unaligned_index)):
        segments = [(0, _aligned(header).toreadonly()), (4096, _aligned(data)), (16384, last)]
        fio = WriteRecorder()
        engine = HostEngine(StoreConfig(root=tmp_path, direct_io="on", durability="none"), fio)
        fio.writes.clear()  # the probe's
        fio.truncates.clear()
        try:
            path = tmp_path / name.replace(" ", "-")
            engine.write_file(str(path), segments, size, exclusive=True)
        finally:
            engine.close()
        assert path.read_bytes() == header + data + index
        assert fio.truncates == []
        records[name] = fio.writes
    assert records["in place"] == records["planned"]


@pytest.mark.parametrize(
    "lengths_and_shifts",
    [
        [],
        [(4096, 0)],
        [(4096, 0), (8192, 0), (100, 0)],
        [(4096, 0), (4100, 0)],
        [(4096, 0), (4096, 8)],
        [(0, 3), (4096, 0)],
        [(4096, 0), (100, 8), (4096, 0)],
    ],
)
def test_first_unaligned_matches_python(
    native: FileIO, lengths_and_shifts: list[tuple[int, int]]
) -> None:
    """The native alignment query of the O_DIRECT write and its Python twin agree (an empty
    buffer's address is moot)."""
    segments = []
    for length, shift in lengths_and_shifts:
        memory = aligned_buffer(length + 4096)
        segments.append((0, memory[shift : shift + length].data))
    module = fileproto.native_fileproto()
    assert module is not None
    assert module.first_unaligned(segments, 4096) == host.first_unaligned_reference(segments, 4096)


@pytest.mark.parametrize(
    ("segments", "error", "words"),
    [
        ([5], TypeError, "expected segment 0 as an \\(offset, buffer\\) pair, got int"),
        ([(0, 5)], TypeError, "expected segment 0's memory as a contiguous buffer, got int"),
        ([(-1, b"x")], ValueError, "expected segment 0 at an offset >= 0, got -1"),
    ],
)
def test_bad_segments_are_named(
    native: FileIO, tmp_path: Path, segments: list[Any], error: type[Exception], words: str
) -> None:
    """Refused before anything is opened: no file is created."""
    path = tmp_path / "f"
    with pytest.raises(error, match=words):
        native.write_new(str(path), NEW, 0o600, segments, 1)
    assert not path.exists()


# -- exists_many -------------------------------------------------------------------------------


def test_exists_many_answers_what_exists_answers(native: FileIO, tmp_path: Path) -> None:
    """One batch of names of every kind: True for a regular file, False for no such name, and
    for anything else the very OSError exists() raises (a link, a directory, a FIFO, a name
    below a file), in order; the native batch and the reference agree."""
    (tmp_path / "file").write_bytes(b"x")
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    names = ["file", "missing", "dir", "fifo", "link", "file/below", "missing/below", "file"]
    paths = [str(tmp_path / n) for n in names]

    def described(fio: FileIO) -> list[Any]:
        return [
            (type(o).__name__, str(o), getattr(o, "errno", None)) if isinstance(o, OSError) else o
            for o in fio.exists_many(paths)
        ]

    got = described(native)
    assert got == described(Reference())
    assert [g if isinstance(g, bool) else g[0] for g in got] == [
        True,
        False,
        "EntryKindError",
        "EntryKindError",
        "EntryKindError",
        "NotADirectoryError",
        False,
        True,
    ]
    assert native.exists_many([]) == []

"""Checksums computed as a file's bytes pass (FileIO.write_new_hashed / read_regular_hashed,
kvstore/_native/fileproto_hashed.c's hashed transfers): the native calls give the Python
reference's files, sums and errors, for every way a block's data arrives (one segment, pieces,
gaps, more pieces than a group holds), with O_DIRECT, and on every kind of entry a hostile tree
puts at a name."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.checksum import CRC32C, XXH3_64, chunk_sums
from kvstore.errors import CorruptBlockError, KvstoreError
from kvstore.io.buffers import aligned_buffer
from kvstore.io.fileio import O_DIRECT, FileIO
from kvstore.io.host import probe_direct_io
from kvstore.io.native_fileio import NativeFileIO
from kvstore.io.types import Hashing
from tests.native.test_native_fileproto import KINDS, NEW, Reference, _hostile, _open_fds

CHUNK = 1024


@pytest.fixture
def native() -> FileIO:
    """NativeFileIO running the native hashed calls (skips where they are unavailable)."""
    from kvstore.checksum import native_xxh3_capsule  # noqa: PLC0415 - binds on first use
    from kvstore.io.fileproto import native_fileproto_unavailable  # noqa: PLC0415

    why = native_fileproto_unavailable()
    if why is not None or native_xxh3_capsule() is None:
        pytest.skip(f"native hashed transfers not active: {why or 'no native xxh3'}")
    return NativeFileIO()


def _noise(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", call()
    except (OSError, KvstoreError, ValueError) as exc:
        return type(exc).__name__, (
            str(exc),
            getattr(exc, "errno", None),
            getattr(exc, "filename", None),
            getattr(exc, "file_id", None),
        )


# A block-like file: header (4 KiB) at 0, data pieces after it, an index of 100 bytes.
HEADER = 4096


def _pieces(kind: str) -> list[tuple[int, np.ndarray]]:
    """Data segments (file offset, bytes) of a block's data region, in file order."""
    if kind == "one segment":
        return [(HEADER, _noise(40 * CHUNK, 1))]
    if kind == "pieces":  # chunks given one or a few at a time (a strided block's pieces)
        sizes = [1, 3, 2, 1, 5, 1, 1, 4, 2]
    elif kind == "more pieces than a group holds":
        sizes = [1] * 150
    else:  # "empty pieces": zero-length segments in the middle and at the end
        sizes = [2, 0, 3, 0]
    out, at = [], HEADER
    for i, n in enumerate(sizes):
        out.append((at, _noise(n * CHUNK, 10 + i)))
        at += n * CHUNK
    return out


PIECE_KINDS = ["one segment", "pieces", "more pieces than a group holds", "empty pieces"]


def _layout(
    kind: str, aligned: bool = False
) -> tuple[list[tuple[int, memoryview]], int, np.ndarray]:
    data = _pieces(kind)
    end = data[-1][0] + len(data[-1][1])

    def view(array: np.ndarray) -> memoryview:
        if not aligned:
            return array.data
        buffer = aligned_buffer(len(array))
        buffer[:] = array
        return buffer.data

    header = _noise(HEADER, 99)
    index = _noise(100, 98)
    segments = [(0, view(header)), *((o, view(d)) for o, d in data), (end, view(index))]
    joined = np.concatenate([d for _, d in data]) if data else np.zeros(0, np.uint8)
    return segments, end + 100, joined


@pytest.mark.parametrize("group", [CHUNK // 3, CHUNK, 3 * CHUNK, 3 * CHUNK + 7, 1 << 20])
@pytest.mark.parametrize("kind", PIECE_KINDS)
def test_hashed_write_gives_the_reference_file_and_sums(
    native: FileIO, tmp_path: Path, kind: str, group: int
) -> None:
    segments, file_nbytes, joined = _layout(kind)
    count = len(joined) // CHUNK
    files, sums = {}, {}
    for name, fio in (("native", native), ("reference", Reference())):
        out = np.zeros(count, dtype=np.uint64)
        hashing = Hashing(1, len(segments) - 1, XXH3_64, CHUNK, group, out)
        path = str(tmp_path / name)
        os.close(fio.write_new_hashed(path, NEW, 0o600, segments, file_nbytes, hashing))
        files[name], sums[name] = Path(path).read_bytes(), out.tolist()
    expected = bytearray(file_nbytes)
    for offset, data in segments:
        expected[offset : offset + len(data)] = data
    assert files["native"] == files["reference"] == bytes(expected)
    assert (
        sums["native"]
        == sums["reference"]
        == chunk_sums(XXH3_64, joined.data, CHUNK, count).tolist()
    )


def test_hashed_write_with_o_direct(native: FileIO, tmp_path: Path) -> None:
    """Aligned data written direct and hashed first, then the header, the index's whole
    pages direct and its tail buffered: the reference's file and sums."""
    if not probe_direct_io(tmp_path, "auto").enabled:
        pytest.skip("the test file system refuses O_DIRECT")
    data = [(4096 + i * 8192, aligned_buffer(8192)) for i in range(5)]
    for i, (_, buffer) in enumerate(data):
        buffer[:] = _noise(8192, i)
    header, index = aligned_buffer(4096), aligned_buffer(4096)
    header[:] = _noise(4096, 50)
    index[:] = _noise(4096, 51)
    end = 4096 + 5 * 8192
    segments = [(0, header.data), *((o, b.data) for o, b in data), (end, index.data[:4096])]
    segments += [(end + 4096, memoryview(_noise(50, 52).tobytes()))]
    files, sums = {}, {}
    for name, fio in (("native", native), ("reference", Reference())):
        out = np.zeros(5 * 8, dtype=np.uint64)
        hashing = Hashing(1, 6, XXH3_64, CHUNK, 4 * CHUNK, out)
        path = str(tmp_path / name)
        fd = fio.write_new_hashed(path, NEW | O_DIRECT, 0o600, segments, end + 4146, hashing, 7)
        os.close(fd)
        files[name], sums[name] = Path(path).read_bytes(), out.tolist()
    assert files["native"] == files["reference"]
    assert len(files["native"]) == end + 4146
    assert sums["native"] == sums["reference"]
    joined = np.concatenate([np.asarray(b) for _, b in data])
    assert sums["native"] == chunk_sums(XXH3_64, joined.data, CHUNK, 40).tolist()


@pytest.mark.parametrize(
    ("first", "last", "chunk", "group", "sums", "words"),
    [
        (2, 1, CHUNK, CHUNK, 3, "expected hashed segments 0 <= first <= last <= 3, got [2, 1)"),
        (1, 2, 0, CHUNK, 3, "expected chunk_nbytes > 0 and group_nbytes > 0, got 0 and 1024"),
        (1, 2, CHUNK, 0, 3, "expected chunk_nbytes > 0 and group_nbytes > 0, got 1024 and 0"),
        (1, 2, 1000, 4000, 3, "expected hashed segment 1 to hold whole chunks of 1000 bytes"),
        (1, 2, CHUNK, CHUNK, 2, "expected sums of at least 3 native uint64 values"),
    ],
)
def test_bad_geometry_is_refused_alike_before_any_file(
    native: FileIO,
    tmp_path: Path,
    first: int,
    last: int,
    chunk: int,
    group: int,
    sums: int,
    words: str,
) -> None:
    segments = [
        (0, memoryview(bytes(10))),
        (10, memoryview(bytes(3 * CHUNK))),
        (3082, memoryview(b"i")),
    ]
    outcomes = []
    for fio in (native, Reference()):
        hashing = Hashing(first, last, XXH3_64, chunk, group, np.zeros(sums, dtype=np.uint64))
        path = str(tmp_path / type(fio).__name__)
        outcomes.append(
            _outcome(partial(fio.write_new_hashed, path, NEW, 0o600, segments, 3083, hashing))
        )
        assert not os.path.exists(path)
        buffers = [(o, memoryview(bytearray(len(d)))) for o, d in segments]
        outcomes.append(
            _outcome(partial(fio.read_regular_hashed, path, os.O_RDONLY, buffers, 3083, hashing))
        )
    assert outcomes[0] == outcomes[2] and outcomes[1] == outcomes[3], outcomes
    assert outcomes[0][0] == "ValueError" and words in outcomes[0][1][0]


@pytest.mark.parametrize("kind", KINDS)
def test_hashed_write_errors_match(native: FileIO, tmp_path: Path, kind: str) -> None:
    path = _hostile(tmp_path, kind)
    fds_before = _open_fds()
    segments = [(0, memoryview(b"h")), (1, memoryview(bytes(CHUNK)))]
    outcomes = []
    for fio in (native, Reference()):
        hashing = Hashing(1, 2, XXH3_64, CHUNK, CHUNK, np.zeros(1, dtype=np.uint64))
        outcomes.append(
            _outcome(partial(fio.write_new_hashed, path, NEW, 0o600, segments, 1 + CHUNK, hashing))
        )
    assert outcomes[0] == outcomes[1]
    want = "FileNotFoundError" if kind == "missing directory" else "FileExistsError"
    assert outcomes[0][0] == want
    assert _open_fds() == fds_before


# -- reads ---------------------------------------------------------------------------------------


def _read_hashed(
    fio: FileIO, path: str, segments: list[tuple[int, memoryview]], file_nbytes: int, group: int
) -> tuple[tuple[str, Any], list[bytes], list[int]]:
    buffers = [bytearray(len(d)) for _, d in segments]
    into = [(o, memoryview(b)) for (o, _), b in zip(segments, buffers, strict=True)]
    count = sum(len(d) for _, d in segments[1:-1]) // CHUNK
    sums = np.zeros(count, dtype=np.uint64)
    hashing = Hashing(1, len(segments) - 1, XXH3_64, CHUNK, group, sums)
    outcome = _outcome(
        partial(fio.read_regular_hashed, path, os.O_RDONLY, into, file_nbytes, hashing)
    )
    return outcome, [bytes(b) for b in buffers], sums.tolist()


@pytest.mark.parametrize("group", [CHUNK // 3, CHUNK, 3 * CHUNK, 1 << 20])
@pytest.mark.parametrize("kind", PIECE_KINDS)
def test_hashed_read_gives_the_reference_bytes_and_sums(
    native: FileIO, tmp_path: Path, kind: str, group: int
) -> None:
    segments, file_nbytes, joined = _layout(kind)
    path = tmp_path / "block"
    expected = bytearray(file_nbytes)
    for offset, data in segments:
        expected[offset : offset + len(data)] = data
    path.write_bytes(expected)
    got = [
        _read_hashed(fio, str(path), segments, file_nbytes, group) for fio in (native, Reference())
    ]
    assert got[0] == got[1]
    outcome, buffers, sums = got[0]
    assert outcome[0] == "ok"
    assert buffers == [bytes(d) for _, d in segments]
    assert sums == chunk_sums(XXH3_64, joined.data, CHUNK, len(joined) // CHUNK).tolist()


@pytest.mark.parametrize("kind", [*KINDS, "short file", "long file"])
def test_hashed_read_refuses_what_the_reference_refuses(
    native: FileIO, tmp_path: Path, kind: str
) -> None:
    segments, file_nbytes, _ = _layout("pieces")
    if kind in ("short file", "long file"):
        path = str(tmp_path / kind)
        Path(path).write_bytes(bytes(file_nbytes + (-1 if kind == "short file" else 1)))
    else:
        path = _hostile(tmp_path, kind)
    fds_before = _open_fds()
    got = [
        _read_hashed(fio, path, segments, file_nbytes, 3 * CHUNK) for fio in (native, Reference())
    ]
    assert got[0][0] == got[1][0]
    assert got[0][0][0] != "ok"
    if kind in ("short file", "long file"):
        assert got[0][0][0] == "CorruptBlockError" and "file size" in got[0][0][1][0]
        assert got[0][0][1][3] is not None  # the identity of the file found corrupt
    assert _open_fds() == fds_before


class ShortReads(Reference):
    """preadv that stops after 1000 bytes of any read at or past the given offset (a file cut
    under the reader)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def preadv(self, fd: int, buffers: Any, offset: int) -> int:
        if offset >= self.at:
            return (
                super().preadv(fd, [memoryview(buffers[0])[:1000]], offset)
                if offset == self.at
                else 0
            )
        return super().preadv(fd, buffers, offset)


def test_a_short_group_is_a_corrupt_block_naming_the_group(tmp_path: Path) -> None:
    """The reference reads group by group: a read cut short names the group's offset and size
    (the words the native call gives for the same cut: its groups are the same)."""
    segments, file_nbytes, _ = _layout("one segment")
    path = tmp_path / "block"
    path.write_bytes(bytes(file_nbytes))
    outcome, _, _ = _read_hashed(
        ShortReads(HEADER + 8 * CHUNK), str(path), segments, file_nbytes, 8 * CHUNK
    )
    assert outcome[0] == "CorruptBlockError"
    assert outcome[1][0] == f"short read at {HEADER + 8 * CHUNK}: expected {8 * CHUNK}, got 1000"


def test_other_algorithms_take_the_reference(tmp_path: Path) -> None:
    """crc32c (no native hash): NativeFileIO computes the sums with the reference's calls."""
    segments, file_nbytes, joined = _layout("pieces")
    count = len(joined) // CHUNK
    out = np.zeros(count, dtype=np.uint64)
    hashing = Hashing(1, len(segments) - 1, CRC32C, CHUNK, 2 * CHUNK, out)
    os.close(
        NativeFileIO().write_new_hashed(
            str(tmp_path / "f"), NEW, 0o600, segments, file_nbytes, hashing
        )
    )
    assert out.tolist() == chunk_sums(CRC32C, joined.data, CHUNK, count).tolist()


def test_a_corrupt_file_is_not_hidden_by_the_sums(native: FileIO, tmp_path: Path) -> None:
    """The sums are of the bytes read, not of the bytes written: a flipped byte in the middle
    group and in the last group shows in exactly those chunks' values."""
    segments, file_nbytes, joined = _layout("one segment")
    path = tmp_path / "block"
    image = bytearray(file_nbytes)
    for offset, data in segments:
        image[offset : offset + len(data)] = data
    clean = chunk_sums(XXH3_64, joined.data, CHUNK, 40).tolist()
    for chunk in (17, 39):
        damaged = bytearray(image)
        damaged[HEADER + chunk * CHUNK + 5] ^= 0x40
        path.write_bytes(damaged)
        for fio in (native, Reference()):
            _, _, sums = _read_hashed(fio, str(path), segments, file_nbytes, 4 * CHUNK)
            assert [i for i in range(40) if sums[i] != clean[i]] == [chunk]


def test_corrupt_block_error_is_raised_with_identity(tmp_path: Path) -> None:
    """(A short file read through the reference carries its identity, as read_regular's.)"""
    segments, file_nbytes, _ = _layout("pieces")
    path = tmp_path / "short"
    path.write_bytes(bytes(10))
    hashing = Hashing(1, len(segments) - 1, XXH3_64, CHUNK, CHUNK, np.zeros(20, np.uint64))
    into = [(o, memoryview(bytearray(len(d)))) for o, d in segments]
    with pytest.raises(CorruptBlockError) as caught:
        Reference().read_regular_hashed(str(path), os.O_RDONLY, into, file_nbytes, hashing)
    st = path.stat()
    assert caught.value.file_id == (st.st_dev, st.st_ino)


def test_the_hash_function_comes_only_from_the_xxh3_binding(native: FileIO, tmp_path: Path) -> None:
    """The native calls hash with the capsule kvstore._native._xxh3batch.function() hands out (the
    self-tested binding); any other object is refused before a file is created."""
    import importlib  # noqa: PLC0415 - the C modules, by name as kvstore imports them

    from kvstore.checksum import native_xxh3_capsule  # noqa: PLC0415

    proto: Any = importlib.import_module("kvstore._native._fileproto")
    capsule = native_xxh3_capsule()
    assert "kvstore._native._xxh3batch.XXH3_64bits" in repr(capsule)
    segments = [(0, memoryview(bytes(CHUNK)))]
    sums = np.zeros(1, dtype=np.uint64)
    path = str(tmp_path / "f")
    for wrong in (None, object(), sums):
        with pytest.raises((TypeError, ValueError)):
            proto.write_new_hashed(
                path, NEW, 0o600, segments, 1, CHUNK, 0, 1, CHUNK, CHUNK, sums, wrong
            )
        assert not os.path.exists(path)
    os.close(
        proto.write_new_hashed(
            path, NEW, 0o600, segments, 1, CHUNK, 0, 1, CHUNK, CHUNK, sums, capsule
        )
    )
    assert sums.tolist() == chunk_sums(XXH3_64, memoryview(bytes(CHUNK)), CHUNK, 1).tolist()

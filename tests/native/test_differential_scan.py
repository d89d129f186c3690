"""The offline tools' many-entry calls against their references: read_files (differential,
tests/native/differential.py) and list_dir_step / dir_entries (both sides on the same
directories, whose entries, inodes and times they must report alike), with hostile arguments
and hostile trees."""

from __future__ import annotations

import os
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvstore.io import dirlist
from kvstore.io.fileproto import native_fileproto
from tests.native.differential import BAD_SEQUENCES, CONTAINERS, differential
from tests.native.hostile import ClearingPath, expect_ok, expect_raised
from tests.native.isolated import run_isolated
from tests.native.values import (
    DIFF,
    Mem,
    PathArg,
    _fio,
    base_layout,
    build_mem,
    entries,
    layouts,
    mems,
    path_args,
    perturbed,
    resolve,
    scalar,
)

pytestmark = pytest.mark.usefixtures("both_extensions_bound")

# -- read_files ------------------------------------------------------------------------------

READ_NAMES = ("t0", "t1", "t2", "t2", "a", "missing", "sub", "linkdir")


@st.composite
def read_files_cases(draw: st.DrawFn) -> dict[str, Any]:
    hostile = perturbed(draw, ("paths", "file_nbytes", "rows", "targets"))
    size = draw(st.sampled_from((1, 7, 48)))
    layout = draw(layouts(("a", "b")))
    for i in range(3):
        if "targets" in hostile:
            layout[f"t{i}"] = draw(entries(st.sampled_from((size, size, size - 1, size + 1, 0))))
        else:
            layout[f"t{i}"] = ("file", size, 10 + i)
    count = draw(st.integers(0, 5))
    paths = [
        draw(path_args(READ_NAMES, "paths" in hostile and draw(st.booleans())))
        for _ in range(count)
    ]
    container = draw(st.sampled_from((*CONTAINERS, "bad"))) if "paths" in hostile else "list"
    # Rows for every file, a few bytes more, or one byte too few.
    rows_nbytes = max(0, count * size + draw(st.sampled_from((0, 0, 0, 3, -1))))
    return {
        "layout": layout,
        "paths": paths,
        "container": container,
        "bad": draw(st.sampled_from(BAD_SEQUENCES)),
        "file_nbytes": scalar(draw, size, "file_nbytes" in hostile),
        "rows": draw(mems(rows_nbytes, writable=True, hostile="rows" in hostile)),
    }


# The rows given as a 2-D array (one row per file), as the batch check gives them.
TWO_D_ROWS = {
    "layout": base_layout(t0=("file", 8, 1), t1=("file", 8, 2), t2=("fifo",)),
    "paths": [PathArg("t0"), PathArg("t2"), PathArg("t1"), PathArg("linkdir")],
    "container": "list",
    "bad": None,
    "file_nbytes": 8,
    "rows": Mem("fortran", 32, 3),
}


@DIFF
@given(case=read_files_cases())
@example(case=TWO_D_ROWS)
def test_read_files_matches_its_reference(case: dict[str, Any]) -> None:
    """FileIO().read_files (native) and the reference agree: the same outcome per file (1
    read whole; -ENOENT, -ELOOP for a link, -ENOTDIR, -ENAMETOOLONG; -EBADMSG for a file of
    another size, a directory, a FIFO or a socket), the same bytes in the rows, no mtime
    touched; the same exception type for a size that is not a positive integer, paths that
    are not a sequence of paths (a NUL, a wrong type), rows that are not a writable
    contiguous buffer or too small."""
    rows, backing = build_mem(case["rows"])

    def make(side: str, root: str) -> tuple[Callable[[], object], list[object | None], None]:
        fio = _fio(side)
        built = [resolve(p, root) for p in case["paths"]]
        paths: Any = built
        if case["container"] == "tuple":
            paths = tuple(built)
        elif case["container"] == "generator":
            paths = (p for p in built)
        elif case["container"] == "bad":
            paths = case["bad"]
        return lambda: fio.read_files(paths, case["file_nbytes"], rows), [backing], None

    differential(case["layout"], make)


@pytest.mark.parametrize("side", ["native", "reference"])
def test_read_files_snapshots_its_paths(side: str, tmp_path: Path) -> None:
    """read_files([evil, file]) where evil's __fspath__ clears the list reads both names as
    they were: [-ENOENT, 1], the second row filled."""
    (tmp_path / "there").write_bytes(b"abcd")
    paths: list[Any] = []
    paths.extend([ClearingPath(tmp_path / "missing", paths), str(tmp_path / "there")])
    rows = bytearray(8)

    def call() -> object:
        return [_fio(side).read_files(paths, 4, rows), bytes(rows[4:]).decode()]

    assert expect_ok(run_isolated(call)) == [[-2, 1], "abcd"]


# -- list_dir_step / dir_entries -------------------------------------------------------------


def _native_listing(directory: Path, nbytes: int = dirlist.STEP_NBYTES) -> list[Any]:
    """Every step of list_dir_step over ``directory``, concatenated."""
    native = native_fileproto()
    assert native is not None
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    out: list[Any] = []
    try:
        while (step := native.list_dir_step(fd, nbytes, None)) is not None:
            listed, failure = step
            assert failure is None
            out += [(name, dirlist.ListedStat(*fields)) for name, fields in listed]
    finally:
        os.close(fd)
    return out


def _listing(directory: Path, native: bool) -> list[tuple[str, dirlist.ListedStat]]:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        entries_of = dirlist.dir_entries if native else dirlist.reference_dir_entries
        return list(entries_of(fd))
    finally:
        os.close(fd)


def _hostile_tree(root: Path) -> None:
    """Every kind of entry, odd names, times outside int64 nanoseconds."""
    (root / "file").write_bytes(b"x" * 5)
    (root / "empty").write_bytes(b"")
    (root / "dir").mkdir()
    (root / "dir" / "inner").write_bytes(b"y")
    os.symlink("file", root / "link")
    os.symlink("nowhere", root / "dangling")
    os.symlink("dir", root / "dirlink")
    os.mkfifo(root / "fifo")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(root / "sock"))
    os.link(root / "file", root / "hardlink")
    (root / ("n" * 255)).write_bytes(b"long")
    os.mkdir(os.path.join(os.fsencode(root), b"bad\xffname"))
    (root / "unread").write_bytes(b"z")
    (root / "unread").chmod(0)
    (root / "future").write_bytes(b"f")
    os.utime(root / "future", ns=(10**19, 10**19))  # year 2286: past int64 nanoseconds
    (root / "past").write_bytes(b"p")
    os.utime(root / "past", ns=(-(10**19), -(10**19)))  # year 1653


def test_dir_entries_match_the_reference_on_a_hostile_tree(tmp_path: Path) -> None:
    """dir_entries (native) gives the reference's entries in the same order, each with the
    same lstat fields (links not followed, a FIFO never opened, a hard link's count, an
    undecodable name surrogate-escaped, times beyond int64 nanoseconds exact)."""
    _hostile_tree(tmp_path)
    native, reference = _listing(tmp_path, True), _listing(tmp_path, False)
    assert native == reference
    names = {name for name, _ in native}
    assert "bad\udcffname" in names and "n" * 255 in names and len(names) == 14
    by_name = dict(native)
    assert stat.S_ISLNK(by_name["link"].st_mode) and stat.S_ISFIFO(by_name["fifo"].st_mode)
    assert by_name["future"].st_mtime_ns == 10**19
    # The file system clamps what it cannot hold (ext4: 1901): what lstat says, either way.
    assert by_name["past"].st_mtime_ns == os.lstat(tmp_path / "past").st_mtime_ns
    assert by_name["file"].st_nlink == 2


@pytest.mark.parametrize("nbytes", [4096, 5000, 65536])
def test_list_dir_step_of_a_big_directory_over_many_steps(tmp_path: Path, nbytes: int) -> None:
    """3,000 entries with names of 1 to 255 bytes, listed in steps of a small buffer: every
    entry once, as the reference lists them."""
    for i in range(3000):
        (tmp_path / f"{i:04d}{'x' * (i % 252)}").write_bytes(b"")
    steps = _native_listing(tmp_path, nbytes)
    assert steps == _listing(tmp_path, False)
    assert len(steps) == 3000


def test_dir_entries_of_an_empty_directory(tmp_path: Path) -> None:
    assert _listing(tmp_path, True) == [] == _listing(tmp_path, False)


@pytest.mark.parametrize("native", [True, False])
def test_an_entry_that_cannot_be_statted_raises(native: bool, tmp_path: Path) -> None:
    """A directory that may be read but not searched (mode 0o444, not its owner as root):
    its first entry's lstat fails, and both sides raise PermissionError there, after the
    entries before it (none)."""
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "one").write_bytes(b"1")
    listed.chmod(0o444)
    fd = os.open(listed, os.O_RDONLY | os.O_DIRECTORY)

    def call() -> object:
        if os.geteuid() == 0:
            os.setgid(65534)
            os.setuid(65534)  # no longer root: the mode counts
        entries_of = dirlist.dir_entries if native else dirlist.reference_dir_entries
        return [name for name, _ in entries_of(fd)]

    try:
        expect_raised(run_isolated(call), PermissionError)
    finally:
        os.close(fd)
        listed.chmod(0o755)


@pytest.mark.parametrize("native", [True, False])
def test_listing_what_is_not_a_directory_raises(native: bool, tmp_path: Path) -> None:
    """A descriptor of a file: NotADirectoryError; a closed one: EBADF, on both sides."""
    (tmp_path / "f").write_bytes(b"")
    entries_of = dirlist.dir_entries if native else dirlist.reference_dir_entries
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        expect_raised(run_isolated(lambda: list(entries_of(fd))), NotADirectoryError)
    finally:
        os.close(fd)
    outcome = run_isolated(lambda: list(entries_of(fd)))
    expect_raised(outcome, OSError)
    assert outcome.errno == 9


ALIGNED = np.zeros(2, np.float64)
BAD_STEP_ARGS: list[tuple[object, object, object, type[BaseException]]] = [
    (-1, 65536, None, ValueError),
    ("3", 65536, None, TypeError),
    (1.0, 65536, None, TypeError),
    (2**31, 65536, None, OverflowError),
    (None, 65536, None, TypeError),
    (0, 4095, None, ValueError),
    (0, (16 << 20) + 1, None, ValueError),
    (0, 0, None, ValueError),
    (0, -(2**63), None, ValueError),
    (0, 2**63, None, OverflowError),
    (0, 4096.0, None, TypeError),
    (0, 65536, b"12345678", TypeError),
    (0, 65536, "slot", TypeError),
    (0, 65536, 0, TypeError),
    (0, 65536, bytearray(7), ValueError),
    (0, 65536, ALIGNED.view(np.uint8)[1:9], ValueError),
    (0, 65536, ALIGNED.view(np.uint8)[::2], TypeError),
]


@pytest.mark.parametrize(("fd", "nbytes", "beat", "raised"), BAD_STEP_ARGS)
def test_list_dir_step_refuses_bad_arguments(
    fd: object, nbytes: object, beat: object, raised: type, tmp_path: Path
) -> None:
    """A descriptor that is not a non-negative C int, a buffer size outside 4096..16 MiB, a
    beat slot that is not None or 8 writable aligned bytes: the error named, nothing read, no
    crash (descriptor 0 stands for any: the checks come first)."""
    native = native_fileproto()
    assert native is not None
    outcome = run_isolated(lambda: native.list_dir_step(fd, nbytes, beat))  # type: ignore[arg-type]
    expect_raised(outcome, raised)


@pytest.mark.parametrize("beat", [b"12345678", bytearray(7), ALIGNED.view(np.uint8)[1:9], 5])
def test_read_files_refuses_a_bad_beat_slot(beat: object, tmp_path: Path) -> None:
    """read_files' beat slot is checked as list_dir_step's, before any file is opened."""
    native = native_fileproto()
    assert native is not None
    (tmp_path / "f").write_bytes(b"ab")
    rows = bytearray(2)
    outcome = run_isolated(lambda: native.read_files([str(tmp_path / "f")], 2, rows, beat))
    expect_raised(outcome, TypeError if isinstance(beat, (bytes, int)) else ValueError)
    assert rows == bytearray(2)


def test_the_native_calls_beat_as_they_go(tmp_path: Path) -> None:
    """Both calls store CLOCK_MONOTONIC seconds (time.monotonic()'s clock) in the beat slot:
    the hung-mount watchdog hears a slow mount answer entry by entry."""
    native = native_fileproto()
    assert native is not None
    (tmp_path / "f").write_bytes(b"ab")
    slot = np.zeros(1, np.float64)
    before = time.monotonic()
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert native.list_dir_step(fd, 4096, slot) is not None
    finally:
        os.close(fd)
    assert before <= slot[0] <= time.monotonic()
    slot[0] = 0.0
    before = time.monotonic()
    assert native.read_files([str(tmp_path / "f")], 2, bytearray(2), slot) == [1]
    assert before <= slot[0] <= time.monotonic()

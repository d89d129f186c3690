"""Differential tests (tests/native/differential.py) of the file reads and names (read_regular,
read_regular_hashed, sync_and_rename, exists_many)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tests.native.differential import (
    BAD_SEQUENCES,
    CONTAINERS,
    HASHED_FIELDS,
    MIXED_NUMPY_HASHING,
    TOUCH_TIMES,
    TWO_D_SUMS_HASHING,
    SegSpec,
    _hashing,
    _identity,
    _raised,
    build_segments,
    data_end,
    differential,
    hashed_cases,
    segment_specs,
)
from tests.native.values import (
    DIFF,
    NUMPY_INTS,
    O_DIRECT,
    O_NOATIME,
    O_PATH,
    Mem,
    PathArg,
    RaisingBool,
    _fio,
    base_layout,
    entries,
    hostile_int,
    layouts,
    path_args,
    perturbed,
    resolve,
    scalar,
)

pytestmark = pytest.mark.usefixtures("both_extensions_bound")

# -- read_regular / read_regular_hashed ------------------------------------------------------

READ_FLAGS = (
    os.O_RDONLY,
    os.O_RDONLY,
    os.O_RDONLY,
    os.O_RDONLY | O_DIRECT,
    os.O_RDWR,
    os.O_WRONLY,
    os.O_RDONLY | os.O_CREAT,
    O_PATH,
    os.O_RDONLY | O_NOATIME,
    os.O_RDONLY | os.O_TRUNC,
)
TRAILER_FLAGS: tuple[object, ...] = (
    False,
    True,
    0,
    1,
    None,
    "",
    "yes",
    np.bool_(True),
    np.array([True, False]),
    RaisingBool(),
)


@st.composite
def read_cases(draw: st.DrawFn, hashed: bool) -> dict[str, Any]:
    fields = (
        "path",
        "flags",
        "segments",
        "file_nbytes",
        "allow_trailer",
        "touch",
        "target",
    )
    hostile = perturbed(draw, fields + (HASHED_FIELDS if hashed else ()))
    h = draw(hashed_cases(writable=True, hostile=hostile)) if hashed else None
    segments = (
        h.segments
        if h is not None
        else draw(segment_specs(writable=True, hostile="segments" in hostile, direct=True))
    )
    size = data_end(segments)
    file_nbytes = size + draw(st.sampled_from((0, 0, 0, 0, 5)))
    # The file read: of the size expected, or a byte short or long; or not a file at all.
    actual = file_nbytes + draw(st.sampled_from((0, 0, 0, 0, -1, 1)))
    layout = draw(layouts(("a", "b", "c")))
    if "target" in hostile:
        layout["t"] = draw(entries(st.just(max(actual, 0))))
    else:
        layout["t"] = ("file", max(actual, 0), 77)
    return {
        "layout": layout,
        "path": draw(path_args(("t", "t", "t", "a", "missing"), "path" in hostile)),
        "flags": (draw(hostile_int()) if "flags" in hostile else draw(st.sampled_from(READ_FLAGS))),
        "segments": segments,
        "file_nbytes": scalar(draw, file_nbytes, "file_nbytes" in hostile),
        "allow_trailer": (
            draw(st.sampled_from(TRAILER_FLAGS)) if "allow_trailer" in hostile else False
        ),
        "touch": scalar(draw, draw(st.sampled_from(TOUCH_TIMES)), "touch" in hostile),
        "hashing": h,
    }


def _identity_report(value: object, path: object) -> object:
    """A read's (dev, ino), as whether it names the file ``path`` names."""
    if isinstance(value, tuple) and len(value) == 2:
        return {"identity_of_path": list(value) == _identity(path)}
    return repr(value)


def _run_read(case: dict[str, Any]) -> None:
    segments, backings = build_segments(case["segments"])
    hashing, sums_backing = (
        _hashing(case["hashing"]) if case["hashing"] is not None else (None, None)
    )
    memory = [*backings, sums_backing]

    def make(side: str, root: str) -> tuple[Callable[[], object], list[object | None], object]:
        fio = _fio(side)
        path = resolve(case["path"], root)
        flags, nbytes, touch = case["flags"], case["file_nbytes"], case["touch"]

        def call() -> object:
            if hashing is None:
                got = fio.read_regular(
                    path,  # type: ignore[arg-type]
                    flags,
                    segments,  # type: ignore[arg-type]
                    nbytes,
                    case["allow_trailer"],
                    touch,
                )
            else:
                got = fio.read_regular_hashed(path, flags, segments, nbytes, hashing, touch)  # type: ignore[arg-type]
            return _identity_report(got, path)

        return call, memory, path

    differential(case["layout"], make)


# Found by this test: a read with O_CREAT of a missing name creates the file; the native call
# passes open(2) no mode (permissions 0 here, undefined in general), the reference 0o600.
CREATING_READ = {
    "layout": base_layout(),
    "path": PathArg("missing"),
    "flags": os.O_RDONLY | os.O_CREAT,
    "segments": ("seq", "list", []),
    "file_nbytes": 0,
    "allow_trailer": False,
    "touch": 0,
    "hashing": None,
}
# Found by this test: the native call takes allow_trailer's truth value first (PyArg "p"), so
# one that cannot be taken is ValueError; the reference looks at it only for a file of another
# size, and returns here.
AMBIGUOUS_TRAILER = {
    "layout": base_layout(t=("file", 3, 77)),
    "path": PathArg("t"),
    "flags": os.O_RDONLY,
    "segments": ("seq", "list", [("pair", 0, Mem("bytearray", 3, 1))]),
    "file_nbytes": 3,
    "allow_trailer": np.array([True, False]),
    "touch": 0,
    "hashing": None,
}


@DIFF
@given(case=read_cases(hashed=False))
@example(case=CREATING_READ)
@example(case=AMBIGUOUS_TRAILER)
def test_read_regular_matches_its_reference(case: dict[str, Any]) -> None:
    """FileIO().read_regular (native) and the reference agree: the same identity returned,
    or the same exception type and errno (a CorruptBlockError carrying the same file's
    identity) for files of the size expected, short, long (with and without a trailer
    allowed), a directory, a FIFO, a socket, a link, missing; the same bytes landed in every
    buffer (segments overlapping, with gaps, past the end, beyond IOV_MAX, aligned for
    O_DIRECT); the same mtime touched or not; the same tree for any flags (O_CREAT, O_TRUNC,
    O_PATH, O_DIRECT...) and hostile integers, buffers and paths."""
    _run_read(case)


EIGHT_BYTES_READ: SegSpec = ("seq", "list", [("pair", 0, Mem("bytearray", 8, 1))])
TWO_D_SUMS_READ = {
    **AMBIGUOUS_TRAILER,
    "layout": base_layout(t=("file", 8, 77)),
    "segments": EIGHT_BYTES_READ,
    "file_nbytes": 8,
    "allow_trailer": False,
    "hashing": replace(TWO_D_SUMS_HASHING, segments=EIGHT_BYTES_READ),
}


MIXED_NUMPY_READ = {
    **TWO_D_SUMS_READ,
    "hashing": replace(MIXED_NUMPY_HASHING, segments=EIGHT_BYTES_READ),
}


@DIFF
@given(case=read_cases(hashed=True))
@example(case=TWO_D_SUMS_READ)
@example(case=MIXED_NUMPY_READ)
def test_read_regular_hashed_matches_its_reference(case: dict[str, Any]) -> None:
    """FileIO().read_regular_hashed (native) and the reference agree as read_regular does,
    and on the checksums of the hashed range: the same values in ``sums`` (none written
    past a short read), the same refusal of bad hashed geometry or sums."""
    _run_read(case)


# -- sync_and_rename -------------------------------------------------------------------------

RENAME_NAMES = ("a", "b", "c", "sub/d", "new", "gone/n", "linkdir/n")


@st.composite
def rename_cases(draw: st.DrawFn) -> dict[str, Any]:
    hostile = perturbed(draw, ("tmp", "final", "fd"))
    fd: tuple[str, object] = draw(
        st.sampled_from((("none", None), ("open", None), ("open", None), ("closed", None)))
    )
    if "fd" in hostile:
        fd = ("value", draw(hostile_int()))
    elif fd[0] == "open" and draw(st.booleans()):
        fd = ("open", draw(st.sampled_from(NUMPY_INTS)))
    return {
        "layout": draw(layouts()),
        "tmp": draw(path_args(RENAME_NAMES, "tmp" in hostile)),
        "final": draw(path_args(RENAME_NAMES, "final" in hostile)),
        "fd": fd,
    }


# Found by this test: a descriptor given as a numpy integer is synced and the file renamed by
# the native call; the reference passes it on to os.fdatasync, which raises TypeError.
NUMPY_FD_RENAME = {
    "layout": base_layout(a=("file", 3, 1)),
    "tmp": PathArg("a"),
    "final": PathArg("new"),
    "fd": ("open", np.int64),
}


@DIFF
@given(case=rename_cases())
@example(case=NUMPY_FD_RENAME)
def test_sync_and_rename_matches_its_reference(case: dict[str, Any]) -> None:
    """FileIO().sync_and_rename (native) and the reference agree: the same outcome (None, or
    the same exception type and errno: the target taken by a file, a directory, a link, a
    FIFO; the source missing; a bad descriptor; a NUL or wrong type in a name) and the same
    tree, for descriptors None, open (an int or a numpy integer), closed, or hostile."""

    def make(side: str, root: str) -> tuple[Callable[[], object], list[object | None], None]:
        fio = _fio(side)
        tmp, final = resolve(case["tmp"], root), resolve(case["final"], root)
        how, extra = case["fd"]

        def call() -> object:
            fd: Any = extra if how == "value" else None
            if how == "open":
                try:  # the source itself when it can be opened, else the directory
                    fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # type: ignore[arg-type]
                except (OSError, TypeError, ValueError):
                    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
                if extra is not None:
                    fd = extra(fd)
            elif how == "closed":
                fd = 987
            fio.sync_and_rename(fd, tmp, final)  # type: ignore[arg-type]
            return None

        return call, [], None

    differential(case["layout"], make)


# -- exists_many -----------------------------------------------------------------------------


@st.composite
def exists_cases(draw: st.DrawFn) -> dict[str, Any]:
    count = draw(st.integers(0, 6))
    paths = [
        draw(path_args(("a", "b", "c", "sub/d", "sub", "linkdir", "nope"), draw(st.booleans())))
        for _ in range(count)
    ]
    container = draw(st.sampled_from((*CONTAINERS, "bad")))
    return {
        "layout": draw(layouts()),
        "paths": paths,
        "container": container,
        "bad": draw(st.sampled_from(BAD_SEQUENCES)),
    }


def _probe(result: object) -> object:
    if isinstance(result, bool):
        return result
    if isinstance(result, BaseException):
        return _raised(result, None)
    return repr(result)


@DIFF
@given(case=exists_cases())
def test_exists_many_matches_its_reference(case: dict[str, Any]) -> None:
    """FileIO().exists_many (native) and the reference agree on every name: True for a
    regular file, False for a missing name, the same OSError type and errno for anything
    else (a directory, a link, a FIFO, a socket, a name below a file, too long); the same
    exception type for a NUL, a wrong type or no sequence at all."""

    def make(side: str, root: str) -> tuple[Callable[[], object], list[object | None], None]:
        fio = _fio(side)
        built: list[object] = [resolve(p, root) for p in case["paths"]]
        container = case["container"]
        paths: Any = built
        if container == "tuple":
            paths = tuple(built)
        elif container == "generator":
            paths = (p for p in built)
        elif container == "bad":
            paths = case["bad"]

        def call() -> object:
            return [_probe(r) for r in fio.exists_many(paths)]

        return call, [], None

    differential(case["layout"], make)

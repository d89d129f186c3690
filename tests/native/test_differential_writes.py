"""Differential tests (tests/native/differential.py) of the checksum batch, first_unaligned
and the file writes (write_new, write_new_hashed)."""

from __future__ import annotations

import fcntl
import importlib
import os
import stat
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvstore.checksum import reference_batch_sums
from kvstore.io.fileproto import native_fileproto
from kvstore.io.host import first_unaligned_reference
from tests.native.differential import (
    BAD_SEQUENCES,
    CONTAINERS,
    HASHED_FIELDS,
    MIXED_NUMPY_HASHING,
    MODES,
    SUMS_KINDS,
    TWO_D_SUMS_HASHING,
    SegSpec,
    _break_one,
    _hashing,
    _identity,
    build_segments,
    build_sums,
    data_end,
    differential,
    hashed_cases,
    no_layout,
    segment_count,
    segment_specs,
)
from tests.native.values import (
    _KINDS,
    DIFF,
    NEW,
    O_DIRECT,
    O_TMPFILE,
    Mem,
    PathArg,
    _fio,
    base_layout,
    build_mem,
    hostile_int,
    layouts,
    maybe_numpy,
    mem_kinds,
    mems,
    path_args,
    perturbed,
    resolve,
    scalar,
)

pytestmark = pytest.mark.usefixtures("both_extensions_bound")

# -- kvstore._native._xxh3batch.sums ---------------------------------------------------------

OUT_KINDS = (*SUMS_KINDS, "u32", "f64", "bytearray", "bytes", "none", "mv_Q", "mv_q")


def build_out(kind: str, count: int) -> tuple[object, object | None]:
    """``sums``' ``out``: the kinds of :func:`build_sums` and a few more refused ones."""
    n = max(count, 0)
    if kind == "u32":
        a = np.zeros(2 * n, np.uint32)
        return a, a
    if kind == "f64":
        a = np.zeros(n, np.float64)
        return a, a
    if kind == "bytearray":
        raw = bytearray(8 * n)
        return raw, raw
    if kind == "bytes":
        b = bytes(8 * n)
        return b, b
    if kind == "none":
        return None, None
    if kind in ("mv_Q", "mv_q"):
        raw = bytearray(8 * n)
        return memoryview(raw).cast("Q" if kind == "mv_Q" else "q"), raw
    return build_sums(kind, count)


@st.composite
def xxh3_cases(draw: st.DrawFn) -> dict[str, Any]:
    hostile = perturbed(draw, ("data", "chunk", "count", "stride", "out", "size"))
    chunk = draw(st.integers(0, 24))
    count = draw(st.integers(0, 6))
    stride = chunk + draw(st.integers(0, 16))
    needed = (count - 1) * stride + chunk if count else 0
    nbytes = needed + draw(st.sampled_from((0, 0, 1, 7)))
    if "size" in hostile:
        nbytes = max(needed - draw(st.integers(1, 8)), 0)
    data = draw(mems(nbytes, writable=False, hostile="data" in hostile))
    out_count = count + draw(st.sampled_from((0, 0, 2)))
    out_kind = "u64"
    if "out" in hostile:
        out_kind = draw(st.sampled_from(OUT_KINDS))
        out_count = max(count + draw(st.sampled_from((-1, 0, 1))), 0)
    return {
        "data": data,
        "chunk": scalar(draw, chunk, "chunk" in hostile),
        "count": scalar(draw, count, "count" in hostile),
        "stride": scalar(draw, stride, "stride" in hostile),
        "out": (out_kind, out_count),
    }


# Found by this test: data a 1-byte strided memoryview (contiguous: one element), chunks of
# 0 bytes. The native call hashes b"" into out[0]; the reference's 0-byte slice of the view
# is not contiguous, and xxhash raises BufferError.
EMPTY_CHUNK_OF_STRIDED_VIEW = {
    "data": Mem("strided_mv", 1, 1),
    "chunk": 0,
    "count": 1,
    "stride": 0,
    "out": ("u64", 1),
}


@DIFF
@given(case=xxh3_cases())
@example(case=EMPTY_CHUNK_OF_STRIDED_VIEW)
def test_xxh3_batch_sums_matches_its_reference(case: dict[str, Any]) -> None:
    """kvstore._native._xxh3batch.sums and reference_batch_sums agree for every input: the same
    exception type for negative, overflowing, numpy or wrongly typed sizes, data too short,
    data or out that is no buffer, not contiguous, read-only, misaligned, of another item
    type or byte order, or too small; the same uint64 values in ``out`` (and nothing else
    written) for valid ones."""
    native_sums = importlib.import_module("kvstore._native._xxh3batch").sums
    data, data_backing = build_mem(case["data"])
    out, out_backing = build_out(*case["out"])
    args = (data, case["chunk"], case["count"], case["stride"], out)

    def make(side: str, root: str) -> tuple[Callable[[], object], list[object | None], None]:
        fn = native_sums if side == "native" else reference_batch_sums
        return lambda: fn(*args), [data_backing, out_backing], None

    differential(no_layout(), make)


# -- first_unaligned -------------------------------------------------------------------------


@st.composite
def unaligned_cases(draw: st.DrawFn) -> dict[str, Any]:
    hostile = perturbed(draw, ("segments", "alignment"))
    alignment = draw(st.sampled_from((1, 2, 8, 512, 4096)))
    count = draw(st.integers(0, 4))
    items: list[tuple[Any, ...]] = []
    for i in range(count):
        nbytes = draw(st.sampled_from((0, 1, 8, 512, 4096, 4097, 8192)))
        kind = draw(st.one_of(st.just("aligned"), mem_kinds(writable=False)))
        items.append(("pair", draw(maybe_numpy(4096 * i)), Mem(kind, nbytes, i)))
    spec: SegSpec = ("seq", draw(st.sampled_from(CONTAINERS)), items)
    if "segments" in hostile:
        if draw(st.integers(0, 3)) == 0:
            spec = ("bad", draw(st.sampled_from(BAD_SEQUENCES)))
        else:
            _break_one(draw, items, writable=False)
    return {"segments": spec, "alignment": scalar(draw, alignment, "alignment" in hostile)}


@DIFF
@given(case=unaligned_cases())
def test_first_unaligned_matches_its_reference(case: dict[str, Any]) -> None:
    """kvstore._native._fileproto.first_unaligned and first_unaligned_reference agree: the same
    (index, address aligned) for buffers aligned or not in address and length (empty ones,
    4 KiB-aligned ones, numpy offsets), the same exception type for a bad alignment or bad
    segments."""
    native = native_fileproto()
    assert native is not None
    segments, backings = build_segments(case["segments"])
    alignment = case["alignment"]

    def make(side: str, root: str) -> tuple[Callable[[], object], list[object | None], None]:
        fn = native.first_unaligned if side == "native" else first_unaligned_reference

        def call() -> object:
            index, aligned = fn(segments, alignment)  # type: ignore[arg-type]
            return [index, aligned]

        return call, backings, None

    differential(no_layout(), make)


# -- write_new / write_new_hashed ------------------------------------------------------------

WRITE_FLAGS = (
    NEW,
    NEW,
    NEW,
    NEW,
    NEW,
    NEW | O_DIRECT,
    os.O_WRONLY | os.O_CREAT,
    os.O_RDWR | os.O_CREAT | os.O_TRUNC,
    os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    os.O_RDONLY | os.O_CREAT | os.O_EXCL,
    O_TMPFILE | os.O_WRONLY,
    os.O_WRONLY,
)
WRITE_NAMES = ("new", "new", "a", "b", "sub/d", "linkdir/n", "gone/n")


def _fd_report(fd: int, path: object) -> dict[str, Any]:
    """What a returned descriptor says (closed here): an open file, whether it is the file
    the path names, its kind and status flags (O_DIRECT cleared or not)."""
    try:
        st_ = os.fstat(fd)
        return {
            "same_file": [st_.st_dev, st_.st_ino] == _identity(path),
            "kind": _KINDS.get(stat.S_IFMT(st_.st_mode), "other"),
            "status_flags": fcntl.fcntl(fd, fcntl.F_GETFL),
        }
    finally:
        os.close(fd)


@st.composite
def write_cases(draw: st.DrawFn, hashed: bool) -> dict[str, Any]:
    fields = ("path", "flags", "mode", "file_nbytes", "buffered_from", "segments")
    hostile = perturbed(draw, fields + (HASHED_FIELDS if hashed else ()))
    h = draw(hashed_cases(writable=False, hostile=hostile)) if hashed else None
    segments = (
        h.segments
        if h is not None
        else draw(segment_specs(writable=False, hostile="segments" in hostile, direct=True))
    )
    flags = draw(st.sampled_from(WRITE_FLAGS))
    count = segment_count(segments)
    buffered_from: object = draw(st.one_of(st.none(), st.integers(0, count)))
    if "buffered_from" in hostile:
        buffered_from = scalar(draw, count, True)
    file_nbytes = max(data_end(segments) + draw(st.sampled_from((0, 0, 0, 1, -1, 9))), 0)
    return {
        "layout": draw(layouts()),
        "path": draw(path_args(WRITE_NAMES, "path" in hostile)),
        "flags": draw(hostile_int()) if "flags" in hostile else draw(maybe_numpy(flags)),
        "mode": scalar(draw, draw(st.sampled_from(MODES)), "mode" in hostile),
        "segments": segments,
        "file_nbytes": scalar(draw, file_nbytes, "file_nbytes" in hostile),
        "buffered_from": buffered_from,
        "hashing": h,
    }


def _run_write(case: dict[str, Any]) -> None:
    segments, backings = build_segments(case["segments"])
    hashing, sums_backing = (
        _hashing(case["hashing"]) if case["hashing"] is not None else (None, None)
    )
    memory = [*backings, sums_backing]

    def make(side: str, root: str) -> tuple[Callable[[], object], list[object | None], object]:
        fio = _fio(side)
        path = resolve(case["path"], root)
        args = (path, case["flags"], case["mode"], segments, case["file_nbytes"])

        def call() -> object:
            if hashing is None:
                fd = fio.write_new(*args, buffered_from=case["buffered_from"])  # type: ignore[arg-type]
            else:
                fd = fio.write_new_hashed(*args, hashing, buffered_from=case["buffered_from"])  # type: ignore[arg-type]
            return _fd_report(fd, path)

        return call, memory, path

    differential(case["layout"], make)


# Found by this test: the reference refuses numpy uint64 flags where it clears O_DIRECT
# (FileIO.clear_direct: ``np.uint64 & ~O_DIRECT`` is OverflowError); the native call takes them.
NUMPY_FLAGS_WRITE = {
    "layout": base_layout(),
    "path": PathArg("new"),
    "flags": np.uint64(NEW | O_DIRECT),
    "mode": 0o600,
    "segments": ("seq", "list", [("pair", 0, Mem("bytes", 3, 1))]),
    "file_nbytes": 3,
    "buffered_from": 0,
    "hashing": None,
}


@DIFF
@given(case=write_cases(hashed=False))
@example(case=NUMPY_FLAGS_WRITE)
def test_write_new_matches_its_reference(case: dict[str, Any]) -> None:
    """FileIO().write_new (native) and the reference agree: the same outcome (a descriptor
    of the same kind of file with the same status flags, or the same exception type and
    errno), the same files (bytes, size, permissions) and untouched buffers, for segments
    empty, overlapping, with gaps, beyond IOV_MAX or 4 KiB-aligned for O_DIRECT (buffered
    from any segment), any flags and modes, sizes cut or extended, names that exist (a file,
    a directory, a link, a FIFO, a socket) or cannot (NUL, too long, below a file or a
    missing directory, unencodable), and hostile integers and buffers anywhere."""
    _run_write(case)


TWO_D_SUMS_WRITE = {
    **NUMPY_FLAGS_WRITE,
    "flags": NEW,
    "segments": TWO_D_SUMS_HASHING.segments,
    "file_nbytes": 8,
    "buffered_from": None,
    "hashing": TWO_D_SUMS_HASHING,
}


MIXED_NUMPY_WRITE = {**TWO_D_SUMS_WRITE, "hashing": MIXED_NUMPY_HASHING}


@DIFF
@given(case=write_cases(hashed=True))
@example(case=TWO_D_SUMS_WRITE)
@example(case=MIXED_NUMPY_WRITE)
def test_write_new_hashed_matches_its_reference(case: dict[str, Any]) -> None:
    """FileIO().write_new_hashed (native) and the reference agree as write_new does, and on
    the checksums: the same values in ``sums`` (none past what was hashed), the same refusal
    of a hashed range out of bounds or of partial chunks, of chunk or group sizes that are
    not positive, of sums misaligned, read-only, strided, too short or of another type (or
    the reference on both sides where NativeFileIO does not go native: int64 or
    big-endian sums, another algorithm)."""
    _run_write(case)

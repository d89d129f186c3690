"""Differential tests of kvstore's native calls against their Python references, over
hypothesis-generated arguments, valid and hostile alike.

kvstore/_native/xxh3batch.c and kvstore/_native/fileproto*.c promise the result of their Python
reference for every input: the same exception type (TypeError, ValueError, OverflowError, OSError
with the same errno), the same return values and per-block statuses, the same bytes written to files
and into the caller's buffers. Each test here draws a call's arguments (valid geometry mixed with
boundary integers, numpy integers, wrong types, odd buffers, odd paths and odd trees), runs the
native call and the reference each in a forked child (:func:`~tests.native.isolated.run_isolated`: a
crash is a failed example, never a dead runner), each in its own fresh directory holding the same
entries, and compares what the two children report (the value returned or the exception's type and
errno; every buffer of the call, byte for byte, after it) and the two trees after the call (names,
kinds, permissions, file bytes, whether an mtime was touched). The buffers are built once, before
both forks, so both calls see them at the same addresses (alignment decides O_DIRECT and refusals).

The native side is :class:`~kvstore.io.native_fileio.NativeFileIO` (and the two extension
functions called directly); the reference is :class:`~kvstore.io.fileio.FileIO`, which always
runs the Python reference, and :func:`~kvstore.checksum.reference_batch_sums`,
:func:`~kvstore.io.host.first_unaligned_reference`. Error words name different directories,
so only types and errnos are compared.

Hypothesis is derandomized and bounded (``KVTEST_DIFF_EXAMPLES`` examples per test, default
:data:`DEFAULT_EXAMPLES`; set it higher for a longer local soak). Each mismatch these tests
found is kept, minimized, as an explicit ``@example`` of its test (the constants in capitals
next to it say what differed), so it is checked on every run whatever the examples drawn.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st

from kvstore.checksum import CRC32C, XXH3_64
from kvstore.errors import BlockError
from kvstore.io.types import Hashing
from tests.native.isolated import Outcome, run_isolated
from tests.native.values import (
    IOV_MAX,
    OLD_NS,
    SIDES,
    Entry,
    Mem,
    _dump,
    _noise,
    build_mem,
    hostile_int,
    materialize,
    maybe_numpy,
    mems,
    scalar,
    tree,
)

# -- one differential example --------------------------------------------------------------


def _identity(path: object) -> list[int] | None:
    """(st_dev, st_ino) of what ``path`` names (links not followed), None if nothing."""
    try:
        st_ = os.lstat(path)  # type: ignore[arg-type]
    except (OSError, TypeError, ValueError):
        return None
    return [st_.st_dev, st_.st_ino]


def _raised(exc: BaseException, path: object) -> dict[str, Any]:
    """What is compared of an exception: its type, its errno, and for a BlockError whether
    its file_id names the file at ``path``."""
    err = getattr(exc, "errno", None)
    row: dict[str, Any] = {
        "type": type(exc).__name__,
        "errno": err if isinstance(err, int) else None,
    }
    if isinstance(exc, BlockError):
        file_id = exc.file_id
        row["file_id"] = None if file_id is None else list(file_id) == _identity(path)
    return row


def report(
    call: Callable[[], object], memory: Sequence[object | None], path: object = None
) -> dict[str, Any]:
    """Run ``call`` (in the child) and describe it: what it returned or raised, then the
    bytes of every buffer in ``memory``; ``why`` (not compared): the exception's words."""
    why = ""
    try:
        result: dict[str, Any] = {"returned": call()}
    except Exception as exc:  # every outcome is compared, none re-raised
        result = {"raised": _raised(exc, path)}
        why = f"{type(exc).__name__}: {exc}"
    dumps = [_dump(m) for m in memory if m is not None]
    return {"result": result, "memory": dumps, "why": why}


Make = Callable[[str, str], tuple[Callable[[], object], Sequence[object | None], object]]


def _check_clean(side: str, outcome: Outcome) -> None:
    if outcome.kind != "ok":
        pytest.fail(f"the {side} call did not end cleanly: {outcome.describe()}", pytrace=False)


def differential(layout: dict[str, Entry], make: Make) -> None:
    """One example: for each side, a fresh directory holding ``layout``, ``make(side, root)``
    (the call, the buffers to report, the path whose identity an error's file_id is
    checked against) run in a child; then both reports and both trees compared."""
    base = tempfile.mkdtemp(prefix="diff-")
    try:
        outcomes: dict[str, Outcome] = {}
        trees: dict[str, list[tuple[object, ...]]] = {}
        for side in SIDES:
            root = os.path.join(base, side[0])
            os.mkdir(root)
            materialize(root, layout)
            call, memory, path = make(side, root)
            outcomes[side] = run_isolated(functools.partial(report, call, memory, path))
            trees[side] = tree(root)
        native, reference = outcomes["native"], outcomes["reference"]
        _check_clean("native", native)
        _check_clean("reference", reference)
        got, want = native.value, reference.value
        words = f"native: {got.get('why')!r}; reference: {want.get('why')!r}"
        assert got["result"] == want["result"], f"native and reference differ ({words})"
        assert got["memory"] == want["memory"], f"the buffers after the call differ ({words})"
        assert trees["native"] == trees["reference"], f"the trees differ ({words})"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def no_layout() -> dict[str, Entry]:
    return {}


# -- segments --------------------------------------------------------------------------------

# A segment list: ("seq", container, items), ("many", count, gap) or ("bad", object). An item
# is (shape, offset, Mem): shape "pair" is the valid (offset, buffer).
SegSpec = tuple[Any, ...]
ITEM_SHAPES = ("triple", "single", "list", "none", "str")
CONTAINERS = ("list", "list", "list", "list", "tuple", "generator")
BAD_SEQUENCES: tuple[object, ...] = (None, 5, 1.5, b"ab")


def _offsets(draw: st.DrawFn, lengths: Sequence[int], start: int = 0) -> list[int]:
    """Offsets for segments of ``lengths``: back to back, with gaps, or anywhere (overlaps)."""
    how = draw(st.sampled_from(("contiguous", "contiguous", "gaps", "anywhere")))
    if how == "anywhere":
        return [draw(st.integers(0, 64)) for _ in lengths]
    offsets, at = [], start
    for n in lengths:
        at += draw(st.integers(0, 9)) if how == "gaps" else 0
        offsets.append(at)
        at += n
    return offsets


def _break_one(draw: st.DrawFn, items: list[tuple[Any, ...]], writable: bool) -> None:
    """Make one item hostile: its offset, its memory, or its shape."""
    if not items:
        return
    i = draw(st.integers(0, len(items) - 1))
    shape, offset, mem = items[i]
    how = draw(st.sampled_from(("offset", "memory", "shape")))
    if how == "offset":
        items[i] = (shape, draw(hostile_int()), mem)
    elif how == "memory":
        items[i] = (shape, offset, draw(mems(mem.nbytes, writable, hostile=True)))
    else:
        items[i] = (draw(st.sampled_from(ITEM_SHAPES)), offset, mem)


@st.composite
def segment_specs(draw: st.DrawFn, writable: bool, hostile: bool, direct: bool = False) -> SegSpec:
    """Segments for a file call: a few of up to 24 bytes (empty ones too) in any
    arrangement, more than IOV_MAX one-byte ones, 4 KiB-aligned ones for O_DIRECT; hostile:
    one item broken, or no sequence at all."""
    shape = draw(st.sampled_from(("few",) * 6 + ("many",) + (("direct",) if direct else ())))
    if hostile and draw(st.integers(0, 3)) == 0:
        return ("bad", draw(st.sampled_from(BAD_SEQUENCES)))
    if shape == "many":
        count = draw(st.sampled_from((IOV_MAX - 1, IOV_MAX, IOV_MAX + 1, 2 * IOV_MAX + 1)))
        return ("many", count, draw(st.booleans()))
    if shape == "direct":
        count = draw(st.integers(1, 2))
        aligned = [("pair", 4096 * i, Mem("aligned", 4096, i)) for i in range(count)]
        if draw(st.booleans()):
            aligned.append(("pair", 4096 * count, Mem("ndarray", draw(st.integers(1, 9)), 9)))
        return ("seq", "list", aligned)
    lengths = [draw(st.integers(0, 24)) for _ in range(draw(st.integers(0, 5)))]
    offsets = _offsets(draw, lengths)
    items: list[tuple[Any, ...]] = [
        ("pair", draw(maybe_numpy(o)), draw(mems(n, writable)))
        for o, n in zip(offsets, lengths, strict=True)
    ]
    if hostile:
        _break_one(draw, items, writable)
    return ("seq", draw(st.sampled_from(CONTAINERS)), items)


def build_segments(spec: SegSpec) -> tuple[object, list[object | None]]:
    """The segments ``spec`` describes and the backing memory of each buffer."""
    if spec[0] == "bad":
        return spec[1], []
    if spec[0] == "many":
        count, gap = spec[1], spec[2]
        raw = bytearray(_noise(count, 1).tobytes())
        view = memoryview(raw)
        segs = [(i + (3 if gap and i >= count // 2 else 0), view[i : i + 1]) for i in range(count)]
        return segs, [raw]
    _, container, items = spec
    built: list[object] = []
    backings: list[object | None] = []
    for shape, offset, mem in items:
        obj, backing = build_mem(mem)
        backings.append(backing)
        if shape == "pair":
            built.append((offset, obj))
        elif shape == "triple":
            built.append((offset, obj, 1))
        elif shape == "single":
            built.append((offset,))
        elif shape == "list":
            built.append([offset, obj])
        elif shape == "none":
            built.append(None)
        else:
            built.append("ab")
    if container == "tuple":
        return tuple(built), backings
    if container == "generator":
        return (item for item in built), backings
    return built, backings


def data_end(spec: SegSpec) -> int:
    """Where the valid segments' bytes end (0 for none): a valid file size (segments at
    hostile offsets past 64 KiB left out: the files planted stay small)."""
    if spec[0] == "many":
        return int(spec[1]) + (3 if spec[2] else 0)
    if spec[0] != "seq":
        return 0
    ends = [
        int(offset) + mem.nbytes
        for shape, offset, mem in spec[2]
        if shape == "pair" and isinstance(offset, int | np.integer) and 0 <= offset <= 1 << 16
    ]
    return max(ends, default=0)


def segment_count(spec: SegSpec) -> int:
    if spec[0] == "many":
        return int(spec[1])
    return len(spec[2]) if spec[0] == "seq" else 0


# -- hashed segments ------------------------------------------------------------------------


@dataclass(frozen=True)
class HashedCase:
    """Segments, the hashed range [first, last) of whole ``chunk``-byte chunks, the group
    size, the sums buffer (a kind and a count of uint64 values) and the algorithm."""

    segments: SegSpec
    first: object
    last: object
    chunk: object
    group: object
    sums_kind: str
    sums_count: int
    algo: int


SUMS_KINDS = (
    "u64",
    "u64",
    "u64",
    "ulonglong",
    "misaligned",
    "readonly",
    "strided",
    "be",
    "i64",
    "u64_2d",
)


def build_sums(kind: str, count: int) -> tuple[np.ndarray, np.ndarray]:
    """A sums array of ``count`` uint64 values (patterned) as ``kind``, and its backing."""
    pattern = np.arange(1, max(count, 0) + 1, dtype=np.uint64) * np.uint64(0x0101010101010101)
    if kind == "ulonglong":
        a = pattern.astype(np.ulonglong)
        return a, a
    if kind == "misaligned":
        raw = np.zeros(8 * len(pattern) + 16, np.uint8)
        at = (-raw.ctypes.data) % 8 + 5
        a = raw[at : at + 8 * len(pattern)].view(np.uint64)
        a[:] = pattern
        return a, raw
    if kind == "readonly":
        a = pattern.copy()
        a.flags.writeable = False
        return a, a
    if kind == "strided":
        a = np.zeros(2 * len(pattern), np.uint64)
        a[::2] = pattern
        return a[::2], a
    if kind == "be":
        a = pattern.astype(">u8")
        return a, a
    if kind == "i64":
        signed = pattern.view(np.int64).copy()
        return signed, signed
    if kind == "u64_2d" and len(pattern) % 2 == 0 and len(pattern):
        return pattern.reshape(2, -1), pattern
    return pattern, pattern


@st.composite
def hashed_cases(draw: st.DrawFn, writable: bool, hostile: frozenset[str]) -> HashedCase:
    """Valid hashed geometry (plain segments before and after the hashed ones, which hold
    whole chunks; many one-byte chunks across GROUP_PARTS and IOV_MAX), then the ``hostile``
    fields of it broken."""
    if draw(st.integers(0, 5)) == 0:
        count = draw(st.sampled_from((63, 64, 65, 130, IOV_MAX + 1)))
        segments: SegSpec = ("many", count, draw(st.booleans()))
        first, last, chunk, nchunks = 0, count, 1, count
    else:
        chunk = draw(st.sampled_from((1, 8, 16, 64)))
        before = [draw(st.integers(0, 12)) for _ in range(draw(st.integers(0, 2)))]
        hashed = [chunk * draw(st.integers(0, 3)) for _ in range(draw(st.integers(0, 4)))]
        after = [draw(st.integers(0, 12)) for _ in range(draw(st.integers(0, 2)))]
        lengths = before + hashed + after
        offsets = _offsets(draw, lengths)
        items: list[tuple[Any, ...]] = [
            ("pair", o, draw(mems(n, writable))) for o, n in zip(offsets, lengths, strict=True)
        ]
        first, last = len(before), len(before) + len(hashed)
        nchunks = sum(hashed) // chunk
        if "segments" in hostile:
            if len(hashed) > 0 and draw(st.booleans()):  # a hashed segment of part of a chunk
                i = draw(st.integers(first, last - 1))
                shape, offset, mem = items[i]
                items[i] = (shape, offset, Mem(mem.kind, mem.nbytes + 1, mem.seed))
            else:
                _break_one(draw, items, writable)
        segments = ("seq", "list", items)
    group = draw(st.sampled_from((chunk, 2 * chunk, 3 * chunk + 1, max(chunk - 1, 1), 4096)))
    sums_count = nchunks + draw(st.sampled_from((0, 0, 0, 1, 3)))
    sums_kind = "u64"
    if "sums" in hostile:
        sums_kind = draw(st.sampled_from(SUMS_KINDS))
        sums_count = max(nchunks + draw(st.sampled_from((-1, 0, 2))), 0)
    return HashedCase(
        segments=segments,
        first=scalar(draw, first, "first" in hostile),
        last=scalar(draw, last, "last" in hostile),
        chunk=scalar(draw, chunk, "chunk" in hostile),
        group=scalar(draw, group, "group" in hostile),
        sums_kind=sums_kind,
        sums_count=sums_count,
        algo=CRC32C if "algo" in hostile else XXH3_64,
    )


HASHED_FIELDS = ("segments", "first", "last", "chunk", "group", "sums", "algo")


# -- shared by the call tests ------------------------------------------------------------

MODES = (0o600, 0o600, 0o644, 0o400, 0o7777, 0)


def _hashing(h: HashedCase) -> tuple[Hashing, np.ndarray]:
    sums, backing = build_sums(h.sums_kind, h.sums_count)
    hashing = Hashing(h.first, h.last, h.algo, h.chunk, h.group, sums)  # type: ignore[arg-type]
    return hashing, backing


# Found by this test: sums a C-contiguous 2-D uint64 array (2 rows of 1). The native call
# fills it as flat memory; the reference accepts it, then slices rows (out of shape (1, 1))
# and chunk_sums raises ValueError - after creating the file.
TWO_D_SUMS_HASHING = HashedCase(
    segments=("seq", "list", [("pair", 0, Mem("bytes", 8, 1))]),
    first=0,
    last=1,
    chunk=8,
    group=8,
    sums_kind="u64_2d",
    sums_count=2,
    algo=XXH3_64,
)


# Found by this test: chunk_nbytes a numpy int64 and group_nbytes a numpy uint64. The native
# call takes both as integers; the reference's group arithmetic mixes the two numpy types
# (float64) and slicing by it raises TypeError.
MIXED_NUMPY_HASHING = replace(
    TWO_D_SUMS_HASHING, chunk=np.int64(2), group=np.uint64(4), sums_kind="u64", sums_count=4
)


TOUCH_TIMES = (0, 0, OLD_NS, OLD_NS + 1, 2**63 - 1, -1)

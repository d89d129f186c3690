"""Differential tests of kvstore's native calls against their Python references, over
hypothesis-generated arguments, valid and hostile alike.

kvstore/_xxh3batch.c and kvstore/_fileproto.c promise the result of their Python reference for
every input: the same exception type (TypeError, ValueError, OverflowError, OSError with the
same errno), the same return values and per-block statuses, the same bytes written to files
and into the caller's buffers. Each test here draws a call's arguments (valid geometry mixed
with boundary integers, numpy integers, wrong types, odd buffers, odd paths and odd trees),
runs the native call and the reference each in a forked child
(:func:`~tests.native.isolated.run_isolated`: a crash is a failed example, never a dead
runner), each in its own fresh directory holding the same entries, and compares what the two
children report (the value returned or the exception's type and errno; every buffer of the
call, byte for byte, after it) and the two trees after the call (names, kinds, permissions,
file bytes, whether an mtime was touched). The buffers are built once, before both forks, so
both calls see them at the same addresses (alignment decides O_DIRECT and refusals).

The native side is the plain :class:`~kvstore.io.fileio.FileIO` (and the two extension
functions called directly); the reference is a FileIO subclass, which always runs the Python
reference, and :func:`~kvstore.checksum.reference_batch_sums`,
:func:`~kvstore.io.host.first_unaligned_reference`. Error words name different directories,
so only types and errnos are compared.

Hypothesis is derandomized and bounded (``KVTEST_DIFF_EXAMPLES`` examples per test, default
:data:`DEFAULT_EXAMPLES`; set it higher for a longer local soak). Each mismatch these tests
found is kept, minimized, as an explicit ``@example`` of its test (the constants in capitals
next to it say what differed), so it is checked on every run whatever the examples drawn.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from kvstore.checksum import CRC32C, XXH3_64, native_xxh3_capsule, reference_batch_sums
from kvstore.errors import BlockError
from kvstore.io.fileio import FileIO
from kvstore.io.fileproto import native_fileproto
from kvstore.io.host import first_unaligned_reference
from kvstore.io.types import Hashing, PiecePlan
from tests.native.isolated import Outcome, run_isolated

DEFAULT_EXAMPLES = 60  # two forks per example: 35-55 s for the file on 2 cores
EXAMPLES = int(os.environ.get("KVTEST_DIFF_EXAMPLES") or DEFAULT_EXAMPLES)
DIFF = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate, Phase.shrink),  # no explain phase (slow)
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.large_base_example,
    ],
)

O_DIRECT: int = getattr(os, "O_DIRECT", 0)
O_PATH: int = getattr(os, "O_PATH", 0)
O_TMPFILE: int = getattr(os, "O_TMPFILE", 0)
O_NOATIME: int = getattr(os, "O_NOATIME", 0)
NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
OLD_NS = 10**18  # every planted entry's mtime (2001): a touch shows as a changed mtime
SIDES = ("native", "reference")

BOUNDARY_INTS = (
    -(2**63) - 1,
    -(2**63),
    -1,
    0,
    1,
    7,
    8,
    4095,
    4096,
    2**31 - 1,
    2**31,
    2**62,
    2**63 - 1,
    2**63,
    2**64,
)
NUMPY_INTS: tuple[type[np.integer[Any]], ...] = (np.int64, np.uint64, np.int32)
WRONG_TYPES: tuple[object, ...] = (1.0, 0.5, "1", None, b"\x01", [1], np.float64(2.0))


class Reference(FileIO):
    """A FileIO subclass: every compound call runs FileIO's Python reference."""


class FsPath:
    """An ``os.PathLike`` whose ``__fspath__`` returns ``value`` (str, bytes, or anything)."""

    def __init__(self, value: object) -> None:
        self.value = value

    def __fspath__(self) -> Any:
        return self.value


class RaisingBool:
    """A flag whose truth value cannot be taken (``bool()`` raises ValueError)."""

    def __bool__(self) -> bool:
        raise ValueError("no truth value")


@pytest.fixture(autouse=True)
def _both_extensions_bound() -> None:
    """Skip where either extension is not bound (KVSTORE_NATIVE=off, not built)."""
    if native_fileproto() is None or native_xxh3_capsule() is None:
        pytest.skip("the native file protocol or the native xxh3 batch is not bound")


def _fio(side: str) -> FileIO:
    return FileIO() if side == "native" else Reference()


# -- hostile values ----------------------------------------------------------------------------


def _numpy_int(pair: tuple[type[np.integer[Any]], object]) -> object:
    """``value`` as the numpy integer type where it fits (else unchanged)."""
    kind, value = pair
    if isinstance(value, int) and not isinstance(value, bool):
        info = np.iinfo(kind)
        if int(info.min) <= value <= int(info.max):
            return kind(value)
    return value


def hostile_int() -> st.SearchStrategy[object]:
    """A boundary integer, one as a numpy integer, or a value of a wrong type."""
    boundary = st.sampled_from(BOUNDARY_INTS)
    return st.one_of(
        boundary,
        st.tuples(st.sampled_from(NUMPY_INTS), boundary).map(_numpy_int),
        st.sampled_from(WRONG_TYPES),
    )


def maybe_numpy(value: int) -> st.SearchStrategy[object]:
    """``value`` as an int, mostly, or as a numpy integer."""
    return st.one_of(
        st.just(value),
        st.just(value),
        st.tuples(st.sampled_from(NUMPY_INTS), st.just(value)).map(_numpy_int),
    )


def scalar(draw: st.DrawFn, valid: int, hostile: bool) -> object:
    """An argument whose valid value is ``valid``: hostile (a boundary value, a numpy integer,
    a wrong type, or valid +- a little), else ``valid`` itself (maybe as a numpy integer)."""
    if not hostile:
        return draw(maybe_numpy(valid))
    return draw(
        st.one_of(
            hostile_int(),
            st.sampled_from((-8, -1, 1, 8)).map(lambda d: valid + d),
        )
    )


def perturbed(draw: st.DrawFn, fields: Sequence[str], most: int = 2) -> frozenset[str]:
    """Which of ``fields`` an example makes hostile: none (a valid call) or a few."""
    count = draw(st.integers(0, most))
    return frozenset(draw(st.lists(st.sampled_from(fields), min_size=count, max_size=count)))


# -- buffers -----------------------------------------------------------------------------------

# Contiguous writable memory, as the calls take it.
GOOD_KINDS = (
    "bytearray",
    "ndarray",
    "memoryview",
    "u64",
    "u64_2d",
    "aligned",
    "misaligned_u64",
    "zero_d",
)
# Contiguous read-only memory: fine to write from, refused to read into.
READONLY_KINDS = ("bytes", "readonly_mv", "readonly_nd")
# Never acceptable: not contiguous, or no buffer at all.
# (A strided view of one item, or one row, is contiguous by its strides: accepted by both.)
BAD_KINDS = (
    "strided",
    "strided_mv",
    "strided_u64",
    "one_row",
    "fortran",
    "str",
    "none",
    "int",
    "list",
)


@dataclass(frozen=True)
class Mem:
    """A buffer to build (:func:`build_mem`): how, how many bytes, the seed of its bytes."""

    kind: str
    nbytes: int
    seed: int = 0


def _noise(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, max(n, 0), dtype=np.uint8)


def build_mem(m: Mem) -> tuple[object, object | None]:
    """The buffer ``m`` describes and its backing memory (what the child reports after the
    call: every byte the call could have written), None for a non-buffer."""
    n, data, k = m.nbytes, _noise(m.nbytes, m.seed), m.kind
    if k == "bytearray":
        raw = bytearray(data.tobytes())
        return raw, raw
    if k == "memoryview":
        raw = bytearray(data.tobytes())
        return memoryview(raw), raw
    if k == "u64" and n % 8 == 0:
        a = data.copy()
        return a.view(np.uint64), a
    if k == "u64_2d" and n % 16 == 0 and n:
        a = data.copy()
        return a.view(np.uint64).reshape(2, -1), a
    if k == "aligned":
        raw_a = np.zeros(n + 8192, np.uint8)
        at = (-raw_a.ctypes.data) % 4096
        a = raw_a[at : at + n]
        a[:] = data
        return a, a
    if k == "misaligned_u64" and n % 8 == 0:
        raw_a = np.zeros(n + 16, np.uint8)
        at = (-raw_a.ctypes.data) % 8 + 1 + m.seed % 7
        a = raw_a[at : at + n]
        a[:] = data
        return a.view(np.uint64), a
    if k == "zero_d" and n == 1:
        a = data.copy()
        return a.reshape(()), a
    if k == "bytes":
        b = data.tobytes()
        return b, b
    if k == "readonly_mv":
        b = data.tobytes()
        return memoryview(b), b
    if k == "readonly_nd":
        a = data.copy()
        a.flags.writeable = False
        return a, a
    if k == "strided":
        a = np.zeros(2 * n, np.uint8)
        a[::2] = data
        return a[::2], a
    if k == "strided_mv":
        raw = bytearray(2 * n)
        view = memoryview(raw)[::2]
        view[:] = data.tobytes()
        return view, raw
    if k == "strided_u64" and n % 8 == 0:
        a = np.zeros(2 * (n // 8), np.uint64)
        a[::2] = data.view(np.uint64)
        return a[::2], a
    if k == "one_row" and n:
        a = np.zeros((2, n), np.uint8)
        a[0] = data
        return a[::2], a
    if k == "fortran" and n >= 4 and n % 2 == 0:
        a = np.asfortranarray(data.reshape(2, n // 2))
        return a, a
    if k == "str":
        return "x" * n, None
    if k == "none":
        return None, None
    if k == "int":
        return n, None
    if k == "list":
        return list(data.tobytes()), None
    a = data.copy()  # a kind that needs another length: plain bytes
    return a, a


def mem_kinds(writable: bool, hostile: bool = False) -> st.SearchStrategy[str]:
    """Buffer kinds the call accepts (read-only ones too unless ``writable``); hostile: any
    kind, refused ones most likely."""
    good = GOOD_KINDS if writable else GOOD_KINDS + READONLY_KINDS
    if not hostile:
        return st.sampled_from(good)
    refused = BAD_KINDS + (READONLY_KINDS if writable else ())
    return st.one_of(st.sampled_from(refused), st.sampled_from(GOOD_KINDS + refused))


def mems(nbytes: int, writable: bool, hostile: bool = False) -> st.SearchStrategy[Mem]:
    return st.builds(Mem, mem_kinds(writable, hostile), st.just(nbytes), st.integers(0, 255))


def _dump(backing: object) -> str:
    """The bytes of ``backing`` as hex (a digest for large ones)."""
    raw = backing.tobytes() if isinstance(backing, np.ndarray) else bytes(backing)  # type: ignore[call-overload]
    if len(raw) <= 512:
        return raw.hex()
    return f"{len(raw)} bytes, sha256 {hashlib.sha256(raw).hexdigest()}"


# Arrays of int64 values (a piece plan's starts and slot_of), valid form first.
ARRAY_FORMS = (
    "i64",
    "longlong",
    "readonly",
    "misaligned",
    "i32",
    "u64",
    "list",
    "strided",
    "2d",
    "be",
    "bytes",
)


def build_array(values: Sequence[int], form: str) -> tuple[object, object | None]:
    """``values`` as an int64 buffer of ``form`` (or a refused stand-in), and its backing."""
    v = np.asarray(values, dtype=np.int64) if len(values) else np.zeros(0, np.int64)
    if form == "longlong":
        a = v.astype(np.longlong)
        return a, a
    if form == "readonly":
        a = v.copy()
        a.flags.writeable = False
        return a, a
    if form == "misaligned":
        raw = np.zeros(8 * len(v) + 16, np.uint8)
        at = (-raw.ctypes.data) % 8 + 3
        a = raw[at : at + 8 * len(v)].view(np.int64)
        a[:] = v
        return a, raw
    if form == "i32":
        a = v.astype(np.int32)
        return a, a
    if form == "u64":
        a = v.astype(np.uint64)
        return a, a
    if form == "list":
        return [int(x) for x in v], None
    if form == "strided":
        a = np.zeros(2 * len(v), np.int64)
        a[::2] = v
        return a[::2], a
    if form == "2d" and len(v) % 2 == 0 and len(v):
        a = v.copy()
        return a.reshape(2, -1), a
    if form == "be":
        a = v.astype(">i8")
        return a, a
    if form == "bytes":
        return v.tobytes(), None
    a = v.copy()
    return a, a


# -- paths and trees -------------------------------------------------------------------------

# Names a call may be given, relative to its directory: plain ones, below a directory, below a
# symbolic link to it, below a missing directory, below a file, with a trailing slash, too
# long for a component, with a surrogate-escaped byte, unencodable.
HOSTILE_NAMES = (
    "sub/d",
    "linkdir/d",
    "gone/e",
    "a/x",
    "a/",
    "x" * 300,
    "s\udcff",
    "\ud800",
)
PATH_FORMS = ("str", "bytes", "pathlike", "pathlike_bytes")
BAD_PATHS: tuple[object, ...] = (None, 5, 1.5, ["a"], FsPath(5))


@dataclass(frozen=True)
class PathArg:
    """A path argument: ``name`` below the call's directory, given as ``form``, with a NUL
    appended when ``nul``; or, ``name`` None, the wrong-typed ``bad``."""

    name: str | None
    form: str = "str"
    nul: bool = False
    bad: object = None


def resolve(p: PathArg, root: str) -> object:
    """The argument ``p`` describes, below ``root``."""
    if p.name is None:
        return p.bad
    full = os.path.join(root, p.name) + ("\0z" if p.nul else "")
    try:
        encoded = os.fsencode(full)
    except UnicodeEncodeError:  # not encodable: the str itself
        return full
    if p.form == "bytes":
        return encoded
    if p.form == "pathlike":
        return FsPath(full)
    if p.form == "pathlike_bytes":
        return FsPath(encoded)
    return full


@st.composite
def path_args(draw: st.DrawFn, names: Sequence[str], hostile: bool) -> PathArg:
    """One of ``names`` in any form; hostile: a NUL, a hostile name, or a wrong type."""
    form = draw(st.sampled_from(PATH_FORMS))
    if not hostile:
        return PathArg(draw(st.sampled_from(names)), form)
    how = draw(st.sampled_from(("nul", "name", "name", "bad")))
    if how == "nul":
        return PathArg(draw(st.sampled_from(names)), form, nul=True)
    if how == "name":
        return PathArg(draw(st.sampled_from(HOSTILE_NAMES)), form)
    return PathArg(None, bad=draw(st.sampled_from(BAD_PATHS)))


# An entry planted before the call: ("file", nbytes, seed), ("data", bytes), ("dir",),
# ("link", target), ("fifo",), ("socket",).
Entry = tuple[Any, ...]


def entries(file_nbytes: st.SearchStrategy[int] | None = None) -> st.SearchStrategy[Entry]:
    """What a name holds: mostly a regular file; a directory, a symbolic link (to a file, a
    directory, nowhere), a FIFO or a socket."""
    sizes = st.integers(0, 48) if file_nbytes is None else file_nbytes
    file = st.tuples(st.just("file"), sizes, st.integers(0, 255))
    return st.one_of(
        file,
        file,
        st.just(("dir",)),
        st.tuples(st.just("link"), st.sampled_from(("a", "sub", "nowhere"))),
        st.just(("fifo",)),
        st.just(("socket",)),
    )


@st.composite
def layouts(draw: st.DrawFn, names: Sequence[str] = ("a", "b", "c", "sub/d")) -> dict[str, Entry]:
    """A tree: ``sub`` a directory, ``linkdir`` a link to it, each of ``names`` absent or
    holding an entry."""
    layout: dict[str, Entry] = {"sub": ("dir",), "linkdir": ("link", "sub")}
    for name in names:
        if draw(st.booleans()):
            layout[name] = draw(entries())
    return layout


def base_layout(**planted: Entry) -> dict[str, Entry]:
    """The layout of the explicit examples: ``sub``, ``linkdir`` and ``planted``."""
    return {"sub": ("dir",), "linkdir": ("link", "sub"), **planted}


def materialize(root: str, layout: dict[str, Entry]) -> None:
    """Plant ``layout`` below ``root``; every entry's mtime is :data:`OLD_NS`."""
    made: list[str] = []
    for name, entry in sorted(layout.items(), key=lambda kv: (kv[0].count("/"), kv[0])):
        path = os.path.join(root, name)
        parent = os.path.dirname(path)
        if not os.path.lexists(parent):
            os.makedirs(parent)
            made.append(parent)
        kind = entry[0]
        if kind == "file":
            Path(path).write_bytes(_noise(entry[1], entry[2]).tobytes())
        elif kind == "data":
            Path(path).write_bytes(entry[1])
        elif kind == "dir":
            os.mkdir(path)
        elif kind == "link":
            os.symlink(entry[1], path)
        elif kind == "fifo":
            os.mkfifo(path)
        else:
            os.mknod(path, stat.S_IFSOCK | 0o600)
        made.append(path)
    for path in sorted(made, key=lambda p: -p.count("/")):
        os.utime(path, ns=(OLD_NS, OLD_NS), follow_symlinks=False)


_KINDS = {
    stat.S_IFREG: "file",
    stat.S_IFDIR: "dir",
    stat.S_IFLNK: "link",
    stat.S_IFIFO: "fifo",
    stat.S_IFSOCK: "socket",
}


def _contents(path: str, size: int) -> str:
    """A regular file's bytes as hex (small), else a digest of its non-zero 4 KiB pages and
    where they lie (found through SEEK_DATA: a sparse file of 2**40 bytes costs nothing)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if size <= 1 << 20:
            data = os.pread(fd, size, 0)
            return data.hex() if len(data) <= 256 else hashlib.sha256(data).hexdigest()
        digest = hashlib.sha256()
        position = 0
        while position < size:
            try:
                start = os.lseek(fd, position, os.SEEK_DATA)
            except OSError:
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            page = start - start % 4096
            while page < end:
                data = os.pread(fd, 4096, page)
                if data.strip(b"\0"):
                    digest.update(page.to_bytes(8, "little") + data)
                page += 4096
            position = end
        return f"sparse {digest.hexdigest()}"
    finally:
        os.close(fd)


def tree(root: str) -> list[tuple[object, ...]]:
    """Everything below ``root``: name, kind, permissions, whether the mtime is still the
    planted one, and a file's size and bytes or a link's target."""
    rows: list[tuple[object, ...]] = []
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(directory, name)
            st_ = os.lstat(path)
            kind = _KINDS.get(stat.S_IFMT(st_.st_mode), str(stat.S_IFMT(st_.st_mode)))
            row: tuple[object, ...] = (
                os.path.relpath(path, root),
                kind,
                oct(stat.S_IMODE(st_.st_mode)),
                st_.st_mtime_ns == OLD_NS,
            )
            if kind == "file":
                row += (st_.st_size, _contents(path, st_.st_size))
            elif kind == "link":
                row += (os.readlink(path),)
            rows.append(row)
    return sorted(rows)


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


# -- kvstore._xxh3batch.sums -----------------------------------------------------------------

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
    """kvstore._xxh3batch.sums and reference_batch_sums agree for every input: the same
    exception type for negative, overflowing, numpy or wrongly typed sizes, data too short,
    data or out that is no buffer, not contiguous, read-only, misaligned, of another item
    type or byte order, or too small; the same uint64 values in ``out`` (and nothing else
    written) for valid ones."""
    native_sums = importlib.import_module("kvstore._xxh3batch").sums
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
    """kvstore._fileproto.first_unaligned and first_unaligned_reference agree: the same
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
MODES = (0o600, 0o600, 0o644, 0o400, 0o7777, 0)
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


def _hashing(h: HashedCase) -> tuple[Hashing, np.ndarray]:
    sums, backing = build_sums(h.sums_kind, h.sums_count)
    hashing = Hashing(h.first, h.last, h.algo, h.chunk, h.group, sums)  # type: ignore[arg-type]
    return hashing, backing


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
TWO_D_SUMS_WRITE = {
    **NUMPY_FLAGS_WRITE,
    "flags": NEW,
    "segments": TWO_D_SUMS_HASHING.segments,
    "file_nbytes": 8,
    "buffered_from": None,
    "hashing": TWO_D_SUMS_HASHING,
}


# Found by this test: chunk_nbytes a numpy int64 and group_nbytes a numpy uint64. The native
# call takes both as integers; the reference's group arithmetic mixes the two numpy types
# (float64) and slicing by it raises TypeError.
MIXED_NUMPY_HASHING = replace(
    TWO_D_SUMS_HASHING, chunk=np.int64(2), group=np.uint64(4), sums_kind="u64", sums_count=4
)
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
    the reference on both sides where the plain FileIO does not go native: int64 or
    big-endian sums, another algorithm)."""
    _run_write(case)


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
TOUCH_TIMES = (0, 0, OLD_NS, OLD_NS + 1, 2**63 - 1, -1)


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


# -- publish_pieces / read_pieces ------------------------------------------------------------


@dataclass(frozen=True)
class PlanCase:
    """A valid piece geometry (what block files and buffers are built from) and the plan
    the call is given (its fields perhaps hostile)."""

    chunk: int
    piece: int
    starts: tuple[int, ...]
    header: int
    slots_offset: int
    index: bytes
    file_nbytes: int
    plan: dict[str, Any]  # PiecePlan fields; starts/slot_of/index as (values or spec, form)

    @property
    def span(self) -> int:
        return len(self.starts) * self.piece


PLAN_FIELDS = (
    "starts",
    "starts_form",
    "slot_of",
    "slot_of_form",
    "piece_nbytes",
    "chunk_nbytes",
    "slots_offset",
    "index_offset",
    "file_nbytes",
    "alignment",
    "index",
)


def slot_order(starts: Sequence[int], piece: int, chunk: int) -> list[int]:
    """The slot_of that ``starts`` imply (kvstore/_fileproto.c check_piece_places)."""
    piece_at = {start // piece: k for k, start in enumerate(starts)}
    per = piece // chunk
    return [piece_at[s // per] * per + s % per for s in range(len(starts) * per)]


@st.composite
def plan_cases(draw: st.DrawFn, hostile: frozenset[str]) -> PlanCase:
    """A valid plan (pieces of whole chunks permuted in their span, checksum slots in the
    header, the index after the pieces; sometimes 4 KiB-aligned for O_DIRECT), then the
    ``hostile`` fields perturbed: starts out of the span, overlapping, off a chunk or piece;
    slot_of permuted otherwise, too long or short; arrays of other types, misaligned,
    strided, big-endian; sizes and offsets off by a little or boundary values."""
    if draw(st.integers(0, 6)) == 0:
        chunk, per, slots_offset, header, alignment = 4096, 1, 64, 4096, 4096
        npieces = draw(st.integers(1, 2))
    else:
        chunk = draw(st.sampled_from((1, 3, 8, 16, 64)))
        per = draw(st.integers(1, 3))
        npieces = draw(st.integers(1, 4))
        slots_offset = draw(st.integers(0, 16))
        header = slots_offset + 8 * npieces * per + draw(st.integers(0, 16))
        alignment = draw(st.sampled_from((4096, 4096, 1, 8, 512)))
    piece = chunk * per
    span = npieces * piece
    starts = [k * piece for k in draw(st.permutations(range(npieces)))]
    slot_of = slot_order(starts, piece, chunk)
    index = _noise(draw(st.integers(0, 16)), 5).tobytes()
    index_offset = header + span
    file_nbytes = index_offset + len(index) + draw(st.sampled_from((0, 0, 0, 3)))
    given_starts = list(starts)
    if "starts" in hostile:
        k = draw(st.integers(0, npieces - 1))
        given_starts[k] = draw(
            st.sampled_from(
                (span, span + piece, 2**40, 2**62, -piece, starts[k] + 1, starts[0])
                + ((starts[k] + chunk,) if per > 1 else ())
            )
        )
    given_slots = list(slot_of)
    if "slot_of" in hostile:
        how = draw(st.sampled_from(("swap", "bump", "longer", "shorter", "identity")))
        if how == "swap" and len(given_slots) > 1:
            given_slots[0], given_slots[-1] = given_slots[-1], given_slots[0]
        elif how == "bump":
            given_slots[draw(st.integers(0, len(given_slots) - 1))] += 1
        elif how == "longer":
            given_slots.append(len(given_slots))
        elif how == "shorter":
            given_slots.pop()
        else:
            given_slots = list(range(len(given_slots)))
    index_kind = draw(mem_kinds(writable=False, hostile="index" in hostile))
    plan = {
        "file_nbytes": scalar(draw, file_nbytes, "file_nbytes" in hostile),
        "piece_nbytes": scalar(draw, piece, "piece_nbytes" in hostile),
        "starts": (
            given_starts,
            draw(st.sampled_from(ARRAY_FORMS)) if "starts_form" in hostile else "i64",
        ),
        "slot_of": (
            given_slots,
            draw(st.sampled_from(ARRAY_FORMS)) if "slot_of_form" in hostile else "i64",
        ),
        "chunk_nbytes": scalar(draw, chunk, "chunk_nbytes" in hostile),
        "slots_offset": scalar(draw, slots_offset, "slots_offset" in hostile),
        "index": Mem(index_kind, len(index), 5),
        "index_offset": scalar(draw, index_offset, "index_offset" in hostile),
        "alignment": scalar(draw, alignment, "alignment" in hostile),
    }
    return PlanCase(chunk, piece, tuple(starts), header, slots_offset, index, file_nbytes, plan)


def build_plan(case: PlanCase) -> tuple[PiecePlan, list[object | None]]:
    """The PiecePlan the call is given, and the backing memory of its arrays and index."""
    p = dict(case.plan)
    starts, starts_backing = build_array(*p["starts"])
    slot_of, slot_backing = build_array(*p["slot_of"])
    index, index_backing = build_mem(p["index"])
    p.update(starts=starts, slot_of=slot_of, index=index)
    return PiecePlan(**p), [starts_backing, slot_backing, index_backing]


@dataclass(frozen=True)
class BlockCase:
    """One block of a batch: its names (publish: tmp and final; read: the path), its header
    and span buffers, its tuple's shape, and what its names hold before the call."""

    names: tuple[PathArg, ...]
    header: Mem
    span: Mem
    shape: str
    entries: tuple[tuple[str, Entry], ...]


BLOCK_SHAPES = ("list", "short", "long", "none")


def _buffer_mem(draw: st.DrawFn, nbytes: int, writable: bool, aligned: bool, hostile: bool) -> Mem:
    """A header or span buffer of ``nbytes`` (4 KiB-aligned where the geometry is); hostile:
    of a refused kind, or a byte or eight off."""
    mem = Mem("aligned" if aligned else "ndarray", nbytes, draw(st.integers(0, 255)))
    if not hostile:
        return mem
    if draw(st.booleans()):
        return draw(mems(nbytes, writable, hostile=True))
    return Mem(mem.kind, max(nbytes + draw(st.sampled_from((-1, 1, 8))), 0), mem.seed)


def _block_file(case: PlanCase, span: np.ndarray, fixed_seed: int) -> bytes:
    """The file a valid publish of ``span`` under ``case``'s geometry writes: header (noise,
    then each block chunk's xxh3 little-endian in its slot), pieces in piece order, index,
    zeros to the file's size."""
    data = b"".join(span[s : s + case.piece].tobytes() for s in case.starts)
    header = bytearray(_noise(case.header, fixed_seed).tobytes())
    for j in range(len(data) // case.chunk):
        at = case.slots_offset + 8 * j
        digest = xxhash.xxh3_64_intdigest(data[j * case.chunk : (j + 1) * case.chunk])
        header[at : at + 8] = digest.to_bytes(8, "little")
    body = bytes(header) + data + case.index
    return body + bytes(case.file_nbytes - len(body))


@st.composite
def read_block_file(draw: st.DrawFn, case: PlanCase, k: int) -> Entry:
    """What block ``k``'s name holds for a read: a valid block file, one corrupt (a flipped
    byte in its header's fixed part, a slot, a piece or the index), short, long; a
    directory, a FIFO, a socket, a link, nothing."""
    good = _block_file(case, _noise(case.span, 40 + k), 50 + k)
    how = draw(
        st.sampled_from(("valid",) * 4 + ("flip", "flip", "short", "long", "other", "absent"))
    )
    if how == "valid":
        return ("data", good)
    if how == "flip":
        at = draw(st.integers(0, len(good) - 1)) if good else 0
        data = bytearray(good)
        if data:
            data[at] ^= 0x5A
        return ("data", bytes(data))
    if how == "short":
        return ("data", good[:-1])
    if how == "long":
        return ("data", good + b"\0")
    if how == "absent":
        return ("absent",)
    return draw(entries())


@st.composite
def block_cases(draw: st.DrawFn, case: PlanCase, reading: bool, hostile: bool) -> list[BlockCase]:
    """Up to three blocks; hostile: one of them broken (a name, a buffer or its tuple)."""
    aligned = case.chunk == 4096
    count = draw(st.integers(1 if hostile else 0, 3))
    broken = draw(st.integers(0, count - 1)) if hostile else -1
    blocks = []
    for k in range(count):
        name = f"b{k}"
        part = draw(st.sampled_from(("names", "header", "span", "shape"))) if k == broken else ""
        planted: list[tuple[str, Entry]] = []
        if reading:
            names: tuple[PathArg, ...] = (draw(path_args((name,), part == "names")),)
            planted.append((name, draw(read_block_file(case, k))))
        else:
            tmp = draw(path_args((f".{name}.tmp",), part == "names" and draw(st.booleans())))
            final = draw(path_args((name, name, name, f"gone/{name}"), part == "names"))
            names = (tmp, final)
            if draw(st.integers(0, 3)) == 0:  # the final name taken already
                planted.append((name, draw(entries())))
            if draw(st.integers(0, 9)) == 0:  # a stale temporary file
                planted.append((f".{name}.tmp", ("file", 5, k)))
        blocks.append(
            BlockCase(
                names=names,
                header=_buffer_mem(draw, case.header, True, aligned, part == "header"),
                span=_buffer_mem(draw, case.span, reading, aligned, part == "span"),
                shape=draw(st.sampled_from(BLOCK_SHAPES)) if part == "shape" else "tuple",
                entries=tuple(planted),
            )
        )
    return blocks


def build_blocks(
    blocks: Sequence[BlockCase], root: str, buffers: Sequence[tuple[object, object]]
) -> list[object]:
    """The batch's items below ``root``: each block's names and its (shared) buffers."""
    items: list[object] = []
    for block, (header, span) in zip(blocks, buffers, strict=True):
        fields = [*(resolve(p, root) for p in block.names), header, span]
        if block.shape == "tuple":
            items.append(tuple(fields))
        elif block.shape == "list":
            items.append(fields)
        elif block.shape == "short":
            items.append(tuple(fields[:-1]))
        elif block.shape == "long":
            items.append((*fields, None))
        else:
            items.append(None)
    return items


def _batch_layout(blocks: Sequence[BlockCase]) -> dict[str, Entry]:
    layout: dict[str, Entry] = {"sub": ("dir",), "linkdir": ("link", "sub"), "a": ("file", 9, 1)}
    layout.update(
        (name, entry) for block in blocks for name, entry in block.entries if entry[0] != "absent"
    )
    return layout


PUBLISH_FLAGS = (NEW, NEW, NEW, NEW | O_DIRECT, os.O_WRONLY | os.O_CREAT, os.O_RDWR | os.O_CREAT)


def simple_plan(**changes: object) -> PlanCase:
    """The plan of the explicit examples: one piece of one 8-byte chunk after an 8-byte
    header (its one slot), no index; ``changes`` replace fields of the plan given."""
    plan: dict[str, Any] = {
        "file_nbytes": 16,
        "piece_nbytes": 8,
        "starts": ([0], "i64"),
        "slot_of": ([0], "i64"),
        "chunk_nbytes": 8,
        "slots_offset": 0,
        "index": Mem("bytes", 0, 5),
        "index_offset": 16,
        "alignment": 4096,
    }
    plan.update(changes)
    return PlanCase(8, 8, (0,), 8, 0, b"", 16, plan)


def simple_block(reading: bool, entry: Entry | None = None) -> BlockCase:
    """Block ``b0`` of the explicit examples (``entry``: what its name holds)."""
    names = (PathArg("b0"),) if reading else (PathArg(".b0.tmp"), PathArg("b0"))
    planted = (("b0", entry),) if entry is not None else ()
    return BlockCase(names, Mem("ndarray", 8, 1), Mem("ndarray", 8, 2), "tuple", planted)


# Found by this test: numpy uint64 flags; the reference's ``flags & ~O_DIRECT`` is OverflowError.
NUMPY_FLAGS_PUBLISH = {
    "plan": simple_plan(),
    "blocks": [simple_block(False)],
    "container": "list",
    "flags": np.uint64(NEW),
    "mode": 0o600,
}
# Found by this test: an alignment given as a numpy int32 with O_DIRECT; the reference's
# ``address % alignment`` is OverflowError (numpy int32 arithmetic), the native call gives the
# block's status.
INT32_ALIGNMENT_PUBLISH = {
    "plan": simple_plan(alignment=np.int32(8)),
    "blocks": [simple_block(False)],
    "container": "list",
    "flags": NEW | O_DIRECT,
    "mode": 0o600,
}
# Found by this test: mode None is TypeError natively; the reference skips its mode checks
# (None stands for "no mode" there) and returns [] for an empty batch.
NO_MODE_PUBLISH = {
    "plan": simple_plan(),
    "blocks": [],
    "container": "list",
    "flags": NEW,
    "mode": None,
}


@st.composite
def publish_cases(draw: st.DrawFn) -> dict[str, Any]:
    hostile = perturbed(draw, (*PLAN_FIELDS, "flags", "mode", "blocks"), most=2)
    plan = draw(plan_cases(hostile))
    blocks = draw(block_cases(plan, reading=False, hostile="blocks" in hostile))
    flags = draw(st.sampled_from(PUBLISH_FLAGS))
    return {
        "plan": plan,
        "blocks": blocks,
        "container": draw(st.sampled_from(CONTAINERS)) if "blocks" in hostile else "list",
        "flags": draw(hostile_int()) if "flags" in hostile else draw(maybe_numpy(flags)),
        "mode": scalar(draw, draw(st.sampled_from(MODES)), "mode" in hostile),
    }


def _containerize(items: list[object], container: str) -> object:
    if container == "tuple":
        return tuple(items)
    if container == "generator":
        return (item for item in items)
    return items


def _block_buffers(
    blocks: Sequence[BlockCase],
) -> tuple[list[tuple[object, object]], list[object | None]]:
    buffers, memory = [], []
    for block in blocks:
        header, header_backing = build_mem(block.header)
        span, span_backing = build_mem(block.span)
        buffers.append((header, span))
        memory += [header_backing, span_backing]
    return buffers, memory


# Found by this test: index_offset a numpy int64 near 2**63 (a 3-byte index ending past it).
# The native call raises OverflowError; the reference's overflow check adds in numpy int64,
# wraps, and a later check raises ValueError.
WRAPPING_INDEX_PUBLISH = {
    **NUMPY_FLAGS_PUBLISH,
    "plan": simple_plan(index=Mem("bytes", 3, 5), index_offset=np.int64(2**63 - 2)),
    "flags": NEW,
}


@DIFF
@given(case=publish_cases())
@example(case=NUMPY_FLAGS_PUBLISH)
@example(case=WRAPPING_INDEX_PUBLISH)
@example(case=INT32_ALIGNMENT_PUBLISH)
@example(case=NO_MODE_PUBLISH)
def test_publish_pieces_matches_its_reference(case: dict[str, Any]) -> None:
    """FileIO().publish_pieces (native) and the reference agree: the same statuses
    (PUBLISHED, ALREADY_THERE for a regular file there, -EEXIST for a directory, link or
    FIFO there, -ENOENT below a missing directory, -EEXIST for a stale temporary file, ...),
    the same published files byte for byte, the same checksums written into every header,
    no temporary file left; and the same exception type for every hostile plan (starts out
    of the span, overlapping, off a chunk; slot_of not the order the starts give; arrays
    misaligned, strided, of other types; slots, header, index or file size out of bounds;
    boundary integers) and every hostile block (wrong tuple, NUL, wrong-sized, read-only or
    strided buffers)."""
    plan, memory = build_plan(case["plan"])
    blocks: list[BlockCase] = case["blocks"]
    buffers, block_memory = _block_buffers(blocks)

    def make(side: str, root: str) -> tuple[Callable[[], object], list[object | None], None]:
        fio = _fio(side)
        items = _containerize(build_blocks(blocks, root, buffers), case["container"])
        flags, mode = case["flags"], case["mode"]
        return lambda: fio.publish_pieces(items, flags, mode, plan), memory + block_memory, None  # type: ignore[arg-type]

    differential(_batch_layout(blocks), make)


@st.composite
def read_pieces_cases(draw: st.DrawFn) -> dict[str, Any]:
    hostile = perturbed(draw, (*PLAN_FIELDS, "header_nbytes", "touch", "blocks"), most=2)
    plan = draw(plan_cases(hostile))
    return {
        "plan": plan,
        "blocks": draw(block_cases(plan, reading=True, hostile="blocks" in hostile)),
        "container": draw(st.sampled_from(CONTAINERS)) if "blocks" in hostile else "list",
        "header_nbytes": scalar(draw, plan.header, "header_nbytes" in hostile),
        "touch": scalar(draw, draw(st.sampled_from(TOUCH_TIMES)), "touch" in hostile),
        "direct": draw(st.booleans()),
    }


# Found by this test (read_pieces' twins of the publish mismatches): an int32 alignment with
# O_DIRECT; header_nbytes None (the reference then takes the header as publish_pieces does, from
# the index); touch_if_older_than_ns None (the reference compares it only with a file's mtime).
INT32_ALIGNMENT_READ = {
    "plan": simple_plan(alignment=np.int32(8)),
    "blocks": [simple_block(True, ("file", 16, 3))],
    "container": "list",
    "header_nbytes": 8,
    "touch": 0,
    "direct": True,
}
NO_HEADER_SIZE_READ = {**INT32_ALIGNMENT_READ, "plan": simple_plan(), "header_nbytes": None}
NO_TOUCH_READ = {
    **NO_HEADER_SIZE_READ,
    "blocks": [simple_block(True)],  # b0 missing: the reference returns [-ENOENT]
    "header_nbytes": 8,
    "touch": None,
    "direct": False,
}


@DIFF
@given(case=read_pieces_cases())
@example(case=INT32_ALIGNMENT_READ)
@example(case=NO_HEADER_SIZE_READ)
@example(case=NO_TOUCH_READ)
def test_read_pieces_matches_its_reference(case: dict[str, Any]) -> None:
    """FileIO().read_pieces (native) and the reference agree: the same statuses (VERIFIED
    for a valid block, also one with a flipped index byte or header byte outside the slots;
    -EBADMSG for a flipped slot or piece byte, a short or long file, a directory, FIFO or
    socket; -ENOENT, -ELOOP, ...), the same bytes landed in every header and span (also for
    the blocks that fail), the same mtimes touched, buffered or O_DIRECT; and the same
    exception type for every hostile plan, header size, touch time or block."""
    plan, memory = build_plan(case["plan"])
    blocks: list[BlockCase] = case["blocks"]
    buffers, block_memory = _block_buffers(blocks)

    def make(side: str, root: str) -> tuple[Callable[[], object], list[object | None], None]:
        fio = _fio(side)
        items = _containerize(build_blocks(blocks, root, buffers), case["container"])

        def call() -> object:
            return fio.read_pieces(
                items,  # type: ignore[arg-type]
                case["header_nbytes"],
                plan,
                case["touch"],
                direct=case["direct"],
            )

        return call, memory + block_memory, None

    differential(_batch_layout(blocks), make)

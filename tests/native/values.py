"""The arguments of tests/native's differential tests: hostile integers, buffers of every
kind, paths, and trees planted with every kind of entry (tests/native/differential.py runs
them)."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from kvstore.io.fileio import FileIO
from kvstore.io.native_fileio import NativeFileIO

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


def _fio(side: str) -> FileIO:
    return NativeFileIO() if side == "native" else Reference()


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

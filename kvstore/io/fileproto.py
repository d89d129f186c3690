"""Binding of the native per-file protocol, the C extension ``kvstore._native._fileproto``.

The extension does one block file's whole protocol (open, vectored writes or reads, the
O_DIRECT switch, truncate, fstat, touch, close; fdatasync then the no-replace rename) in one
call with the GIL released: per 4 KiB block on tmpfs, the Python sequence of the same system
calls costs several times the calls themselves (docs/performance.md). :class:`FileIO
<kvstore.io.fileio.FileIO>`'s compound operations (``write_new``, ``read_regular``,
``sync_and_rename``) use it; their Python versions, composed of FileIO's own primitives, are
the reference, the fallback when the extension is missing, and what every subclass of FileIO
runs (tests that record calls or inject faults keep seeing every step).

Bound once per process on first use by :mod:`kvstore.native` (the ``KVSTORE_NATIVE`` switch),
like the native xxh3 batch of :mod:`kvstore.checksum`: self-tested (the flag values it was
compiled with must be this Python's) and, when anything fails, one WARNING and the Python
reference from then on.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Protocol

from kvstore.native import NativeBinding

# read_regular's result: st_mode, st_size, st_dev, st_ino, st_mtime_ns, and None or the
# (offset, expected, got) of a run that came back short.
ReadOutcome = tuple[int, int, int, int, int, tuple[int, int, int] | None]


class NativeFileProto(Protocol):
    """The functions of ``kvstore._native._fileproto`` (kvstore/_native/fileproto.c documents
    each): the extension's one typing.

    Every function checks every argument before it touches memory, and raises (never a signal,
    never a status) for a caller's mistake: TypeError for a wrong type (a non-integer, a
    non-buffer, read-only memory where the call writes, a path that is not str, bytes or
    os.PathLike), OverflowError for a number or a derived size (offset + length, pieces x
    piece size, slots) past 2**63, ValueError for the rest (a negative size or offset, a NUL in
    a path, a mode outside 0..0o7777, int64/uint64 buffers not 8-byte aligned or of the wrong
    format or count, pieces that do not tile their span, a slot order other than the one their
    starts give, checksum slots outside the header, a header, span or index outside the file).
    Any integer is taken where an int is (numpy integers included). Sequences are copied once
    when the call starts: a list changed meanwhile (by an item's __fspath__ or __index__)
    changes nothing. An empty segment moves nothing. The Python reference of each function
    (kvstore/io/fileio.py, kvstore/io/piece_batch.py, checked by kvstore/io/callcheck.py) raises
    the same types and returns the same values and statuses.
    """

    def write_new(  # noqa: PLR0913 - the C function's arguments
        self,
        path: str,
        flags: int,
        mode: int,
        segments: Sequence[tuple[int, Any]],
        buffered_from: int,
        file_nbytes: int,
        /,
    ) -> int: ...

    def read_regular(  # noqa: PLR0913 - the C function's arguments
        self,
        path: str,
        flags: int,
        segments: Sequence[tuple[int, Any]],
        expected_size: int,
        allow_trailer: bool,
        touch_if_older_than_ns: int,
        /,
    ) -> ReadOutcome: ...

    def write_new_hashed(  # noqa: PLR0913 - the C function's arguments
        self,
        path: str,
        flags: int,
        mode: int,
        segments: Sequence[tuple[int, Any]],
        buffered_from: int,
        file_nbytes: int,
        first: int,
        last: int,
        chunk_nbytes: int,
        group_nbytes: int,
        sums: Any,
        xxh3: object,
        /,
    ) -> int: ...

    def read_regular_hashed(  # noqa: PLR0913 - the C function's arguments
        self,
        path: str,
        flags: int,
        segments: Sequence[tuple[int, Any]],
        expected_size: int,
        touch_if_older_than_ns: int,
        first: int,
        last: int,
        chunk_nbytes: int,
        group_nbytes: int,
        sums: Any,
        xxh3: object,
        /,
    ) -> ReadOutcome: ...

    def sync_and_rename(self, fd: int, src: str, dst: str, /) -> bool: ...

    def first_unaligned(
        self, segments: Sequence[tuple[int, Any]], alignment: int, /
    ) -> tuple[int, bool]: ...

    def exists_many(self, paths: Sequence[str], /) -> list[int]: ...

    def list_dir_step(
        self, fd: int, nbytes: int, beat: Any, /
    ) -> tuple[list[tuple[str, tuple[int, ...]]], tuple[int, str] | None] | None: ...

    def read_files(
        self, paths: Sequence[str], file_nbytes: int, rows: Any, beat: Any, /
    ) -> list[int]: ...

    def check_rows(  # noqa: PLR0913 - the C function's arguments
        self,
        rows: Any,
        count: int,
        row_nbytes: int,
        equal: Sequence[tuple[int, Any]],
        zero: Sequence[tuple[int, int]],
        ranges: Sequence[tuple[int, int, int]],
        key: tuple[int, int, int],
        hash_hi: Sequence[int],
        hash_lo: Sequence[int],
        slots: tuple[int, int, int, int, int],
        crc_offset: int,
        xxh3: object,
        /,
    ) -> bytes: ...
    def read_pieces(  # noqa: PLR0913 - the C function's arguments
        self,
        blocks: Sequence[tuple[str, Any, Any]],
        flags: int,
        file_nbytes: int,
        header_nbytes: int,
        piece_nbytes: int,
        starts: Any,
        slot_of: Any,
        chunk_nbytes: int,
        slots_offset: int,
        touch_if_older_than_ns: int,
        alignment: int,
        xxh3: object,
        /,
    ) -> list[int]: ...

    def publish_pieces(  # noqa: PLR0913 - the C function's arguments
        self,
        blocks: Sequence[tuple[str, str, Any, Any]],
        flags: int,
        mode: int,
        file_nbytes: int,
        piece_nbytes: int,
        starts: Any,
        slot_of: Any,
        chunk_nbytes: int,
        slots_offset: int,
        index: Any,
        index_offset: int,
        alignment: int,
        xxh3: object,
        /,
    ) -> list[int]: ...


# Every function of NativeFileProto: an extension built from older sources lacks some, and is
# not used at all (one warning) rather than failing at the first call of a missing one.
REQUIRED_FUNCTIONS = tuple(
    name for name in NativeFileProto.__dict__ if not name.startswith("_") and name != "mro"
)


def _bind(module: ModuleType) -> tuple[NativeFileProto | None, str | None]:
    """The extension, once it is checked to be built for this platform's flag values."""
    missing = [name for name in REQUIRED_FUNCTIONS if not callable(getattr(module, name, None))]
    if missing:
        return None, (
            f"kvstore._native._fileproto lacks {', '.join(missing)}: built from older sources "
            "(reinstall kvstore to rebuild it)"
        )
    wrong = self_test(module.constants())
    if wrong is not None:
        return None, f"kvstore._native._fileproto failed its self-test: {wrong}"
    native: NativeFileProto = module
    return native, None


NATIVE_FILEPROTO = NativeBinding("kvstore._native._fileproto", _bind, "using the Python file calls")


def native_fileproto() -> NativeFileProto | None:
    """The bound extension, or None (the Python reference is used)."""
    return NATIVE_FILEPROTO.get()


def native_fileproto_unavailable() -> str | None:
    """Why the native file protocol is not used (binding it on first call), None when it is."""
    return NATIVE_FILEPROTO.unavailable()


def self_test(constants: dict[str, int]) -> str | None:
    """Where the extension's compiled flags differ from this Python's ``os`` (None if
    nowhere): a module built against other headers would open files without the rules."""
    expected = {
        "O_DIRECT": getattr(os, "O_DIRECT", 0),
        "O_NOFOLLOW": os.O_NOFOLLOW,
        "O_NONBLOCK": os.O_NONBLOCK,
        "O_CLOEXEC": os.O_CLOEXEC,
    }
    for name, value in expected.items():
        if constants.get(name) != value:
            return f"{name}: expected {value:#o}, got {constants.get(name)!r}"
    return None

"""The argument checks of the native file calls, in Python: the reference refuses what the C
refuses, with the same exception type, in the same order.

kvstore/_native/fileproto*.c check every argument before they touch memory (types, counts,
offsets and lengths against the buffers they index, alignment, overflow-checked sizes) and raise
TypeError, ValueError or OverflowError naming the argument. :class:`~kvstore.io.fileio.FileIO`'s
Python reference of each call runs these checks first, so that both give the same result for
every input (tests/native compares them over generated arguments). The order of the checks is
the C's: the first one that fails decides the exception. Scalars are converted as
``PyArg_ParseTuple`` converts them (``n``: any integer within ``Py_ssize_t``, ``i``: within a C
``int``), in argument order, before anything else.
"""

from __future__ import annotations

import operator
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.callargs import (
    address,
    buffer_view,
    cint,
    int64,
    native_words,
    path_bytes,
    snapshot,
    ssize,
    typed_view,
)
from kvstore.io.types import PiecePlan

# Linux's IOV_MAX; os.sysconf may not know it everywhere (kvstore/_native/fileproto_internal.h
# uses limits.h).
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
_SSIZE_MIN, _SSIZE_MAX = -sys.maxsize - 1, sys.maxsize


def check_mode(call: str, mode: int) -> None:
    if not 0 <= mode <= 0o7777:
        raise ValueError(f"{call}: expected a file mode 0..0o7777, got {mode}")


def check_segments(segments: object, writable: bool) -> list[tuple[int, memoryview]]:
    """The (offset, memory) pairs of a file call, checked as the C's ``kv_fp_acquire_segments``
    (kvstore/_native/fileproto_args.c) checks them: a sequence (snapshot) of 2-tuples, each
    offset an integer within 0..2**63-1, each memory a contiguous (writable) buffer that ends
    below 2**63. Offsets come back as ints (numpy integers accepted), memory as flat byte
    views."""
    items = snapshot(
        segments, "file protocol: expected segments as a sequence of (offset, buffer) pairs"
    )
    out: list[tuple[int, memoryview]] = []
    for i, item in enumerate(items):
        if not isinstance(item, tuple) or len(item) != 2:
            raise TypeError(
                f"file protocol: expected segment {i} as an (offset, buffer) pair, got "
                f"{type(item).__name__}"
            )
        try:
            offset = operator.index(item[0])
        except TypeError:
            raise TypeError(
                f"file protocol: expected segment {i}'s offset as an integer, got "
                f"{type(item[0]).__name__}"
            ) from None
        if offset > _SSIZE_MAX or offset < _SSIZE_MIN:
            raise OverflowError(
                f"file protocol: expected segment {i}'s offset below 2**63, got {offset}"
            )
        if offset < 0:
            raise ValueError(f"file protocol: expected segment {i} at an offset >= 0, got {offset}")
        view = buffer_view(item[1], writable)
        if view is None:
            kind = "writable contiguous" if writable else "contiguous"
            raise TypeError(
                f"file protocol: expected segment {i}'s memory as a {kind} buffer, got "
                f"{type(item[1]).__name__}"
            )
        if offset + len(view) > _SSIZE_MAX:
            raise OverflowError(
                f"file protocol: expected segment {i} to end below 2**63, got {len(view)} "
                f"bytes at {offset}"
            )
        out.append((offset, view))
    return out


def check_new_file(  # noqa: PLR0913 - write_new's arguments
    path: object,
    flags: int,
    mode: int,
    segments: object,
    buffered_from: int,
    file_nbytes: int,
    hashing: Sequence[int] = (),
) -> tuple[list[tuple[int, memoryview]], int, int]:
    """write_new's (and, with the ``hashing`` scalars first, last, chunk_nbytes and
    group_nbytes, write_new_hashed's first) checks, in the C's order: the segments, the
    flags and the mode as the C takes them (numpy integers as ints)."""
    flags = cint(flags, "flags")
    mode = cint(mode, "mode")
    ssize(buffered_from, "buffered_from")
    ssize(file_nbytes, "file_nbytes")
    for value in hashing:
        ssize(value, "hashing")
    path_bytes(path)
    check_mode("write_new", mode)
    checked = check_segments(segments, writable=False)
    if not 0 <= buffered_from <= len(checked) or file_nbytes < 0:
        raise ValueError(
            f"write_new: expected 0 <= buffered_from <= {len(checked)} segments and "
            f"file_nbytes >= 0, got {buffered_from} and {file_nbytes}"
        )
    return checked, flags, mode


def check_read(  # noqa: PLR0913 - read_regular's arguments
    path: object,
    flags: int,
    segments: object,
    file_nbytes: int,
    touch_if_older_than_ns: int,
    hashing: Sequence[int] = (),
    allow_trailer: object = False,
) -> tuple[list[tuple[int, memoryview]], int]:
    """read_regular's (and, with the ``hashing`` scalars, read_regular_hashed's first)
    checks, in the C's order: the segments and the flags as the C takes them."""
    flags = cint(flags, "flags")
    ssize(file_nbytes, "expected_size")
    bool(allow_trailer)  # PyArg's "p": the object's truth, which may raise
    int64(touch_if_older_than_ns, "touch_if_older_than_ns")
    for value in hashing:
        ssize(value, "hashing")
    path_bytes(path)
    if file_nbytes < 0:
        raise ValueError(f"read_regular: expected a file size >= 0, got {file_nbytes}")
    return check_segments(segments, writable=True), flags


def check_sync_and_rename(fd: int | None, src: object, dst: object) -> None:
    """sync_and_rename's checks: a descriptor (None: no sync), two names without NUL."""
    if fd is not None:
        cint(fd, "fd")
    path_bytes(src)
    path_bytes(dst)
    if fd is not None and fd < 0:
        raise ValueError(
            f"sync_and_rename: expected a descriptor >= 0, or None for no sync, got {fd}"
        )


def int64_values(call: str, array: object, what: str, count: int) -> np.ndarray:
    """``array`` as C-contiguous native int64 values aligned to 8 bytes (``count`` of them;
    any number when count < 0): TypeError for a non-buffer, ValueError for anything else."""
    view = typed_view(array)
    if view is None:
        raise TypeError(
            f"{call}: expected {what} as a C-contiguous int64 buffer, got {type(array).__name__}"
        )
    if not native_words(view, signed=True) or (count >= 0 and view.nbytes // 8 != count):
        raise ValueError(
            f"{call}: expected {what} as {count if count >= 0 else 'any number of'} int64 "
            f"values aligned to 8 bytes, got format '{view.format}', {view.nbytes} bytes"
        )
    return np.frombuffer(view, dtype=np.int64)


def overlaps(a: memoryview, b: memoryview) -> bool:
    """Whether two views share a byte of memory (kvstore/_native/fileproto_args.c
    ``kv_fp_overlaps``)."""
    if not len(a) or not len(b):
        return False
    a0, b0 = address(a), address(b)
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


def check_sums_apart(sums: object, hashed: Sequence[memoryview], first: int) -> None:
    """A hashed call's ``sums`` share no memory with the hashed segments (numbered from
    ``first``): they are written while those are hashed."""
    view = typed_view(sums)
    assert view is not None  # check_uint64_sums took it
    for i, data in enumerate(hashed, first):
        if overlaps(view, data):
            raise ValueError(
                "file protocol: expected sums apart from the hashed memory, got an overlap "
                f"with segment {i}"
            )


def check_uint64_sums(sums: object, chunks: int) -> None:
    """A hashed call's ``sums``: writable C-contiguous native uint64 values, at least
    ``chunks`` of them, aligned to 8 bytes (the C stores them as ``uint64_t``)."""
    view = typed_view(sums)
    if view is None or view.readonly:
        raise TypeError(
            "file protocol: expected sums as a writable C-contiguous uint64 buffer, got "
            f"{type(sums).__name__}"
        )
    if not native_words(view, signed=False) or view.nbytes // 8 < chunks:
        raise ValueError(
            f"file protocol: expected sums of at least {chunks} native uint64 values aligned "
            f"to 8 bytes, got format '{view.format}', {view.nbytes} bytes at address % 8 = "
            f"{address(view) % 8}"
        )


@dataclass(frozen=True)
class CheckedPieces:
    """A piece batch's geometry once checked: the arrays as int64, the derived sizes."""

    starts: np.ndarray
    slot_of: np.ndarray
    span_nbytes: int
    nchunks: int
    header_nbytes: int


def check_piece_plan(  # noqa: PLR0913 - the C call's scalars, in its order
    call: str,
    plan: PiecePlan,
    header_nbytes: int | None,
    flags: int,
    mode: int | None,
    touch_if_older_than_ns: int | None = None,
) -> CheckedPieces:
    """publish_pieces' (``header_nbytes`` None: the header is what precedes the pieces before
    the index) or read_pieces' geometry checks, in the C's order: the pieces tile the span in
    whole chunks, slot_of is the chunk order their starts give, the checksum slots lie in the
    header, header, span and index in the file."""
    p = plan
    publishing = header_nbytes is None
    cint(flags, "flags")
    if publishing:
        cint(mode, "mode")
    file_nbytes = ssize(p.file_nbytes, "file_nbytes")
    if header_nbytes is not None:
        ssize(header_nbytes, "header_nbytes")
    piece = ssize(p.piece_nbytes, "piece_nbytes")
    chunk = ssize(p.chunk_nbytes, "chunk_nbytes")
    slots_offset = ssize(p.slots_offset, "slots_offset")
    if not publishing:
        int64(touch_if_older_than_ns, "touch_if_older_than_ns")
    if header_nbytes is None:
        ssize(p.index_offset, "index_offset")
    alignment = ssize(p.alignment, "alignment")
    if publishing:
        check_mode(call, mode)  # type: ignore[arg-type]
    starts = int64_values(call, p.starts, "starts", -1)
    npieces = len(starts)
    if (
        piece <= 0
        or chunk <= 0
        or piece % chunk
        or alignment <= 0
        or npieces <= 0
        or npieces > IOV_MAX - 2
    ):
        raise ValueError(
            f"{call}: expected 1..{IOV_MAX - 2} pieces of whole chunks and an alignment > 0, "
            f"got {npieces} pieces of {piece} bytes, chunks of {chunk}, alignment {alignment}"
        )
    span = npieces * piece
    if span > _SSIZE_MAX:
        raise OverflowError(
            f"{call}: expected a span below 2**63 bytes, got {npieces} pieces of {piece} bytes"
        )
    nchunks = span // chunk
    slot_of = int64_values(call, p.slot_of, "slot_of", nchunks)
    _check_piece_places(call, starts, slot_of, piece, chunk, span)
    if header_nbytes is None:
        header_nbytes = _header_before_index(call, p, file_nbytes, span)
    if file_nbytes < 0 or slots_offset < 0 or header_nbytes < 0:
        raise ValueError(
            f"{call}: expected file_nbytes, slots_offset and the header's size >= 0, got "
            f"{file_nbytes}, {slots_offset} and {header_nbytes}"
        )
    slots_end = slots_offset + 8 * nchunks
    if slots_end > _SSIZE_MAX or header_nbytes + span > _SSIZE_MAX:
        raise OverflowError(
            f"{call}: expected the slots ({nchunks} at {slots_offset}) and the "
            f"{header_nbytes}-byte header and span to end below 2**63"
        )
    if slots_end > header_nbytes or header_nbytes + span > file_nbytes:
        raise ValueError(
            f"{call}: expected {nchunks} checksum slots at {slots_offset} inside the "
            f"{header_nbytes}-byte header, and header and {span}-byte span inside the "
            f"{file_nbytes}-byte file"
        )
    return CheckedPieces(starts, slot_of, span, nchunks, header_nbytes)


def _header_before_index(call: str, p: PiecePlan, file_nbytes: int, span: int) -> int:
    """publish_pieces' index checks: a buffer inside the file after the span; the header is
    what comes before the pieces (they end where the index starts)."""
    index_offset = operator.index(p.index_offset)  # a numpy integer would wrap below
    index = buffer_view(p.index, writable=False)
    if index is None:
        raise TypeError(
            f"{call}: expected the index as a contiguous buffer, got {type(p.index).__name__}"
        )
    if index_offset < 0:
        raise ValueError(f"{call}: expected the index at an offset >= 0, got {index_offset}")
    if index_offset + len(index) > _SSIZE_MAX:
        raise OverflowError(
            f"{call}: expected the {len(index)}-byte index at {index_offset} to end below 2**63"
        )
    if index_offset + len(index) > file_nbytes or index_offset < span:
        raise ValueError(
            f"{call}: expected the {len(index)}-byte index at {index_offset} inside the "
            f"{file_nbytes}-byte file, after the {span}-byte span"
        )
    return index_offset - span


def _check_piece_places(  # noqa: PLR0913 - the geometry, one argument each
    call: str,
    starts: np.ndarray,
    slot_of: np.ndarray,
    piece: int,
    chunk: int,
    span: int,
) -> None:
    """The pieces tile the span (each start a multiple of ``piece``, each place once) and
    ``slot_of`` is the order that follows (kvstore/_native/fileproto_piece_args.c
    ``check_piece_places``)."""
    npieces = len(starts)
    piece_at = [-1] * npieces
    for k, start in enumerate(starts.tolist()):
        place = start // piece if start >= 0 else -1
        if start < 0 or start % piece or place >= npieces or piece_at[place] >= 0:
            raise ValueError(
                f"{call}: expected the starts to tile the {span}-byte span with pieces of "
                f"{piece} bytes (each a multiple of it, once), got {start} for piece {k}"
            )
        piece_at[place] = k
    per_piece = piece // chunk
    s = np.arange(len(slot_of), dtype=np.int64)
    expected = np.asarray(piece_at, dtype=np.int64)[s // per_piece] * per_piece + s % per_piece
    wrong = np.flatnonzero(expected != slot_of)
    if wrong.size:
        at = int(wrong[0])
        raise ValueError(
            f"{call}: expected slot_of[{at}] = {int(expected[at])} (the chunk order the starts "
            f"give), got {int(slot_of[at])}"
        )


def check_piece_blocks(
    call: str, blocks: Iterable[object], checked: CheckedPieces, reading: bool
) -> list[tuple[bytes | None, bytes, memoryview, memoryview]]:
    """The blocks of a piece batch, checked as the C's ``kv_fp_acquire_piece_blocks``
    (kvstore/_native/fileproto_piece_args.c) checks them:
    (tmp, final, header, span) tuples (reads: (path, header, span)), names without NUL, a
    writable header of the plan's size, a span of the plan's size (writable for reads).
    Returns (tmp or None, final/path, header, span) with names as bytes."""
    size = 3 if reading else 4
    shape = "(path, header, span)" if reading else "(tmp, final, header, span)"
    items = snapshot(blocks, "file protocol: expected the blocks as a sequence of tuples")
    out: list[tuple[bytes | None, bytes, memoryview, memoryview]] = []
    for i, item in enumerate(items):
        if not isinstance(item, tuple) or len(item) != size:
            raise TypeError(
                f"{call}: expected block {i} as a {shape} tuple, got {type(item).__name__}"
            )
        tmp = None if reading else path_bytes(item[0])
        final = path_bytes(item[size - 3])
        header = buffer_view(item[size - 2], writable=True)
        if header is None:
            raise TypeError(
                f"{call}: expected block {i}'s header as a writable contiguous buffer, got "
                f"{type(item[size - 2]).__name__}"
            )
        span = buffer_view(item[size - 1], writable=reading)
        if span is None:
            raise TypeError(
                f"{call}: expected block {i}'s span as a {'writable ' if reading else ''}"
                f"contiguous buffer, got {type(item[size - 1]).__name__}"
            )
        if len(header) != checked.header_nbytes or len(span) != checked.span_nbytes:
            raise ValueError(
                f"{call}: block {i}: expected a header of {checked.header_nbytes} bytes and a "
                f"span of {checked.span_nbytes} bytes, got {len(header)} and {len(span)}"
            )
        if overlaps(header, span):
            raise ValueError(
                f"{call}: block {i}: expected its header and span in separate memory, got an "
                "overlap"
            )
        out.append((tmp, final, header, span))
    return out


def check_paths(paths: Sequence[object] | Iterable[object]) -> list[bytes]:
    """exists_many's names: a snapshot, each as bytes without NUL."""
    items = snapshot(paths, "exists_many: expected a sequence of paths")
    return [path_bytes(p) for p in items]


def check_read_files(
    paths: object, file_nbytes: object, rows: object
) -> tuple[list[bytes], int, memoryview]:
    """read_files' arguments, in the C's order (kvstore/_native/fileproto_scan.c): the size
    (an integer within ``Py_ssize_t``, > 0), the paths (a snapshot, each as bytes without
    NUL), the rows (a writable contiguous buffer of at least one row per path, the total
    below 2**63). The names, the size as an int and the rows as a flat byte view."""
    size = ssize(file_nbytes, "read_files")
    if size <= 0:
        raise ValueError(f"read_files: expected a file size > 0, got {size}")
    names = [path_bytes(p) for p in snapshot(paths, "read_files: expected a sequence of paths")]
    view = buffer_view(rows, writable=True)
    if view is None:
        raise TypeError(
            f"read_files: expected the rows as a writable contiguous buffer, got "
            f"{type(rows).__name__}"
        )
    need = len(names) * size
    if need > _SSIZE_MAX:
        raise OverflowError(
            f"read_files: expected {len(names)} files of {size} bytes to fit below 2**63 bytes"
        )
    if len(view) < need:
        raise ValueError(
            f"read_files: expected rows of at least {need} bytes ({len(names)} files of {size}), "
            f"got {len(view)}"
        )
    return names, size, view


@dataclass(frozen=True)
class CheckedRows:
    """check_rows' arguments once checked: the rows as a flat byte view and each rule as plain
    integers and bytes (kvstore/_native/fileproto_rows.c)."""

    view: memoryview
    count: int
    row_nbytes: int
    equal: list[tuple[int, bytes]]
    zero: list[tuple[int, int]]
    ranges: list[tuple[int, int, int]]
    key: tuple[int, int, int]
    hash_hi: list[int]
    hash_lo: list[int]
    slots: tuple[int, int, int, int, int]
    crc_offset: int


def check_rows_args(  # noqa: PLR0913 - check_rows' arguments, in the C's order
    rows: object,
    count: object,
    row_nbytes: object,
    equal: object,
    zero: object,
    ranges: object,
    key: object,
    hash_hi: object,
    hash_lo: object,
    slots: object,
    crc_offset: object,
) -> CheckedRows:
    """check_rows' arguments, in the C's order: the scalars (count, row size, crc offset, as
    ``n``), count >= 0 and row size > 0, the rows (a contiguous buffer of at least count rows,
    the total below 2**63), the equal, zero and range rules, the key and slot rules, the crc
    rule (each within a row), then the coordinates (one per row, hash_hi in 0..255, hash_lo in
    0..2**(64 - lo_shift) - 1)."""
    n = ssize(count, "check_rows")
    size = ssize(row_nbytes, "check_rows")
    crc = ssize(crc_offset, "check_rows")
    if n < 0 or size <= 0:
        raise ValueError(
            f"check_rows: expected a row count >= 0 and a row size > 0, got {n} rows of {size} "
            "bytes"
        )
    view = buffer_view(rows, writable=False)
    if view is None:
        raise TypeError(f"check_rows: expected the rows as a contiguous buffer, got {type(rows)}")
    if n * size > _SSIZE_MAX:
        raise OverflowError(f"check_rows: expected {n} rows of {size} bytes to fit below 2**63")
    if len(view) < n * size:
        raise ValueError(f"check_rows: expected rows of at least {n * size} bytes, got {len(view)}")
    equal_rules = [
        _equal_rule(item, i, size)
        for i, item in enumerate(
            snapshot(equal, "check_rows: expected the equal rules as (offset, bytes) pairs")
        )
    ]
    zero_rules = []
    for i, item in enumerate(snapshot(zero, "check_rows: expected the zero rules as pairs")):
        offset, length = _rule_ints(item, 2, "zero rule", i)
        _within_row(size, offset, length, "zero rule", i)
        zero_rules.append((offset, length))
    range_rules = []
    for i, item in enumerate(snapshot(ranges, "check_rows: expected the range rules")):
        offset, low, high = _rule_ints(item, 3, "range rule", i)
        _within_row(size, offset, 1, "range rule", i)
        if not 0 <= low <= high <= 255:
            raise ValueError(f"check_rows: expected range rule {i}'s bounds in 0..255")
        range_rules.append((offset, low, high))
    hi_offset, lo_offset, lo_shift = _rule_ints(key, 3, "key rule", 0)
    _within_row(size, hi_offset, 1, "key rule", 0)
    _within_row(size, lo_offset, 8, "key rule", 0)
    if not 1 <= lo_shift <= 63:
        raise ValueError(f"check_rows: expected the key's lo_shift in 1..63, got {lo_shift}")
    slot_rule = _rule_ints(slots, 5, "slot rule", 0)
    slots_offset, chunks, first, stride, chunk_nbytes = slot_rule
    if chunks < 0 or chunk_nbytes <= 0 or stride < chunk_nbytes:
        raise ValueError("check_rows: expected chunks >= 0 and 0 < chunk_nbytes <= stride")
    _within_row(size, slots_offset, min(8 * chunks, _SSIZE_MAX), "slot rule's slots", 0)
    span = min((chunks - 1) * stride + chunk_nbytes, _SSIZE_MAX) if chunks else 0
    _within_row(size, first, span, "slot rule's chunks", 0)
    _within_row(size, crc, 4, "crc rule", 0)
    return CheckedRows(
        view,
        n,
        size,
        equal_rules,
        zero_rules,
        range_rules,
        (hi_offset, lo_offset, lo_shift),
        _coords(hash_hi, n, 255, "hash_hi"),
        _coords(hash_lo, n, (1 << (64 - lo_shift)) - 1, "hash_lo"),
        (slots_offset, chunks, first, stride, chunk_nbytes),
        crc,
    )


def _rule_ints(item: object, n: int, what: str, index: int) -> tuple[int, ...]:
    """One rule as ``n`` integers within ``Py_ssize_t`` (the C's ``rule_ints``)."""
    wrong = TypeError(f"check_rows: expected {what} {index} as a sequence of {n} integers")
    try:
        values: tuple[Any, ...] = tuple(item)  # type: ignore[arg-type]
    except TypeError:
        raise wrong from None
    if len(values) != n:
        raise wrong
    out = []
    for value in values:
        try:
            number = operator.index(value)
        except TypeError:
            raise wrong from None
        if not _SSIZE_MIN <= number <= _SSIZE_MAX:
            raise OverflowError(f"check_rows: expected {what} {index}'s integers within 2**63")
        out.append(number)
    return tuple(out)


def _equal_rule(item: object, index: int, row_nbytes: int) -> tuple[int, bytes]:
    if not isinstance(item, tuple) or len(item) != 2:
        raise TypeError(f"check_rows: expected equal rule {index} as an (offset, bytes) pair")
    try:
        offset = operator.index(item[0])
    except TypeError:
        raise TypeError(f"check_rows: expected equal rule {index}'s offset as an integer") from None
    if not _SSIZE_MIN <= offset <= _SSIZE_MAX:
        raise OverflowError(f"check_rows: expected equal rule {index}'s offset within 2**63")
    view = buffer_view(item[1], writable=False)
    if view is None:
        raise TypeError(f"check_rows: expected equal rule {index}'s bytes as a contiguous buffer")
    _within_row(row_nbytes, offset, len(view), "equal rule", index)
    return offset, view.tobytes()


def _within_row(row_nbytes: int, offset: int, length: int, what: str, index: int) -> None:
    if offset < 0 or length < 0 or offset + length > row_nbytes:
        raise ValueError(
            f"check_rows: expected {what} {index} within a row of {row_nbytes} bytes, got "
            f"{length} bytes at {offset}"
        )


def _coords(values: object, count: int, most: int, what: str) -> list[int]:
    items = snapshot(values, "check_rows: expected the coordinates as a sequence of integers")
    if len(items) != count:
        raise ValueError(f"check_rows: expected {count} {what} values, got {len(items)}")
    out = []
    for i, item in enumerate(items):
        try:
            value = operator.index(item)
        except TypeError:
            raise TypeError(f"check_rows: expected {what}[{i}] as an integer") from None
        if not 0 <= value <= most:
            raise ValueError(f"check_rows: expected {what}[{i}] in 0..{most}")
        out.append(value)
    return out

"""Whole vectored writes and reads over a file object's ``pwritev``/``preadv`` primitives.

The loops the Python reference of every file call is made of (:class:`~kvstore.io.fileio.FileIO`
and :mod:`kvstore.io.piece_batch`): runs of file-contiguous segments, ``IOV_MAX`` batches,
short transfers resumed. Empty buffers move nothing and are passed over, as the C loops of
kvstore/_native/fileproto_transfer.c pass them over: an empty segment is no write at all, never a
write that "made no progress".
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from typing import Any, Protocol

from kvstore.errors import CorruptBlockError
from kvstore.io.callcheck import IOV_MAX
from kvstore.io.types import Segment


class VectoredFile(Protocol):
    """The primitives these loops call (:class:`~kvstore.io.fileio.FileIO` has them)."""

    def pwritev(self, fd: int, buffers: Sequence[Any], offset: int) -> int: ...

    def preadv(self, fd: int, buffers: Sequence[Any], offset: int) -> int: ...

    def clear_direct(self, fd: int, open_flags: int | None = None) -> None: ...


O_DIRECT: int = getattr(os, "O_DIRECT", 0)


def coalesce(segments: Sequence[Segment]) -> list[tuple[int, list[memoryview]]]:
    """Group file-contiguous segments into (offset, buffers) runs for one vectored call each."""
    n = len(segments)
    if n == 1:
        offset, data = segments[0]
        return [(offset, [data])]
    if n == 2:  # the common case of a small block: header, then the data right after it
        (first, head), (second, tail) = segments
        if second == first + len(head):
            return [(first, [head, tail])]
    runs: list[tuple[int, list[memoryview]]] = []
    end = -1
    for offset, data in segments:
        if offset == end:
            runs[-1][1].append(data)
        else:
            runs.append((offset, [data]))
        end = offset + len(data)
    return runs


def write_fully(fio: VectoredFile, fd: int, buffers: Sequence[Any], offset: int) -> int:
    """``pwritev`` all of ``buffers`` at ``offset``, in IOV_MAX batches, retrying short writes;
    returns the bytes written (all of them).

    A write that makes no progress raises ``OSError(ENOSPC)`` rather than looping forever.
    """
    pending = _nonempty(buffers)
    pos = offset
    while pending:
        # The common case, all of it in one call, slices nothing.
        batch = pending if len(pending) <= IOV_MAX else pending[:IOV_MAX]
        want = sum(map(len, batch))
        done = fio.pwritev(fd, batch, pos)
        if done <= 0:
            raise OSError(errno.ENOSPC, "pwritev made no progress")
        pos += done
        pending = _advance(pending, done) if done < want else pending[len(batch) :]
    return pos - offset


def read_fully(fio: VectoredFile, fd: int, buffers: Sequence[Any], offset: int) -> int:
    """``preadv`` into all of ``buffers`` from ``offset``; returns bytes read (short at EOF)."""
    pending = _nonempty(buffers)
    pos = offset
    total = 0
    while pending:
        batch = pending if len(pending) <= IOV_MAX else pending[:IOV_MAX]
        want = sum(map(len, batch))
        done = fio.preadv(fd, batch, pos)
        if done <= 0:
            return total
        total += done
        pos += done
        pending = _advance(pending, done) if done < want else pending[len(batch) :]
    return total


def _advance(buffers: list[memoryview], nbytes: int) -> list[memoryview]:
    """``buffers`` with the first ``nbytes`` consumed."""
    out = list(buffers)
    while nbytes:
        head = out[0]
        if len(head) <= nbytes:
            nbytes -= len(head)
            out.pop(0)
        else:
            out[0] = head[nbytes:]
            nbytes = 0
    return out


def _nonempty(buffers: Sequence[Any]) -> list[memoryview]:
    """``buffers`` as flat byte views, the empty ones left out."""
    views = [memoryview(b).cast("B") for b in buffers]
    return [v for v in views if len(v)] if not all(views) else views


def write_runs(  # noqa: PLR0913 - the file, its flags, which segments, where direct ends
    fio: VectoredFile,
    fd: int,
    flags: int,
    segments: Sequence[Segment],
    lo: int,
    hi: int,
    buffered_from: int,
    end: int,
) -> int:
    """Segments ``[lo, hi)`` written one vectored write per file-contiguous run, O_DIRECT
    cleared before segment ``buffered_from`` (when the flags hold it); returns the furthest
    byte written (``end`` or beyond)."""
    if lo < buffered_from:
        for offset, buffers in coalesce(segments[lo : min(hi, buffered_from)]):
            end = max(end, offset + write_fully(fio, fd, buffers, offset))
    if hi > buffered_from:
        if flags & O_DIRECT and lo <= buffered_from:
            fio.clear_direct(fd, flags)
        for offset, buffers in coalesce(segments[max(lo, buffered_from) : hi]):
            end = max(end, offset + write_fully(fio, fd, buffers, offset))
    return end


def check_size(size: int, file_nbytes: int, allow_trailer: bool) -> None:
    """A file of ``size`` bytes where ``file_nbytes`` are expected is :class:`CorruptBlockError`
    (``allow_trailer``: longer is fine)."""
    if size != file_nbytes and not (allow_trailer and size > file_nbytes):
        raise CorruptBlockError(f"file size: expected {file_nbytes} bytes, got {size}")


def read_run(fio: VectoredFile, fd: int, buffers: Sequence[Any], offset: int) -> None:
    """Fill ``buffers`` from ``offset`` of ``fd``; a short read is :class:`CorruptBlockError`."""
    want = sum(map(len, buffers))
    got = read_fully(fio, fd, buffers, offset)
    if got != want:
        raise CorruptBlockError(_short_read(offset, want, got))


def _short_read(offset: int, want: int, got: int) -> str:
    return f"short read at {offset}: expected {want}, got {got}"


def check_run(short: tuple[int, int, int] | None) -> None:
    """The native read's short run ``(offset, expected, got)``, if any, as
    :func:`read_run` raises it."""
    if short is not None:
        raise CorruptBlockError(_short_read(*short))

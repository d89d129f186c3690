"""The Python reference of the native piece batches (``publish_pieces``, ``read_pieces``).

kvstore/_native/fileproto_pieces.c writes or reads a batch of raw dense blocks given as pieces in
one call without the GIL. These functions do the same steps with a
:class:`~kvstore.io.fileio.FileIO`'s primitives, block by block, and return the same per-block
statuses (:data:`PUBLISHED`, :data:`ALREADY_THERE`, :data:`VERIFIED` or ``-errno``); they run
wherever the extension does not (``KVSTORE_NATIVE=off``, a FileIO subclass), and tests/native
holds the two to each other.
The arguments are checked first, as the C checks them (:mod:`kvstore.io.callcheck`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import operator
import os
import stat
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from kvstore.callargs import address, buffer_view
from kvstore.checksum import XXH3_64, chunk_sums
from kvstore.io.callcheck import CheckedPieces, check_piece_blocks, check_piece_plan
from kvstore.io.rename import renameat2_noreplace
from kvstore.io.types import ALREADY_THERE, PUBLISHED, VERIFIED, PiecePlan
from kvstore.io.vectored import O_DIRECT, VectoredFile, read_fully, write_runs


class BatchFile(VectoredFile, Protocol):
    """The primitives the references call (:class:`~kvstore.io.fileio.FileIO` has them)."""

    def open(self, path: str, flags: int, mode: int = 0o600) -> int: ...

    def fstat(self, fd: int) -> os.stat_result: ...

    def close(self, fd: int) -> None: ...

    def ftruncate(self, fd: int, length: int) -> None: ...

    def touch(self, fd: int) -> None: ...


def publish_pieces(
    fio: BatchFile, blocks: Sequence[object], flags: int, mode: int, plan: PiecePlan
) -> list[int]:
    """:meth:`FileIO.publish_pieces <kvstore.io.fileio.FileIO.publish_pieces>` in Python: the same
    checks, steps and statuses as the native call, through ``fio``'s primitives."""
    checked = check_piece_plan("publish_pieces", plan, None, flags, mode)
    items = check_piece_blocks("publish_pieces", blocks, checked, reading=False)
    flags, mode = operator.index(flags), operator.index(mode)  # numpy integers too
    plan = _plain(plan, publishing=True)
    index = buffer_view(plan.index, writable=False)
    assert index is not None  # checked above
    outcomes = []
    for tmp, final, header, span in items:
        assert tmp is not None  # a publish block has both names
        outcomes.append(
            _publish_one(fio, plan, checked, (tmp, final), header, span, flags, mode, index)
        )
    return outcomes


def read_pieces(  # noqa: PLR0913 - the C call's arguments
    fio: BatchFile,
    blocks: Sequence[object],
    flags: int,
    header_nbytes: int,
    plan: PiecePlan,
    touch_if_older_than_ns: int,
) -> list[int]:
    """:meth:`FileIO.read_pieces <kvstore.io.fileio.FileIO.read_pieces>` in Python."""
    checked = check_piece_plan(
        "read_pieces", plan, header_nbytes, flags, None, touch_if_older_than_ns
    )
    items = check_piece_blocks("read_pieces", blocks, checked, reading=True)
    flags = operator.index(flags)
    touch_if_older_than_ns = operator.index(touch_if_older_than_ns)
    plan = _plain(plan, publishing=False)
    return [
        _read_one(fio, plan, checked, path, header, span, flags, touch_if_older_than_ns)
        for _, path, header, span in items
    ]


def _plain(plan: PiecePlan, publishing: bool) -> PiecePlan:
    """``plan`` with its sizes as Python ints (numpy integers are taken, as the C takes them,
    but must not meet machine addresses in numpy arithmetic)."""
    return dataclasses.replace(
        plan,
        file_nbytes=operator.index(plan.file_nbytes),
        piece_nbytes=operator.index(plan.piece_nbytes),
        chunk_nbytes=operator.index(plan.chunk_nbytes),
        slots_offset=operator.index(plan.slots_offset),
        # a read has no index: its offset is not an argument of the call
        index_offset=operator.index(plan.index_offset) if publishing else 0,
        alignment=operator.index(plan.alignment),
    )


def _aligned(plan: PiecePlan, checked: CheckedPieces, header: memoryview, span: memoryview) -> bool:
    """Whether every byte an O_DIRECT transfer of the block moves is aligned: the header and
    every piece, in address and length (kvstore/_native/fileproto_pieces.c
    ``piece_block_aligned``)."""
    a = plan.alignment
    base = address(span)
    if address(header) % a or len(header) % a or plan.piece_nbytes % a:
        return False
    return all((base + int(start)) % a == 0 for start in checked.starts)


def _segments(
    plan: PiecePlan, checked: CheckedPieces, header: memoryview, span: memoryview
) -> list[tuple[int, memoryview]]:
    """The header at 0, then the pieces back to back in piece order."""
    size = plan.piece_nbytes
    segments = [(0, header)]
    for k, start in enumerate(checked.starts.tolist()):
        segments.append((len(header) + k * size, span[start : start + size]))
    return segments


def _slots(plan: PiecePlan, checked: CheckedPieces, header: memoryview) -> np.ndarray:
    """The header's checksum slots, as native uint64 values over its memory."""
    raw = np.frombuffer(header, dtype=np.uint8)
    at = plan.slots_offset
    return raw[at : at + 8 * checked.nchunks].view(np.uint64)


def _publish_one(  # noqa: PLR0913 - one block of the batch and the plan it shares
    fio: BatchFile,
    plan: PiecePlan,
    checked: CheckedPieces,
    names: tuple[bytes, bytes],
    header: memoryview,
    span: memoryview,
    flags: int,
    mode: int,
    index: memoryview,
) -> int:
    """kvstore/_native/fileproto_pieces.c ``publish_piece_block``, step for step."""
    tmp, final = names
    try:
        st = os.lstat(final)
    except FileNotFoundError:
        pass
    except OSError as exc:
        return -(exc.errno or errno.EIO)
    else:
        return ALREADY_THERE if stat.S_ISREG(st.st_mode) else -errno.EEXIST
    sums = chunk_sums(XXH3_64, span, plan.chunk_nbytes, checked.nchunks)
    _slots(plan, checked, header)[checked.slot_of] = sums
    direct = bool(flags & O_DIRECT) and _aligned(plan, checked, header, span)
    open_flags = flags if direct else flags & ~O_DIRECT
    segments = [*_segments(plan, checked, header, span), (plan.index_offset, index)]
    try:
        fd = fio.open(tmp, open_flags, mode)  # type: ignore[arg-type]
    except OSError as exc:
        return -(exc.errno or errno.EIO)
    err = 0
    try:
        n = len(segments)  # the index, last, goes buffered after a direct header and pieces
        end = write_runs(fio, fd, open_flags, segments, 0, n, n - 1 if direct else n, 0)
        if end != plan.file_nbytes:
            fio.ftruncate(fd, plan.file_nbytes)
    except OSError as exc:
        err = exc.errno or errno.EIO
    try:
        fio.close(fd)
    except OSError as exc:
        if not err and exc.errno != errno.EINTR:
            err = exc.errno or errno.EIO
    if not err:
        err = renameat2_noreplace(tmp, final)
        if not err:
            return PUBLISHED
    with contextlib.suppress(OSError):
        os.unlink(tmp)
    # The rename found the block there: another writer published it since the probe.
    return ALREADY_THERE if err == errno.EEXIST else -err


def _read_one(  # noqa: PLR0913 - one block of the batch and the plan it shares
    fio: BatchFile,
    plan: PiecePlan,
    checked: CheckedPieces,
    path: bytes,
    header: memoryview,
    span: memoryview,
    flags: int,
    touch_if_older_than_ns: int,
) -> int:
    """kvstore/_native/fileproto_pieces.c ``read_piece_block``, step for step."""
    direct = bool(flags & O_DIRECT) and _aligned(plan, checked, header, span)
    open_flags = flags if direct else flags & ~O_DIRECT
    try:
        fd = fio.open(path, open_flags)  # type: ignore[arg-type]
    except OSError as exc:
        return -(exc.errno or errno.EIO)
    err = 0
    try:
        st = fio.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != plan.file_nbytes:
            err = errno.EBADMSG
        else:
            buffers = [data for _, data in _segments(plan, checked, header, span)]
            if read_fully(fio, fd, buffers, 0) != len(header) + checked.span_nbytes:
                err = errno.EBADMSG
            elif st.st_mtime_ns < touch_if_older_than_ns:
                with contextlib.suppress(OSError):  # best effort, as read_regular
                    fio.touch(fd)
    except OSError as exc:
        err = exc.errno or errno.EIO
    finally:
        with contextlib.suppress(OSError):
            fio.close(fd)
    if err:
        return -err
    sums = chunk_sums(XXH3_64, span, plan.chunk_nbytes, checked.nchunks)
    if not np.array_equal(_slots(plan, checked, header)[checked.slot_of], sums):
        return -errno.EBADMSG
    return VERIFIED

"""The compound file operations as one GIL-free call each of ``kvstore._native._fileproto``.

:class:`NativeFileIO` is :class:`~kvstore.io.fileio.FileIO` with its compound operations
(:meth:`~FileIO.exists_many`, :meth:`~FileIO.write_new`, :meth:`~FileIO.write_new_hashed`,
:meth:`~FileIO.read_regular`, :meth:`~FileIO.read_regular_hashed`,
:meth:`~FileIO.sync_and_rename`, the piece batches, :meth:`~FileIO.read_files`) run by the C
extension when :func:`~kvstore.io.fileproto.native_fileproto` binds it (``KVSTORE_NATIVE``),
and by the Python reference they override otherwise (the same results, errors and bytes on
disk: tests/native holds the two to each other). The primitives are FileIO's, so the tools'
walks and every non-compound call behave alike either way. :data:`DEFAULT_FILEIO` is the one
every store and engine uses unless given another; a test that injects faults subclasses
FileIO instead, so that every step of a compound operation goes through its overrides.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.callargs import snapshot
from kvstore.checksum import XXH3_64, native_xxh3_capsule
from kvstore.errors import CorruptBlockError
from kvstore.io import stall
from kvstore.io.entries import FileId, not_regular
from kvstore.io.fileio import O_DIRECT, FileIO, check_sync_fd, refused_open
from kvstore.io.fileproto import NativeFileProto, ReadOutcome, native_fileproto
from kvstore.io.types import Hashing, PieceBlock, PiecePlan, Segment
from kvstore.io.vectored import check_run, check_size


class NativeFileIO(FileIO):
    """FileIO whose compound operations run natively where the extension is bound."""

    def exists_many(self, paths: Sequence[str]) -> list[bool | OSError]:
        """:meth:`FileIO.exists_many` in one native call; a name that is neither a regular
        file nor absent is asked about again through :meth:`exists`, for the words."""
        native = native_fileproto()
        if native is None:
            return super().exists_many(paths)
        names = snapshot(paths, "exists_many: expected a sequence of paths")
        codes = native.exists_many(names)
        return [
            code == 1 if code >= 0 else self._exists_or_error(p)
            for p, code in zip(names, codes, strict=True)
        ]

    def write_new(  # noqa: PLR0913 - FileIO.write_new's signature
        self,
        path: str,
        flags: int,
        mode: int,
        segments: Sequence[Segment],
        file_nbytes: int,
        buffered_from: int | None = None,
    ) -> int:
        native = native_fileproto()
        if native is None:
            return super().write_new(path, flags, mode, segments, file_nbytes, buffered_from)
        stop = len(segments) if buffered_from is None else buffered_from
        return native.write_new(path, flags, mode, segments, stop, file_nbytes)

    def write_new_hashed(  # noqa: PLR0913 - FileIO.write_new_hashed's signature
        self,
        path: str,
        flags: int,
        mode: int,
        segments: Sequence[Segment],
        file_nbytes: int,
        hashing: Hashing,
        buffered_from: int | None = None,
    ) -> int:
        bound = _hashing_binding(hashing)
        if bound is None:
            return super().write_new_hashed(
                path, flags, mode, segments, file_nbytes, hashing, buffered_from
            )
        native, xxh3 = bound
        h = hashing
        stop = len(segments) if buffered_from is None else buffered_from
        return native.write_new_hashed(
            path, flags, mode, segments, stop, file_nbytes,
            h.first, h.last, h.chunk_nbytes, h.group_nbytes, h.sums, xxh3,
        )  # fmt: skip

    def read_regular(  # noqa: PLR0913 - FileIO.read_regular's signature
        self,
        path: str,
        flags: int,
        segments: Sequence[Segment],
        file_nbytes: int,
        allow_trailer: bool = False,
        touch_if_older_than_ns: int = 0,
    ) -> FileId:
        native = native_fileproto()
        if native is None:
            return super().read_regular(
                path, flags, segments, file_nbytes, allow_trailer, touch_if_older_than_ns
            )
        try:
            outcome = native.read_regular(
                path, flags, segments, file_nbytes, allow_trailer, touch_if_older_than_ns
            )
        except OSError as exc:
            refused = refused_open(path, exc)
            if refused is exc:
                raise
            raise refused from None
        return _native_read(path, outcome, file_nbytes, allow_trailer)

    def read_regular_hashed(  # noqa: PLR0913 - FileIO.read_regular_hashed's signature
        self,
        path: str,
        flags: int,
        segments: Sequence[Segment],
        file_nbytes: int,
        hashing: Hashing,
        touch_if_older_than_ns: int = 0,
    ) -> FileId:
        bound = _hashing_binding(hashing)
        if bound is None:
            return super().read_regular_hashed(
                path, flags, segments, file_nbytes, hashing, touch_if_older_than_ns
            )
        native, xxh3 = bound
        h = hashing
        try:
            outcome = native.read_regular_hashed(
                path, flags, segments, file_nbytes, touch_if_older_than_ns,
                h.first, h.last, h.chunk_nbytes, h.group_nbytes, h.sums, xxh3,
            )  # fmt: skip
        except OSError as exc:
            refused = refused_open(path, exc)
            if refused is exc:
                raise
            raise refused from None
        return _native_read(path, outcome, file_nbytes, False)

    def sync_and_rename(self, fd: int | None, tmp: str, final: str) -> None:
        check_sync_fd(fd)
        native = native_fileproto()
        if native is None:
            super().sync_and_rename(fd, tmp, final)
            return
        if not native.sync_and_rename(-1 if fd is None else fd, tmp, final):
            self.rename(tmp, final)  # no renameat2 here: rename_noreplace's fallbacks

    @property
    def native_piece_batches(self) -> bool:
        """Both extensions bound, on a little-endian machine (the header's slots are
        little-endian uint64)."""
        return (
            sys.byteorder == "little"
            and native_fileproto() is not None
            and native_xxh3_capsule() is not None
        )

    def publish_pieces(
        self, blocks: Sequence[PieceBlock], flags: int, mode: int, plan: PiecePlan
    ) -> list[int]:
        bound = self._piece_batch_binding()
        if bound is None:
            return super().publish_pieces(blocks, flags, mode, plan)
        native, xxh3 = bound
        return native.publish_pieces(
            blocks, flags, mode, plan.file_nbytes, plan.piece_nbytes, plan.starts, plan.slot_of,
            plan.chunk_nbytes, plan.slots_offset, plan.index, plan.index_offset, plan.alignment,
            xxh3,
        )  # fmt: skip

    def read_pieces(
        self,
        blocks: Sequence[tuple[str, memoryview, memoryview]],
        header_nbytes: int,
        plan: PiecePlan,
        touch_if_older_than_ns: int,
        direct: bool = False,
    ) -> list[int]:
        bound = self._piece_batch_binding()
        if bound is None:
            return super().read_pieces(blocks, header_nbytes, plan, touch_if_older_than_ns, direct)
        native, xxh3 = bound
        flags = os.O_RDONLY | (O_DIRECT if direct else 0)
        return native.read_pieces(
            blocks, flags, plan.file_nbytes, header_nbytes, plan.piece_nbytes, plan.starts,
            plan.slot_of, plan.chunk_nbytes, plan.slots_offset, touch_if_older_than_ns,
            plan.alignment, xxh3,
        )  # fmt: skip

    def read_files(self, paths: Sequence[str], file_nbytes: int, rows: Any) -> list[int]:
        native = native_fileproto()
        if native is None:
            return super().read_files(paths, file_nbytes, rows)
        return native.read_files(paths, file_nbytes, rows, stall.beat_slot())

    def _piece_batch_binding(self) -> tuple[NativeFileProto, object] | None:
        """The extension and the xxh3 capsule a piece batch runs with; None where
        :attr:`native_piece_batches` is false (the reference runs)."""
        native = native_fileproto()
        xxh3 = native_xxh3_capsule()
        if not self.native_piece_batches or native is None or xxh3 is None:
            return None
        return native, xxh3


DEFAULT_FILEIO: FileIO = NativeFileIO()


def _hashing_binding(hashing: Hashing) -> tuple[NativeFileProto, object] | None:
    """The extension and the xxh3 capsule when a hashed call may run natively: xxh3 into
    native uint64 sums, both extensions bound; else None (the reference runs)."""
    if hashing.algo != XXH3_64 or hashing.sums.dtype != np.uint64:
        return None
    native = native_fileproto()
    xxh3 = native_xxh3_capsule() if native is not None else None
    return None if native is None or xxh3 is None else (native, xxh3)


def _native_read(path: str, outcome: ReadOutcome, file_nbytes: int, allow_trailer: bool) -> FileId:
    """The identity of the file a native read read, or what the Python reference raises for
    the same outcome: not a regular file, the wrong size, a short run."""
    mode, size, dev, ino, _mtime_ns, short = outcome
    if not stat.S_ISREG(mode):
        raise not_regular(path, mode)
    try:
        check_size(size, file_nbytes, allow_trailer)
        check_run(short)
    except CorruptBlockError as exc:
        exc.file_id = (dev, ino)
        raise
    return dev, ino

"""Whole small files into the rows of one buffer: the Python reference of ``read_files``.

:meth:`FileIO.read_files <kvstore.io.fileio.FileIO.read_files>` runs this, step for step what
kvstore/_native/fileproto_scan.c ``read_one_file`` does for each file, through the file
object's primitives (so a test's recording or fault-injecting FileIO sees every call).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from kvstore.io import stall
from kvstore.io.callcheck import check_read_files
from kvstore.io.piece_batch import BatchFile
from kvstore.io.vectored import read_fully

READ_WHOLE = 1  # a file's outcome: read whole into its row


def read_files(fio: BatchFile, paths: object, file_nbytes: object, rows: object) -> list[int]:
    """For each path, in order: :data:`READ_WHOLE` once the regular file of exactly
    ``file_nbytes`` bytes is read into row ``i`` of ``rows``; ``-errno`` of the open, fstat or
    read that failed; ``-EBADMSG`` for a file that is not regular, has another size or reads
    short (its row then holds what was read). No mtime is touched; a beat
    (:func:`kvstore.io.stall.beat`) after each file."""
    names, size, view = check_read_files(paths, file_nbytes, rows)
    outcomes = []
    for i, name in enumerate(names):
        outcomes.append(_read_one(fio, name, view[i * size : (i + 1) * size]))
        stall.beat()  # the mount answered (the tools' hung-mount watchdog)
    return outcomes


def _read_one(fio: BatchFile, path: bytes, row: memoryview) -> int:
    try:
        fd = fio.open(path, os.O_RDONLY)  # type: ignore[arg-type]
    except OSError as exc:
        return -(exc.errno or errno.EIO)
    try:
        st = fio.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != len(row):
            return -errno.EBADMSG
        return READ_WHOLE if read_fully(fio, fd, [row], 0) == len(row) else -errno.EBADMSG
    except OSError as exc:
        return -(exc.errno or errno.EIO)
    finally:
        with contextlib.suppress(OSError):
            fio.close(fd)

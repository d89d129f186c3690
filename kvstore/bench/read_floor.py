"""The read floor of an offline check: list every directory of a store and read every file
whole, checking nothing.

``kvstore verify`` must at least list each fan-out directory (``getdents64`` and an ``lstat``
per entry) and read each block file once. This does exactly that with the same GIL-free calls
(:func:`~kvstore.io.dirlist.dir_entries`, :meth:`FileIO.read_files
<kvstore.io.fileio.FileIO.read_files>`) on the same number of threads, and nothing else: no
header, key or checksum check, no entries kept. The scale suite runs it beside verify on the
same store, so that verify's blocks per second read as a fraction of what the file system
gives this job.

Usage: ``python -m kvstore.bench.read_floor ROOT [--threads N]``; prints files, bytes, seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvstore import heap
from kvstore.io.buffers import ThreadStaging
from kvstore.io.dirlist import dir_entries
from kvstore.io.native_fileio import DEFAULT_FILEIO

ROUND_NBYTES = 8 << 20  # bytes of files per read_files call (verify's round)
_STAGING = ThreadStaging()


def directories(root: Path) -> list[str]:
    """Every directory below ``root`` (links not followed), ``root`` included."""
    return [directory for directory, _dirs, _files in os.walk(root, followlinks=False)]


def read_directory(directory: str) -> tuple[int, int]:
    """List ``directory`` and read its regular files whole: (files read, bytes)."""
    by_size: dict[int, list[str]] = {}
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        for name, st in dir_entries(fd):
            if stat.S_ISREG(st.st_mode) and st.st_size > 0:
                by_size.setdefault(st.st_size, []).append(f"{directory}{os.sep}{name}")
    finally:
        os.close(fd)
    files = nbytes = 0
    for size, paths in by_size.items():
        rows = max(1, ROUND_NBYTES // size)
        buffer = _STAGING.copy_rows(rows, size)  # where verify's batch check reads to
        for i in range(0, len(paths), rows):
            codes = DEFAULT_FILEIO.read_files(paths[i : i + rows], size, buffer.reshape(-1).data)
            done = sum(1 for code in codes if code == 1)
            files += done
            nbytes += done * size
    return files, nbytes


def read_floor(root: Path, threads: int) -> dict[str, float]:
    """Read every file below ``root`` on ``threads`` threads, one directory per task."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max(1, threads)) as pool:
        results = list(pool.map(read_directory, directories(root)))
    seconds = time.perf_counter() - start
    files = sum(f for f, _ in results)
    nbytes = sum(b for _, b in results)
    return {"files": files, "bytes": nbytes, "seconds": round(seconds, 3)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstore.bench.read_floor", description=__doc__)
    parser.add_argument("root", type=Path)
    parser.add_argument("--threads", type=int, default=4, help="reader threads (verify's default)")
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        parser.error(f"expected a store directory, got {args.root}")
    heap.tune_for_batch_tool()  # as the tools run (kvstore/heap.py): a floor as low as theirs
    print(json.dumps(read_floor(args.root, args.threads)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

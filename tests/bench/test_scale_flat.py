"""Every admin and inspection command runs in memory independent of the store's size.

The scale suite (:mod:`kvstore.bench.scale`) at 10^4 and 10^5 blocks: each command as its own
process, as an operator runs it. A command that keeps something per block grows by tens of
MB over 9 * 10^4 more blocks (the tools did: 1-2 KB a block); a bounded one stays within a few
MB (the scan's window of listed entries fills up towards ~10^6 blocks). The test fails when a
command's peak RSS grows by more than :data:`FLAT_MB`, i.e. by more than ~230 bytes a block
(before the tools streamed, verify grew by 207 MB here, gc by 109 MB, inspect tree by 86 MB).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from kvstore.bench import scale

SIZES = (10_000, 100_000)
FLAT_MB = 20.0
LIMIT_MB = 300.0  # the bound at 10^6 blocks: none may need more already here


def _base(tmp_path: Path) -> Path:
    """tmpfs where there is room (the store is ~1.2 GB allocated), else the test's directory."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 4 << 30:
        return shm / f"kvtest-scale-{os.getpid()}"
    return tmp_path


def test_admin_and_inspection_memory_does_not_grow_with_the_store(tmp_path: Path) -> None:
    base = _base(tmp_path)
    try:
        result = scale.run(base, SIZES)
    finally:
        if base != tmp_path:
            shutil.rmtree(base, ignore_errors=True)
    print(scale.table(result))  # shown in CI's log with -s, and on failure
    small, big = result["sizes"]
    assert [small["store_blocks"], big["store_blocks"]] == list(SIZES)
    grown = {}
    for name, _argv in scale.COMMANDS:
        before, after = small["commands"][name], big["commands"][name]
        for run in (before, after):
            assert run["exit"] in (0, 1), (name, run["stderr_tail"])
            assert 10 < run["peak_rss_mb"] < LIMIT_MB, (name, run)
        grown[name] = round(after["peak_rss_mb"] - before["peak_rss_mb"], 1)
    assert all(mb <= FLAT_MB for mb in grown.values()), (
        f"peak RSS grew with the store (MB from {SIZES[0]:,} to {SIZES[1]:,} blocks): {grown}"
    )
    assert big["read_blocks_per_s"] > 0 and big["lookup_1k_ms"] > 0
    # verify's read floor read every block of the same store (a ratio, not a limit).
    assert big["read_floor"]["files"] >= big["store_blocks"]
    assert big["verify_vs_floor"] > 0

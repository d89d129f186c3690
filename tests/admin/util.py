"""Helpers of the admin CLI tests: populate a store, age files, snapshot a tree, run the CLI."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.cli import main
from kvstore.store.group_store import GroupStore
from kvstore.store.types import BlockWrite, WriteStatus
from tests.helpers import block_bytes

NS_PER_S = 1_000_000_000


def seed_of(block_hash: bytes) -> int:
    """The ``block_bytes`` seed of a block: its contents are a function of its hash."""
    return int.from_bytes(block_hash[:4], "little")


def expected_bytes(group: GroupStore, block_hash: bytes) -> np.ndarray:
    return block_bytes(group.layout, seed_of(block_hash))


def write(
    group: GroupStore,
    hashes: Sequence[bytes],
    parents: Sequence[bytes | None] | None = None,
) -> list[str]:
    """Write blocks (contents from their hash); their paths."""
    parent_list = list(parents) if parents is not None else [None] * len(hashes)
    writes = [
        BlockWrite(h, expected_bytes(group, h), p) for h, p in zip(hashes, parent_list, strict=True)
    ]
    results = group.write_blocks(writes)
    assert all(r.status is WriteStatus.WRITTEN for r in results), results
    return [group.path_of(h) for h in hashes]


def held(path: str | Path) -> int:
    """What a file holds on the disk as gc and du count it (allocated, at least its size)."""
    st = os.lstat(path)
    return max(st.st_blocks * 512, st.st_size)


def set_mtime(path: str | Path, ns: int) -> None:
    os.utime(path, ns=(ns, ns))


def age(paths: Sequence[str], *, newest_s_ago: float = 100.0, step_s: float = 10.0) -> list[int]:
    """Give ``paths`` increasing mtimes in the past (the last is ``newest_s_ago``); the times."""
    now = time.time_ns()
    times = [
        now - int((newest_s_ago + step_s * (len(paths) - 1 - i)) * NS_PER_S)
        for i in range(len(paths))
    ]
    for p, t in zip(paths, times, strict=True):
        set_mtime(p, t)
    return times


def snapshot(root: Path) -> dict[str, tuple[str, int, int]]:
    """relative path -> (type, size, mtime_ns) of every entry below ``root`` (and root)."""
    out: dict[str, tuple[str, int, int]] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in [".", *dirs, *files]:
            path = os.path.join(dirpath, name) if name != "." else dirpath
            st = os.lstat(path)
            kind = "dir" if os.path.isdir(path) else "file"
            size = st.st_size if kind == "file" else 0
            out[os.path.relpath(path, root)] = (kind, size, st.st_mtime_ns)
    return out


def cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    """Run ``kvstore`` through ``main(argv)``: (exit code, stdout, stderr)."""
    rc = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def cli_json(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, Any]:
    """Run ``kvstore ... --json``: (exit code, parsed document)."""
    rc, out, err = cli(capsys, *argv, "--json")
    try:
        return rc, json.loads(out)
    except ValueError:
        raise AssertionError(f"not JSON (rc {rc}): {out!r} / {err!r}") from None


def file_sums(root: Path, *, allocated: bool = False) -> dict[str, int]:
    """Byte sums by category computed straight from the files (independent of kvstore.admin):
    apparent sizes, or (``allocated``) what the files hold on the disk as gc counts it."""
    sums = {"blocks": 0, "block_count": 0, "temp": 0, "quarantine": 0, "trash": 0}
    for dirpath, _dirs, files in os.walk(root):
        parts = Path(dirpath).relative_to(root).parts
        for name in files:
            path = os.path.join(dirpath, name)
            size = held(path) if allocated else os.lstat(path).st_size
            if "quarantine" in parts:
                sums["quarantine"] += size
            elif "trash" in parts:
                sums["trash"] += size
            elif ".tmp-" in name and "c" in parts:
                sums["temp"] += size
            elif "c" in parts and name.isdigit():
                sums["blocks"] += size
                sums["block_count"] += 1
    return sums

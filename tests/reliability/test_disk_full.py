"""Threat 4, disk full for real.

On a small tmpfs (8 MiB; needs ``mount``, skipped with the reason where refused) and, in the
full tier, a loop-mounted ext4 image, one store object writes thousands of blocks past the
capacity while reading back acknowledged ones: writes turn FAILED (ENOSPC), nothing raises,
reads keep hitting, no temporary file is left behind, acknowledged blocks stay intact. Then
``kvstore gc`` frees space and writing resumes.

Where mounts are refused, the same runs in a child process under ``RLIMIT_FSIZE`` (SIGXFSZ
ignored, so writes past the limit fail with EFBIG): the limit is lowered below a block file
after some writes and raised again later.
"""

from __future__ import annotations

import contextlib
import io
import os
import resource
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.cli import main
from kvstore.config import StoreConfig
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockRead, BlockWrite, WriteStatus
from tests.helpers import block_bytes, block_hash, make_small_identity, tmp_files
from tests.reliability import workers
from tests.reliability.common import FULL, figure, fork_context, tier


@contextlib.contextmanager
def mounted(point: Path, kind: str) -> Iterator[Path]:
    """A small file system mounted at ``point`` (skip the test if mounting is refused)."""
    point.mkdir()
    if kind == "tmpfs":
        cmd = ["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(point)]
    else:
        image = point.parent / "ext4.img"
        with image.open("wb") as f:
            f.truncate(16 << 20)
        mkfs = subprocess.run(
            ["mkfs.ext4", "-q", "-F", "-m", "0", str(image)],
            capture_output=True,
            text=True,
            check=False,
        )
        if mkfs.returncode:
            pytest.skip(f"mkfs.ext4 failed: {mkfs.stderr.strip()}")
        cmd = ["mount", "-o", "loop", str(image), str(point)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a {kind} ({exc}); the RLIMIT_FSIZE test covers this")
    if done.returncode:
        pytest.skip(
            f"cannot mount a {kind} ({done.stderr.strip()}); the RLIMIT_FSIZE test covers this"
        )
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False, timeout=60)


def _gc(root: Path, max_bytes: int) -> int:
    with contextlib.redirect_stdout(io.StringIO()):
        return main(["gc", str(root), "--max-bytes", str(max_bytes), "--grace", "0", "--json"])


def fill_and_recover(root: Path, writes: int) -> dict[str, Any]:
    """Write ``writes`` blocks on a small file system, reading acknowledged ones back; then
    free space with ``kvstore gc`` and write again. Returns the figures; asserts the rules."""
    identity = make_small_identity()
    statuses = {"written": 0, "exists": 0, "failed": 0}
    errors: set[str] = set()
    acked: list[int] = []
    reads = read_misses = 0
    with KVStore(StoreConfig(root=root, durability="full", io_threads=2)) as store:
        g = store.namespace(identity).group(0)
        layout = g.layout
        out = np.zeros(layout.block_nbytes, dtype=np.uint8)
        rng = np.random.default_rng(4)

        def check_some(k: int) -> None:
            nonlocal reads, read_misses
            for i in rng.choice(acked, size=min(k, len(acked)), replace=False):
                (r,) = g.read_blocks([BlockRead(block_hash(int(i), "full"), out)])
                reads += 1
                assert r.ok, f"acknowledged block {i}: {r.status.value} {r.error}"
                assert np.array_equal(out, block_bytes(layout, int(i)))

        for start in range(0, writes, 4):
            batch = list(range(start, min(start + 4, writes)))
            results = g.write_blocks(
                [BlockWrite(block_hash(i, "full"), block_bytes(layout, i)) for i in batch]
            )
            for i, r in zip(batch, results, strict=True):
                statuses[r.status.value] += 1
                if r.status is WriteStatus.WRITTEN:
                    acked.append(i)
                else:
                    errors.add(r.error.split(":")[1].strip() if ":" in r.error else r.error)
            check_some(2)
        assert statuses["failed"] > writes // 2, statuses  # it really ran out of space
        assert tmp_files(root) == [], tmp_files(root)[:5]
        check_some(len(acked))  # every acknowledged block, intact
        full_at = len(acked)

        # Free space: gc to half the usage (twice: trash is unlinked on the next pass).
        budget = full_at * layout.file_nbytes // 2
        gc_rc = [_gc(root, budget), _gc(root, budget)]
        present = [i for i in acked if g.contains([block_hash(i, "full")])[0]]
        acked = present
        check_some(len(acked))
        resumed = 0
        for i in range(writes, writes + 40):
            (r,) = g.write_blocks([BlockWrite(block_hash(i, "full"), block_bytes(layout, i))])
            resumed += r.status is WriteStatus.WRITTEN
            if r.status is WriteStatus.WRITTEN:
                acked.append(i)
        check_some(len(acked))
    assert gc_rc == [0, 0], gc_rc
    assert resumed == 40, f"only {resumed} of 40 writes after freeing space"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["verify", str(root)]) == 0
    return {
        "writes": writes,
        "statuses": statuses,
        "errors": sorted(errors),
        "blocks_when_full": full_at,
        "reads_of_acknowledged": reads,
        "writes_after_gc": resumed,
        "temps_left": len(tmp_files(root)),
    }


@pytest.mark.parametrize(
    "kind",
    ["tmpfs", pytest.param("ext4", marks=pytest.mark.skipif(not FULL, reason="full tier"))],
)
def test_disk_full_on_a_small_file_system(tmp_path: Path, kind: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting needs root; the RLIMIT_FSIZE test covers this")
    with mounted(tmp_path / "mnt", kind) as point:
        figures = fill_and_recover(point / "store", tier(3000, 20_000))
        shutil.rmtree(point / "store", ignore_errors=True)
    figure(f"disk full ({kind})", **figures)


def test_disk_full_by_rlimit_fsize(tmp_path: Path) -> None:
    if not hasattr(resource, "RLIMIT_FSIZE") or not hasattr(signal, "SIGXFSZ"):
        pytest.skip("RLIMIT_FSIZE / SIGXFSZ not available on this platform")
    ctx = fork_context()
    receive, send = ctx.Pipe(duplex=False)
    root = tmp_path / "store"
    proc = ctx.Process(  # type: ignore[attr-defined]
        daemon=True,
        target=workers.rlimit_writer,
        args=(str(root), make_small_identity().to_json(), tier(3000, 20_000), send),
    )
    proc.start()
    send.close()
    assert receive.poll(300), "the writer did not report"
    report = receive.recv()
    proc.join(30)
    figure("disk full (RLIMIT_FSIZE)", **report)
    assert proc.exitcode == 0
    assert report["problems"] == [], report["problems"][:10]
    assert report["statuses"]["failed"] >= tier(3000, 20_000) - 100
    assert report["writes_after_limit_raised"] == 40
    assert tmp_files(root) == []

"""``kvstore verify`` against its read floor, by block size.

The scale suite measures verify on tiny blocks (8 KiB files, so that 10^6 fit on tmpfs), where
each file's system calls dominate. Real blocks are larger (a 16-token block of an 8B model is
2 MiB): there verify must be limited by reading, not by its checks. For each block size this
builds a store of about ``total_mib`` MiB of blocks (one KV head of head_dim 64, 16 tokens,
``layers`` layers: 8 layers make a 37 KB file, 64 a 267 KB one, 256 a 1.06 MB one), then
times, alternately and in this process (no interpreter start), ``verify_store`` with 4 reader
threads and :func:`~kvstore.bench.read_floor.read_floor` with as many (every file listed and
read whole with the same native calls, nothing checked), and reports the best of each and
their ratio.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvstore import heap
from kvstore.admin.verify import VerifyOptions, verify_store
from kvstore.bench.read_floor import read_floor
from kvstore.config import StoreConfig
from kvstore.identity import GroupSpec, Identity
from kvstore.io.buffers import aligned_buffer
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockWrite, WriteStatus

LAYERS = (8, 64, 256)
THREADS = 4  # verify's default reader threads
ROUNDS = 3
WRITE_BATCH = 256


def _identity(layers: int) -> Identity:
    return Identity(
        model=f"bench/verify-floor-{layers}",
        kv_dtype="bfloat16",
        tokens_per_block=16,
        groups=(
            GroupSpec(
                kind="full",
                layer_names=tuple(f"l{i}" for i in range(layers)),
                num_kv_heads=1,
                head_dim=64,
            ),
        ),
    )


def build(root: Path, layers: int, total_mib: int) -> tuple[int, int]:
    """A fresh store of about ``total_mib`` MiB of ``layers``-layer blocks: (blocks, file bytes)."""
    shutil.rmtree(root, ignore_errors=True)
    store = KVStore(StoreConfig(root=root, durability="none", io_threads=2, direct_io="off"))
    try:
        group = store.namespace(_identity(layers)).group(0)
        size = group.layout.file_nbytes
        count = max(1, (total_mib << 20) // size)
        data = aligned_buffer(group.layout.block_nbytes)
        data[:] = np.arange(len(data), dtype=np.uint8)
        hashes = [hashlib.sha256(f"{layers}:{i}".encode()).digest() for i in range(count)]
        for i in range(0, count, WRITE_BATCH):
            results = group.write_blocks([BlockWrite(h, data) for h in hashes[i : i + WRITE_BATCH]])
            if any(r.status is not WriteStatus.WRITTEN for r in results):
                raise RuntimeError(f"verify floor: a write failed: {results[0]}")
    finally:
        store.close()
    return count, size


def measure(root: Path, blocks: int, file_nbytes: int) -> dict[str, Any]:
    """Best of :data:`ROUNDS` alternating runs of verify and its floor over ``root``."""
    verify_s, floor_s = [], []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        report = verify_store(root, VerifyOptions(threads=THREADS, progress=False))
        verify_s.append(time.perf_counter() - start)
        if report["counts"] or report["blocks"]["checked"] != blocks:
            raise RuntimeError(f"verify floor: verify was not clean: {report['counts']}")
        floor_s.append(read_floor(root, THREADS)["seconds"])
    gb = blocks * file_nbytes / 1e9
    return {
        "blocks": blocks,
        "file_nbytes": file_nbytes,
        "verify_s": round(min(verify_s), 3),
        "floor_s": round(min(floor_s), 3),
        "verify_gb_per_s": round(gb / min(verify_s), 2),
        "floor_gb_per_s": round(gb / max(min(floor_s), 1e-9), 2),
        "verify_vs_floor": round(min(floor_s) / min(verify_s), 2),
    }


def run(base: Path, total_mib: int, layers: tuple[int, ...] = LAYERS) -> list[dict[str, Any]]:
    """Each block size in turn: build, measure, remove (one store on the disk at a time).
    The collector is set as the tools set it (:mod:`kvstore.heap`), verify running here."""
    heap.tune_for_batch_tool()
    rows = []
    for n in layers:
        root = base / f"verify-floor-{n}"
        try:
            blocks, size = build(root, n, total_mib)
            rows.append(measure(root, blocks, size))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return rows


def lines(rows: list[dict[str, Any]]) -> list[str]:
    """The table's lines: one per block size."""
    out = [f"verify against its read floor by block size ({THREADS} threads, best of {ROUNDS}):"]
    for r in rows:
        out.append(
            f"  {r['file_nbytes'] / 1024:8.0f} KiB files x {r['blocks']:>6,}: verify "
            f"{r['verify_s']:.2f} s ({r['verify_gb_per_s']:.2f} GB/s), floor {r['floor_s']:.2f} s "
            f"({r['floor_gb_per_s']:.2f} GB/s): {r['verify_vs_floor']:.2f}x"
        )
    return out

"""Processes of the gc race test (module level, so the spawn start method can import them).

Kept free of the CLI and of pytest so that a child starts in a fraction of a second.
"""

from __future__ import annotations

import random
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.config import StoreConfig
from kvstore.store.group_store import GroupStore
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockRead, BlockWrite, ReadStatus
from tests.helpers import block_bytes, block_hash, make_small_identity

SALT = "race"


def race_hash(i: int) -> bytes:
    return block_hash(i, SALT)


def contents(group: GroupStore, i: int) -> np.ndarray:
    return block_bytes(group.layout, 1_000_000 + i)


def _open(root: str) -> tuple[KVStore, GroupStore]:
    # access_granularity_s=0: reads never touch mtimes, so last use = write time and the
    # budget's survivors are exactly the newest blocks (the test's definition relies on it).
    config = StoreConfig(root=Path(root), durability="none", io_threads=1, access_granularity_s=0)
    store = KVStore(config, create=False)
    return store, store.namespace(make_small_identity(), create=False).group(0)


def writer(
    root: str, first: int, count: int, pace_s: float, ready: Event, go: Event, out: Queue[Any]
) -> None:
    """Write blocks first..first+count-1 one at a time; report (index, status, ack time)."""
    store, group = _open(root)
    records: list[tuple[int, str, int]] = []
    try:
        ready.set()
        go.wait(60)
        for i in range(first, first + count):
            (result,) = group.write_blocks([BlockWrite(race_hash(i), contents(group, i))])
            records.append((i, result.status.value, time.time_ns()))
            time.sleep(pace_s)
    finally:
        store.close()
        out.put(("writer", records))


def reader(
    root: str, upper: int, seed: int, ready: Event, go: Event, stop: Event, out: Queue[Any]
) -> None:
    """Read random blocks 0..upper-1 until ``stop``; every result must be an exact hit or a miss."""
    store, group = _open(root)
    rng = random.Random(seed)
    buf = np.zeros(group.layout.block_nbytes, dtype=np.uint8)
    expected: dict[int, np.ndarray] = {}
    stats = {"hit": 0, "miss": 0}
    bad: list[str] = []
    try:
        ready.set()
        go.wait(60)
        while not stop.is_set():
            i = rng.randrange(upper)
            buf[:] = 0
            (result,) = group.read_blocks([BlockRead(race_hash(i), buf)])
            if result.status is ReadStatus.HIT:
                want = expected.get(i)
                if want is None:
                    want = expected[i] = contents(group, i)
                if not np.array_equal(buf, want):
                    bad.append(f"block {i}: HIT with wrong bytes")
                stats["hit"] += 1
            elif result.status is ReadStatus.MISS:
                stats["miss"] += 1
            else:
                bad.append(f"block {i}: {result.status.value} ({result.error})")
    finally:
        store.close()
        out.put(("reader", {"stats": stats, "bad": bad}))

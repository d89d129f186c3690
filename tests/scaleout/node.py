"""The processes of one "node" of the scale-out tests.

Each runs under ``nsenter --net=<the node's namespace>`` on that node's mount of the shared
volume: ``python -m tests.scaleout.node '<json spec>'``. Protocol on stdout: ``READY`` once the
store is open, then (when ``spec["sync"]``) it waits for one line on stdin before starting, and
it ends with one line ``RESULT <json>``. Loops stop when ``spec["stop_file"]`` (a local file)
exists or after ``spec["duration_s"]``. Block contents are a pure function of (salt, index), so
any node can check any other node's blocks byte for byte.

Roles (``spec["role"]``):

* ``tp_write``: write blocks with every rank of a parallel layout (one process per rank, the
  multi-writer protocol), then commit them as the scheduler would.
* ``tp_read``: read those blocks with every rank of other layouts; count pages and wrong pages.
* ``write_list``: write a list of block indices in order (whole blocks, or the multi-writer
  protocol with two writers and a commit), recording each status.
* ``writer_loop``: write fresh blocks one after another, appending each acknowledgement to a
  local ack file (flushed), until stopped or killed.
* ``reader_loop``: read random blocks of an index range; every result must be a miss or a hit
  with exactly the right bytes.
* ``watch``: poll existence of a set of blocks and record when each appears and disappears
  (publish and eviction staleness as seen from this node), reading the visible ones.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.config import StoreConfig
from kvstore.identity import Identity
from kvstore.io.fileio import FileIO
from kvstore.io.native_fileio import DEFAULT_FILEIO
from kvstore.store.group_store import GroupStore
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockRead, BlockWrite, ChunkWrite, ReadStatus
from tests.helpers import block_bytes, block_hash, make_small_identity

Spec = dict[str, Any]


def content(group: GroupStore, salt: str, i: int) -> np.ndarray:
    """The bytes of block ``i`` of a test (any node computes the same)."""
    return block_bytes(group.layout, (zlib.crc32(salt.encode()) & 0xFFFF) * 1_000_003 + i)


def bhash(salt: str, i: int) -> bytes:
    return block_hash(i, salt)


def parent_of(salt: str, i: int, chain: int) -> bytes | None:
    """Blocks form chains of ``chain`` blocks (0: independent blocks)."""
    return bhash(salt, i - 1) if chain and i % chain else None


class PublishRaceFileIO(FileIO):
    """Counts publishing renames that found their target already there (another node won),
    optionally waiting a random moment before each rename (``publish_delay_s``): a slower
    network between the existence check and the publish, so that racing nodes collide."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.conflicts = 0
        self._rng = random.Random()

    def rename(self, src: str, dst: str) -> None:
        if self.delay_s:
            time.sleep(self._rng.uniform(0, self.delay_s))
        try:
            super().rename(src, dst)
        except FileExistsError:
            self.conflicts += 1
            raise


def open_store(
    spec: Spec, create: bool = True, fio: FileIO = DEFAULT_FILEIO
) -> tuple[KVStore, GroupStore]:
    config = StoreConfig(
        root=Path(spec["root"]),
        durability=spec.get("durability", "full"),
        io_threads=spec.get("io_threads", 2),
        access_granularity_s=spec.get("access_granularity_s", 60),
    )
    store = KVStore(config, create=create, fio=fio)
    identity = Identity.from_json(spec["identity"]) if "identity" in spec else make_small_identity()
    return store, store.namespace(identity, create=create).group(0)


class Stopper:
    def __init__(self, spec: Spec) -> None:
        self.stop_file = spec.get("stop_file")
        self.deadline = time.monotonic() + spec.get("duration_s", 3600)

    def __call__(self) -> bool:
        if time.monotonic() > self.deadline:
            return True
        return self.stop_file is not None and os.path.exists(self.stop_file)


# -- writers and readers ---------------------------------------------------------------------


def _write_one(group: GroupStore, spec: Spec, i: int, mode: str) -> str:
    salt, chain = spec["salt"], spec.get("chain", 0)
    h, parent = bhash(salt, i), parent_of(salt, i, chain)
    data = content(group, salt, i)
    if mode == "whole":
        (result,) = group.write_blocks([BlockWrite(h, data, parent)])
        return result.status.value + (f" ({result.error})" if result.error else "")
    # Two writers (ranks) each write half of the inner chunks, then one commits.
    (pending,) = group.begin_blocks([h], [parent])
    n = group.layout.num_chunks
    size = group.layout.chunk_nbytes
    halves = [list(range(0, n // 2)), list(range(n // 2, n))]
    for chunks in halves:
        payload = np.concatenate([data[c * size : (c + 1) * size] for c in chunks])
        (error,) = group.write_chunks([ChunkWrite(pending, chunks, payload)])
        if error is not None:
            group.abort_blocks([pending])
            return "failed"
    (result,) = group.commit_blocks([pending])
    return result.status.value + (f" ({result.error})" if result.error else "")


def write_list(spec: Spec) -> dict[str, Any]:
    fio = PublishRaceFileIO(spec.get("publish_delay_s", 0.0))
    store, group = open_store(spec, fio=fio)
    statuses: list[tuple[int, str]] = []
    started = time.perf_counter()
    try:
        _ready(spec)
        for i in spec["indices"]:
            statuses += [(i, _write_one(group, spec, i, spec.get("mode", "whole")))]
    finally:
        store.close()
    return {
        "statuses": statuses,
        "rename_conflicts": fio.conflicts,
        "seconds": round(time.perf_counter() - started, 3),
    }


def writer_loop(spec: Spec) -> dict[str, Any]:
    """Write indices first, first+1, ...; one line per acknowledgement in the ack file."""
    store, group = open_store(spec)
    stop = Stopper(spec)
    acks = 0
    modes = spec.get("modes", ["whole", "multi"])
    try:
        with open(spec["ack_file"], "a", buffering=1) as ack:
            _ready(spec)
            i = spec["first"]
            while not stop() and i < spec.get("last", 1 << 60):
                status = _write_one(group, spec, i, modes[i % len(modes)])
                ack.write(f"{i} {status} {time.time_ns()}\n")
                acks += 1
                i += 1
                if spec.get("pace_s"):
                    time.sleep(spec["pace_s"])
    finally:
        store.close()
    return {"acks": acks}


def reader_loop(spec: Spec) -> dict[str, Any]:
    store, group = open_store(spec, create=False)
    stop = Stopper(spec)
    rng = random.Random(spec.get("seed", 0))
    salt = spec["salt"]
    lo, hi = spec["range"]
    buf = np.zeros(group.layout.block_nbytes, dtype=np.uint8)
    stats = {"reads": 0, "hit": 0, "miss": 0, "corrupt": 0, "error": 0, "wrong": 0}
    bad: list[str] = []
    try:
        _ready(spec)
        while not stop():
            i = rng.randrange(lo, hi)
            buf[:] = 0
            (result,) = group.read_blocks([BlockRead(bhash(salt, i), buf)])
            stats["reads"] += 1
            if result.status is ReadStatus.HIT:
                stats["hit"] += 1
                if not np.array_equal(buf, content(group, salt, i)):
                    stats["wrong"] += 1
                    bad.append(f"block {i}: hit with wrong bytes")
            elif result.status is ReadStatus.MISS:
                stats["miss"] += 1
            else:
                stats[result.status.value] = stats.get(result.status.value, 0) + 1
                bad.append(f"block {i}: {result.status.value} ({result.error})")
    finally:
        store.close()
    return {"stats": stats, "bad": bad[:20], "store": store.stats.snapshot()}


def watch(spec: Spec) -> dict[str, Any]:
    """Record when each watched block becomes visible / invisible from this node."""
    store, group = open_store(spec, create=False)
    stop = Stopper(spec)
    salt = spec["salt"]
    indices = list(spec["indices"])
    hashes = [bhash(salt, i) for i in indices]
    appeared: dict[int, int] = {}
    vanished: dict[int, int] = {}
    buf = np.zeros(group.layout.block_nbytes, dtype=np.uint8)
    reads = {"hit": 0, "miss": 0, "wrong": 0, "other": 0, "hit_after_eviction": 0}
    polls = 0
    try:
        _ready(spec)
        while not stop():
            polls += 1
            present = group.contains(hashes)
            now = time.time_ns()
            for i, p in zip(indices, present, strict=True):
                if p and i not in appeared:
                    appeared[i] = now
                if not p and i in appeared and i not in vanished:
                    vanished[i] = now
            visible = [i for i, p in zip(indices, present, strict=True) if p]
            if visible:  # read one visible block: it must be whole and right
                i = visible[polls % len(visible)]
                (result,) = group.read_blocks([BlockRead(bhash(salt, i), buf)])
                if result.status is ReadStatus.HIT:
                    reads["hit"] += 1
                    reads["wrong"] += not np.array_equal(buf, content(group, salt, i))
                    if spec.get("evicted_marker") and os.path.exists(spec["evicted_marker"]):
                        reads["hit_after_eviction"] += 1
                elif result.status is ReadStatus.MISS:
                    reads["miss"] += 1
                else:
                    reads["other"] += 1
            time.sleep(spec.get("poll_s", 0.002))
    finally:
        store.close()
    return {"appeared": appeared, "vanished": vanished, "reads": reads, "polls": polls}


def _ready(spec: Spec) -> None:
    print("READY", flush=True)
    if spec.get("sync"):
        sys.stdin.readline()


def _tp(role: str) -> Any:
    """The parallel-layout roles live in node_tp (torch is imported only by those)."""

    def run(spec: Spec) -> Any:
        return getattr(importlib.import_module("tests.scaleout.node_tp"), role)(spec)

    return run


ROLES = {
    "tp_write": _tp("tp_write"),
    "tp_read": _tp("tp_read"),
    "write_list": write_list,
    "writer_loop": writer_loop,
    "reader_loop": reader_loop,
    "watch": watch,
}


def main() -> None:
    spec: Spec = json.loads(sys.argv[1])
    result = ROLES[spec["role"]](spec)
    if spec["role"] in ("tp_write", "tp_read"):
        print("READY", flush=True)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

"""Child processes of the reliability suite (imported by the forkserver: keep them top level).

* :func:`kill_writer` writes blocks forever (whole blocks, the multi-writer protocol, or every
  rank of a parallel layout through RankIO with a commit), reporting each acknowledged block on a
  pipe, until it is killed: from outside (SIGKILL after a delay) or by itself at a chosen
  FileIO call (:class:`KillingFileIO`), possibly in the middle of a write.
* :func:`orphan_rank` is one rank writing its chunks of pending blocks until it is killed.
* :func:`race_writer` / :func:`race_reader` are the processes of the concurrency test.
"""

from __future__ import annotations

import logging
import os
import random
import resource
import signal
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.config import StoreConfig
from kvstore.identity import Identity
from kvstore.io.fileio import FileIO
from kvstore.store.group_store import GroupStore
from kvstore.store.page_store import KVStore
from kvstore.store.types import (
    BlockRead,
    BlockWrite,
    ChunkWrite,
    PendingBlock,
    ReadStatus,
    WriteStatus,
)
from tests.helpers import block_bytes, block_hash
from tests.reliability.ranks import World

ACKED = (WriteStatus.WRITTEN, WriteStatus.EXISTS)
KILL_SALT = "kill"


def kill_hash(i: int) -> bytes:
    return block_hash(i, KILL_SALT)


class KillingFileIO(FileIO):
    """SIGKILLs its own process at call number ``at``; a write there is torn first (a random
    prefix of its bytes reaches the file)."""

    def __init__(self, at: int, seed: int) -> None:
        self.at = at
        self.calls = 0
        self.rng = random.Random(seed)

    def _tick(self) -> bool:
        self.calls += 1
        return self.calls == self.at

    @staticmethod
    def _die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # never reached

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        if self._tick():
            self._die()
        return super().open(path, flags, mode)

    def pwritev(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        if self._tick():
            try:  # tear the write: a random prefix (4 KiB granular, as O_DIRECT needs)
                views = [memoryview(b).cast("B") for b in buffers]
                total = sum(len(v) for v in views) // 4096
                if total:
                    super().pwritev(fd, _prefix(views, self.rng.randrange(total) * 4096), offset)
            finally:
                self._die()
        return super().pwritev(fd, buffers, offset)

    def ftruncate(self, fd: int, length: int) -> None:
        if self._tick():
            self._die()
        super().ftruncate(fd, length)

    def fdatasync(self, fd: int) -> None:
        if self._tick():
            self._die()
        super().fdatasync(fd)

    def rename(self, src: str, dst: str) -> None:
        if self._tick():
            self._die()
        super().rename(src, dst)

    def fsync_dir(self, path: str) -> None:
        if self._tick():
            self._die()
        super().fsync_dir(path)

    def unlink(self, path: str) -> None:
        if self._tick():
            self._die()
        super().unlink(path)

    def exists(self, path: str) -> bool:
        if self._tick():
            self._die()
        return super().exists(path)


def _prefix(views: list[memoryview], nbytes: int) -> list[memoryview]:
    out = []
    for v in views:
        if nbytes <= 0:
            break
        out.append(v[:nbytes])
        nbytes -= len(out[-1])
    return out


def _open(
    root: str, identity_json: dict[str, Any], fio: FileIO | None, durability: str = "full"
) -> tuple[KVStore, GroupStore, Identity]:
    logging.getLogger("kvstore").setLevel(logging.ERROR)  # children expect failures: no noise
    identity = Identity.from_json(identity_json)
    config = StoreConfig(root=Path(root), durability=durability, io_threads=2)  # type: ignore[arg-type]
    store = KVStore(config) if fio is None else KVStore(config, fio=fio)
    return store, store.namespace(identity).group(0), identity


def kill_writer(
    root: str,
    identity_json: dict[str, Any],
    mode: str,
    pool: int,
    seed: int,
    kill_at_call: int,
    acks: Connection,
) -> None:
    """Write random blocks of ``pool`` forever in ``mode``; send acknowledged indices."""
    rng = random.Random(seed)
    fio = KillingFileIO(kill_at_call, seed) if kill_at_call else None
    _store, g, identity = _open(root, identity_json, fio)  # open until killed
    layout = g.layout
    world = None
    if mode in ("tp", "dcp"):
        world = World(g, identity, "tp=2" if mode == "tp" else "tp=4,dcp=2")
    while True:
        picks = rng.sample(range(pool), rng.randint(1, 3))
        hashes = [kill_hash(i) for i in picks]
        if mode == "whole":
            results = g.write_blocks(
                [BlockWrite(h, block_bytes(layout, i)) for h, i in zip(hashes, picks, strict=True)]
            )
            statuses = [r.status for r in results]
        elif mode == "multi":
            pendings = g.begin_blocks(hashes)
            half = layout.num_chunks // 2
            cut = half * layout.chunk_nbytes
            for part in (range(half), range(half, layout.num_chunks)):
                writes = []
                for p, i in zip(pendings, picks, strict=True):
                    data = block_bytes(layout, i)
                    chunk_range = list(part)
                    lo, hi = (
                        chunk_range[0] * layout.chunk_nbytes,
                        (chunk_range[-1] + 1) * layout.chunk_nbytes,
                    )
                    writes.append(ChunkWrite(p, chunk_range, data[lo:hi]))
                assert all(e is None for e in g.write_chunks(writes))
            del cut
            statuses = [r.status for r in g.commit_blocks(pendings)]
        else:
            assert world is not None
            statuses = world.store(hashes, picks)
        acks.send([i for i, s in zip(picks, statuses, strict=True) if s in ACKED])


def orphan_rank(
    root: str,
    identity_json: dict[str, Any],
    pendings: list[PendingBlock],
    seeds: list[int],
    kill_at_call: int,
    seed: int,
    done: Connection,
) -> None:
    """One rank writing the first half of the chunks of each pending block, then idling; it
    is killed at its FileIO call ``kill_at_call`` (or from outside)."""
    _store, g, _ = _open(root, identity_json, KillingFileIO(kill_at_call, seed))
    layout = g.layout
    half = layout.num_chunks // 2
    for p, i in zip(pendings, seeds, strict=True):
        data = block_bytes(layout, i)
        (error,) = g.write_chunks(
            [ChunkWrite(p, list(range(half)), data[: half * layout.chunk_nbytes])]
        )
        assert error is None
    done.send(True)
    time.sleep(60)


# -- concurrency (threat 5) --------------------------------------------------------------------


def race_content(layout: Any, ns: int, i: int) -> np.ndarray:
    """Bytes of block ``i`` in namespace ``ns`` (different namespaces, different bytes)."""
    return block_bytes(layout, (ns + 1) * 1_000_003 + i)


def race_writer(
    root: str,
    identity_jsons: list[dict[str, Any]],
    ns: int,
    pool: int,
    ops: int,
    seed: int,
    out: Connection,
) -> None:
    """``ops`` writes of random blocks of namespace ``ns`` (whole or multi-writer)."""
    rng = random.Random(seed)
    store, g, _ = _open(root, identity_jsons[ns], None, durability="none")
    layout = g.layout
    counts = {"written": 0, "exists": 0, "failed": 0}
    errors: list[str] = []
    for n in range(ops):
        i = rng.randrange(pool)
        h = block_hash(i, "race")
        data = race_content(layout, ns, i)
        if n % 4:
            (r,) = g.write_blocks([BlockWrite(h, data)])
        else:
            (p,) = g.begin_blocks([h])
            half = layout.num_chunks // 2 * layout.chunk_nbytes
            errs = g.write_chunks(
                [
                    ChunkWrite(p, list(range(layout.num_chunks // 2)), data[:half]),
                    ChunkWrite(
                        p, list(range(layout.num_chunks // 2, layout.num_chunks)), data[half:]
                    ),
                ]
            )
            assert errs == [None, None], errs
            (r,) = g.commit_blocks([p])
        counts[r.status.value] += 1
        if r.status is WriteStatus.FAILED:
            errors.append(r.error)
    store.close()
    out.send({"counts": counts, "errors": errors[:5]})


def race_reader(
    root: str,
    identity_jsons: list[dict[str, Any]],
    ns: int,
    pool: int,
    min_ops: int,
    seed: int,
    stop_file: str,
    out: Connection,
) -> None:
    """Read random blocks (whole or some chunks) until ``stop_file`` exists and ``min_ops`` are
    done; every result must be a HIT with exactly its bytes or a MISS."""
    rng = random.Random(seed)
    store, g, _ = _open(root, identity_jsons[ns], None, durability="none")
    layout = g.layout
    counts = {"hit": 0, "miss": 0, "corrupt": 0, "error": 0}
    bad: list[str] = []
    buf = np.zeros(layout.block_nbytes, dtype=np.uint8)
    n = 0
    while n < min_ops or not os.path.exists(stop_file):
        i = rng.randrange(pool)
        chunks = None if n % 3 else sorted(rng.sample(range(layout.num_chunks), 2))
        size = layout.block_nbytes if chunks is None else 2 * layout.chunk_nbytes
        out_view = buf[:size]
        out_view.fill(0)
        (r,) = g.read_blocks([BlockRead(block_hash(i, "race"), out_view, chunks)])
        counts[r.status.value] += 1
        n += 1
        if r.status is ReadStatus.HIT:
            want = race_content(layout, ns, i)
            if chunks is not None:
                c = layout.chunk_nbytes
                want = np.concatenate([want[k * c : (k + 1) * c] for k in chunks])
            if not np.array_equal(out_view, want):
                bad.append(f"block {i} of namespace {ns}: HIT with wrong bytes")
        elif r.status is not ReadStatus.MISS:
            bad.append(f"block {i} of namespace {ns}: {r.status.value} ({r.error})")
    store.close()
    out.send({"counts": counts, "bad": bad[:10]})


# -- disk full by RLIMIT_FSIZE (threat 4) --------------------------------------------------------


def rlimit_writer(root: str, identity_json: dict[str, Any], writes: int, out: Connection) -> None:
    """Write 100 blocks, lower RLIMIT_FSIZE below a block file, write ``writes`` more (all must
    fail, none may raise) while reading the acknowledged ones, raise the limit, write again."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
    store, g, _ = _open(root, identity_json, None)
    layout = g.layout
    buf = np.zeros(layout.block_nbytes, dtype=np.uint8)
    statuses = {"written": 0, "exists": 0, "failed": 0}
    errors: set[str] = set()
    problems: list[str] = []
    acked: list[int] = []
    reads = 0

    def write(i: int) -> WriteStatus:
        try:
            (r,) = g.write_blocks([BlockWrite(block_hash(i, "fsize"), block_bytes(layout, i))])
        except Exception as exc:
            problems.append(f"write {i} raised {type(exc).__name__}: {exc}")
            return WriteStatus.FAILED
        statuses[r.status.value] += 1
        if r.status is WriteStatus.WRITTEN:
            acked.append(i)
        else:
            errors.add(r.error)
        return r.status

    def read(i: int) -> None:
        nonlocal reads
        reads += 1
        (r,) = g.read_blocks([BlockRead(block_hash(i, "fsize"), buf)])
        if not r.ok or not np.array_equal(buf, block_bytes(layout, i)):
            problems.append(f"acknowledged block {i}: {r.status.value} {r.error}")

    rng = random.Random(5)
    for i in range(100):
        write(i)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    # Half a block file, 4 KiB aligned (an O_DIRECT write cut at an odd size is EINVAL).
    resource.setrlimit(resource.RLIMIT_FSIZE, (layout.file_nbytes // 2 // 4096 * 4096, hard))
    for i in range(100, 100 + writes):
        write(i)
        read(rng.choice(acked))
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    after = sum(write(i) is WriteStatus.WRITTEN for i in range(100 + writes, 140 + writes))
    for i in acked:
        read(i)
    store.close()
    out.send(
        {
            "writes": writes + 140,
            "statuses": statuses,
            "errors": sorted(errors)[:3],
            "reads_of_acknowledged": reads,
            "writes_after_limit_raised": after,
            "problems": problems[:10],
        }
    )

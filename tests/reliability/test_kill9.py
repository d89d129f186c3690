"""Threat 1, kill -9 of writer processes at random points.

Writer processes (four at a time, on one store) write random blocks of a shared pool forever:
whole blocks, the multi-writer protocol, and every rank of a TP and of a DCP layout through
RankIO with a commit. Each is SIGKILLed at a random point: half from outside after a random
delay (anywhere, even while opening the store), half by itself at a random FileIO call, a write
there torn first. Meanwhile a reader in this process reads random blocks of the pool: every
read must be a HIT with exactly the block's bytes or a MISS. Afterwards every acknowledged
block reads back exactly, ``kvstore verify`` finds nothing but orphan temporary files, and
``kvstore verify --fix`` removes them all.

A second test kills one rank of a multi-writer block at a random call and lets the scheduler
commit anyway: the commit must refuse every block that rank did not finish.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.cli import main
from kvstore.config import StoreConfig
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockRead, ChunkWrite, ReadStatus, WriteStatus
from tests.helpers import block_bytes, make_small_identity, tmp_files
from tests.reliability import workers
from tests.reliability.common import figure, fork_context, tier
from tests.reliability.workers import kill_hash

MODES = ("whole", "multi", "tp", "dcp")
POOL = tier(600, 4000)  # blocks the writers choose from (most writes are new blocks)
PARALLEL = 4


def _verify(root: Path, *args: str) -> tuple[int, dict[str, Any]]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["verify", str(root), "--json", *args])
    return rc, json.loads(buf.getvalue())


class Reader(threading.Thread):
    """Reads random blocks of the pool until stopped; counts outcomes, records bad ones."""

    def __init__(self, root: Path) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.stop = threading.Event()
        self.counts = {"hit": 0, "miss": 0, "corrupt": 0, "error": 0}
        self.bad: list[str] = []

    def run(self) -> None:
        config = StoreConfig(root=self.root, durability="none", io_threads=1)
        rng = random.Random(7)
        with KVStore(config) as store:
            g = store.namespace(make_small_identity()).group(0)
            out = np.zeros(g.layout.block_nbytes, dtype=np.uint8)
            while not self.stop.is_set():
                i = rng.randrange(POOL)
                out.fill(0)
                (r,) = g.read_blocks([BlockRead(kill_hash(i), out)])
                self.counts[r.status.value] += 1
                if r.status is ReadStatus.HIT:
                    if not np.array_equal(out, block_bytes(g.layout, i)):
                        self.bad.append(f"block {i}: HIT with wrong bytes")
                elif r.status is not ReadStatus.MISS:
                    self.bad.append(f"block {i}: {r.status.value} ({r.error})")


def test_kill9_writers_at_random_points(tmp_path: Path) -> None:
    kills = tier(240, 2000)
    root = tmp_path / "store"
    identity = make_small_identity()
    with KVStore(StoreConfig(root=root)) as store:
        store.namespace(identity)
    ctx = fork_context()
    rng = random.Random(20260)
    acked: set[int] = set()
    started = killed = self_killed = 0
    reader = Reader(root)
    reader.start()
    t0 = time.monotonic()
    batch: list[tuple[Any, Any, float, bool]] = []
    try:
        while started < kills:
            for _ in range(min(PARALLEL, kills - started)):
                mode = MODES[started % len(MODES)]
                inside = rng.random() < 0.5
                kill_at = rng.randrange(1, 120) if inside else 0
                delay = rng.uniform(0.0, 0.08)
                receive, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(  # type: ignore[attr-defined]
                    daemon=True,
                    target=workers.kill_writer,
                    args=(
                        str(root),
                        identity.to_json(),
                        mode,
                        POOL,
                        rng.randrange(1 << 30),
                        kill_at,
                        send,
                    ),
                )
                proc.start()
                send.close()
                batch.append((proc, receive, time.monotonic() + delay, inside))
                started += 1
            deadline = time.monotonic() + 30
            while batch:
                assert time.monotonic() < deadline, "a writer outlived its kill"
                for item in list(batch):
                    proc, receive, when, inside = item
                    while receive.poll():
                        try:
                            acked.update(receive.recv())
                        except (EOFError, OSError):
                            break
                    if not inside and time.monotonic() >= when and proc.is_alive():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(proc.pid, signal.SIGKILL)
                    if not proc.is_alive():
                        proc.join()
                        with contextlib.suppress(EOFError, OSError):
                            while receive.poll():
                                acked.update(receive.recv())
                        receive.close()
                        assert proc.exitcode == -signal.SIGKILL, proc.exitcode
                        killed += 1
                        self_killed += inside
                        batch.remove(item)
                time.sleep(0.002)
    finally:
        reader.stop.set()
        reader.join(30)
        for proc, *_ in batch:  # only after a failure
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
    elapsed = time.monotonic() - t0

    # Every acknowledged block is there, exactly.
    lost = []
    with KVStore(StoreConfig(root=root, durability="none")) as store:
        g = store.namespace(identity).group(0)
        out = np.zeros(g.layout.block_nbytes, dtype=np.uint8)
        for i in sorted(acked):
            (r,) = g.read_blocks([BlockRead(kill_hash(i), out)])
            if not r.ok or not np.array_equal(out, block_bytes(g.layout, i)):
                lost.append((i, r.status.value))
    temps_before = len(tmp_files(root))
    _, doc = _verify(root, "--tmp-age", "0")
    kinds = set(doc["counts"])
    rc_fix, _ = _verify(root, "--fix", "--tmp-age", "0")
    rc_after, after = _verify(root)
    figure(
        "kill -9 of writers",
        kills=killed,
        self_kills_at_a_fileio_call=self_killed,
        acknowledged=len(acked),
        acknowledged_lost=len(lost),
        reads=sum(reader.counts.values()),
        read_outcomes=reader.counts,
        temps_left=temps_before,
        temps_after_verify_fix=len(tmp_files(root)),
        torn_or_wrong_reads=len(reader.bad),
        seconds=round(elapsed, 1),
    )
    assert killed == kills
    assert reader.bad == [], reader.bad[:10]
    assert lost == [], lost[:10]
    assert len(acked) > kills // 10  # the writers got far enough to acknowledge blocks
    assert kinds <= {"orphan-temp"}, doc["findings"][:5]
    assert rc_fix == (1 if temps_before else 0)
    assert tmp_files(root) == []
    assert rc_after == 0, after["findings"][:5]
    assert reader.counts["hit"] > 0 and reader.counts["miss"] > 0


def test_kill9_of_one_rank_then_commit(tmp_path: Path) -> None:
    """A rank dies (SIGKILL at a random FileIO call) while writing its chunks; the scheduler
    writes the other half and commits anyway: a block is published only if complete."""
    rounds = tier(40, 300)
    root = tmp_path / "store"
    identity = make_small_identity()
    ctx = fork_context()
    rng = random.Random(99)
    statuses = {"written": 0, "failed": 0}
    bad: list[str] = []
    with KVStore(StoreConfig(root=root, durability="none")) as store:
        g = store.namespace(identity).group(0)
        layout = g.layout
        half = layout.num_chunks // 2
        out = np.zeros(layout.block_nbytes, dtype=np.uint8)
        for r in range(rounds):
            seeds = [r * 10 + k for k in range(3)]
            pendings = g.begin_blocks([kill_hash(10_000 + s) for s in seeds])
            receive, send = ctx.Pipe(duplex=False)
            # Calls per block: open, writes, fdatasync: ~4; kill somewhere in the three blocks.
            proc = ctx.Process(  # type: ignore[attr-defined]
                daemon=True,
                target=workers.orphan_rank,
                args=(
                    str(root),
                    identity.to_json(),
                    pendings,
                    [10_000 + s for s in seeds],
                    rng.randrange(1, 16),
                    rng.randrange(1 << 30),
                    send,
                ),
            )
            proc.start()
            send.close()
            assert receive.poll(30)  # it died (the pipe closed) or finished its share
            if proc.is_alive():  # finished without reaching its kill point: kill it now
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
            proc.join(30)
            receive.close()
            for p, s in zip(pendings, seeds, strict=True):
                data = block_bytes(layout, 10_000 + s)
                (error,) = g.write_chunks(
                    [
                        ChunkWrite(
                            p,
                            list(range(half, layout.num_chunks)),
                            data[half * layout.chunk_nbytes :],
                        )
                    ]
                )
                assert error is None
            for p, s, result in zip(pendings, seeds, g.commit_blocks(pendings), strict=True):
                statuses[result.status.value] += 1
                (read,) = g.read_blocks([BlockRead(p.block_hash, out)])
                if result.status is WriteStatus.WRITTEN:
                    if not read.ok or not np.array_equal(out, block_bytes(layout, 10_000 + s)):
                        bad.append(f"round {r} block {s}: committed but reads {read.status.value}")
                elif read.status is not ReadStatus.MISS:
                    bad.append(f"round {r} block {s}: failed commit but reads {read.status.value}")
    figure(
        "kill -9 of one rank, then commit",
        kills=rounds,
        blocks=3 * rounds,
        committed=statuses["written"],
        refused=statuses["failed"],
        torn_blocks_published=len(bad),
    )
    assert bad == [], bad[:10]
    assert statuses["failed"] > 0 and statuses["written"] > 0

"""Threat 3, I/O errors: fail every FileIO call of the engine-facing API, once and for good.

The engine (the vLLM connector) calls ``contains`` (lookups), ``RankIO.store`` +
``commit_blocks`` / ``abort_blocks`` (stores) and ``read_blocks`` / ``RankIO.load`` (loads). A
clean run of a workload doing all of them (whole blocks, a multi-writer block, a TP layout and a
DCP layout through RankIO, hits, a miss, a block already present) is recorded call by call; then
for every call number k and every fault kind the workload runs again with call k failing
(``once``) or calls k, k+1, ... failing (``persistent``). After each run:

* no engine-facing call raised; every load returned HIT (exact bytes) / MISS / CORRUPT / ERROR;
* every file under a published block name is complete and verifies (no visible partial block);
* every block acknowledged (WRITTEN / EXISTS) in the run, and the block present before it,
  reads back exactly once the faults stop (with ``eof`` faults a block whose read came back
  short may have been quarantined instead: a lost page, never a wrong one);
* a temporary file is left only where an ``unlink`` failed, and ``kvstore verify --fix`` then
  removes it;
* the same store object writes and reads normally once the faults stop.
"""

from __future__ import annotations

import contextlib
import functools
import io
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest

from kvstore.admin.blockfile import check_block_file
from kvstore.cli import main
from kvstore.identity import Identity
from kvstore.store.group_store import GroupStore
from kvstore.store.paths import QUARANTINE
from kvstore.store.types import BlockRead, BlockWrite, ChunkWrite, ReadStatus, WriteStatus
from tests.helpers import StoreFactory, block_bytes, make_small_identity, shard_files, tmp_files
from tests.reliability.common import FULL, figure
from tests.reliability.faults import KINDS, TRANSFER_FAULTS, TRANSFERS, FaultFileIO
from tests.reliability.ranks import World

ACKED = (WriteStatus.WRITTEN, WriteStatus.EXISTS)
T = TypeVar("T")


def h(name: str) -> bytes:
    return name.encode().ljust(32, b"\x5a")


PRESENT = h("present")  # written before every run
A, B, C, D, E, MISSING = h("a"), h("b"), h("c"), h("d"), h("e"), h("missing")
SEEDS = {PRESENT: 1, A: 2, B: 3, C: 4, D: 5, E: 6, MISSING: 7}


@dataclass
class Run:
    raised: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    acked: set[bytes] = field(default_factory=set)
    corrupt: set[bytes] = field(default_factory=set)
    statuses: dict[str, int] = field(default_factory=dict)

    def count(self, status: ReadStatus | WriteStatus) -> None:
        self.statuses[status.value] = self.statuses.get(status.value, 0) + 1


def workload(g: GroupStore, tp: World, dcp: World) -> Run:
    """Every engine-facing call once; nothing may raise."""
    run = Run()
    layout = g.layout

    def guard(what: str, fn: Callable[[], T]) -> T | None:
        try:
            return fn()
        except BaseException as exc:
            run.raised.append(f"{what}: {type(exc).__name__}: {exc}")
            return None

    guard("contains", lambda: g.contains([A, PRESENT, MISSING]))
    writes = guard(
        "write_blocks",
        lambda: g.write_blocks(
            [BlockWrite(x, block_bytes(layout, SEEDS[x])) for x in (A, B, PRESENT)]
        ),
    )
    for x, w in zip((A, B, PRESENT), writes or [], strict=writes is not None):
        run.count(w.status)
        if w.status in ACKED:
            run.acked.add(x)

    def multi_writer() -> None:
        (pending,) = g.begin_blocks([C], [A])
        data = block_bytes(layout, SEEDS[C])
        half = layout.num_chunks // 2
        cut = half * layout.chunk_nbytes
        errors = g.write_chunks(
            [
                ChunkWrite(pending, list(range(half)), data[:cut]),
                ChunkWrite(pending, list(range(half, layout.num_chunks)), data[cut:]),
            ]
        )
        if any(e is not None for e in errors):
            g.abort_blocks([pending])
            run.count(WriteStatus.FAILED)
            return
        (committed,) = g.commit_blocks([pending])
        run.count(committed.status)
        if committed.status in ACKED:
            run.acked.add(C)

    guard("multi-writer", multi_writer)
    for world, x in ((tp, D), (dcp, E)):
        statuses = guard("RankIO.store+commit", functools.partial(world.store, [x], [SEEDS[x]]))
        for s in statuses or []:
            run.count(s)
            if s in ACKED:
                run.acked.add(x)

    names = [PRESENT, A, B, C, D, E, MISSING]
    outs = [np.zeros(layout.block_nbytes, dtype=np.uint8) for _ in names]
    partial = np.zeros(2 * layout.chunk_nbytes, dtype=np.uint8)
    reads = guard(
        "read_blocks",
        lambda: g.read_blocks(
            [BlockRead(x, o) for x, o in zip(names, outs, strict=True)]
            + [BlockRead(A, partial, [4, 1])]
        ),
    )
    for i, r in enumerate(reads or []):
        run.count(r.status)
        x = names[i] if i < len(names) else A
        if r.status is ReadStatus.CORRUPT:
            run.corrupt.add(x)
        if not r.ok:
            continue
        want = block_bytes(layout, SEEDS[x])
        if i < len(names):
            exact = np.array_equal(outs[i], want)
        else:
            size = layout.chunk_nbytes
            exact = np.array_equal(
                partial, np.concatenate([want[4 * size : 5 * size], want[size : 2 * size]])
            )
        if not exact:
            run.wrong.append(f"read_blocks served wrong bytes for {x!r}")
    for world, xs in ((tp, [A, D, MISSING]), (dcp, [E, PRESENT])):
        loaded = guard("RankIO.load", functools.partial(world.load, xs, [SEEDS[x] for x in xs]))
        for x, one in zip(xs, loaded or [], strict=loaded is not None):
            for status in one.statuses:
                run.count(status)
                if status is ReadStatus.CORRUPT:
                    run.corrupt.add(x)
            if not one.exact:
                run.wrong.append(f"RankIO.load served wrong bytes for {x!r}")
    return run


@dataclass
class Rig:
    g: GroupStore
    fio: FaultFileIO
    identity: Identity
    root: Path
    tp: World
    dcp: World
    present_bytes: bytes

    def reset(self) -> None:
        """Back to the state before a run: only PRESENT published, no temps, no quarantine."""
        keep = self.g.path_of(PRESENT)
        for path in shard_files(self.root) + tmp_files(self.root):
            if str(path) != keep:
                path.unlink()
        quarantine = self.g.array_path.parent / QUARANTINE
        if quarantine.exists():
            shutil.rmtree(quarantine)
        target = Path(keep)
        if not target.exists() or target.read_bytes() != self.present_bytes:
            target.write_bytes(self.present_bytes)
            target.chmod(0o600)


def make_rig(make_store: StoreFactory, root: Path, direct_io: str) -> Rig:
    fio = FaultFileIO()
    identity = make_small_identity()
    store = make_store(fio=fio, durability="full", io_threads=1, direct_io=direct_io)
    g = store.namespace(identity).group(0)
    (r,) = g.write_blocks([BlockWrite(PRESENT, block_bytes(g.layout, SEEDS[PRESENT]))])
    assert r.status is WriteStatus.WRITTEN
    return Rig(
        g,
        fio,
        identity,
        root,
        World(g, identity, "tp=2"),
        World(g, identity, "tp=4,dcp=2,interleave=8"),
        Path(g.path_of(PRESENT)).read_bytes(),
    )


def after_run(rig: Rig, run: Run, kind: str) -> list[str]:
    """The invariants once the faults stop; a list of problems."""
    g = rig.g
    problems = [f"raised into the engine: {e}" for e in run.raised] + run.wrong
    for path in shard_files(rig.root):
        hi, lo = int(path.parent.name), int(path.name)
        fault = check_block_file(str(path), g.layout, g.namespace_digest, g.index, hi, lo)
        if fault is not None:
            problems.append(f"visible partial/bad block {path.name}: {fault.kind} {fault.detail}")
    out = np.zeros(g.layout.block_nbytes, dtype=np.uint8)
    for x in {*run.acked, PRESENT}:
        (r,) = g.read_blocks([BlockRead(x, out)])
        lost_to_short_read = kind == "eof" and x in run.corrupt
        if r.status is ReadStatus.HIT:
            if not np.array_equal(out, block_bytes(g.layout, SEEDS[x])):
                problems.append(f"acknowledged block {x!r} has wrong bytes")
        elif not lost_to_short_read:
            problems.append(f"acknowledged block {x!r} reads {r.status.value} ({r.error})")
    temps = tmp_files(rig.root)
    if temps and "unlink" not in rig.fio.injected:
        problems.append(f"temporary files left without a failed unlink: {temps}")
    # The same store works again.
    fresh = h(f"fresh-{len(rig.fio.calls)}")
    data = block_bytes(g.layout, 99)
    (w,) = g.write_blocks([BlockWrite(fresh, data)])
    (r,) = g.read_blocks([BlockRead(fresh, out)])
    if w.status is not WriteStatus.WRITTEN or not r.ok or not np.array_equal(out, data):
        problems.append(f"store does not recover: write {w.status.value}, read {r.status.value}")
    return problems


ERRNO_KINDS = [k for k in KINDS if k not in TRANSFER_FAULTS]


def plan(sites: list[str]) -> list[tuple[str, int, bool]]:
    """(fault kind, call number, persistent) of every run.

    Full tier: every kind at every call, once and persistent. PR tier: every call fails once
    and persistently, the kinds rotating over the calls (each kind still hits every kind of
    call site many times); transfer calls also get a short and an empty transfer.
    """
    runs: list[tuple[str, int, bool]] = []
    for k, site in enumerate(sites):
        transfer = site in TRANSFERS
        if FULL:
            kinds = [kind for kind in KINDS if transfer or kind not in TRANSFER_FAULTS]
            runs += [(kind, k, p) for kind in kinds for p in (False, True)]
            continue
        runs.append((ERRNO_KINDS[k % len(ERRNO_KINDS)], k, False))
        runs.append((ERRNO_KINDS[(k + 2) % len(ERRNO_KINDS)], k, True))
        if transfer:
            runs.append((TRANSFER_FAULTS[k % 2], k, False))
            runs.append((TRANSFER_FAULTS[(k + 1) % 2], k, True))
    return runs


@pytest.mark.parametrize(
    "direct_io",
    ["auto", pytest.param("off", marks=pytest.mark.skipif(not FULL, reason="full tier"))],
)
def test_every_call_fails_once_and_for_good(
    make_store: StoreFactory, root: Path, direct_io: str
) -> None:
    rig = make_rig(make_store, root, direct_io)
    rig.fio.arm(None)
    clean = workload(rig.g, rig.tp, rig.dcp)
    sites = list(rig.fio.calls)
    rig.fio.disarm()
    assert clean.raised == [] and clean.wrong == [], (clean.raised, clean.wrong)
    assert clean.acked == {A, B, C, D, E, PRESENT}
    rig.reset()

    runs = injected = temps_swept = 0
    by_site: dict[str, int] = {}
    kinds_used: set[str] = set()
    statuses: dict[str, int] = {}
    problems: list[str] = []
    for kind, k, persistent in plan(sites):
        site = sites[k]
        kinds_used.add(kind)
        rig.fio.arm(kind, k, persistent)
        run = workload(rig.g, rig.tp, rig.dcp)
        rig.fio.disarm()
        runs += 1
        injected += len(rig.fio.injected)
        if rig.fio.injected:
            by_site[site] = by_site.get(site, 0) + 1
        for status, n in run.statuses.items():
            statuses[status] = statuses.get(status, 0) + n
        where = f"{kind} {'persistent' if persistent else 'once'} at call {k} ({site})"
        problems += [f"{where}: {p}" for p in after_run(rig, run, kind)]
        if tmp_files(root) and (FULL or temps_swept < 25):
            with contextlib.redirect_stdout(io.StringIO()):
                rc = main(["verify", str(root), "--fix", "--tmp-age", "0", "--json"])
            temps_swept += 1
            if rc != 1 or tmp_files(root):
                problems.append(f"{where}: verify --fix exit {rc}, temps {tmp_files(root)}")
        rig.reset()
    figure(
        f"I/O errors (direct_io={direct_io})",
        call_sites=len(sites),
        fault_kinds=len(kinds_used),
        runs=runs,
        faults_injected=injected,
        statuses=statuses,
        raised_into_engine=sum("raised into the engine" in p for p in problems),
        temps_swept_by_verify=temps_swept,
        wrong_pages_served=sum("wrong bytes" in p for p in problems),
    )
    assert problems == [], problems[:20]
    assert set(by_site) >= {
        "open",
        "pwritev",
        "preadv",
        "fdatasync",
        "rename",
        "fsync_dir",
        "exists",
    }

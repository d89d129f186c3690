"""Threat 2, power loss: replay every prefix of a recorded workload with unsynced writes dropped.

A workload (store creation, whole-block batches, a multi-writer block, a range-written block
with completion markers, a rewrite, a delete, an abort) runs through a
:class:`~tests.reliability.crashsim.CrashRecorder`. For every prefix of its log and every crash
policy of :mod:`tests.reliability.crashsim`, the disk state is rebuilt in a fresh directory and
opened like a restarting server would: the store must open, and every block of the workload
must read as a HIT with exactly its bytes, a MISS, or a CORRUPT miss, never as a HIT with other
bytes. With ``durability="full"`` every block acknowledged (WRITTEN or EXISTS) before the crash
point must be a HIT under every policy; with ``"none"`` only under ``all`` (a process crash).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from kvstore.config import StoreConfig
from kvstore.identity import Identity
from kvstore.store.page_store import KVStore
from kvstore.store.types import (
    BlockRead,
    BlockWrite,
    ChunkWrite,
    RangeWrite,
    ReadStatus,
    WriteStatus,
)
from tests.helpers import block_bytes, make_odd_identity, make_small_identity
from tests.reliability.common import FULL, figure
from tests.reliability.crashsim import (
    POLICIES,
    CrashModel,
    CrashRecorder,
    crash_state,
    essential,
    fingerprint,
    materialize,
)

RANDOM_POLICIES = 2 if not FULL else 8


@dataclass
class Workload:
    """What the recorded run did: block contents and when each acknowledgement held."""

    seeds: dict[bytes, int] = field(default_factory=dict)
    # (hash, first crash point that must have it, first crash point that need not: deleted)
    acked: list[tuple[bytes, int, int]] = field(default_factory=list)


def _hash(i: int, fan: int) -> bytes:
    return bytes([fan, i]) + bytes(range(30))


def run_workload(
    root: Path, identity: Identity, durability: str, direct_io: str
) -> tuple[CrashRecorder, Workload]:
    fio = CrashRecorder()
    work = Workload()
    forever = 1 << 60
    config = StoreConfig(root=root, durability=durability, io_threads=1, direct_io=direct_io)  # type: ignore[arg-type]
    with KVStore(config, fio=fio) as store:
        g = store.namespace(identity).group(0)
        layout = g.layout

        def ack(hashes: list[bytes], statuses: list[WriteStatus]) -> None:
            for h, s in zip(hashes, statuses, strict=True):
                assert s in (WriteStatus.WRITTEN, WriteStatus.EXISTS), s
                work.acked.append((h, fio.position, forever))

        batch = [_hash(0, 7), _hash(1, 7), _hash(2, 9)]  # two share a fan-out directory
        for i, h in enumerate(batch):
            work.seeds[h] = i
        res = g.write_blocks([BlockWrite(h, block_bytes(layout, work.seeds[h])) for h in batch])
        ack(batch, [r.status for r in res])

        # Multi-writer: two writers fill halves, the committer publishes.
        mw = _hash(3, 9)
        work.seeds[mw] = 3
        data = block_bytes(layout, 3)
        (pending,) = g.begin_blocks([mw], [batch[2]])
        half = layout.num_chunks // 2
        cut = half * layout.chunk_nbytes
        assert g.write_chunks([ChunkWrite(pending, list(range(half)), data[:cut])]) == [None]
        errors = g.write_chunks(
            [ChunkWrite(pending, list(range(half, layout.num_chunks)), data[cut:])]
        )
        assert errors == [None]
        ack([mw], [r.status for r in g.commit_blocks([pending])])

        # Token-split (DCP) writers: byte ranges, completion markers, checksums at commit.
        rw = _hash(4, 11)
        work.seeds[rw] = 4
        data = block_bytes(layout, 4)
        (pending,) = g.begin_blocks([rw])
        token = layout.elems_per_token * layout.itemsize
        size = layout.chunk_nbytes
        for slot in range(2):
            ranges = [
                (c * size + t * token, data[c * size + t * token : c * size + (t + 1) * token])
                for c in range(layout.num_chunks)
                for t in range(slot, layout.tokens, 2)
            ]
            assert g.write_ranges([RangeWrite(pending, ranges, slot)]) == [None]
        everything = [list(range(layout.num_chunks))]
        ack([rw], [r.status for r in g.commit_blocks([pending], everything, range_writers=2)])

        # An aborted block never appears.
        ab = _hash(5, 11)
        work.seeds[ab] = 5
        (pending,) = g.begin_blocks([ab])
        g.write_chunks([ChunkWrite(pending, [0], block_bytes(layout, 5)[:size])])
        g.abort_blocks([pending])

        # A rewrite is EXISTS; a delete ends block 1's guarantee where it starts.
        ack([batch[0]], [g.write_blocks([BlockWrite(batch[0], block_bytes(layout, 0))])[0].status])
        deleting = fio.position
        assert g.delete_blocks([batch[1]]) == 1
        work.acked = [(h, a, deleting if h == batch[1] else d) for h, a, d in work.acked]

        more = [_hash(6, 7), _hash(7, 200)]
        for i, h in enumerate(more):
            work.seeds[h] = 6 + i
        res = g.write_blocks([BlockWrite(h, block_bytes(layout, work.seeds[h])) for h in more])
        ack(more, [r.status for r in res])
    return fio, work


@dataclass
class Tally:
    states: int = 0
    unique: int = 0
    reads: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    wrong: int = 0
    lost_acked: int = 0
    open_failures: int = 0
    problems: list[str] = field(default_factory=list)


def check_state(
    state_root: Path,
    identity: Identity,
    work: Workload,
    required: set[bytes],
    tally: Tally,
    where: str,
) -> None:
    config = StoreConfig(root=state_root, durability="none", io_threads=1, direct_io="off")
    try:
        store = KVStore(config)
    except Exception as exc:  # the server would not start: a finding
        tally.open_failures += 1
        tally.problems.append(f"{where}: store does not open: {type(exc).__name__}: {exc}")
        return
    with store:
        try:
            g = store.namespace(identity).group(0)
        except Exception as exc:
            tally.open_failures += 1
            tally.problems.append(f"{where}: namespace does not open: {type(exc).__name__}: {exc}")
            return
        out = np.zeros(g.layout.block_nbytes, dtype=np.uint8)
        for h, seed in work.seeds.items():
            out.fill(0)
            (result,) = g.read_blocks([BlockRead(h, out)])
            tally.reads += 1
            if result.status is ReadStatus.HIT:
                tally.hits += 1
                if not np.array_equal(out, block_bytes(g.layout, seed)):
                    tally.wrong += 1
                    tally.problems.append(f"{where}: block {seed} served with wrong bytes")
            elif result.status is ReadStatus.MISS:
                tally.misses += 1
            elif result.status is ReadStatus.CORRUPT:
                tally.corrupt += 1
            else:
                tally.problems.append(f"{where}: block {seed}: {result.status} {result.error}")
            if h in required and result.status is not ReadStatus.HIT:
                tally.lost_acked += 1
                tally.problems.append(
                    f"{where}: acknowledged block {seed} lost ({result.status.value})"
                )


def replay_all(
    base: Path, fio: CrashRecorder, work: Workload, identity: Identity, durability: str
) -> Tally:
    model = CrashModel(list(fio.log), str(base))
    tally = Tally()
    seen: dict[str, tuple[int, int]] = {}
    policies = [*POLICIES, *(f"random-{k}" for k in range(RANDOM_POLICIES))]
    scratch = base.parent / "replay"
    for prefix in range(len(model) + 1):
        for policy in policies:
            state = essential(crash_state(model, prefix, policy))
            tally.states += 1
            must = durability == "full" or policy == "all"
            required = {h for h, a, d in work.acked if must and a <= prefix < d}
            key = fingerprint(state) + "".join(sorted(h.hex() for h in required))
            if key in seen:
                continue
            seen[key] = (prefix, 0)
            tally.unique += 1
            if scratch.exists():
                shutil.rmtree(scratch)
            materialize(state, scratch)
            where = f"prefix {prefix}/{len(model)} ({model.log[prefix - 1][0] if prefix else '-'})"
            check_state(scratch / "store", identity, work, required, tally, f"{where} {policy}")
    return tally


@pytest.mark.parametrize(
    ("durability", "direct_io", "kind"),
    [
        ("full", "auto", "small"),
        ("none", "auto", "small"),
        pytest.param("full", "off", "odd", marks=pytest.mark.skipif(not FULL, reason="full tier")),
        pytest.param("none", "off", "odd", marks=pytest.mark.skipif(not FULL, reason="full tier")),
    ],
)
def test_power_loss_at_every_prefix(
    tmp_path: Path, durability: str, direct_io: str, kind: str
) -> None:
    identity = make_small_identity() if kind == "small" else make_odd_identity()
    base = tmp_path / "rec"
    base.mkdir()
    fio, work = run_workload(base / "store", identity, durability, direct_io)
    tally = replay_all(base, fio, work, identity, durability)
    figure(
        f"power loss (durability={durability}, direct_io={direct_io}, {kind})",
        ops=len(fio.log),
        crash_states=tally.states,
        distinct_states=tally.unique,
        reads=tally.reads,
        hits=tally.hits,
        misses=tally.misses,
        corrupt_misses=tally.corrupt,
        acknowledged_lost=tally.lost_acked,
        open_failures=tally.open_failures,
        wrong_pages_served=tally.wrong,
    )
    assert tally.problems == [], tally.problems[:10]
    assert tally.hits > 0 and tally.misses > 0

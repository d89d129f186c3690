"""gc --watch against readers and a writer in other processes.

Setup: an initial population of ``P`` independent blocks with distinct past mtimes; a writer
process adds ``W`` blocks one at a time, 15 ms apart (distinct mtimes even with a 10 ms kernel
clock tick); two reader processes read random blocks of both sets in a loop (``read_blocks``
verifies the header and every checksum); gc runs
``--watch --max-passes`` with a budget of ``K`` block files and a zero grace period (trash is
unlinked on the next pass, so unlinks race with reads too).

Readers never touch mtimes (``access_granularity_s=0``), so a block's last use is its write
time. **Within budget**, precisely: gc keeps published + temporary bytes <= K files, evicting the
oldest first; the writer has at most one temporary file at a time, so every pass keeps at least
the ``K - 1`` newest blocks present at its scan. A block among the ``K - 1`` newest acknowledged
(WRITTEN) blocks at the end was among the ``K - 1`` newest present at every pass after it was
acknowledged, so it must still be readable, byte for byte.

Checked afterwards: no read was ever CORRUPT, ERROR or a HIT with wrong bytes (no partial
read); reads hit and missed; gc evicted during the run; every block within budget is readable;
at most K blocks are left; ``kvstore verify`` finds nothing.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.cli import main
from kvstore.store.types import BlockRead, BlockWrite, WriteStatus
from tests.admin import race_workers
from tests.admin.race_workers import contents, race_hash
from tests.admin.util import NS_PER_S, held, set_mtime
from tests.helpers import StoreFactory, make_small_identity

P, W, K = 30, 60, 20
DEADLINE_S = 60


def test_gc_watch_against_readers_and_a_writer(
    root: Path, make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    group = make_store().namespace(make_small_identity()).group(0)
    results = group.write_blocks([BlockWrite(race_hash(i), contents(group, i)) for i in range(P)])
    assert all(r.status is WriteStatus.WRITTEN for r in results)
    now = time.time_ns()
    for i in range(P):  # the initial population is older than anything the writer writes
        set_mtime(group.path_of(race_hash(i)), now - (100 + P - i) * NS_PER_S)
    size = held(group.path_of(race_hash(0)))  # what gc counts: what a block holds on the disk
    budget = K * size

    ctx = mp.get_context("spawn")
    out: Any = ctx.Queue()
    go, stop = ctx.Event(), ctx.Event()
    readies = [ctx.Event() for _ in range(3)]
    procs = [
        ctx.Process(target=race_workers.writer, args=(str(root), P, W, 0.015, readies[0], go, out)),
        *(
            ctx.Process(
                target=race_workers.reader,
                args=(str(root), P + W, seed, readies[1 + seed], go, stop, out),
            )
            for seed in range(2)
        ),
    ]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + DEADLINE_S
        for ready in readies:
            assert ready.wait(max(0.1, deadline - time.monotonic())), "a child did not start"
        go.set()
        passes: list[dict[str, Any]] = []
        while procs[0].is_alive() or len(passes) < 5:
            assert time.monotonic() < deadline, "the writer did not finish in time"
            rc = main(
                [
                    "gc",
                    str(root),
                    "--max-bytes",
                    str(budget),
                    "--watch",
                    "--interval",
                    "0.02",
                    "--max-passes",
                    "10",
                    "--grace",
                    "0",
                    "--json",
                    # The survivors asserted below are exactly LRU's: no evicting ahead.
                    "--no-evict-ahead",
                ]
            )
            assert rc == 0
            passes += [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        # Settle: one more pass now that the writer is done (readers still reading).
        assert main(["gc", str(root), "--max-bytes", str(budget), "--grace", "0"]) == 0
        capsys.readouterr()
        time.sleep(0.2)
    finally:
        stop.set()
        reports = [out.get(timeout=DEADLINE_S) for _ in procs]
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    writer_records = next(r for kind, r in reports if kind == "writer")
    assert [status for _, status, _ in writer_records] == ["written"] * W
    for kind, report in reports:
        if kind == "reader":
            assert report["bad"] == [], report["bad"][:5]
            assert report["stats"]["hit"] > 0 and report["stats"]["miss"] > 0, report["stats"]
    assert sum(p["evicted"]["blocks"] for p in passes) > 0
    assert all(p["after"]["usage"] <= budget for p in passes)

    acknowledged = [i for i, _, _ in sorted(writer_records, key=lambda r: r[2])]
    protected = acknowledged[-(K - 1) :]
    buf = np.zeros(group.layout.block_nbytes, dtype=np.uint8)
    for i in protected:
        (result,) = group.read_blocks([BlockRead(race_hash(i), buf)])
        assert result.ok, f"block {i} within budget was lost ({result.status.value})"
        assert np.array_equal(buf, contents(group, i))
    remaining = [i for i in range(P + W) if Path(group.path_of(race_hash(i))).exists()]
    assert len(remaining) <= K
    assert set(protected) <= set(remaining)
    assert main(["verify", str(root)]) == 0
    print(  # shown with -s: how much racing happened
        f"passes {len(passes)}, evicted {sum(p['evicted']['blocks'] for p in passes)}, "
        f"reads {[r['stats'] for k, r in reports if k == 'reader']}"
    )

"""Two nodes, one store, on a real distributed file system (GlusterFS over FUSE).

Node A and node B are the two FUSE mounts of :mod:`tests.scaleout.gluster`, each with its own
client process, network namespace and kernel caches; their processes
(:mod:`tests.scaleout.node`) run in those namespaces. Every test prints one line of figures.

* :func:`test_filesystem_semantics` - what kvstore relies on, checked on the mounts: the
  O_DIRECT probe and its log line, no-replace publishing across nodes, fsyncs, last-use mtimes
  set by a reader on one node seen by the other.
* :func:`test_tp2_on_a_read_at_tp4_and_tp1_on_b` - the parallel mapping across machines.
* :func:`test_same_prefixes_from_both_nodes` - one copy survives, none torn.
* :func:`test_kill9_writer_on_a_while_b_reads`.
* :func:`test_gc_watch_on_a_while_both_nodes_write_and_b_reads` - capacity across nodes.
* :func:`test_publish_and_eviction_staleness` - how long node B's caches hide a change made on
  node A, against the bound set by the mount options.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.cli import main as kvstore_main
from kvstore.config import StoreConfig
from kvstore.identity import GroupSpec, Identity
from kvstore.io.fileio import FileIO
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockRead, BlockWrite, ReadStatus, WriteStatus
from tests.helpers import make_small_identity, tmp_files
from tests.scaleout import gluster as gl
from tests.scaleout.harness import SharedRoot
from tests.scaleout.node import bhash, content

NS = 1_000_000_000


def figure(test: str, **counts: object) -> str:
    line = f"[scaleout] {test}: " + ", ".join(f"{k}={v}" for k, v in counts.items())
    print(line)
    return line


def _cli_json(*args: str) -> tuple[int, dict[str, Any]]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = kvstore_main([*args, "--json"])
    return rc, json.loads(buf.getvalue())


def _read_all(root: Path, salt: str, indices: list[int]) -> dict[str, int]:
    """Read ``indices`` through the mount ``root`` lies on; count hits, misses, wrong blocks."""
    config = StoreConfig(root=root, durability="none", access_granularity_s=0)
    counts = {"hit": 0, "miss": 0, "wrong": 0, "other": 0}
    with KVStore(config, create=False) as store:
        group = store.namespace(make_small_identity(), create=False).group(0)
        buf = np.zeros(group.layout.block_nbytes, dtype=np.uint8)
        for i in indices:
            (result,) = group.read_blocks([BlockRead(bhash(salt, i), buf)])
            if result.status is ReadStatus.HIT:
                counts["hit"] += 1
                counts["wrong"] += not np.array_equal(buf, content(group, salt, i))
            elif result.status is ReadStatus.MISS:
                counts["miss"] += 1
            else:
                counts["other"] += 1
    return counts


def _create_store(root: Path) -> int:
    """Create the store and the small identity's namespace; returns a block file's size."""
    with KVStore(StoreConfig(root=root, durability="full")) as store:
        return store.namespace(make_small_identity()).group(0).layout.file_nbytes


def _acks(path: Path) -> list[tuple[int, str, int]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:  # a line cut by a kill has fewer fields
            rows.append((int(parts[0]), parts[1], int(parts[2])))
    return rows


# -- 1. the file system's semantics ----------------------------------------------------------


def test_filesystem_semantics(
    gluster: gl.GlusterEnv, shared: SharedRoot, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = shared.a, shared.b
    with caplog.at_level(logging.INFO, logger="kvstore.io"):
        store = KVStore(StoreConfig(root=a, durability="full", access_granularity_s=1))
    try:
        engine_line = store.engine.describe()
        # direct_io=auto writes buffered on FUSE (bricks fail O_DIRECT fragments under load),
        # with one log line saying why.
        assert not store.engine.direct.enabled, engine_line
        assert "fuse.glusterfs file system" in store.engine.direct.reason, engine_line
        assert any("buffered writes" in r.getMessage() for r in caplog.records), caplog.text
        group = store.namespace(make_small_identity()).group(0)
        h = bhash("semantics", 0)
        data = content(group, "semantics", 0)
        (written,) = group.write_blocks([BlockWrite(h, data)])  # fdatasync + directory fsync
        assert written.status is WriteStatus.WRITTEN
        assert os.stat(group.path_of(h)).st_nlink == 1  # published by link + unlink: one name
        leftovers = [p.name for p in a.iterdir() if p.name.startswith(".kvstore-probe-")]
        assert leftovers == []
    finally:
        store.close()

    # No-replace publishing across nodes: node A looks a name up (and caches the miss),
    # node B then creates it; A's rename onto it must fail, not replace B's file.
    fio = FileIO()
    target_a, target_b = a / "noreplace", b / "noreplace"
    assert not target_a.exists()  # A caches a negative entry (negative-timeout)
    target_b.write_bytes(b"node B")
    tmp_a = a / "noreplace.tmp-x"
    tmp_a.write_bytes(b"node A")
    with pytest.raises(FileExistsError):
        fio.rename(str(tmp_a), str(target_a))
    assert target_b.read_bytes() == b"node B" and tmp_a.read_bytes() == b"node A"
    fresh = a / "fresh"
    fio.rename(str(tmp_a), str(fresh))
    assert fresh.read_bytes() == b"node A" and not tmp_a.exists()

    # Last use: a read on node B sets the mtime; node A (and gc running there) sees it.
    path_a = Path(group.path_of(h))
    old = time.time_ns() - 3600 * NS
    os.utime(path_a, ns=(old, old))
    time.sleep(gl.ATTRIBUTE_TIMEOUT_S + 0.2)
    assert os.stat(path_a).st_mtime_ns == old  # node A caches the old attributes now
    with KVStore(StoreConfig(root=b, access_granularity_s=1), create=False) as store_b:
        group_b = store_b.namespace(make_small_identity(), create=False).group(0)
        buf = np.zeros(group_b.layout.block_nbytes, dtype=np.uint8)
        (result,) = group_b.read_blocks([BlockRead(h, buf)])
        assert result.ok and np.array_equal(buf, data)
    touched = time.monotonic()
    while os.stat(path_a).st_mtime_ns == old:
        assert time.monotonic() - touched < gl.ATTRIBUTE_TIMEOUT_S + 2, "touch not seen on A"
        time.sleep(0.02)
    seen_after = time.monotonic() - touched
    figure(
        "semantics",
        engine=f"'{engine_line}'",
        rename="no-replace",
        mtime_touch_on_b_seen_on_a_after_s=round(seen_after, 3),
    )


# -- 2. the parallel mapping across machines -------------------------------------------------


def _gqa_identity() -> Identity:
    """8 KV heads x 4 layers, bfloat16: a GQA model small enough for seconds."""
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(4))
    return Identity(
        model="test/scaleout-gqa",
        kv_dtype="bfloat16",
        tokens_per_block=16,
        groups=(GroupSpec(kind="full", layer_names=names, num_kv_heads=8, head_dim=64),),
    )


def test_tp2_on_a_read_at_tp4_and_tp1_on_b(gluster: gl.GlusterEnv, shared: SharedRoot) -> None:
    identity = _gqa_identity()
    spec = {"identity": identity.to_json(), "n": 8, "seed": 10, "salt": "tp", "family": "hnd"}
    writer = shared.start(gluster.a, "tp-write-a", role="tp_write", layout="tp=2", **spec)
    wrote = writer.result(timeout=180)
    assert wrote["written"] == spec["n"] and wrote["visible_before_commit"] == 0, wrote
    reader = shared.start(
        gluster.b, "tp-read-b", role="tp_read", layouts=["tp=4", "tp=1", "tp=2,pp=2"], **spec
    )
    read = reader.result(timeout=180)
    for key, counts in read.items():
        assert counts["hits"] == counts["blocks"], (key, counts)
        assert counts["wrong_pages"] == 0, (key, counts)
    hits = sum(c["hits"] for c in read.values())
    figure(
        "tp2 on A -> tp4/tp1/tp2pp2 on B",
        blocks=spec["n"],
        write_ranks=wrote["ranks"],
        written=wrote["written"],
        rank_block_reads=sum(c["blocks"] for c in read.values()),
        hits_across_nodes=hits,
        pages=sum(c["pages"] for c in read.values()),
        wrong_pages=sum(c["wrong_pages"] for c in read.values()),
    )


def test_ranks_on_both_nodes_write_one_block(gluster: gl.GlusterEnv, shared: SharedRoot) -> None:
    """Pipeline stages on two machines: tp=2,pp=2 with stage 0 on A and stage 1 on B write
    the same pending files through two FUSE clients; B commits; A reads at tp=1 and tp=4."""
    identity = _gqa_identity()
    spec = {
        "identity": identity.to_json(),
        "n": 6,
        "seed": 11,
        "salt": "pp-across",
        "layout": "tp=2,pp=2",
        "pendings_file": str(shared.local / "pendings.pickle"),
    }
    stage0 = [[0, 0, 0], [1, 0, 0]]
    stage1 = [[0, 1, 0], [1, 1, 0]]
    a = shared.start(gluster.a, "pp-stage0-a", role="tp_write", coords=stage0, commit=False, **spec)
    wrote_a = a.result(timeout=180)
    b = shared.start(gluster.b, "pp-stage1-b", role="tp_write", coords=stage1, **spec)
    wrote_b = b.result(timeout=180)
    assert wrote_b["visible_before_commit"] == 0 and wrote_b["written"] == spec["n"], wrote_b
    reader = shared.start(gluster.a, "pp-read-a", role="tp_read", layouts=["tp=1", "tp=4"], **spec)
    read = reader.result(timeout=180)
    for key, counts in read.items():
        assert counts["hits"] == counts["blocks"] and counts["wrong_pages"] == 0, (key, counts)
    assert tmp_files(shared.a) == []
    figure(
        "pp=2 stages on A and B -> tp1/tp4 on A",
        blocks=spec["n"],
        ranks_on_a=wrote_a["ranks"],
        ranks_on_b=wrote_b["ranks"],
        written=wrote_b["written"],
        hits_across_nodes=sum(c["hits"] for c in read.values()),
        pages=sum(c["pages"] for c in read.values()),
        wrong_pages=sum(c["wrong_pages"] for c in read.values()),
    )


# -- 3. both nodes write the same prefixes ---------------------------------------------------


@pytest.mark.parametrize(
    ("mode_a", "mode_b", "order_b"),
    [("whole", "multi", "same"), ("whole", "whole", "same"), ("multi", "whole", "reversed")],
)
def test_same_prefixes_from_both_nodes(
    gluster: gl.GlusterEnv, shared: SharedRoot, mode_a: str, mode_b: str, order_b: str
) -> None:
    n, chain = 96, 16
    _create_store(shared.a)
    salt = f"same-{mode_a}-{mode_b}-{order_b}"
    indices = list(range(n))
    # publish_delay_s: a random wait before each publishing rename, so that the nodes often
    # both pass the existence check and race at the rename itself.
    common = {
        "salt": f"same-{mode_a}-{mode_b}-{order_b}",
        "chain": chain,
        "sync": True,
        "durability": "full",
        "publish_delay_s": 0.004,
    }
    pa = shared.start(
        gluster.a, "same-a", role="write_list", indices=indices, mode=mode_a, **common
    )
    order = indices if order_b == "same" else indices[::-1]
    pb = shared.start(gluster.b, "same-b", role="write_list", indices=order, mode=mode_b, **common)
    for p in (pa, pb):
        p.wait_ready()
    for p in (pa, pb):
        p.go()
    ra, rb = pa.result(), pb.result()
    sa, sb = dict(ra["statuses"]), dict(rb["statuses"])
    outcomes = {i: (sa[i], sb[i]) for i in indices}
    # Exactly one node publishes each block (WRITTEN), the other finds it there (EXISTS), and
    # neither fails: FileIO.rename publishes with link(2), which is a single link on one brick
    # because the rsync-style temporary name lies on the final name's brick (the volume's
    # default rsync-hash-regex), so EEXIST is atomic. Temporary names of another shape let two
    # racing links both succeed (issue 10).
    bad = {i: o for i, o in outcomes.items() if sorted(o) != ["exists", "written"]}
    assert not bad, f"expected one WRITTEN and one EXISTS per block: {list(bad.items())[:10]}"
    assert tmp_files(shared.a) == []
    # What the bricks hold, bypassing every client cache: one data file per block, no DHT
    # link files (a link file means a publish crossed bricks).
    bricks = gl.brick_files(gluster, shared.name)
    on_bricks = {path: counts for path, counts in bricks.items() if "/c/" in path}
    copies = sorted({c["data"] for c in on_bricks.values()})
    link_files = sum(c["link"] for c in on_bricks.values())
    assert len(on_bricks) == n and copies == [1] and link_files == 0, (copies, link_files)
    reads_a = _read_all(shared.a, salt, indices)
    reads_b = _read_all(shared.b, salt, indices)
    for reads in (reads_a, reads_b):
        assert reads == {"hit": n, "miss": 0, "wrong": 0, "other": 0}, reads
    rc, report = _cli_json("verify", str(shared.b))
    assert rc == 0, report["findings"][:5]
    figure(
        f"same prefixes A:{mode_a} B:{mode_b}/{order_b}",
        blocks=n,
        written_by_a=sum(s == "written" for s in sa.values()),
        written_by_b=sum(s == "written" for s in sb.values()),
        lost_at_rename=ra["rename_conflicts"] + rb["rename_conflicts"],
        copies_per_block=copies[0],
        dht_link_files=link_files,
        hits_on_a=reads_a["hit"],
        hits_on_b=reads_b["hit"],
        torn=reads_a["other"] + reads_b["other"],
        wrong=reads_a["wrong"] + reads_b["wrong"],
        seconds_a=ra["seconds"],
        seconds_b=rb["seconds"],
    )


# -- 4. kill -9 of a writer on one node while the other reads --------------------------------


def test_kill9_writer_on_a_while_b_reads(gluster: gl.GlusterEnv, shared: SharedRoot) -> None:
    rounds, pool = 3, 120
    _create_store(shared.a)
    salt = "kill9"
    stop = shared.local / "stop-reader"
    reader = shared.start(
        gluster.b,
        "kill9-reader-b",
        role="reader_loop",
        salt=salt,
        range=[0, pool],
        stop_file=str(stop),
        access_granularity_s=0,
    )
    reader.wait_ready()
    ack_file = shared.local / "acks"
    rng = random.Random(7)
    first = 0
    killed_after: list[int] = []
    for r in range(rounds):
        writer = shared.start(
            gluster.a,
            f"kill9-writer-a-{r}",
            role="writer_loop",
            salt=salt,
            first=first,
            last=pool,
            ack_file=str(ack_file),
            modes=["whole", "multi"],
            durability="full" if r % 2 == 0 else "none",
        )
        writer.wait_ready()
        target = len(_acks(ack_file)) + rng.randrange(15, 40)
        deadline = time.monotonic() + 60
        while len(_acks(ack_file)) < target:
            assert time.monotonic() < deadline, writer.stderr_tail()
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.05))  # anywhere inside the next write
        writer.kill9()
        acks = _acks(ack_file)
        killed_after.append(len(acks))
        first = max(i for i, _, _ in acks) + 1
        time.sleep(0.3)  # the reader keeps reading around the dead writer's leftovers
    time.sleep(0.5)
    stop.touch()
    got = reader.result()
    assert got["stats"]["wrong"] == 0 and got["bad"] == [], got
    acked = [i for i, status, _ in _acks(ack_file) if status == "written"]
    time.sleep(gl.NEGATIVE_TIMEOUT_S)  # B's reader may have just cached a miss of the newest
    reads_b = _read_all(shared.b, salt, acked)
    assert reads_b == {"hit": len(acked), "miss": 0, "wrong": 0, "other": 0}, reads_b
    rc, report = _cli_json("verify", str(shared.b), "--tmp-age", "0")
    assert set(report["counts"]) <= {"orphan-temp"}, report["findings"][:5]
    orphans = report["counts"].get("orphan-temp", 0)
    rc, _ = _cli_json("verify", str(shared.b), "--fix", "--tmp-age", "0")
    rc, report = _cli_json("verify", str(shared.b))
    assert rc == 0, report["findings"][:5]
    figure(
        "kill -9 writer on A, reader on B",
        kills=rounds,
        acked_blocks=len(acked),
        orphan_temps_swept=orphans,
        reader_reads=got["stats"]["reads"],
        hits_across_nodes=got["stats"]["hit"],
        misses=got["stats"]["miss"],
        corrupt=got["stats"]["corrupt"],
        errors=got["stats"]["error"],
        wrong=got["stats"]["wrong"],
    )


# -- 5. gc --watch on one node while both write and the other reads ---------------------------


def _passes_done(out: Path) -> int:
    """Passes ``kvstore gc --watch --json`` reported so far (one JSON line each)."""
    text = out.read_text() if out.exists() else ""
    return text.count("\n")


def _wait_passes(out: Path, passes: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _passes_done(out) < passes:
        assert time.monotonic() < deadline, f"gc --watch did not finish {passes} passes"
        time.sleep(0.1)


def test_gc_watch_on_a_while_both_nodes_write_and_b_reads(
    gluster: gl.GlusterEnv, shared: SharedRoot
) -> None:
    per_writer, keep, grace_s = 150, 40, 2.0
    size = _create_store(shared.a)
    budget = keep * size
    salt = "gc"
    stop = shared.local / "stop"
    acks_a, acks_b = shared.local / "acks-a", shared.local / "acks-b"
    base_b = 1_000_000
    common = {"salt": salt, "sync": True, "pace_s": 0.01, "access_granularity_s": 0}
    writers = [
        shared.start(
            gluster.a, "gc-writer-a", role="writer_loop", first=0, last=per_writer,
            ack_file=str(acks_a), modes=["whole"], **common,
        ),
        shared.start(
            gluster.b, "gc-writer-b", role="writer_loop", first=base_b,
            last=base_b + per_writer, ack_file=str(acks_b), modes=["multi"], **common,
        ),
    ]  # fmt: skip
    readers = [
        shared.start(
            gluster.b, f"gc-reader-b{k}", role="reader_loop", range=rng, seed=k,
            stop_file=str(stop), **common,
        )
        for k, rng in enumerate([[0, per_writer], [base_b, base_b + per_writer]])
    ]  # fmt: skip
    for p in writers + readers:
        p.wait_ready()
    kvstore_bin = [
        sys.executable,
        "-c",
        "import sys; from kvstore.cli import main; sys.exit(main())",
    ]
    gc_argv = gluster.a.command(
        [
            *kvstore_bin, "gc", str(shared.a), "--max-bytes", str(budget), "--watch",
            "--interval", "0.2", "--grace", str(grace_s), "--json",
            # The check below (the keep-2 newest blocks survive) is plain LRU to the budget;
            # evicting ahead of the writers' rate would take up to half the budget more.
            "--no-evict-ahead",
        ]
    )  # fmt: skip
    gc_out, gc_err = shared.local / "gc.jsonl", shared.local / "gc.stderr"
    with open(gc_out, "w") as out, open(gc_err, "w") as err:
        gc_proc = subprocess.Popen(gc_argv, stdout=out, stderr=err)
    try:
        for p in writers + readers:
            p.go()
        for w in writers:
            w.result(timeout=120)
        # Two more passes: the second one started after the writers' last block (a pass on
        # GlusterFS takes seconds on a loaded machine), and trash older than the grace expires.
        _wait_passes(gc_out, _passes_done(gc_out) + 2, timeout_s=180)
        time.sleep(grace_s + 1.0)
    finally:
        gc_proc.send_signal(signal.SIGTERM)  # stops after the current pass
        gc_proc.wait(timeout=60)
        stop.touch()
    assert gc_proc.returncode == 0, gc_err.read_text()[-2000:]
    passes = [json.loads(line) for line in gc_out.read_text().splitlines()]
    reads = [r.result() for r in readers]
    for got in reads:
        assert got["stats"]["wrong"] == 0 and got["bad"] == [], got
    assert passes and all(p["after"]["usage"] <= budget for p in passes)
    evicted = sum(p["evicted"]["blocks"] for p in passes)
    unlinked = sum(p["trash_emptied"]["files"] for p in passes)
    assert evicted >= 2 * per_writer - keep
    rc, usage = _cli_json("du", str(shared.b))
    assert usage["total"]["gc_usage"] <= budget
    # Each writer holds at most one temporary file: every pass keeps the keep-2 newest blocks.
    acked = sorted(
        ((t, i) for f in (acks_a, acks_b) for i, s, t in _acks(f) if s == "written"),
        reverse=True,
    )
    newest = [i for _, i in acked[: keep - 2]]
    reads_b = _read_all(shared.b, salt, newest)
    assert reads_b["hit"] == len(newest) and reads_b["wrong"] == 0, reads_b
    rc, report = _cli_json("verify", str(shared.b))
    assert rc == 0, report["findings"][:5]
    stats = [r["stats"] for r in reads]
    figure(
        "gc --watch on A, writers on A and B, readers on B",
        budget_blocks=keep,
        written=len(acked),
        gc_passes=len(passes),
        max_usage_after_pass=max(p["after"]["usage"] for p in passes) // size,
        gc_pass_s_max=round(max(p["seconds"] for p in passes), 2),
        evicted=evicted,
        trash_unlinked=unlinked,
        reads=sum(s["reads"] for s in stats),
        hits_across_nodes=stats[0]["hit"],
        hits=sum(s["hit"] for s in stats),
        misses=sum(s["miss"] for s in stats),
        corrupt=sum(s["corrupt"] for s in stats),
        errors=sum(s["error"] for s in stats),
        wrong=sum(s["wrong"] for s in stats),
    )


# -- 6. staleness ----------------------------------------------------------------------------


def test_publish_and_eviction_staleness(gluster: gl.GlusterEnv, shared: SharedRoot) -> None:
    n = 30
    _create_store(shared.a)
    salt = "stale"
    stop = shared.local / "stop"
    marker = shared.local / "evicted"
    watcher = shared.start(
        gluster.b, "stale-watch-b", role="watch", salt=salt, indices=list(range(n)),
        stop_file=str(stop), evicted_marker=str(marker), access_granularity_s=0,
    )  # fmt: skip
    watcher.wait_ready()
    time.sleep(0.3)  # B has probed every block: its misses are cached now
    acks = shared.local / "acks"
    writer = shared.start(
        gluster.a, "stale-writer-a", role="writer_loop", salt=salt, first=0, last=n,
        pace_s=0.07, ack_file=str(acks), modes=["whole"],
    )  # fmt: skip
    writer.result()
    published = {i: t for i, s, t in _acks(acks) if s == "written"}
    assert len(published) == n
    time.sleep(gl.NEGATIVE_TIMEOUT_S + 0.5)
    evict_start = time.time_ns()
    rc, _ = _cli_json("gc", str(shared.a), "--max-bytes", "0", "--grace", "60")
    evict_end = time.time_ns()
    marker.touch()
    assert rc == 0
    time.sleep(gl.ENTRY_TIMEOUT_S + gl.ATTRIBUTE_TIMEOUT_S + 0.5)
    stop.touch()
    seen = watcher.result()
    appeared = {int(k): v for k, v in seen["appeared"].items()}
    vanished = {int(k): v for k, v in seen["vanished"].items()}
    assert set(appeared) == set(range(n)), "a block never became visible on B"
    publish_lag = sorted((appeared[i] - published[i]) / NS for i in range(n))
    assert set(vanished) == set(range(n)), "an evicted block stayed visible on B"
    evict_lag = sorted(max(0, vanished[i] - evict_end) / NS for i in range(n))
    reads = seen["reads"]
    assert reads["wrong"] == 0 and reads["other"] == 0, reads
    # Bounds: the mount's negative timeout (publish) and entry + attribute timeouts (eviction),
    # plus one poll and scheduling slack on a loaded two-core machine.
    slack = 0.5
    assert publish_lag[-1] <= gl.NEGATIVE_TIMEOUT_S + slack, publish_lag
    assert evict_lag[-1] <= gl.ENTRY_TIMEOUT_S + gl.ATTRIBUTE_TIMEOUT_S + slack, evict_lag
    figure(
        "staleness A -> B",
        blocks=n,
        publish_visible_on_b_median_s=round(publish_lag[n // 2], 3),
        publish_visible_on_b_max_s=round(publish_lag[-1], 3),
        negative_timeout_s=gl.NEGATIVE_TIMEOUT_S,
        eviction_seen_on_b_max_s=round(evict_lag[-1], 3),
        gc_seconds=round((evict_end - evict_start) / NS, 3),
        reads_on_b=reads["hit"] + reads["miss"],
        hits_after_eviction=reads["hit_after_eviction"],
        wrong=reads["wrong"],
    )

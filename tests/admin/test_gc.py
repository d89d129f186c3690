"""``kvstore gc``: LRU leaves first, two-phase deletion, dry run, budget accounting, --watch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.admin import gc
from kvstore.admin.eviction import (
    KeySet,
    LastUseHistogram,
    ParentCounts,
    bloom_false_positive_rate,
)
from kvstore.admin.gc import Policy
from kvstore.store.paths import temp_path_for
from kvstore.store.types import BlockRead, ReadStatus
from tests.admin.util import (
    NS_PER_S,
    age,
    cli,
    cli_json,
    expected_bytes,
    held,
    set_mtime,
    snapshot,
    write,
)
from tests.helpers import StoreFactory, block_hash, chain_hashes, make_small_identity

REPO = Path(__file__).resolve().parents[2]


def present(paths: list[str]) -> list[bool]:
    return [os.path.exists(p) for p in paths]


@pytest.fixture
def chain_plus_one(root: Path, make_store: StoreFactory) -> tuple[list[str], int]:
    """A <- B <- C (a prefix chain) and D (alone); LRU order A, B, D, C. (paths, file size)."""
    group = make_store().namespace(make_small_identity()).group(0)
    a, b, c = chain_hashes(3)
    d = block_hash(99)
    paths = write(group, [a, b, c, d], [None, a, b, None])
    now = time.time_ns()
    for path, seconds_ago in zip(paths, [400, 300, 100, 200], strict=True):
        set_mtime(path, now - seconds_ago * NS_PER_S)
    return paths, held(paths[0])


def test_leaves_go_first(
    root: Path, chain_plus_one: tuple[list[str], int], capsys: pytest.CaptureFixture[str]
) -> None:
    """Budget for 2 blocks: LRU alone would evict A and B (the oldest) and break the chain at
    its root; leaves-first evicts D (the oldest leaf), then C, and keeps the prefix A <- B."""
    paths, size = chain_plus_one
    rc, doc = cli_json(capsys, "gc", root, "--max-bytes", 2 * size, "--dry-run", "--list-victims")
    assert rc == 0
    c, d = chain_hashes(3)[2], block_hash(99)
    assert sorted(v["hash"] for v in doc["evicted"]["victims"]) == sorted([d.hex(), c.hex()])
    assert present(paths) == [True] * 4
    rc, doc = cli_json(capsys, "gc", root, "--max-bytes", 2 * size)
    assert rc == 0
    assert present(paths) == [True, True, False, False]
    # Without --list-victims the report summarises them: count, bytes, last-use range.
    assert "victims" not in doc["evicted"] and doc["evicted"]["blocks"] == 2
    last = doc["evicted"]["last_use"]
    assert last["oldest_ns"] <= last["newest_ns"] and last["oldest"].endswith("Z")
    assert doc["after"]["usage"] == 2 * size and not doc["over_budget"]
    # Budget for 1: B is a leaf now and goes; the root of the chain stays.
    assert cli_json(capsys, "gc", root, "--max-bytes", size)[0] == 0
    assert present(paths) == [True, False, False, False]


def test_max_age_leaves_first(
    root: Path, chain_plus_one: tuple[list[str], int], capsys: pytest.CaptureFixture[str]
) -> None:
    paths, _ = chain_plus_one
    # Older than 150 s: A, B, D. D is a leaf and goes; A and B have the young C below them.
    rc, doc = cli_json(capsys, "gc", root, "--max-age", "150s")
    assert rc == 0 and doc["evicted"]["blocks"] == 1
    assert present(paths) == [True, True, True, False]
    # Older than 50 s: everything, leaves first: C, then B, then A.
    rc, doc = cli_json(capsys, "gc", root, "--max-age", "50", "--list-victims")
    a, b, c = chain_hashes(3)
    assert [v["hash"] for v in doc["evicted"]["victims"]] == [c.hex(), b.hex(), a.hex()]
    assert present(paths) == [False] * 4


def test_one_lru_over_all_namespaces(
    root: Path, make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    store = make_store()
    g1 = store.namespace(make_small_identity()).group(0)
    g2 = store.namespace(make_small_identity(revision="b")).group(0)
    p1 = write(g1, [block_hash(i, "x") for i in range(3)])
    p2 = write(g2, [block_hash(i, "y") for i in range(3)])
    age([p1[0], p2[0], p1[1], p2[1], p1[2], p2[2]])
    size = held(p1[0])
    assert cli_json(capsys, "gc", root, "--max-bytes", 3 * size)[0] == 0
    assert present(p1 + p2) == [False, False, True, False, True, True]


def test_dry_run_changes_nothing(
    root: Path, make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    store = make_store()
    ident = make_small_identity()
    group = store.namespace(ident).group(0)
    paths = write(group, [block_hash(i) for i in range(6)])
    age(paths)
    orphan = paths[0] + ".tmp-00000000000000ff"
    Path(orphan).write_bytes(b"o" * 100)
    set_mtime(orphan, time.time_ns() - 7200 * NS_PER_S)
    trash = store.root / ident.namespace / "trash"
    trash.mkdir()
    (trash / f"g0-1-2-{time.time_ns() - 3600 * NS_PER_S}").write_bytes(b"t" * 50)
    before = snapshot(root)
    rc, doc = cli_json(capsys, "gc", root, "--max-bytes", "1", "--max-age", "1s", "--dry-run")
    assert rc == 0  # all blocks would go and the orphan temp would be swept: 0 bytes left
    assert snapshot(root) == before
    assert doc["dry_run"] is True
    assert doc["evicted"]["blocks"] == 6
    # Every byte figure of gc's is what the files hold on the disk (a 50-byte file: a page).
    assert doc["trash_emptied"] == {"entries": 1, "files": 1, "bytes": held(next(trash.iterdir()))}
    assert doc["temps_removed"] == {"files": 1, "bytes": held(orphan)}
    rc, out, _ = cli(capsys, "gc", root, "--max-bytes", "10G", "--dry-run")
    assert rc == 0 and "dry run" in out and "would evict 0 blocks" in out
    assert snapshot(root) == before


def test_two_phase_deletion(
    root: Path, make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """Evicted blocks are renamed into trash (a reader that opened before reads them whole,
    a later open misses) and unlinked only once older than the grace period."""
    store = make_store()
    ident = make_small_identity()
    group = store.namespace(ident).group(0)
    hashes = [block_hash(i) for i in range(3)]
    paths = write(group, hashes)
    age(paths)
    fd = os.open(paths[0], os.O_RDONLY)  # a reader in the middle of its read
    try:
        rc, doc = cli_json(capsys, "gc", root, "--max-bytes", 2 * held(paths[0]))
        assert rc == 0 and doc["evicted"]["blocks"] == 1
        assert not os.path.exists(paths[0])
        trash = root / ident.namespace / "trash"
        (bucket,) = trash.iterdir()  # fanned out like the store: trash/<hi>/
        hi = int(Path(paths[0]).parent.name)
        assert bucket.name == str(hi)
        (entry,) = bucket.iterdir()
        assert entry.name.startswith(f"g0-{hi}-")
        data = os.pread(fd, group.layout.file_nbytes + 1, 0)
        assert data == entry.read_bytes() and len(data) == group.layout.file_nbytes
    finally:
        os.close(fd)
    out = np.zeros(group.layout.block_nbytes, dtype=np.uint8)
    assert group.read_blocks([BlockRead(hashes[0], out)])[0].status is ReadStatus.MISS
    # Still inside the grace period: the next run keeps it.
    rc, doc = cli_json(capsys, "gc", root, "--max-bytes", "1G")
    assert doc["trash_emptied"]["entries"] == 0 and entry.exists()
    assert doc["before"]["trash_bytes"] == held(entry)
    assert doc["before"]["usage"] == 2 * held(paths[1])  # trash is not counted
    # A run after the grace period unlinks it.
    later = time.time_ns() + 61 * NS_PER_S
    doc = gc.gc_pass(root, Policy(max_bytes=1 << 30), now_ns=later)
    assert doc["trash_emptied"]["entries"] == 1 and not entry.exists()
    rc, doc = cli_json(capsys, "gc", root, "--max-bytes", "1G", "--grace", "0")
    assert rc == 0 and doc["trash_emptied"]["entries"] == 0


def test_trash_is_fanned_out_and_flat_entries_still_expire(
    root: Path, make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """Victims go to trash/<hi>/ (like the blocks: no directory of millions after a big pass);
    entries of the earlier flat trash are still counted and unlinked once expired."""
    store = make_store()
    ident = make_small_identity()
    group = store.namespace(ident).group(0)
    paths = write(group, [block_hash(i) for i in range(40)])
    age(paths)
    trash = root / ident.namespace / "trash"
    trash.mkdir()
    flat = trash / f"g0-1-2-{time.time_ns() - 600 * NS_PER_S}"  # an earlier version's entry
    flat.write_bytes(b"f" * 10)
    rc, doc = cli_json(capsys, "gc", root, "--max-bytes", 0, "--grace", "1h")
    assert rc == 0 and doc["evicted"]["blocks"] == 40
    assert doc["trash_emptied"]["entries"] == 0 and flat.exists()  # 10 min: not expired
    his = {Path(p).parent.name for p in paths}
    assert {d.name for d in trash.iterdir() if d.is_dir()} == his
    moved = [e for d in trash.iterdir() if d.is_dir() for e in d.iterdir()]
    assert len(moved) == 40 and all(e.name.startswith(f"g0-{e.parent.name}-") for e in moved)
    rc, doc = cli_json(capsys, "gc", root, "--max-bytes", "1G", "--grace", "0")
    assert doc["before"]["trash_entries"] == 41
    assert doc["trash_emptied"]["entries"] == 41 and doc["trash_emptied"]["files"] == 41
    assert not flat.exists() and not any(any(d.iterdir()) for d in trash.iterdir())


def test_readers_record_last_use(
    root: Path, make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """A read refreshes the block's mtime (once per access_granularity_s): gc keeps it."""
    group = make_store(access_granularity_s=1).namespace(make_small_identity()).group(0)
    hashes = [block_hash(i) for i in range(4)]
    paths = write(group, hashes)
    age(paths)  # hashes[0] is the oldest
    out = np.zeros(group.layout.block_nbytes, dtype=np.uint8)
    assert group.read_blocks([BlockRead(hashes[0], out)])[0].ok
    assert np.array_equal(out, expected_bytes(group, hashes[0]))
    assert cli_json(capsys, "gc", root, "--max-bytes", 2 * held(paths[1]))[0] == 0
    assert present(paths) == [True, False, False, True]


def test_block_used_since_the_scan_is_kept(
    root: Path, make_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gc re-checks a victim's mtime just before renaming it: one a reader used since the scan
    stays (counted as kept), and the next candidate goes in its place."""
    from kvstore.admin import eviction_pass  # noqa: PLC0415

    group = make_store().namespace(make_small_identity()).group(0)
    hashes = [block_hash(i) for i in range(3)]
    paths = write(group, hashes)
    age(paths)
    size = held(paths[0])
    real_take = eviction_pass.EvictionRun._take

    def take(run: eviction_pass.EvictionRun, block: object, *args: object) -> None:
        if block.path == paths[0]:  # type: ignore[attr-defined]
            set_mtime(paths[0], time.time_ns())  # a reader, between the scan and the rename
        real_take(run, block, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(eviction_pass.EvictionRun, "_take", take)
    doc = gc.gc_pass(root, Policy(max_bytes=2 * size, list_victims=True))
    assert doc["evicted"]["kept_recently_used"] == 1
    assert present(paths) == [True, False, True]  # the next oldest went instead
    assert doc["after"]["usage"] == 2 * size and not doc["over_budget"]


def test_parent_links_need_the_full_hash_and_cycles_still_drain(
    root: Path, make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """A damaged pair naming each other as parent has no leaf: after a leaf round that finds
    none, the last round evicts by last use alone (reported), so the budget is still met."""
    group = make_store().namespace(make_small_identity()).group(0)
    a, b = block_hash(1), block_hash(2)
    paths = write(group, [a, b], [b, a])
    age(paths)
    rc, doc = cli_json(capsys, "gc", root, "--max-bytes", 0)
    assert rc == 0 and doc["evicted"]["blocks"] == 2
    assert doc["selection"]["lru_fallback"] is True
    assert present(paths) == [False, False]


def test_parent_filter_counts_children_and_saturates_safely() -> None:
    """A key is a parent while a child names it; the last child gone exposes it. Other keys
    never look like parents in a filter this empty."""
    counts = ParentCounts(1 << 12)
    parent = ("ns", 0, 7, 12345)
    counts.add(parent)
    counts.add(parent)
    assert counts.may_be_parent(parent)
    counts.remove(parent)
    assert counts.may_be_parent(parent)
    counts.remove(parent)
    assert not counts.may_be_parent(parent)
    others = [("ns", 0, i % 256, i * 7919) for i in range(200)]
    assert not any(counts.may_be_parent(k) for k in others)
    assert counts.may_be_parent(("ns", 0, 7, 12345)) is False
    # The same hash in another namespace or group is another key.
    counts.add(parent)
    assert not counts.may_be_parent(("other", 0, 7, 12345))
    assert not counts.may_be_parent(("ns", 1, 7, 12345))
    assert bloom_false_positive_rate(10**6) < 1e-3 < bloom_false_positive_rate(10**8)
    with pytest.raises(ValueError, match="at least 64 counters"):
        ParentCounts(8)


def test_batch_and_single_key_filters_agree() -> None:
    """The scans ask the filters a fan-out directory at a time (numpy); evictions one key at
    a time: both must find the same slots, or a parent could be exposed that is not."""
    rng = np.random.default_rng(7)
    hi = rng.integers(0, 256, 300, dtype=np.uint64)
    lo = rng.integers(0, 1 << 62, 300, dtype=np.uint64)
    keys = [("ns", 1, int(h), int(x)) for h, x in zip(hi, lo, strict=True)]
    counts = ParentCounts(1 << 16)
    counts.add_many("ns", 1, hi[:100], lo[:100])
    counts.add_many("ns", 1, hi[:10], lo[:10])  # ten keys named twice: two children each
    batch = counts.may_be_parent_many("ns", 1, hi, lo)
    assert batch.tolist() == [counts.may_be_parent(k) for k in keys]
    assert batch[:100].all() and batch[100:].sum() <= 3
    for k in keys[:10]:
        counts.remove(k)
    assert counts.may_be_parent_many("ns", 1, hi[:10], lo[:10]).all()  # one child left each
    for k in keys[:100]:
        counts.remove(k)
    assert not counts.may_be_parent_many("ns", 1, hi[:100], lo[:100]).any()
    seen = KeySet(1 << 16)
    for k in keys[:50]:
        seen.add(k)
    many = seen.contains_many("ns", 1, hi, lo)
    assert many.tolist() == [k in seen for k in keys] and many[:50].all()


def test_histogram_cut_frees_the_excess_oldest_first() -> None:
    """The cut-off takes the oldest intervals whole and the boundary one only as needed."""
    hist = LastUseHistogram(oldest_ns=0, now_ns=999, buckets=10)  # intervals of 100 ns
    for when, size in [(5, 10), (150, 20), (160, 20), (950, 40)]:
        hist.add(when, size)
    assert hist.total_bytes == 90
    assert hist.cut(0) is None
    cut = hist.cut(25)
    assert cut is not None and (cut.before_ns, cut.boundary_end_ns) == (100, 200)
    assert cut.below_bytes == 10  # the 5-ns block; the boundary interval holds 40 more
    cut = hist.cut(10)
    assert cut is not None and (cut.before_ns, cut.below_bytes) == (0, 0)
    everything = hist.cut(1000)
    assert everything is not None and everything.before_ns > 999
    assert hist.bucket(5000) == 9 and hist.bucket(-5) == 0  # future = now, past = oldest
    for b in range(10):
        assert hist.bucket(hist.start_ns(b)) == b


@pytest.mark.parametrize("shape", ["current", "legacy"])
def test_temps_and_quarantine_count_and_over_budget(
    root: Path, make_store: StoreFactory, capsys: pytest.CaptureFixture[str], shape: str
) -> None:
    """Temporary files are counted and crashed writers' swept, in today's rsync-style shape
    (``.<lo>.tmp-<token>``) and in the shape of earlier versions (``<lo>.tmp-<token>``)."""
    store = make_store()
    ident = make_small_identity()
    group = store.namespace(ident).group(0)
    paths = write(group, [block_hash(i) for i in range(3)])
    size = held(paths[0])

    def temp(path: str, token: str) -> str:
        return temp_path_for(path, token) if shape == "current" else f"{path}.tmp-{token}"

    young = temp(paths[0], "0000000000000001")
    Path(young).write_bytes(b"y" * size)  # a write in flight: counted, kept
    old = temp(paths[1], "0000000000000002")
    Path(old).write_bytes(b"o" * size)
    set_mtime(old, time.time_ns() - 7200 * NS_PER_S)  # a crashed writer's: swept
    rc, doc = cli_json(capsys, "gc", root, "--max-bytes", 3 * size)
    assert rc == 0
    assert doc["before"]["usage"] == 5 * size
    assert doc["temps_removed"] == {"files": 1, "bytes": size}
    assert doc["evicted"]["blocks"] == 1 and doc["after"]["usage"] == 3 * size
    assert os.path.exists(young) and not os.path.exists(old)
    quarantine = root / ident.namespace / "quarantine"
    quarantine.mkdir()
    (quarantine / "g0-1-1-1").write_bytes(b"q" * 4 * size)
    rc, doc = cli_json(capsys, "gc", root, "--max-bytes", 3 * size)
    assert rc == 1 and doc["over_budget"] is True  # only non-block bytes left
    assert doc["after"]["blocks"] == 0
    rc, out, _ = cli(capsys, "gc", root, "--max-bytes", 3 * size)
    assert rc == 1 and "OVER BUDGET" in out


def test_a_pass_within_budget_reads_no_header(root: Path, make_store: StoreFactory) -> None:
    """A pass within budget is one stat-only scan; one over budget reads each header once
    (plus each victim's, just before it goes)."""
    group = make_store().namespace(make_small_identity()).group(0)
    paths = write(group, [block_hash(i) for i in range(5)])
    age(paths)
    docs: list[dict[str, Any]] = []

    def on_pass(doc: dict[str, Any], number: int) -> None:
        docs.append(doc)
        if number == 2:
            write(group, [block_hash(100)])

    rc = gc.watch(root, Policy(max_bytes=1 << 30), interval_s=0.0, max_passes=4, on_pass=on_pass)
    assert rc == 0
    assert [d["headers_read"] for d in docs] == [0, 0, 0, 0]
    assert [d["before"]["blocks"] for d in docs] == [5, 5, 6, 6]
    size = held(paths[0])
    doc = gc.gc_pass(root, Policy(max_bytes=5 * size))
    assert doc["evicted"]["blocks"] == 1 and doc["headers_read"] == 6 + 1
    assert doc["selection"]["rounds"] == 1 and doc["selection"]["parents"] == 0


def test_watch_evicts_ahead_of_the_writers() -> None:
    """--watch aims below the budget by what writers add until the next pass's evictions
    land: the rate seen between passes times (interval + pass time), at most half the budget."""
    ahead = gc.EvictAhead(interval_s=10.0, max_bytes=10_000)
    assert ahead.headroom() == 0  # nothing seen yet
    ahead.observe({"before": {"usage": 5000}, "after": {"usage": 4000}}, 0.0, 2.0)
    assert ahead.headroom() == 0  # one pass: no rate yet
    # 10 s after the last pass ended, the next found 1200 bytes more than it left: 120 B/s.
    ahead.observe({"before": {"usage": 5200}, "after": {"usage": 4000}}, 12.0, 12.0)
    assert ahead.rate == pytest.approx(60.0)  # smoothed: half of 120 B/s
    assert ahead.headroom() == int(60.0 * (10.0 + 0.0))
    for t in range(10):
        ahead.observe({"before": {"usage": 10**9}, "after": {"usage": 0}}, 20.0 + t, 20.0 + t)
    assert ahead.headroom() == 5000  # capped at half the budget
    assert gc.EvictAhead(10.0, None).headroom() == 0


def test_watch_cli_json_lines(
    root: Path, make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    group = make_store().namespace(make_small_identity()).group(0)
    paths = write(group, [block_hash(i) for i in range(4)])
    age(paths)
    size = held(paths[0])
    rc, out, _ = cli(
        capsys,
        "gc",
        root,
        "--max-bytes",
        2 * size,
        "--watch",
        "--interval",
        "0.01",  # > 0: the interval must be a positive duration (issue 14 item 5)
        "--max-passes",
        "3",
        "--json",
    )
    assert rc == 0
    passes = [json.loads(line) for line in out.splitlines()]
    assert [p["evicted"]["blocks"] for p in passes] == [2, 0, 0]
    rc, out, _ = cli(capsys, "gc", root, "--max-bytes", size, "--watch", "--max-passes", "1")
    assert rc == 0 and "pass 1:" in out and "evicted 1" in out


def test_watch_stops_on_sigterm(root: Path, make_store: StoreFactory) -> None:
    write(make_store().namespace(make_small_identity()).group(0), [block_hash(1)])
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstore.cli",
            "gc",
            str(root),
            "--max-bytes",
            "1G",
            "--watch",
            "--interval",
            "30",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())  # the first pass is done: now sleeping
        assert first["before"]["blocks"] == 1
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - started < 5  # did not sit out the 30 s interval
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_gc_argument_errors(
    root: Path, make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    make_store()
    rc, _, err = cli(capsys, "gc", root)
    assert rc == 2 and "expected --max-bytes or --max-age" in err
    with pytest.raises(SystemExit) as exc:
        cli(capsys, "gc", root, "--max-bytes", "10X")
    assert exc.value.code == 2
    assert "expected a size like 10G" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli(capsys, "gc", root, "--max-age", "soon")


def test_ctrl_c_during_eviction_leaves_nothing_half_done(
    root: Path,
    make_store: StoreFactory,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C after some victims went: exit 130 with one line on stderr; every block is
    either still published or whole in trash, no temporary file, verify clean."""
    from kvstore.admin import eviction_pass  # noqa: PLC0415

    group = make_store().namespace(make_small_identity()).group(0)
    hashes = [block_hash(i) for i in range(10)]
    paths = write(group, hashes)
    age(paths)
    real_take = eviction_pass.EvictionRun._take
    taken: list[int] = []

    def take(run: eviction_pass.EvictionRun, *args: object) -> None:
        if len(taken) == 3:
            raise KeyboardInterrupt
        taken.append(1)
        real_take(run, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(eviction_pass.EvictionRun, "_take", take)
    rc, out, err = cli(capsys, "gc", root, "--max-bytes", 0)
    assert rc == 130 and out == "" and err.strip().endswith("kvstore gc: interrupted")
    left = sum(present(paths))
    trashed = [f for f in (root / group.namespace / "trash").rglob("*") if f.is_file()]
    assert left == 7 and len(trashed) == 3
    assert all(t.stat().st_size == group.layout.file_nbytes for t in trashed)  # whole
    assert not list(root.rglob("*.tmp-*"))
    monkeypatch.undo()
    assert cli(capsys, "verify", root)[0] == 0


def test_a_trash_bucket_that_is_a_link_is_never_entered(
    root: Path, make_store: StoreFactory, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """trash/<hi> planted as a link to a directory outside the store: the victim is not moved
    through it (deleted directly, reported), the outside is untouched, and the link itself is
    what a later pass removes once expired (never followed)."""
    ident = make_small_identity()
    group = make_store().namespace(ident).group(0)
    paths = write(group, [block_hash(1)])
    age(paths)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"k")
    trash = root / ident.namespace / "trash"
    trash.mkdir()
    bucket = trash / Path(paths[0]).parent.name
    bucket.symlink_to(outside)
    rc, doc = cli_json(capsys, "gc", root, "--max-bytes", 0)
    assert doc["evicted"]["blocks"] == 1 and not os.path.exists(paths[0])
    assert rc == 1 and [f["kind"] for f in doc["findings"]] == ["trash-unusable"]
    assert sorted(p.name for p in outside.iterdir()) == ["keep"]
    rc, doc = cli_json(capsys, "gc", root, "--max-bytes", 0, "--grace", "0")
    assert not bucket.is_symlink() and (outside / "keep").exists()

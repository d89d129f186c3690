"""``kvstore ls`` and ``kvstore du``: numbers equal sums taken straight from the files."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from kvstore.admin.scan import open_root, scan_store
from kvstore.identity import Identity
from tests.admin.util import age, cli, cli_json, file_sums, snapshot, write
from tests.helpers import (
    StoreFactory,
    block_hash,
    chain_hashes,
    make_mla_identity,
    make_small_identity,
    make_two_group_identity,
)


@pytest.fixture
def populated(root: Path, make_store: StoreFactory) -> dict[str, Identity]:
    """Three namespaces (dense, two-group, MLA) with blocks, a temp file and quarantine."""
    store = make_store()
    small, two, mla = make_small_identity(), make_two_group_identity(), make_mla_identity()
    chain = chain_hashes(5)
    paths = write(store.namespace(small).group(0), chain, [None, *chain[:-1]])
    age(paths)
    ns_two = store.namespace(two)
    write(ns_two.group(0), [block_hash(i) for i in range(3)])
    write(ns_two.group(1), [block_hash(i) for i in range(4)])
    mla_group = store.namespace(mla).group(0)
    mla_paths = write(mla_group, [block_hash(i, "mla") for i in range(2)])
    Path(mla_paths[0] + ".tmp-0123456789abcdef").write_bytes(b"x" * 1000)  # a write in flight
    quarantine = store.root / mla.namespace / "quarantine"
    quarantine.mkdir()
    (quarantine / "g0-1-2-3").write_bytes(b"q" * 777)
    return {"small": small, "two": two, "mla": mla}


def test_ls_namespaces_json(
    root: Path, populated: dict[str, Identity], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, doc = cli_json(capsys, "ls", root)
    assert rc == 0
    rows = {n["name"]: n for n in doc["namespaces"]}
    assert set(rows) == {i.namespace for i in populated.values()}
    small = rows[populated["small"].namespace]
    assert small["model"] == "test/tiny-llama"
    assert small["dtype"] == "bfloat16"
    assert small["groups"] == 1
    assert small["blocks"] == 5
    assert rows[populated["two"].namespace]["groups"] == 2
    assert rows[populated["two"].namespace]["blocks"] == 7
    for ident in populated.values():
        ns_dir = root / ident.namespace
        sums = file_sums(ns_dir)
        row = rows[ident.namespace]
        assert row["bytes"] == sums["blocks"]
        assert row["blocks"] == sums["block_count"]
        mtimes = [
            os.stat(os.path.join(d, f)).st_mtime_ns
            for d, _, fs in os.walk(ns_dir)
            for f in fs
            if f.isdigit() and f"{os.sep}c{os.sep}" in d + os.sep
        ]
        assert row["oldest_ns"] == min(mtimes)
        assert row["newest_ns"] == max(mtimes)
    assert doc["total"]["bytes"] == file_sums(root)["blocks"]
    assert doc["total"]["blocks"] == 5 + 7 + 2


def ls_lines(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, list[Any]]:
    """Run ``kvstore ls ROOT NS --json``: (exit code, its JSON Lines objects)."""
    rc, out, err = cli(capsys, *argv, "--json")
    try:
        return rc, [json.loads(line) for line in out.splitlines()]
    except ValueError:
        raise AssertionError(f"not JSON Lines (rc {rc}): {out!r} / {err!r}") from None


def test_ls_namespace_blocks(
    root: Path, populated: dict[str, Identity], capsys: pytest.CaptureFixture[str]
) -> None:
    ident = populated["small"]
    rc, objects = ls_lines(capsys, "ls", root, ident.namespace)
    assert rc == 0
    *blocks, summary = objects
    assert [b["type"] for b in blocks] == ["block"] * 5 and summary["type"] == "summary"
    chain = chain_hashes(5)
    # Streamed in scan order; sorted by last use, the chain (aged oldest-first) comes back.
    blocks.sort(key=lambda b: -b["last_access_ns"])
    assert [b["hash"] for b in blocks] == [h.hex() for h in reversed(chain)]
    assert [b["parent"] for b in blocks] == [h.hex() for h in reversed(chain[:-1])] + [None]
    assert all(b["tokens"] == 16 and b["group"] == 0 and b["error"] is None for b in blocks)
    for b in blocks:
        st = os.stat(root / b["path"])
        assert (b["bytes"], b["last_access_ns"]) == (st.st_size, st.st_mtime_ns)
    assert summary["namespace"]["blocks"] == 5 and summary["problems"] == []
    assert summary["namespace"]["bytes"] == sum(b["bytes"] for b in blocks)
    rc, out, _ = cli(capsys, "ls", root, ident.namespace)
    assert rc == 0
    assert chain[0].hex()[:16] in out and "last access" in out
    assert out.splitlines()[-1].startswith("  5 blocks, ")


def test_du_matches_files(
    root: Path, populated: dict[str, Identity], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, doc = cli_json(capsys, "du", root)
    assert rc == 0
    rows = {n["name"]: n for n in doc["namespaces"]}
    for ident in populated.values():
        sums = file_sums(root / ident.namespace)
        row = rows[ident.namespace]
        assert row["block_bytes"] == sums["blocks"]
        assert row["temp"]["bytes"] == sums["temp"]
        assert row["quarantine"]["bytes"] == sums["quarantine"]
        assert row["trash"]["bytes"] == sums["trash"] == 0
        assert sum(g["bytes"] for g in row["groups"]) == sums["blocks"]
        for g in row["groups"]:
            assert g["bytes"] == file_sums(root / ident.namespace / f"g{g['group']}")["blocks"]
    mla = rows[populated["mla"].namespace]
    assert mla["temp"] == {"files": 1, "bytes": 1000}
    assert mla["quarantine"] == {"files": 1, "bytes": 777}
    total = file_sums(root)
    assert doc["total"]["block_bytes"] == total["blocks"]
    # gc's budget counts what the files hold on the disk, not their sizes.
    on_disk = file_sums(root, allocated=True)
    assert doc["total"]["gc_usage"] == on_disk["blocks"] + on_disk["temp"] + on_disk["quarantine"]
    assert doc["total"]["gc_usage"] >= total["blocks"] + 1000 + 777
    rc, out, _ = cli(capsys, "du", root)
    assert rc == 0 and "counted by gc --max-bytes" in out


def test_listing_is_read_only(
    root: Path, populated: dict[str, Identity], capsys: pytest.CaptureFixture[str]
) -> None:
    before = snapshot(root)
    for argv in (["ls", root], ["du", root]):
        assert cli(capsys, *argv)[0] == 0
        assert cli_json(capsys, *argv)[0] == 0
    assert cli(capsys, "ls", root, populated["two"].namespace)[0] == 0
    assert ls_lines(capsys, "ls", root, populated["two"].namespace)[0] == 0
    assert snapshot(root) == before


def test_empty_store(
    root: Path, make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    make_store()
    rc, doc = cli_json(capsys, "ls", root)
    assert (rc, doc["namespaces"], doc["total"]) == (0, [], {"blocks": 0, "bytes": 0})
    assert cli(capsys, "ls", root)[1].strip().endswith("no namespaces")


def test_errors_exit_2(
    root: Path, tmp_path: Path, populated: dict[str, Identity], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, err = cli(capsys, "ls", tmp_path / "nowhere")
    assert rc == 2 and "expected a kvstore store directory, got nothing there" in err
    other = tmp_path / "other"
    other.mkdir()
    (other / "file").write_text("x")
    rc, _, err = cli(capsys, "du", other)
    assert rc == 2 and "expected a kvstore store" in err
    rc, _, err = cli(capsys, "ls", root, "no-such-namespace")
    assert rc == 2 and "expected one of the store's" in err and "no-such-namespace" in err
    assert err.count("\n") == 1  # one line


def test_scan_sorts_every_file(root: Path, populated: dict[str, Identity]) -> None:
    """Every file below the root is exactly one of block, temp, foreign, held, metadata."""
    scan = scan_store(open_root(root))
    seen = {e.path for e in [*scan.blocks, *scan.temps, *scan.foreign]}
    seen |= {h.path for h in [*scan.quarantine, *scan.trash]}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if name == "zarr.json":
                continue
            assert path in seen, path


def test_a_tallying_scan_keeps_no_block_entries_and_counts_the_same(
    root: Path, populated: dict[str, Identity]
) -> None:
    """``ls`` and ``du`` scan with keep_blocks=False: per-group tallies, no entry per block,
    the same counts, bytes and use times as the entries of a full scan."""
    store = open_root(root)
    full = scan_store(store)
    tallied = scan_store(store, keep_blocks=False)
    assert tallied.blocks == [] and len(full.blocks) == 5 + 7 + 2
    for ns in store.namespaces:
        for group in ns.groups:
            entries = [b for b in full.blocks if b.namespace == ns.name and b.group == group.index]
            tally = tallied.tally(ns.name, group.index)
            assert tally.blocks == len(entries)
            assert tally.bytes == sum(b.size for b in entries)
            assert tally.oldest_ns == min(b.mtime_ns for b in entries)
            assert tally.newest_ns == max(b.mtime_ns for b in entries)
    assert tallied.tally().blocks == len(full.blocks)
    assert tallied.tally("no-such-namespace").blocks == 0
    assert tallied.tally("no-such-namespace").oldest_ns is None
    assert [t.path for t in tallied.temps] == [t.path for t in full.temps]


def test_the_scan_lists_a_bounded_window_of_fanout_directories(
    root: Path, populated: dict[str, Identity], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fan-out directories are listed at most LISTINGS_AHEAD ahead of the one being merged
    (the listings held at once never grow with the store), and the result is a serial
    scan's."""
    from kvstore.admin import scan as scan_module  # noqa: PLC0415

    store = open_root(root)
    expected = [b.path for b in scan_store(store).blocks]
    outstanding = 0
    most = 0
    real_run = scan_module._FanoutTask.run
    real_merge = scan_module.FanoutPart.merge_into

    def run(task: Any) -> None:
        nonlocal outstanding, most
        outstanding += 1
        most = max(most, outstanding)
        real_run(task)

    def merge(part: Any, *args: Any) -> None:
        nonlocal outstanding
        outstanding -= 1
        real_merge(part, *args)

    monkeypatch.setattr(scan_module, "LISTINGS_AHEAD", 3)
    monkeypatch.setattr(scan_module._FanoutTask, "run", run)
    monkeypatch.setattr(scan_module.FanoutPart, "merge_into", merge)
    assert [b.path for b in scan_store(store).blocks] == expected
    assert 1 <= most <= 3


def test_streamed_blocks_come_in_bounded_batches_in_scan_order(
    root: Path, populated: dict[str, Identity], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``on_blocks`` sees every block of a full scan, in its order, in batches of at most
    BLOCK_BATCH, none kept; entries listed but not yet handed over never exceed
    LISTINGS_AHEAD * (BATCHES_AHEAD + 1) batches."""
    from kvstore.admin import scan as scan_module  # noqa: PLC0415

    store = open_root(root)
    expected = [b.path for b in scan_store(store).blocks]
    assert len(expected) >= 8
    monkeypatch.setattr(scan_module, "BLOCK_BATCH", 2)
    monkeypatch.setattr(scan_module, "BATCHES_AHEAD", 1)
    monkeypatch.setattr(scan_module, "LISTINGS_AHEAD", 2)
    lock = threading.Lock()
    listed = handed = most = 0
    real_put = scan_module._FanoutTask._put

    def put(task: Any, item: Any) -> None:
        nonlocal listed, most
        real_put(task, item)
        if isinstance(item, list):
            with lock:
                listed += len(item)
                most = max(most, listed - handed)

    monkeypatch.setattr(scan_module._FanoutTask, "_put", put)
    batches: list[list[str]] = []

    def take(batch: Any) -> None:
        nonlocal handed
        with lock:
            handed += len(batch)
        batches.append([b.path for b in batch])

    scan = scan_store(store, on_blocks=take)
    assert [p for b in batches for p in b] == expected
    assert all(1 <= len(b) <= 2 for b in batches)
    assert scan.blocks == []
    assert scan.tally().blocks == len(expected)
    assert most <= 2 * (1 + 1) * 2


def test_a_consumer_that_raises_stops_the_scan_threads(
    root: Path, populated: dict[str, Identity], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception from ``on_blocks`` (a Ctrl-C: KeyboardInterrupt) propagates at once and
    the listing threads blocked on full queues give up: no thread is left behind."""
    from kvstore.admin import scan as scan_module  # noqa: PLC0415

    monkeypatch.setattr(scan_module, "BLOCK_BATCH", 1)
    monkeypatch.setattr(scan_module, "BATCHES_AHEAD", 1)
    before = {t.ident for t in threading.enumerate()}

    def interrupt(batch: Any) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        scan_store(open_root(root), on_blocks=interrupt)
    left = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert left == []

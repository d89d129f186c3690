"""The writers and soak suites, tiny, through the bench front-end: every check they make holds
(counts asserted, not only that they ran), and the checks themselves catch what they exist to
catch (a leftover temporary file, a key published twice or not at all, an acknowledged block
gone without gc evicting it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvstore import bench
from kvstore.bench import soak, writers
from kvstore.store.types import BlockWrite, WriteStatus

BLOCKS = 200  # per process


def _suite(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str, *extra: str
) -> dict[str, Any]:
    argv = ["--suite", name, "--root", str(tmp_path / "scratch"), "--threads", "2", "--json"]
    assert bench.main([*argv, *extra]) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out)["suites"][name]
    return result


def test_writers_suite_publishes_every_key_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = _suite(capsys, tmp_path, "writers", "--writers-procs", "1,2", "--writers-blocks",
                    str(BLOCKS))  # fmt: skip
    rows = {(r["mode"], r["procs"]): r for r in result["rows"]}
    assert set(rows) == {(m, n) for m in writers.MODES for n in (1, 2)}
    distinct = {("disjoint", 2): 2 * BLOCKS, ("half", 2): 3 * BLOCKS // 2, ("same", 2): BLOCKS}
    for (mode, n), row in rows.items():
        want = distinct.get((mode, n), BLOCKS)
        checks = row["checks"]
        assert checks["problems"] == [], (mode, n)
        assert row["ok"]
        assert row["blocks_submitted"] == n * BLOCKS
        assert row["blocks_distinct"] == want
        assert row["written"] == want  # each key published by exactly one process
        assert row["exists"] == n * BLOCKS - want
        assert row["failed"] == 0
        assert checks["census"]["block_files"] == want
        assert checks["census"]["temps"] == 0
        assert checks["census"]["foreign"] == []
        assert checks["read_back"] == {"missing": 0, "wrong": 0, "failed": 0}
        assert checks["verify"]["exit"] == 0
        assert row["blocks_per_s"] > 0
        assert row["mb_per_s"] > 0
    assert result["ok"]


def test_writers_checks_catch_a_temp_a_double_publish_and_a_missing_key(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store, group = writers.open_group(root, "none", 1)
    hashes = [writers.key_of("t", i) for i in range(4)]
    nbytes = group.layout.block_nbytes
    try:
        results = group.write_blocks(
            [BlockWrite(h, writers.content_of(h, nbytes)) for h in hashes[:3]]
        )
        assert all(r.status is WriteStatus.WRITTEN for r in results)
        path = group.path_of(hashes[0])
        temp = Path(path).with_name(f".{Path(path).name}.tmp-abc")
        temp.write_bytes(b"x")
    finally:
        store.close()
    # The processes say WRITTEN five times for four keys; key 3 was never written.
    claimed = [
        {"worker": 0, "written": 3, "exists": 0, "failed": 0, "errors": []},
        {"worker": 1, "written": 2, "exists": 0, "failed": 0, "errors": []},
    ]
    problems = writers._check(root, claimed, hashes, "none")["problems"]
    assert any("WRITTEN 5 times for 4 distinct keys" in p for p in problems)
    assert any("3 block files for 4 keys (1 keys without a file" in p for p in problems)
    assert any("1 temporary files left" in p for p in problems)
    assert any("1 missing" in p for p in problems)


def test_soak_suite_loses_nothing_and_reads_nothing_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    budget = 150 * writers.suite_layout().file_nbytes
    result = _suite(
        capsys, tmp_path, "soak", "--soak-seconds", "4", "--soak-rate", "200",
        "--soak-readers", "1", "--soak-budget", str(budget), "--soak-interval", "0.5",
    )  # fmt: skip
    assert result["problems"] == []
    assert result["ok"]
    assert result["acknowledged"] > 150  # more than the budget holds: gc had to evict
    reads = result["reads"]
    assert reads["reads"] == reads["hits"] + reads["misses"] > 0
    assert reads["hits"] > 0
    assert reads["wrong"] == reads["failed"] == 0
    gc = result["gc"]
    assert gc["passes"] > 0
    assert gc["exit"] == 0
    assert gc["evicted_blocks"] > 0
    assert gc["victims_listed"] == gc["evicted_blocks"]
    assert gc["max_usage_after"] <= budget
    end = result["end"]
    assert end["lost"] == 0
    assert end["readable"] + end["missing_evicted"] == result["acknowledged"]
    assert end["missing_evicted"] > 0
    assert end["unacknowledged_published"] == 0
    assert end["census"]["temps"] == result["temps_after_writers"] == 0
    assert end["census"]["quarantine_entries"] == 0
    assert result["verify"]["exit"] == 0


def test_soak_check_tells_an_eviction_from_a_loss(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store, group = writers.open_group(root, "none", 1)
    tag = soak._tag(0)
    hashes = [writers.key_of(tag, i) for i in range(8)]
    nbytes = group.layout.block_nbytes
    try:
        group.write_blocks([BlockWrite(h, writers.content_of(h, nbytes)) for h in hashes])
        group.delete_blocks(hashes[5:7])  # gone behind gc's back
    finally:
        store.close()
    results = [
        {"role": "writer", "id": 0, "written": 8, "errors": []},
        {"role": "reader", "id": 0, "reads": 1, "hits": 0, "misses": 1, "wrong": 0,
         "failed": 0, "errors": [], "missed_keys": [[0, 6]]},
    ]  # fmt: skip
    gc_out = tmp_path / "gc.jsonl"
    gc_out.write_text(
        json.dumps({"evicted": {"blocks": 1, "victims": [{"hash": hashes[5].hex()}]}})
    )
    problems = soak._check(root, results, (1, 1), gc_out, "none")["problems"]
    assert problems == [
        "1 acknowledged blocks missing and not among gc's victims",
        "1 keys readers missed that are not among gc's victims",
    ]


def test_failed_checks_fail_the_bench_command(capsys: pytest.CaptureFixture[str]) -> None:
    """scripts/bench.py exits 1 when a suite's own checks failed, naming it on stderr."""
    assert bench._exit_status({"suites": {"writers": {"ok": True}, "lookup": {}}}) == 0
    assert bench._exit_status({"suites": {"writers": {"ok": True}, "soak": {"ok": False}}}) == 1
    assert "soak" in capsys.readouterr().err

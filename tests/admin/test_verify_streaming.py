"""``kvstore verify`` and ``kvstore ls ROOT NS`` stream: bounded work in flight, sampling by a
seeded draw per block, a bounded findings list, Ctrl-C that leaves nothing half-done, output
before the scan ends. Window sizes are shrunk so that a few dozen blocks exercise the bounds."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvstore.admin import blockfile, ls, scan, verify, verify_cli
from kvstore.store.batch_check import RawBatchCheck
from kvstore.store.group_store import GroupStore
from tests.admin.test_verify import flip
from tests.admin.util import cli, cli_json, write
from tests.helpers import StoreFactory, block_hash, make_small_identity

N_BLOCKS = 120


@pytest.fixture
def group(make_store: StoreFactory) -> GroupStore:
    return make_store().namespace(make_small_identity()).group(0)


@pytest.fixture
def blocks(group: GroupStore) -> list[str]:
    """N_BLOCKS intact blocks, spread over the fan-out directories; their paths."""
    return write(group, [block_hash(i) for i in range(N_BLOCKS)])


def corrupt(group: GroupStore, paths: list[str]) -> None:
    for path in paths:
        flip(path, group.layout.chunk_offset(0) + 3)


def quarantine_dir(root: Path) -> Path:
    return root / make_small_identity().namespace / "quarantine"


class CountingPool(ThreadPoolExecutor):
    """A pool that records the most tasks ever submitted and not yet finished."""

    most = 0
    submitted = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self._outstanding = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        with self._lock:
            self._outstanding += 1
            CountingPool.submitted += 1
            CountingPool.most = max(CountingPool.most, self._outstanding)
        future = super().submit(fn, *args, **kwargs)
        future.add_done_callback(self._done)
        return future

    def _done(self, _future: Future[Any]) -> None:
        with self._lock:
            self._outstanding -= 1


def test_verify_keeps_a_bounded_window_of_checks(
    root: Path,
    group: GroupStore,
    blocks: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At most threads * TASKS_AHEAD tasks of TASK_BLOCKS are in flight, and every block is
    still checked (a bad one found) exactly once."""
    monkeypatch.setattr(verify, "TASK_BLOCKS", 3)
    monkeypatch.setattr(verify, "ThreadPoolExecutor", CountingPool)
    monkeypatch.setattr(CountingPool, "most", 0)
    monkeypatch.setattr(CountingPool, "submitted", 0)
    corrupt(group, blocks[7:8])
    rc, doc = cli_json(capsys, "verify", root, "--threads", "2")
    assert rc == 1 and doc["counts"] == {"corrupt": 1}
    assert doc["blocks"]["found"] == doc["blocks"]["checked"] == N_BLOCKS
    assert CountingPool.submitted >= N_BLOCKS // 3
    assert 1 <= CountingPool.most <= 2 * verify.TASKS_AHEAD


def test_findings_list_is_bounded_counts_and_fixes_are_not(
    root: Path,
    group: GroupStore,
    blocks: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(verify, "MAX_LISTED_BLOCK_FINDINGS", 3)
    bad = blocks[:8]
    corrupt(group, bad)
    (Path(blocks[9]).parent / "notes.txt").write_text("x")  # never left out of the list
    rc, doc = cli_json(capsys, "verify", root, "--fix")
    assert rc == 1
    assert doc["counts"] == {"corrupt": 8, "foreign": 1}
    listed = [f for f in doc["findings"] if f["kind"] == "corrupt"]
    assert len(listed) == 3 and doc["findings_omitted"] == 5
    assert [f["kind"] for f in doc["findings"]].count("foreign") == 1
    assert all(not os.path.lexists(p) for p in bad)  # --fix acted on every bad block
    assert len([q for q in quarantine_dir(root).iterdir() if q.name.startswith("g0-")]) == 8
    rc, out, _ = cli(capsys, "verify", root)
    assert rc == 0 and "no findings" in out
    corrupt(group, blocks[10:15])
    rc, out, _ = cli(capsys, "verify", root)
    assert rc == 1 and "5 finding(s): 5 corrupt" in out
    assert "2 more bad block(s) not listed" in out


def test_sampler_draws_each_block_with_probability_p() -> None:
    items: Any = list(range(100_000))
    got = verify._Sampler(0.1, seed=1).choose(items)
    assert abs(len(got) - 10_000) < 400  # 4 standard deviations of Binomial(10^5, 0.1)
    assert got == verify._Sampler(0.1, seed=1).choose(items)  # same seed: same blocks
    assert got != verify._Sampler(0.1, seed=2).choose(items)
    assert verify._Sampler(1.0, seed=None).choose(items) is items  # no draw at all


def _interrupt_after(monkeypatch: pytest.MonkeyPatch, k: int) -> list[str]:
    """Send SIGINT to the main thread (a real Ctrl-C) from the k-th block check, which then
    returns only once verify has told its checks to stop; the paths judged, in order."""
    real_judge = blockfile.judge_block_file
    real_init = verify._BlockChecker.__init__
    checkers: list[Any] = []
    judged: list[str] = []

    def init(self: Any, *args: Any) -> None:
        real_init(self, *args)
        checkers.append(self)

    def judge(path: str, *args: Any) -> Any:
        result = real_judge(path, *args)
        judged.append(path)
        if len(judged) == k:
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
            assert checkers[0]._stop.wait(10), "verify did not react to SIGINT"
        return result

    monkeypatch.setattr(verify._BlockChecker, "__init__", init)
    monkeypatch.setattr(verify, "judge_block_file", judge)
    # Every block through the one-by-one check, where the Ctrl-C is sent from (the batch
    # check would call the good ones intact without it).
    monkeypatch.setattr(
        RawBatchCheck, "intact", lambda _self, paths, _hi, _lo: [False] * len(paths)
    )
    return judged


def test_ctrl_c_stops_verify_fix_with_nothing_half_done(
    root: Path,
    group: GroupStore,
    blocks: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C: no more checks are begun, the one in flight finishes (and its fix), a partial
    summary goes to stderr, nothing to stdout, exit 130; every bad block is either in place
    or whole in quarantine, and no temporary file is left."""
    monkeypatch.setattr(verify, "TASK_BLOCKS", 4)
    bad = blocks[::3]
    corrupt(group, bad)
    sizes = {os.lstat(p).st_ino: os.lstat(p).st_size for p in bad}
    judged = _interrupt_after(monkeypatch, 10)
    rc, out, err = cli(capsys, "verify", root, "--fix", "--threads", "1", "--json")
    assert rc == verify_cli.EXIT_INTERRUPTED and out == ""
    assert "verify interrupted" in err and "nothing is half-done" in err
    assert "not checked: the remaining blocks" in err
    # The 10th check was in flight: it finished; no other began (queued tasks were dropped,
    # the running one stopped after its block).
    assert len(judged) == 10
    assert "10 checked" in err
    held = list(quarantine_dir(root).iterdir()) if quarantine_dir(root).exists() else []
    moved = {q.lstat().st_ino: q.lstat().st_size for q in held}
    assert moved and set(moved) <= set(sizes)
    assert all(sizes[ino] == size for ino, size in moved.items())  # whole files
    assert f"({len(moved)} quarantined)" in err
    judged_bad = set(judged) & set(bad)
    assert len(moved) == len(judged_bad)  # every bad block judged was fixed, no other
    for path in bad:  # in place or in quarantine, never both or neither
        assert os.path.lexists(path) != (path in judged_bad)
    leftovers = [n for _d, _s, files in os.walk(root) for n in files if ".tmp-" in n]
    assert leftovers == []
    monkeypatch.undo()
    rc, doc = cli_json(capsys, "verify", root, "--fix")  # a second run finishes the job
    assert rc == 1 and doc["counts"] == {"corrupt": len(bad) - len(moved)}
    assert cli_json(capsys, "verify", root)[0] == 0


def test_ctrl_c_after_the_blocks(
    root: Path,
    blocks: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def interrupted(*_args: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(verify, "_sweep", interrupted)
    rc, out, err = cli(capsys, "verify", root)
    assert rc == verify_cli.EXIT_INTERRUPTED and out == ""
    assert f"{N_BLOCKS} checked" in err and "every block was checked" in err


def test_ls_streams_before_the_scan_ends(
    root: Path, blocks: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows come out while the scan still lists fan-out directories, in order, each once."""
    monkeypatch.setattr(ls, "TASK_BLOCKS", 1)
    monkeypatch.setattr(ls, "TASKS_AHEAD", 1)
    real_scan = scan.scan_store
    dirs: list[int] = []

    def counting_scan(*args: Any, on_dir: Callable[[], None], **kwargs: Any) -> Any:
        def counted() -> None:
            dirs.append(1)
            on_dir()

        return real_scan(*args, on_dir=counted, **kwargs)

    monkeypatch.setattr(ls, "scan_store", counting_scan)
    emitted: list[tuple[int, str]] = []
    store = scan.open_root(root)
    ns = store.namespace(make_small_identity().namespace)
    summary = ls.stream_blocks(
        store, ns, lambda text: emitted.append((len(dirs), text)), ls.json_line, progress=False
    )
    assert emitted[0][0] < len(dirs) // 2  # the first rows long before the last directory
    lines = "".join(text for _, text in emitted).splitlines()
    assert len(lines) == N_BLOCKS == summary["namespace"]["blocks"]
    paths = [os.path.join(root, p) for p in (json.loads(line)["path"] for line in lines)]
    assert sorted(paths) == sorted(blocks)
    his = [int(Path(p).parent.name) for p in paths]
    assert his == sorted(his)  # scan order: fan-out directory by directory


class ClosedPipe:
    """A stdout whose reader went away after the first write (``kvstore ls ... | head -1``)."""

    def __init__(self) -> None:
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        if self.writes > 1:
            raise BrokenPipeError(32, "Broken pipe")
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def test_ls_stops_when_its_reader_goes(
    root: Path, blocks: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ls, "TASK_BLOCKS", 1)
    monkeypatch.setattr(ls, "TASKS_AHEAD", 1)
    real_read = blockfile.read_header
    reads: list[str] = []

    def counting_read(path: str) -> Any:
        reads.append(path)
        return real_read(path)

    monkeypatch.setattr(ls, "read_header", counting_read)
    pipe = ClosedPipe()
    monkeypatch.setattr(sys, "stdout", pipe)
    rc = ls.run(root, make_small_identity().namespace, as_json=True)
    assert rc == ls.EXIT_BROKEN_PIPE
    assert len(reads) < N_BLOCKS // 2  # the scan stopped: the rest is never read

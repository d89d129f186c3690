"""Issue 14, tools side: the admin CLI and ``kvstore-inspect`` on a hostile tree.

One test per defect of the review (each failed before the fix):

* item 2: ``<ns>/trash`` or ``<ns>/quarantine`` a symbolic link to a directory outside the
  root: gc never moves a block through it, verify names the link (kind ``symlink``, OUTSIDE),
  ``verify --fix`` unlinks the link and never moves anything through it;
* item 3: a FIFO at a block path, at the root's / a namespace's / an array's ``zarr.json``,
  in trash and quarantine: no tool hangs (a wall-clock alarm), the FIFO is a finding;
* item 6: an unreadable directory (mode 000 for a non-root user; a PermissionError injected at
  the listing call for root, who reads everything): every tool reports it and carries on; gc
  says its usage is incomplete, exits 1 and still evicts from the readable part; a namespace
  whose ``zarr.json`` is a directory is reported by gc and its bytes are counted;
* item 7: ``<ns>/trash`` a regular file: gc reports it and still evicts (deleting directly).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import numpy as np
import pytest

from kvstore.admin import gc
from kvstore.cli import main as admin_main
from kvstore.inspect.cli import main as inspect_main
from kvstore.io.dirlist import ListedStat
from kvstore.store import paths
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockRead, ReadStatus
from tests.admin.util import NS_PER_S, age, cli_json, expected_bytes, write
from tests.helpers import StoreFactory, block_hash, make_small_identity

ALARM_S = 10.0
TOOLS: tuple[tuple[str, ...], ...] = (
    ("ls", "{root}"),
    ("ls", "{root}", "{ns}"),
    ("du", "{root}"),
    ("verify", "{root}", "--threads", "1"),
    ("verify", "{root}", "--threads", "1", "--fix"),
    ("gc", "{root}", "--max-bytes", "1T"),
    ("inspect", "overview", "{root}"),
    ("inspect", "tree", "{root}"),
)


@contextlib.contextmanager
def alarm(seconds: float = ALARM_S) -> Iterator[None]:
    """TimeoutError in the main thread if the body runs longer than ``seconds`` (a hang)."""

    def expired(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"hang: still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_tool(argv: list[str]) -> tuple[int, str, str]:
    """One admin or inspect command in-process under the alarm: (rc, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with alarm(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = inspect_main(argv[1:]) if argv[0] == "inspect" else admin_main(argv)
    return rc, out.getvalue(), err.getvalue()


def run_all(root: Path, ns: str) -> dict[str, tuple[int, str, str]]:
    """Every tool of :data:`TOOLS`; each must exit 0, 1 or 2 (2 with one line on stderr)."""
    results = {}
    for template in TOOLS:
        argv = [a.format(root=root, ns=ns) for a in template]
        rc, out, err = run_tool(argv)
        assert rc in (0, 1, 2), (argv, rc, err)
        assert "Traceback" not in err, (argv, err)
        if rc == 2:
            assert len(err.strip().splitlines()) == 1, (argv, err)
        results[" ".join(template[:2] if template[0] == "inspect" else template[:1])] = (
            rc,
            out,
            err,
        )
    return results


def tree_state(path: Path) -> dict[str, tuple[int, int, int]]:
    """relative path -> (mode, size, mtime_ns) of everything below ``path`` (lstat)."""
    out = {}
    for dirpath, dirs, files in os.walk(path):
        for name in [".", *dirs, *files]:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[os.path.relpath(p, path)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture
def populated(root: Path, make_store: StoreFactory, tmp_path: Path) -> tuple[Path, str, list[str]]:
    """A store with one namespace of 6 aged blocks, and a sentinel directory outside it."""
    group = make_store().namespace(make_small_identity()).group(0)
    paths = write(group, [block_hash(i) for i in range(6)])
    age(paths)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "keep").write_bytes(b"sentinel")
    return root, group.array_path.parent.name, paths


# -- item 2: trash / quarantine as symbolic links --------------------------------------------


@pytest.mark.parametrize("held", ["trash", "quarantine"])
def test_gc_and_verify_never_move_through_a_link(
    populated: tuple[Path, str, list[str]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    held: str,
) -> None:
    root, ns, paths = populated
    outside = tmp_path / "outside"
    link = root / ns / held
    if link.exists():
        link.rmdir()
    link.symlink_to(outside)
    before = tree_state(outside)

    rc, doc = cli_json(capsys, "gc", root, "--max-bytes", 0, "--grace", "0")
    assert doc["evicted"]["blocks"] == len(paths)
    assert not any(os.path.exists(p) for p in paths)
    assert tree_state(outside) == before, "gc moved evicted blocks through the link"
    if held == "trash":
        assert rc == 1 and [f["kind"] for f in doc["findings"]] == ["trash-unusable"]
        assert "symbolic link" in doc["findings"][0]["detail"]

    rc, doc = cli_json(capsys, "verify", root)
    (finding,) = [f for f in doc["findings"] if f["path"].endswith(held)]
    assert rc == 1 and finding["kind"] == "symlink"
    assert "OUTSIDE the root" in finding["detail"] and str(outside) in finding["detail"]

    rc, doc = cli_json(capsys, "verify", root, "--fix")
    (finding,) = [f for f in doc["findings"] if f["path"].endswith(held)]
    assert finding["action"] == "unlinked (the link only)"
    assert not os.path.lexists(link)
    assert tree_state(outside) == before, "verify --fix touched the link's target"


def test_verify_fix_does_not_quarantine_through_a_linked_quarantine(
    populated: tuple[Path, str, list[str]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A foreign file and a linked quarantine/: the file is never moved through the link."""
    root, ns, _paths = populated
    outside = tmp_path / "outside"
    (root / ns / "stray").write_bytes(b"x")
    (root / ns / "quarantine").symlink_to(outside)
    before = tree_state(outside)
    rc, doc = cli_json(capsys, "verify", root, "--fix")
    actions = {Path(f["path"]).name: f["action"] for f in doc["findings"]}
    assert rc == 1 and tree_state(outside) == before
    assert actions["quarantine"] == "unlinked (the link only)"
    # Fixed in order (findings sorted by kind): the stray file went into a real quarantine/ or
    # was left; never through the link.
    assert (root / ns / "stray").exists() or (root / ns / "quarantine").is_dir()


# -- item 3: FIFOs ----------------------------------------------------------------------------


def _fifo_at(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        for child in path.iterdir():
            child.unlink()
        path.rmdir()
    elif path.exists() or path.is_symlink():
        path.unlink()
    os.mkfifo(path)


@pytest.mark.parametrize(
    "where", ["block", "ns-zarr", "array-zarr", "root-zarr", "trash-entry", "quarantine-entry"]
)
def test_no_tool_hangs_on_a_fifo(populated: tuple[Path, str, list[str]], where: str) -> None:
    root, ns, paths = populated
    target = {
        "block": Path(paths[0]),
        "ns-zarr": root / ns / "zarr.json",
        "array-zarr": root / ns / "g0" / "zarr.json",
        "root-zarr": root / "zarr.json",
        "trash-entry": root / ns / "trash" / "g0-1-2-3",
        "quarantine-entry": root / ns / "quarantine" / "g0-1-2-3",
    }[where]
    target.parent.mkdir(exist_ok=True)
    _fifo_at(target)
    if where == "block":
        rc, out, _err = run_tool(["verify", str(root), "--json"])
        assert rc == 1 and '"kind": "special-file"' in out and "FIFO" in out
        rc, out, _err = run_tool(["inspect", "overview", str(root)])
        assert rc == 1 and "FIFO" in out
    if where == "ns-zarr":
        rc, out, _err = run_tool(["gc", str(root), "--max-bytes", "1T", "--json"])
        assert rc == 1 and '"bad-namespace"' in out and "FIFO" in out
    results = run_all(root, ns)  # verify --fix among them: may move the FIFO to quarantine
    if where == "root-zarr":  # not a store: refused (exit 2, one line naming the FIFO)
        assert all(rc == 2 for rc, _o, _e in results.values()), results
        assert "FIFO" in results["ls"][2]


# -- item 6: unreadable directories -----------------------------------------------------------


@contextlib.contextmanager
def unreadable(path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make directory ``path`` unreadable: mode 000, and (root reads everything) a
    PermissionError injected at the one listing every tool goes through (store.paths)."""
    real_batches = paths.iter_dir_batches

    def iter_dir_batches(
        p: str | Path, *, root: str | Path | None = None
    ) -> Iterator[list[tuple[str, ListedStat]]]:
        if Path(p) == path:
            raise PermissionError(13, "Permission denied", str(p))
        return real_batches(p, root=root)

    if os.geteuid() == 0:
        monkeypatch.setattr(paths, "iter_dir_batches", iter_dir_batches)
    mode = stat.S_IMODE(path.stat().st_mode)
    path.chmod(0)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):  # verify --fix may have moved it
            path.chmod(mode)


def _check_unreadable_fanout(root: Path, ns: str, paths: list[str]) -> None:
    hidden = Path(paths[0]).parent
    visible = [p for p in paths if Path(p).parent != hidden]
    assert visible, "the test needs blocks in more than one fan-out directory"
    results = run_all(root, ns)
    for name in ("ls", "du", "verify", "gc"):
        rc, out, err = results[name]
        assert rc == 1 and "cannot list" in out + err, (name, rc, out, err)
    rc, out, _err = results["inspect overview"]
    assert rc == 1 and "cannot list" in out
    rc, out, _err = run_tool(["verify", str(root), "--json", "--threads", "1"])
    assert rc == 1 and '"kind": "unreadable"' in out
    # gc carries on: it evicts every readable block, says its usage is a lower bound.
    rc, out, err = run_tool(["gc", str(root), "--max-bytes", "0", "--grace", "0", "--json"])
    assert rc == 1 and '"usage_complete": false' in out and str(hidden) in err
    assert not any(os.path.exists(p) for p in visible)


def test_unreadable_fanout_directory_injected(
    populated: tuple[Path, str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, ns, paths = populated
    with unreadable(Path(paths[0]).parent, monkeypatch):
        _check_unreadable_fanout(root, ns, paths)
    assert os.path.exists(paths[0]), "the unreadable directory's block was touched"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a mode 000 directory")
def test_unreadable_fanout_directory_mode_000(populated: tuple[Path, str, list[str]]) -> None:
    root, ns, paths = populated
    hidden = Path(paths[0]).parent
    hidden.chmod(0)
    try:
        _check_unreadable_fanout(root, ns, paths)
    finally:
        hidden.chmod(0o700)
    assert os.path.exists(paths[0])


def test_unreadable_namespace_is_counted_by_gc(
    populated: tuple[Path, str, list[str]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, ns, paths = populated
    size = os.path.getsize(paths[0])
    # A namespace whose zarr.json is a directory: its blocks still occupy the disk.
    (root / ns / "zarr.json").rename(root / ns / "zarr.json.saved")
    (root / ns / "zarr.json").mkdir()
    rc, doc = cli_json(capsys, "gc", root, "--max-bytes", "1T")
    assert rc == 1 and [f["kind"] for f in doc["findings"]] == ["bad-namespace"]
    assert doc["before"]["usage"] >= len(paths) * size
    assert doc["before"]["unusable_bytes"] >= len(paths) * size
    rc, doc = cli_json(capsys, "gc", root, "--max-bytes", len(paths) * size // 2)
    assert rc == 1 and doc["over_budget"] and doc["evicted"]["blocks"] == 0
    assert all(os.path.exists(p) for p in paths)


# -- item 7: trash as a regular file ----------------------------------------------------------


def test_gc_evicts_when_trash_is_a_file(
    populated: tuple[Path, str, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    root, ns, paths = populated
    trash = root / ns / "trash"
    if trash.exists():
        trash.rmdir()
    trash.write_bytes(b"not a directory")
    size = os.lstat(paths[0]).st_blocks * 512  # gc counts what files hold on the disk
    held_by_file = max(os.lstat(trash).st_blocks * 512, trash.stat().st_size)
    rc, doc = cli_json(capsys, "gc", root, "--max-bytes", 3 * size + held_by_file)
    assert rc == 1  # evicted, and reported the unusable trash
    assert doc["evicted"]["blocks"] == 3 and not doc["over_budget"]
    assert {f["kind"] for f in doc["findings"]} == {"trash-unusable"}
    assert [os.path.exists(p) for p in paths] == [False] * 3 + [True] * 3
    assert trash.read_bytes() == b"not a directory"
    rc, doc = cli_json(capsys, "verify", root, "--fix")
    assert rc == 1 and any(
        "trash/ must be a real directory" in f["detail"] for f in doc["findings"]
    )
    rc, doc = cli_json(capsys, "gc", root, "--max-bytes", 0, "--grace", "0")
    assert doc["evicted"]["blocks"] == 3 and doc["findings"] == []
    assert list((root / ns / "trash").iterdir()) != []  # a real trash/ again


# -- clock jumps ------------------------------------------------------------------------------


def test_trash_named_in_the_future_still_expires(
    populated: tuple[Path, str, list[str]],
) -> None:
    root, ns, _paths = populated
    trash = root / ns / "trash"
    trash.mkdir(exist_ok=True)
    now = time.time_ns()
    future = trash / f"g0-1-2-{now + 3600 * NS_PER_S}"
    future.write_bytes(b"x" * 10)
    policy = gc.Policy(max_bytes=1 << 40, grace_s=60.0)
    first = gc.gc_pass(root, policy, now_ns=now)
    assert first["trash_emptied"]["entries"] == 0  # restamped to now, grace starts now
    assert not future.exists() and len(list(trash.iterdir())) == 1
    second = gc.gc_pass(root, policy, now_ns=now + 61 * NS_PER_S)
    assert second["trash_emptied"]["entries"] == 1 and list(trash.iterdir()) == []


def test_future_mtime_does_not_pin_a_block(
    populated: tuple[Path, str, list[str]],
) -> None:
    root, _ns, paths = populated
    now = time.time_ns()
    os.utime(paths[0], ns=(now + 3600 * NS_PER_S,) * 2)
    policy = gc.Policy(max_age_s=10.0, grace_s=0.0)
    first = gc.gc_pass(root, policy, now_ns=now)
    assert first["future_mtimes_reset"] == 1 and os.path.exists(paths[0])
    assert not any(os.path.exists(p) for p in paths[1:])  # the aged ones went
    second = gc.gc_pass(root, policy, now_ns=now + 20 * NS_PER_S)
    assert second["evicted"]["blocks"] == 1 and not os.path.exists(paths[0])


# -- gc while readers read --------------------------------------------------------------------


def test_gc_evicting_under_readers_never_serves_a_wrong_page(
    root: Path, make_store: StoreFactory
) -> None:
    """Reader threads read every block in a loop while gc evicts everything with no grace
    period (the unlink races the reads): every read is an exact hit or a miss."""
    store: KVStore = make_store()
    group = store.namespace(make_small_identity()).group(0)
    hashes = [block_hash(i, "gc-readers") for i in range(40)]
    write(group, hashes)
    age([group.path_of(h) for h in hashes])
    stop = threading.Event()
    outcomes: dict[str, int] = {}
    wrong: list[str] = []

    def reader(seed: int) -> None:
        out = np.zeros(group.layout.block_nbytes, dtype=np.uint8)
        i = seed
        while not stop.is_set():
            h = hashes[i % len(hashes)]
            i += 7
            (r,) = group.read_blocks([BlockRead(h, out)])
            outcomes[r.status.value] = outcomes.get(r.status.value, 0) + 1
            if r.status is ReadStatus.HIT and not np.array_equal(out, expected_bytes(group, h)):
                wrong.append(h.hex())
            elif r.status not in (ReadStatus.HIT, ReadStatus.MISS):
                wrong.append(f"{r.status.value}: {r.error}")

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.2)
        for budget in (30, 20, 10, 0):
            policy = gc.Policy(max_bytes=budget * group.layout.file_nbytes, grace_s=0.0)
            gc.gc_pass(root, policy)
            gc.gc_pass(root, policy)  # empties the trash of the pass before
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert wrong == []
    assert outcomes.get("hit", 0) > 0 and outcomes.get("miss", 0) > 0, outcomes


def test_gc_reports_an_unreadable_namespace_directory(
    populated: tuple[Path, str, list[str]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Item 6: gc said "within budget", exit 0, and never mentioned the namespace."""
    root, ns, paths = populated
    with unreadable(root / ns, monkeypatch):
        rc, doc = cli_json(capsys, "gc", root, "--max-bytes", "1T")
        err = capsys.readouterr().err
    assert rc == 1 and doc["usage_complete"] is False
    assert any(f["path"].endswith(ns) for f in doc["findings"]), doc["findings"]
    assert all(os.path.exists(p) for p in paths)
    assert "Traceback" not in err

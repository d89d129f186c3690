"""``kvstore rm``: unpublish a namespace by rename, delete it after the grace period."""

from __future__ import annotations

import io
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore.store.types import BlockRead, BlockWrite, ReadStatus, WriteStatus
from tests.admin.util import NS_PER_S, cli, cli_json, expected_bytes, snapshot, write
from tests.helpers import StoreFactory, block_hash, make_small_identity


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def two_namespaces(root: Path, make_store: StoreFactory) -> tuple[str, str]:
    store = make_store()
    a = make_small_identity()
    b = make_small_identity(revision="b")
    write(store.namespace(a).group(0), [block_hash(i) for i in range(3)])
    write(store.namespace(b).group(0), [block_hash(i) for i in range(2)])
    return a.namespace, b.namespace


def test_rm_now(
    root: Path, two_namespaces: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    gone, kept = two_namespaces
    kept_before = {k: v for k, v in snapshot(root).items() if k.startswith(kept)}
    rc, doc = cli_json(capsys, "rm", root, gone, "--yes", "--now")
    assert rc == 0
    assert doc["namespace"] == gone and doc["deleted"] is True and doc["files"] >= 3
    assert not (root / gone).exists()
    assert [p.name for p in root.iterdir() if p.name.startswith(".trash-")] == []
    assert {k: v for k, v in snapshot(root).items() if k.startswith(kept)} == kept_before
    rc, doc = cli_json(capsys, "ls", root)
    assert [n["name"] for n in doc["namespaces"]] == [kept]


def test_rm_waits_for_the_grace_period(
    root: Path, two_namespaces: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    gone, _ = two_namespaces
    started = time.monotonic()
    rc, out, err = cli(capsys, "rm", root, gone, "--yes", "--grace", "0.3")
    assert rc == 0 and time.monotonic() - started >= 0.3
    assert "waiting 0.3 s" in err and "deleted" in out
    assert not (root / gone).exists()


def test_rm_confirmation(
    root: Path,
    two_namespaces: tuple[str, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gone, _ = two_namespaces
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    rc, _, err = cli(capsys, "rm", root, gone)
    assert rc == 2 and "expected --yes (stdin is not a terminal)" in err
    monkeypatch.setattr("sys.stdin", _Terminal("something else\n"))
    rc, _, err = cli(capsys, "rm", root, gone)
    assert rc == 1 and "type its name to confirm" in err and "not removed" in err
    assert (root / gone).exists()
    monkeypatch.setattr("sys.stdin", _Terminal(gone + "\n"))
    rc, _, _ = cli(capsys, "rm", root, gone, "--now")
    assert rc == 0 and not (root / gone).exists()


def test_rm_unknown_namespace(
    root: Path, two_namespaces: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    before = snapshot(root)
    rc, _, err = cli(capsys, "rm", root, "nope-000000000000", "--yes", "--now")
    assert rc == 2 and "expected one of the store's" in err
    rc, _, err = cli(capsys, "rm", root, "../elsewhere", "--yes", "--now")
    assert rc == 2
    assert snapshot(root) == before


def test_servers_using_a_removed_namespace_miss_and_fail_writes(
    root: Path, make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    ident = make_small_identity()
    group = make_store().namespace(ident).group(0)
    h = block_hash(1)
    write(group, [h])
    assert cli_json(capsys, "rm", root, ident.namespace, "--yes", "--now")[0] == 0
    out = np.zeros(group.layout.block_nbytes, dtype=np.uint8)
    assert group.read_blocks([BlockRead(h, out)])[0].status is ReadStatus.MISS
    (result,) = group.write_blocks([BlockWrite(block_hash(2), expected_bytes(group, h))])
    assert result.status is WriteStatus.FAILED and "was removed" in result.error
    assert not (root / ident.namespace).exists()  # the write did not resurrect it


def test_expired_removals_are_swept(
    root: Path, two_namespaces: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A removal interrupted during its wait leaves .trash-*; gc and rm delete it once expired."""
    gone, kept = two_namespaces
    old = root / f".trash-{gone}-{time.time_ns() - 120 * NS_PER_S}"
    (root / gone).rename(old)
    rc, doc = cli_json(capsys, "du", root)
    assert rc == 0
    assert doc["root_entries"]["removed_namespaces"]["files"] >= 3
    rc, doc = cli_json(capsys, "gc", root, "--max-bytes", "1G", "--dry-run")
    assert doc["trash_emptied"]["entries"] == 1 and old.exists()
    rc, doc = cli_json(capsys, "gc", root, "--max-bytes", "1G")
    assert rc == 0
    assert doc["trash_emptied"]["entries"] == 1 and not old.exists()
    assert (root / kept).exists()


def test_rm_reports_what_it_cannot_delete(
    root: Path,
    two_namespaces: tuple[str, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An unreadable directory inside the removed namespace (PermissionError injected: tests
    run as root): rm unpublishes, says what it could not delete, exits 1; gc deletes it later."""
    gone, _kept = two_namespaces

    def refuse(path: str, *args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(shutil, "rmtree", refuse)
    rc, _out, err = cli(capsys, "rm", root, gone, "--yes", "--now")
    assert rc == 1 and "Permission denied" in err and "Traceback" not in err
    assert not (root / gone).exists()  # unpublished all the same
    monkeypatch.undo()
    rc, doc = cli_json(capsys, "gc", root, "--max-bytes", "1T", "--grace", "0")
    assert rc == 0 and doc["trash_emptied"]["entries"] == 1
    assert not any(p.name.startswith(".trash-") for p in root.iterdir())

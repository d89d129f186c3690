"""``kvstore verify --fix`` acts on the file it judged, never on whatever has the name by then.

Between verify's check of a block and its quarantine rename, a reader may quarantine the bad
copy and a writer re-publish a good, acknowledged one under the same name; between the scan
that judged a temporary file old and its deletion, the name may come to hold another file.
Each race is made deterministic by a hook that runs right after the judgement.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.admin import scan, verify
from kvstore.store import full_check
from kvstore.store.types import BlockRead
from tests.admin.test_verify import flip
from tests.admin.util import NS_PER_S, cli_json, expected_bytes, set_mtime, write
from tests.helpers import StoreFactory, block_hash, make_small_identity


def test_fix_leaves_a_copy_republished_after_the_check(
    root: Path,
    make_store: StoreFactory,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    group = make_store().namespace(make_small_identity()).group(0)
    good, bad = block_hash(0), block_hash(1)
    paths = write(group, [good, bad])
    flip(paths[1], group.layout.chunk_offset(0) + 7)  # the copy verify will judge corrupt
    real_check = full_check.check_file
    republished: list[int] = []

    def check_then_republish(path: str | Path, *args: Any, **kwargs: Any) -> Any:
        result = real_check(path, *args, **kwargs)
        if str(path) == paths[1] and not republished:
            # Another reader quarantines the bad copy (a rename: its inode stays in use, so
            # the new copy cannot reuse the number), a writer re-publishes a good one.
            os.rename(paths[1], root.parent / "quarantined-by-a-reader")
            write(group, [bad])
            republished.append(os.lstat(paths[1]).st_ino)
        return result

    monkeypatch.setattr(full_check, "check_file", check_then_republish)
    rc, doc = cli_json(capsys, "verify", root, "--fix")
    assert republished, "the hook never ran: the check path changed"
    assert rc == 1  # the bad copy was found ...
    [finding] = doc["findings"]
    assert finding["kind"] == "corrupt"
    assert finding["action"].startswith("left in place"), finding["action"]
    # ... and the acknowledged copy that replaced it is still published, intact.
    assert os.lstat(paths[1]).st_ino == republished[0]
    ns_dir = root / make_small_identity().namespace
    assert not (ns_dir / "quarantine").exists() or not list((ns_dir / "quarantine").iterdir())
    out = np.zeros(group.layout.block_nbytes, dtype=np.uint8)
    [result] = group.read_blocks([BlockRead(bad, out)])
    assert result.status.value == "hit"
    assert np.array_equal(out, expected_bytes(group, bad).reshape(-1).view(np.uint8))
    monkeypatch.undo()
    rc, doc = cli_json(capsys, "verify", root)
    assert rc == 0 and doc["findings"] == []


def test_fix_quarantines_the_file_it_judged(
    root: Path, make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without a race, the bad copy is still quarantined (the guard does not stop the fix)."""
    group = make_store().namespace(make_small_identity()).group(0)
    [path] = write(group, [block_hash(2)])
    ino = os.lstat(path).st_ino
    flip(path, group.layout.chunk_offset(0) + 7)
    rc, doc = cli_json(capsys, "verify", root, "--fix")
    assert rc == 1
    [finding] = doc["findings"]
    assert finding["action"].startswith("quarantined as "), finding["action"]
    assert not os.path.lexists(path)
    held = list((root / make_small_identity().namespace / "quarantine").iterdir())
    assert [p.lstat().st_ino for p in held] == [ino]


def test_fix_deletes_only_the_temp_file_it_judged(
    root: Path,
    make_store: StoreFactory,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    group = make_store().namespace(make_small_identity()).group(0)
    [path] = write(group, [block_hash(3)])
    orphan = path + ".tmp-00000000deadbeef"
    Path(orphan).write_bytes(b"t" * 4096)
    set_mtime(orphan, time.time_ns() - 7200 * NS_PER_S)  # judged old: a writer crashed
    real_scan = scan.scan_store

    def scan_then_replace(*args: Any, **kwargs: Any) -> Any:
        scanned = real_scan(*args, **kwargs)
        # Another verify swept it (renamed away: the inode number stays taken); a file took the
        # name since.
        os.rename(orphan, root.parent / "swept-by-another-verify")
        Path(orphan).write_bytes(b"n" * 100)
        return scanned

    monkeypatch.setattr(verify, "scan_store", scan_then_replace)  # the name verify calls
    rc, doc = cli_json(capsys, "verify", root, "--fix")
    [finding] = doc["findings"]
    assert finding["kind"] == "orphan-temp"
    assert finding["action"].startswith("left in place"), finding["action"]
    assert Path(orphan).read_bytes() == b"n" * 100
    assert rc == 1

"""Issue 14: the hostile-tree fuzzing, generalised to every path the store and the tools touch.

Every entry of a small store (root ``zarr.json``, namespace directory and ``zarr.json``, array
directory and ``zarr.json``, the ``c/`` chain and a fan-out directory, a block file, a
temporary file, ``trash/`` and ``quarantine/`` and an entry of each) is replaced in turn by

* a symbolic link to something inside the root, and one to a sentinel directory outside it,
* a FIFO, a directory, a regular file,
* an unreadable directory (mode 000; as root, who reads everything, a PermissionError is
  injected at the tools' listing calls for that path as well),

and then the store is opened and every block looked up and read (server path), and every tool
runs: ``ls``, ``ls NS``, ``du``, ``verify``, ``verify --fix``, ``gc`` (emptying trash),
``rm`` of a second namespace, ``kvstore-inspect overview``. All under a wall-clock alarm.

Checked for every case: nothing hangs; no traceback (exit 0, 1 or 2; 2 with one line on
stderr; the store raises only ``KvstoreError``); every hit is the block's exact bytes; the
sentinel directory outside the root is unchanged (nothing moved into, out of or through a
link); and once the original entry is put back, every block reads back exactly (nothing
acknowledged was lost: no tool deleted or moved a valid block). The figure line gives the case
count, the exit codes, and the time.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.config import StoreConfig
from kvstore.errors import KvstoreError
from kvstore.identity import Identity
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockRead, ReadStatus
from tests.admin.util import age, expected_bytes, write
from tests.helpers import block_hash, make_small_identity
from tests.reliability.common import figure
from tests.reliability.test_hostile_tools import alarm, run_tool, tree_state, unreadable

BLOCKS = 6
SECOND = Identity(
    model="test/hostile-second",
    kv_dtype=make_small_identity().kv_dtype,
    tokens_per_block=make_small_identity().tokens_per_block,
    groups=make_small_identity().groups,
)


def _block(root: Path, ns: str, i: int) -> Path:
    found = sorted((root / ns / "g0").rglob("*"))
    blocks = [p for p in found if p.is_file() and p.name.isdigit()]
    return blocks[i]


# Where each entry lives, given (root, namespace name). The block and fan-out entries are those
# of the first block (in path order).
ENTRIES: dict[str, Callable[[Path, str], Path]] = {
    "root zarr.json": lambda r, ns: r / "zarr.json",
    "namespace dir": lambda r, ns: r / ns,
    "namespace zarr.json": lambda r, ns: r / ns / "zarr.json",
    "group dir": lambda r, ns: r / ns / "g0",
    "group zarr.json": lambda r, ns: r / ns / "g0" / "zarr.json",
    "c dir": lambda r, ns: r / ns / "g0" / "c",
    "chain dir c/0": lambda r, ns: r / ns / "g0" / "c" / "0",
    "fan-out dir": lambda r, ns: _block(r, ns, 0).parent,
    "block file": lambda r, ns: _block(r, ns, 0),
    "temp file": lambda r, ns: _block(r, ns, 1).parent / f".{_block(r, ns, 1).name}.tmp-fuzz",
    "trash dir": lambda r, ns: r / ns / "trash",
    "trash entry": lambda r, ns: r / ns / "trash" / "g0-1-2-1000",
    "quarantine dir": lambda r, ns: r / ns / "quarantine",
    "quarantine entry": lambda r, ns: r / ns / "quarantine" / "g0-1-2-1000",
}
KINDS = ("symlink inside", "symlink outside", "fifo", "directory", "file", "unreadable")
TOOLS: tuple[tuple[str, ...], ...] = (
    ("ls", "{root}"),
    ("ls", "{root}", "{ns}"),
    ("du", "{root}"),
    ("verify", "{root}", "--threads", "1"),
    ("verify", "{root}", "--threads", "1", "--fix"),
    ("gc", "{root}", "--max-bytes", "1T", "--grace", "0"),
    ("rm", "{root}", "{ns2}", "--yes", "--now"),
    ("inspect", "overview", "{root}"),
)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str, list[bytes]]:
    """A store with BLOCKS blocks, a temp file, trash and quarantine entries, a 2nd namespace."""
    root = tmp_path_factory.mktemp("tree") / "store"
    hashes = [block_hash(i, "tree") for i in range(BLOCKS)]
    with KVStore(StoreConfig(root=root, durability="none", io_threads=1)) as store:
        group = store.namespace(make_small_identity()).group(0)
        age(write(group, hashes))
        write(store.namespace(SECOND).group(0), [block_hash(0, "second")])
        ns = group.array_path.parent.name
        ns2 = store.namespace(SECOND).group(0).array_path.parent.name
    # The server creates all 256 fan-out directories; keep only those holding files so that
    # each of the ~700 tool runs lists a handful, not 512 (the tools scan them all the same).
    for hi_dir in [*(root / ns).rglob("c/**/*"), *(root / ns2).rglob("c/**/*")]:
        if hi_dir.is_dir() and hi_dir.name.isdigit() and not any(hi_dir.iterdir()):
            with contextlib.suppress(OSError):
                hi_dir.rmdir()
    ENTRIES["temp file"](root, ns).write_bytes(b"t" * 100)
    for held in ("trash", "quarantine"):
        (root / ns / held).mkdir(exist_ok=True)
        ENTRIES[f"{held} entry"](root, ns).write_bytes(b"h" * 100)
    return root, ns, ns2, hashes


def _remove(path: Path) -> None:
    if not os.path.lexists(path):
        return
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        for dirpath, dirs, _files in os.walk(path):
            for d in dirs:
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(dirpath, d), 0o700, follow_symlinks=False)
        path.chmod(0o700)
        shutil.rmtree(path)
    else:
        path.unlink()


def _replace(path: Path, kind: str, root: Path, outside: Path) -> Path:
    """Put a ``kind`` entry at ``path``; the directory made unreadable (or ``path``)."""
    was_dir = path.is_dir() and not path.is_symlink()
    if kind == "unreadable" and was_dir:
        path.chmod(0)
        return path
    _remove(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "symlink inside":
        # to a real entry of the same kind inside the root
        path.symlink_to(root / "zarr.json" if not was_dir else root / ".inside-target")
    elif kind == "symlink outside":
        path.symlink_to(outside if was_dir else outside / "keep")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
        (path / "x").write_bytes(b"d")
    elif kind == "file":
        path.write_bytes(b"{not what belongs here")
    else:  # unreadable: a directory where a file belongs, mode 000
        path.mkdir()
        path.chmod(0)
    return path


def _read_all(root: Path, hashes: list[bytes], *, strict: bool) -> Counter[str]:
    """Open the store and read every block: a hit must be exact; ``strict``: all must hit."""
    outcomes: Counter[str] = Counter()
    with alarm():
        try:
            with KVStore(StoreConfig(root=root, durability="none", io_threads=1)) as store:
                group = store.namespace(make_small_identity()).group(0)
                for h in hashes:
                    out = np.zeros(group.layout.block_nbytes, dtype=np.uint8)
                    group.contains([h])
                    (r,) = group.read_blocks([BlockRead(h, out)])
                    outcomes[r.status.value] += 1
                    if r.status is ReadStatus.HIT:
                        assert np.array_equal(out, expected_bytes(group, h)), "wrong page"
                    elif strict:
                        raise AssertionError(f"acknowledged block lost: {r.status.value} {r.error}")
        except KvstoreError as exc:
            if strict:
                raise AssertionError(f"store refused after restore: {exc}") from exc
            outcomes["refused"] += 1
    return outcomes


@contextlib.contextmanager
def _maybe_unreadable(path: Path | None, mp: pytest.MonkeyPatch) -> Iterator[None]:
    if path is None:
        yield
        return
    path.chmod(0o700)
    with unreadable(path, mp):
        yield
    with contextlib.suppress(FileNotFoundError):  # verify --fix may have moved it
        path.chmod(0)


def _run_cases(
    template: tuple[Path, str, str, list[bytes]], tmp_path: Path, phase: str
) -> tuple[int, int, Counter[int], Counter[str], list[str], float]:
    """Every entry x every kind, running the server path (``phase="store"``) or every tool
    (``"tools"``); (cases, commands, exit codes, read outcomes, failures, seconds)."""
    source, ns, ns2, hashes = template
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"sentinel")
    (outside / "sub").mkdir()
    started = time.perf_counter()
    cases = commands = 0
    exit_codes: Counter[int] = Counter()
    reads: Counter[str] = Counter()
    failures: list[str] = []
    for entry, where in ENTRIES.items():
        for kind in KINDS:
            root = tmp_path / "case" / "store"
            if root.parent.exists():
                _remove(root.parent)
            shutil.copytree(source, root, symlinks=True)
            (root / ".inside-target").mkdir()
            before_outside = tree_state(outside)
            path = where(root, ns)
            original = where(source, ns)
            try:
                made = _replace(path, kind, root, outside)
                with pytest.MonkeyPatch.context() as mp:
                    hidden = made if kind == "unreadable" else None
                    with _maybe_unreadable(hidden, mp):
                        if phase == "store":
                            reads += _read_all(root, hashes, strict=False)
                        else:
                            for template_argv in TOOLS:
                                argv = [a.format(root=root, ns=ns, ns2=ns2) for a in template_argv]
                                rc, _out, err = run_tool(argv)
                                commands += 1
                                exit_codes[rc] += 1
                                assert rc in (0, 1, 2), (argv, rc, err)
                                assert "Traceback" not in err, (argv, err)
                                if rc == 2:
                                    assert len(err.strip().splitlines()) == 1, (argv, err)
                changed = tree_state(outside) != before_outside
                assert not changed, f"touched outside the root: {sorted(tree_state(outside))}"
                # Put the original back; then nothing acknowledged may be missing.
                _remove(path)
                if original.is_dir():
                    shutil.copytree(original, path, symlinks=True)
                else:
                    shutil.copy2(original, path)
                _read_all(root, hashes, strict=True)
            except (AssertionError, TimeoutError, OSError) as exc:
                failures.append(f"{entry} -> {kind}: {type(exc).__name__}: {exc}"[:400])
            cases += 1
    return cases, commands, exit_codes, reads, failures, time.perf_counter() - started


def test_tools_on_every_hostile_entry(
    template: tuple[Path, str, str, list[bytes]], tmp_path: Path
) -> None:
    cases, commands, exit_codes, _reads, failures, seconds = _run_cases(template, tmp_path, "tools")
    figure(
        "hostile tree, tools (every entry x every kind)",
        cases=cases,
        commands=commands,
        exit_codes=dict(sorted(exit_codes.items())),
        failures=len(failures),
        seconds=round(seconds, 1),
    )
    assert failures == [], "\n".join(failures)
    assert cases == len(ENTRIES) * len(KINDS) and commands == cases * len(TOOLS)
    # The cases reached the tools' error paths: findings and refusals, not only clean runs.
    assert exit_codes[0] > 0 and exit_codes[1] > 0 and exit_codes[2] > 0


def test_store_on_every_hostile_entry(
    template: tuple[Path, str, str, list[bytes]], tmp_path: Path
) -> None:
    cases, _commands, _codes, reads, failures, seconds = _run_cases(template, tmp_path, "store")
    figure(
        "hostile tree, store open/lookup/read (every entry x every kind)",
        cases=cases,
        reads=dict(reads),
        failures=len(failures),
        seconds=round(seconds, 1),
    )
    assert failures == [], "\n".join(failures)
    assert cases == len(ENTRIES) * len(KINDS)
    assert reads["hit"] > 0 and reads["refused"] + reads["miss"] + reads["corrupt"] > 0

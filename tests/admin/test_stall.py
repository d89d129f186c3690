"""The admin and inspection tools on a hung mount: one clear line and exit 3, not a hang.

A real hung mount (a frozen FUSE daemon, an NFS server gone) blocks a ``stat`` or ``read``
without an error; here the store's directory listing is made to block forever in a child
process, the tool is run as an operator runs it, and the watchdog must end it. The second
half does the same on a real hung mount: a frozen faultfs (tests/faultfs), skipped where FUSE
is unavailable.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.io import stall
from kvstore.store import paths
from kvstore.store.page_store import KVStore
from tests.admin.util import write
from tests.faultfs.child import REPO, Child
from tests.faultfs.fixture import mounted
from tests.faultfs.handle import FaultFS
from tests.helpers import (
    StoreFactory,
    block_hash,
    make_small_identity,
    shard_files,
    tmp_files,
)

# The child: every directory listing of the store blocks (as on a frozen mount), then the CLI.
HUNG = """
import sys, threading
from kvstore.store import paths
def frozen(*args, **kwargs):
    threading.Event().wait()
paths.iter_dir_batches = frozen  # every listing goes through it
if sys.argv[1] == "kvstore":
    from kvstore.cli import main
else:
    from kvstore.inspect.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _run(program: str, *argv: str, timeout_s: str = "1") -> tuple[int, str, float]:
    env = {**os.environ, stall.ENV: timeout_s}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", HUNG, program, *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    return proc.returncode, proc.stderr, time.monotonic() - start


@pytest.mark.parametrize(
    "argv",
    [
        ("kvstore", "du"),
        ("kvstore", "verify"),
        ("kvstore", "gc", "--max-bytes", "0"),
        ("kvstore-inspect", "overview"),
    ],
)
def test_a_tool_on_a_hung_mount_says_so_and_exits(
    root: Path, make_store: StoreFactory, argv: tuple[str, ...]
) -> None:
    write(make_store().namespace(make_small_identity()).group(0), [block_hash(1)])
    program, command, *rest = argv
    code, err, seconds = _run(program, command, str(root), *rest)
    assert code == stall.EXIT_STALLED, err
    assert f"{program} {command}: error: the file system of {root} did not answer" in err
    assert "hung mount" in err and stall.ENV in err
    assert seconds < 30  # 1 s of silence, plus the child's start


def test_the_timeout_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(stall.ENV, raising=False)
    assert stall.timeout_from_env() == stall.DEFAULT_TIMEOUT_S
    monkeypatch.setenv(stall.ENV, "0")
    assert stall.timeout_from_env() == 0  # off
    for bad in ("-1", "soon", "inf"):
        monkeypatch.setenv(stall.ENV, bad)
        with pytest.raises(ConfigError, match="expected a number of seconds >= 0"):
            stall.timeout_from_env()


def test_waiting_that_is_not_the_stores_does_not_count(root: Path) -> None:
    """A prompt or gc --watch between passes (stall.paused) never trips the watchdog."""
    code = subprocess.run(
        [
            sys.executable,
            "-c",
            "import time\n"
            "from kvstore.io import stall\n"
            "with stall.watching('t', '/x', timeout_s=0.3):\n"
            "    with stall.paused():\n"
            "        time.sleep(1.5)\n"
            "print('done')\n",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert code.returncode == 0 and code.stdout.strip() == "done", code.stderr


def test_the_watchdog_ends_with_the_command() -> None:
    """In a process that goes on after the command (a test calling main), the watchdog is
    gone once the command returned: it can never end that process later."""
    with stall.watching("t", "/x", timeout_s=0.2):
        pass
    time.sleep(0.5)
    assert not [t for t in threading.enumerate() if t.name == "kvstore-stall"]


# -- on a real hung mount: a frozen faultfs ------------------------------------------------

STALL_S = "2"  # the tools' watchdog limit in these tests
LINE_WITHIN_S = 30.0  # the stall line must come within this (2 s of silence, plus the start)
EXIT_WITHIN_S = 5.0  # and the tool's exit this long after it, the mount still frozen


@pytest.fixture
def faultfs(tmp_path: Path) -> Iterator[FaultFS]:
    """A faultfs mount (tests/faultfs/fixture.py); skipped where FUSE is unavailable."""
    with mounted(tmp_path) as fs:
        yield fs


@pytest.fixture
def mounted_store(faultfs: FaultFS) -> tuple[Path, str, str]:
    """A store of a 4-block chain under the mount: (root, namespace, first block's hex)."""
    root = faultfs.mount / "store"
    config = StoreConfig(root=root, durability="full", io_threads=2)
    hashes = [block_hash(i, "stall") for i in range(4)]
    with KVStore(config) as store:
        group = store.namespace(make_small_identity()).group(0)
        write(group, hashes, [None, *hashes[:-1]])
        namespace = group.namespace
    return root, namespace, hashes[0].hex()


def tool(program: str, command: str, *args: str, limit_s: str = STALL_S) -> Child:
    """``kvstore COMMAND ARGS`` or ``kvstore-inspect COMMAND ARGS`` as an operator runs it,
    with the watchdog at ``limit_s``, in a child whose output is read as it comes."""
    module = "kvstore.cli" if program == "kvstore" else "kvstore.inspect.cli"
    return Child(
        [sys.executable, "-m", module, command, *args],
        env={stall.ENV: limit_s, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )


def argv_of(command: str, root: Path, namespace: str, block: str) -> list[str]:
    """The command line of ``command`` ("kvstore du", "kvstore-inspect tree", ...)."""
    program, name = command.split()
    extra = {
        "gc": ["--max-bytes", "1G"],  # scans everything, evicts nothing
        "tree": [namespace],
        "block": [namespace, block],
    }.get(name, [])
    return [program, name, str(root), *extra]


def succeeds(argv: list[str]) -> None:
    """The command on the healthy mount: exit 0."""
    child = tool(*argv)
    code = child.wait(120)
    assert code == 0, (argv, child.err[-5:])


TOOLS = [
    "kvstore du",
    "kvstore ls",
    "kvstore verify",
    "kvstore gc",
    "kvstore-inspect overview",
    "kvstore-inspect tree",
    "kvstore-inspect block",
]


@pytest.mark.parametrize("frozen", ["lookup", "read"])
def test_the_tools_on_a_frozen_mount_say_so_and_exit(
    faultfs: FaultFS, mounted_store: tuple[Path, str, str], frozen: str
) -> None:
    """Lookups (or reads) of everything in the store frozen, every tool started at once (as
    operators would): each prints one line naming the root within seconds (the seven starts
    share the machine's cores: the line comes a few seconds after the start), and exits 3
    while the mount is still frozen: the worker held in the FUSE request cannot end, its
    supervising parent can (kvstore/io/supervise.py). After the thaw every command succeeds
    and verify finds the store clean."""
    root, namespace, block = mounted_store
    argvs = {command: argv_of(command, root, namespace, block) for command in TOOLS}
    faultfs.freeze(frozen, path_glob="store/*")
    children = {command: tool(*argv) for command, argv in argvs.items()}
    try:
        deadline = time.monotonic() + LINE_WITHIN_S
        lines = {
            command: child.wait_line("did not answer", max(0.0, deadline - time.monotonic()))
            for command, child in children.items()
        }
        exited = {
            command: child.exited_within(EXIT_WITHIN_S) for command, child in children.items()
        }
    finally:
        faultfs.thaw()
    codes = {command: child.wait(60) for command, child in children.items()}
    for command, child in children.items():
        # every tool reads the store's zarr.json documents: a read freeze holds each too
        line = lines[command]
        assert line is not None, (command, codes[command], child.err)
        assert exited[command], (command, "ended only after the thaw")
        assert codes[command] == stall.EXIT_STALLED, (command, codes[command], child.err)
        assert line.startswith(f"{command}: error: the file system of {root} did not answer")
        assert "hung mount" in line and stall.ENV in line
        assert child.err == [line], (command, child.err)  # one line, no traceback
        print(
            f"{frozen} frozen: {command}: stall line after {child.arrived[line]:.1f} s, "
            "exit 3 while frozen"
        )
    reruns = {command: tool(*argv) for command, argv in argvs.items()}
    for command, child in reruns.items():
        assert child.wait(120) == 0, (command, child.err[-5:])
    succeeds(["kvstore", "verify", str(root)])
    assert tmp_files(faultfs.backing) == []


def console_script(program: str) -> list[str]:
    """The installed console script ``program`` (as an operator runs it), or ``python -m``
    of its module where this interpreter has none."""
    module = "kvstore.cli" if program == "kvstore" else "kvstore.inspect.cli"
    script = Path(sys.executable).parent / program
    if not script.exists():
        return [sys.executable, "-m", module]
    assert f"from {module} import entry" in script.read_text(), (
        f"{script} is not pyproject.toml's entry point: reinstall (pip install -e .)"
    )
    return [str(script)]


def worker_of(child: Child, timeout_s: float = 60.0) -> int:
    """The pid of the tool's worker process (its one child), once it forked."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            pid = child.proc.pid
            with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
                found = f.read().split()
            if found:
                return int(found[0])
        time.sleep(0.02)
    raise AssertionError(f"{child.argv}: no worker process after {timeout_s} s")


def alive(pid: int) -> bool:
    """Is ``pid`` a process that has not ended (neither gone nor a zombie)?"""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def test_a_tool_on_a_frozen_mount_exits_before_the_thaw(
    faultfs: FaultFS, mounted_store: tuple[Path, str, str]
) -> None:
    """The console scripts, as installed, on a frozen mount: each prints its one line and
    exits 3 while the mount is frozen; its worker, held in the FUSE request, is killed (it
    dies at the thaw and never goes on with its work: no temporary of a gc, verify clean)."""
    root = mounted_store[0]
    blocks = sorted(shard_files(faultfs.backing))
    argvs = {
        "kvstore du": ["kvstore", "du", str(root)],
        "kvstore gc": ["kvstore", "gc", str(root), "--max-bytes", "0"],  # would evict all
        "kvstore-inspect overview": ["kvstore-inspect", "overview", str(root)],
    }
    faultfs.freeze("lookup", path_glob="store/*")
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    children = {
        command: Child(
            [*console_script(program), *args], env={stall.ENV: STALL_S, "PYTHONPATH": path}
        )
        for command, (program, *args) in argvs.items()
    }
    try:
        workers = {command: worker_of(child) for command, child in children.items()}
        for command, child in children.items():
            assert child.wait_line("did not answer", LINE_WITHIN_S) is not None, child.err
            assert child.exited_within(EXIT_WITHIN_S), f"{command}: state {child.state()!r}"
            assert child.proc.returncode == stall.EXIT_STALLED, (command, child.err)
            assert len(child.err) == 1, child.err
            print(f"{command}: exit 3 on the frozen mount, by {child.seconds():.1f} s")
        held = [command for command, pid in workers.items() if alive(pid)]
    finally:
        faultfs.thaw()
    print(f"workers still held in the mount at the thaw: {held}")
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in workers.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [c for c, pid in workers.items() if alive(pid)], "a worker outlived the thaw"
    succeeds(["kvstore", "verify", str(root)])
    assert tmp_files(faultfs.backing) == []
    assert (
        sorted(shard_files(faultfs.backing)) == blocks
    )  # the killed gc evicted nothing after the thaw


def test_a_slow_mount_is_not_a_hung_one(
    faultfs: FaultFS, mounted_store: tuple[Path, str, str]
) -> None:
    """Every lookup and read of the store answering 20 ms late (about 4000 of them for verify
    or du on a 4-block store: 256 fan-out directories, uncached lookups): the tools take
    several times the watchdog's limit (5 s here), but the answers beat it, so none gives
    up. The longest silence measured on such a mount is ~50 operations (reading the
    namespace's and group's zarr.json: kvstore/store/view.py), about 1 s here."""
    root, namespace, block = mounted_store
    faultfs.delay(["lookup", "read"], 0.02, path_glob="store/*")
    children = {
        c: tool(*argv_of(c, root, namespace, block), limit_s="5")
        for c in ("kvstore verify", "kvstore du")
    }
    for command, child in children.items():
        code = child.wait(300)
        assert code == 0, (command, child.err[-3:])
        print(f"{command} on a mount answering in 20 ms: {child.seconds():.1f} s")


def test_listing_an_empty_directory_beats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A listing beats once it is done, empty or not: a walk through a run of empty fan-out
    directories (a store's 256 per group, most of them empty in a small store) answered by a
    slow mount is progress, not silence."""
    monkeypatch.setattr(stall, "_clock", memoryview(bytearray(32)).cast("d"))  # never beat
    assert paths.list_dir(tmp_path) == []
    assert stall._clock[stall.BEAT] > 0.0

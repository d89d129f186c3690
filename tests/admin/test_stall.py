"""The admin and inspection tools on a hung mount: one clear line and exit 3, not a hang.

A real hung mount (a frozen FUSE daemon, an NFS server gone) blocks a ``stat`` or ``read``
without an error; here the store's directory listing is made to block forever in a child
process, the tool is run as an operator runs it, and the watchdog must end it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvstore.errors import ConfigError
from kvstore.io import stall
from tests.admin.util import write
from tests.helpers import StoreFactory, block_hash, make_small_identity

# The child: every directory listing of the store blocks (as on a frozen mount), then the CLI.
HUNG = """
import sys, threading
from kvstore.store import paths
def frozen(*args, **kwargs):
    threading.Event().wait()
paths.iter_dir = frozen
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

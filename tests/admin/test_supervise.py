"""The console scripts' supervisor (kvstore/io/supervise.py), without a file system to hang.

Each test runs a small ``main`` under :func:`supervise.run` in a child, as the console scripts
do: the worker's stall is a read of a pipe nobody writes to (no beat comes), its signals are
real ones (a terminal's Ctrl-C through a pseudo-terminal, ``kill`` of the parent). The hung
FUSE mount itself: tests/admin/test_stall.py.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import subprocess
import sys
import termios
import time
import tomllib
from pathlib import Path

import pytest

from kvstore.bench.scale import _MARK, _TRAMPOLINE
from kvstore.io import stall
from tests.faultfs.child import Child

REPO = Path(__file__).resolve().parents[2]
ROOT = "/the/root"

# argv: MODE [ARG]; prints "worker PID" first (stdout), then does what MODE says.
WORKER = f"""
import os, signal, sys, time
from kvstore.io import stall, supervise
# A tool started by a shell or systemd: SIGHUP's default action (a test run under nohup would
# hand down SIG_IGN, and an ignored signal is discarded, never passed on).
signal.signal(signal.SIGHUP, signal.SIG_DFL)
mode, arg = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""
def main():
    try:
        print("worker", os.getpid(), flush=True)
        if mode == "exit":
            return int(arg)
        if mode == "signal":
            os.kill(os.getpid(), int(arg))
        if mode == "raise":
            raise RuntimeError("boom")
        if mode == "stall":  # a read that never returns: the mount stopped answering
            with stall.watching("tool cmd", {ROOT!r}):
                os.read(os.pipe()[0], 1)
            open(arg, "w").close()  # never: the work does not go on after the stall
        if mode == "wait":  # waits that are not the store's: no stall
            with stall.watching("tool cmd", {ROOT!r}), stall.paused():
                time.sleep(float(arg))
        if mode == "rss":
            big = bytearray(int(arg) << 20)
            big[::4096] = b"x" * len(big[::4096])
        return 0
    except KeyboardInterrupt:
        print("tool cmd: interrupted", file=sys.stderr)
        return 130
sys.exit(supervise.run(main))
"""


def env(limit_s: str) -> dict[str, str]:
    return {**os.environ, stall.ENV: limit_s, "PYTHONPATH": str(REPO)}


def start(mode: str, arg: str = "", limit_s: str = "30") -> Child:
    return Child([sys.executable, "-c", WORKER, mode, arg], env=env(limit_s))


def worker_pid(child: Child) -> int:
    line = child.wait_line("worker", 60, stream="out")
    assert line is not None, child.err
    return int(line.split()[1])


def gone(pid: int, timeout_s: float = 10.0) -> bool:
    """Has ``pid`` ended (no process, or a zombie nobody reaped yet)?"""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_a_worker_that_stops_beating_is_killed_and_the_tool_exits_3(tmp_path: Path) -> None:
    never = tmp_path / "after-the-stall"
    child = start("stall", str(never), limit_s="1")
    pid = worker_pid(child)
    assert child.wait(30) == stall.EXIT_STALLED
    assert child.seconds() < 20  # 1 s of silence, the start, 1 s to reap at most
    assert child.err == [
        f"tool cmd: error: the file system of {ROOT} did not answer for 1 s (a hung mount: an "
        "NFS server, a FUSE daemon or a brick that stopped answering?); giving up. Check the "
        f"mount; {stall.ENV} sets this limit."
    ]
    assert gone(pid)
    time.sleep(0.5)
    assert not never.exists()


def test_the_parent_does_not_wait_for_a_worker_that_cannot_die(tmp_path: Path) -> None:
    """A worker that SIGKILL does not end (held in a FUSE request; here: the kill is left out):
    the tool exits 3 on time all the same, and the worker dies with its parent."""
    code = WORKER.replace("sys.exit(", "supervise.os.kill = lambda pid, sig: None\nsys.exit(")
    child = Child([sys.executable, "-c", code, "stall", str(tmp_path / "x")], env=env("1"))
    pid = worker_pid(child)
    assert child.wait(30) == stall.EXIT_STALLED
    assert child.seconds() < 20
    assert gone(pid)  # PR_SET_PDEATHSIG: killed as its parent went


@pytest.mark.parametrize(
    ("mode", "arg", "code"),
    [
        ("exit", "0", 0),
        ("exit", "7", 7),
        ("signal", str(int(signal.SIGTERM)), 128 + signal.SIGTERM),
        ("signal", str(int(signal.SIGKILL)), 128 + signal.SIGKILL),
        ("raise", "", 1),
        ("wait", "1.5", 0),  # paused: 1.5 s of waiting is no stall at a 0.5 s limit
    ],
)
def test_the_workers_exit_status_is_the_tools(mode: str, arg: str, code: int) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, mode, arg],
        env=env("0.5"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == code, proc.stderr
    assert proc.stdout.startswith("worker ")
    assert ("RuntimeError: boom" in proc.stderr) == (mode == "raise")
    assert proc.stderr.count("Traceback") == (mode == "raise")  # the worker's, never the parent's


def test_without_the_watchdog_there_is_no_worker() -> None:
    """``KVSTORE_STALL_TIMEOUT_S=0``: main runs in the process itself."""
    code = WORKER.replace('print("worker", os.getpid()', 'print("worker", os.getppid()')
    proc = subprocess.run(
        [sys.executable, "-c", code, "exit", "0"],
        env=env("0"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["worker", str(os.getpid())]  # our child itself ran main


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signals_sent_to_the_tool_reach_the_worker(signum: int) -> None:
    """``kill -INT/-TERM/-HUP`` of the tool's process (a script, systemd's stop): passed on.
    SIGINT: the worker's own answer (one line, 130); the others end it as they would."""
    child = start("wait", "30")
    worker_pid(child)
    time.sleep(0.3)  # inside the wait
    child.proc.send_signal(signum)
    want = 130 if signum == signal.SIGINT else 128 + signum
    assert child.wait(30) == want, child.err
    assert child.err == (["tool cmd: interrupted"] if signum == signal.SIGINT else [])
    assert child.seconds() < 25


def test_ctrl_c_at_a_terminal_is_answered_once() -> None:
    """Ctrl-C typed at the terminal (SIGINT to the foreground process group: parent and worker
    both get it): the worker answers with its one line and 130, once; the parent lets it."""
    master, slave = os.openpty()

    def controlling_terminal() -> None:  # the new session's terminal: ^C goes to its group
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, "wait", "30"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env("30"),
        start_new_session=True,
        preexec_fn=controlling_terminal,  # noqa: PLW1509 - two calls, no locks, no threads
        close_fds=True,
    )
    os.close(slave)
    try:
        text = _read_until(master, "worker", 60)
        time.sleep(0.3)  # inside the wait
        os.write(master, b"\x03")  # the terminal's intr character
        assert proc.wait(30) == 130, text
        text += _read_until(master, "", 2)
        assert text.count("interrupted") == 1, text
        assert "Traceback" not in text, text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def _read_until(fd: int, text: str, timeout_s: float) -> str:
    """What the pseudo-terminal ``fd`` shows, until ``text`` came (or end of output, or the
    time)."""
    seen = ""
    deadline = time.monotonic() + timeout_s
    while (not text or text not in seen) and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not chunk:
            break
        seen += chunk.decode(errors="replace")
    return seen


def test_a_killed_tool_takes_its_worker_along() -> None:
    """``kill -9`` of the tool: the worker does not go on alone."""
    child = start("wait", "30")
    pid = worker_pid(child)
    child.proc.kill()
    assert child.wait(30) == -signal.SIGKILL
    assert gone(pid)


def test_the_tools_peak_rss_is_the_workers() -> None:
    """``wait4`` of the tool (the scale suite, kvstore/bench/scale.py) reports the worker's
    peak: the parent reaps the worker before it exits."""
    peaks = {}
    bare = [sys.executable, "-S", "-E", "-c", _TRAMPOLINE]  # the scale suite's wait4
    for mb in (0, 300):
        proc = subprocess.run(
            [*bare, sys.executable, "-c", WORKER, "rss", str(mb)],
            env=env("30"),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        peaks[mb] = int(proc.stderr.rpartition(_MARK)[2]) / 1024
    assert peaks[300] - peaks[0] > 280, peaks


def test_the_console_scripts_are_supervised() -> None:
    """pyproject.toml's scripts start through ``entry`` (supervised), not ``main`` (which the
    tests call in-process, unsupervised)."""
    with (REPO / "pyproject.toml").open("rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts == {
        "kvstore": "kvstore.cli:entry",
        "kvstore-inspect": "kvstore.inspect.cli:entry",
    }

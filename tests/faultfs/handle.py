"""The test's side of faultfs: :class:`FaultFS` mounts a backing directory through the daemon
(:mod:`tests.faultfs.daemon`, its own process), sends it freeze / delay / thaw commands, and
unmounts it without ever leaving a hung mount or a frozen process behind.

A process blocked in a frozen FUSE request that the daemon has already taken cannot be killed
(the kernel waits for the daemon's answer, uninterruptibly): every way out therefore lifts the
rules first, and where the daemon does not answer, kills it, which ends its connection and
fails every request still held (ECONNABORTED / ENOTCONN) rather than keeping them.

The test process itself must not touch the mount while it is frozen (a ``stat``, a
``Path.exists()``): it would block like any other process. Work on a frozen mount is done in
child processes or threads, and the mount is never looked at by the teardown before a thaw.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tests.faultfs import gate as gate_mod
from tests.faultfs.mounts import is_mounted, lazy_unmount, unmount_commands

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 30.0  # a cold daemon imports fusepy and mounts: well under a second idle
COMMAND_TIMEOUT_S = 10.0


class FuseUnavailableError(Exception):
    """FUSE cannot be used here; the message says why (the skip reason)."""


def unavailable_reason() -> str | None:
    """Why faultfs cannot mount on this machine (no /dev/fuse, no permission, no fusepy or
    libfuse 2, no unmount tool), or None where it can try."""
    if not os.path.exists("/dev/fuse"):
        return "faultfs: no /dev/fuse (FUSE is not available in this kernel or container)"
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as exc:
        return f"faultfs: /dev/fuse cannot be opened ({exc}): FUSE is not permitted here"
    try:
        import fuse  # type: ignore[import-untyped]  # noqa: F401, PLC0415 - presence check
    except (ImportError, OSError) as exc:
        return (
            f"faultfs: fusepy or libfuse 2 is missing ({exc}): pip install fusepy "
            "(the dev extra), apt-get install libfuse2"
        )
    if not unmount_commands("/", lazy=False):
        return "faultfs: no fusermount (apt-get install fuse3) and not root (umount)"
    return None


class FaultFS:
    """A mounted faultfs: ``mount`` shows ``backing`` through the daemon.

    Operation classes (``ops``): "lookup", "read", "write", single operations of them
    ("fsync", "link", ...), a list, or "all"; see :mod:`tests.faultfs.gate` for which
    operations each class holds. ``path_glob``: an fnmatch
    pattern on the path relative to the mount (``*`` crosses ``/``), None for every path.
    """

    def __init__(self, backing: Path, mount: Path, proc: subprocess.Popen[bytes]) -> None:
        self.backing = backing
        self.mount = mount
        self._proc = proc
        self._sock: socket.socket | None = None
        self._lines: Any = None
        self._lock = threading.Lock()
        self.log = mount.with_name(mount.name + ".log")

    # -- life

    @classmethod
    def start(
        cls,
        backing: Path,
        mount: Path,
        freeze_limit_s: float = gate_mod.DEFAULT_FREEZE_LIMIT_S,
    ) -> FaultFS:
        """Mount ``backing`` (created if missing) at ``mount`` (created); returns once the
        mount answers. :class:`FuseUnavailableError` where it does not come up."""
        backing.mkdir(parents=True, exist_ok=True)
        mount.mkdir(parents=True, exist_ok=True)
        ours, theirs = socket.socketpair()
        log = mount.with_name(mount.name + ".log")
        with open(log, "wb") as err:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    *("-m", "tests.faultfs.daemon", str(backing), str(mount)),
                    *(str(theirs.fileno()), str(freeze_limit_s)),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,  # a file, not a pipe: a full pipe would block the daemon
                pass_fds=[theirs.fileno()],
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": _pythonpath()},
            )
        theirs.close()
        fs = cls(backing, mount, proc)
        fs._sock = ours
        fs._lines = ours.makefile("rb")
        fs._await_ready()
        return fs

    def _await_ready(self) -> None:
        """Wait for the daemon's "ready" (the kernel's INIT reached it); on failure tear down
        what started and raise :class:`FuseUnavailableError` with the daemon's own words."""
        assert self._sock is not None
        self._sock.settimeout(START_TIMEOUT_S)
        try:
            line = self._lines.readline()
        except OSError:
            line = b""
        if line and json.loads(line).get("ready"):
            self._sock.settimeout(COMMAND_TIMEOUT_S)
            return
        self.close()
        text = self.log.read_text(errors="replace").strip() if self.log.exists() else ""
        raise FuseUnavailableError(
            f"faultfs did not mount {self.mount}: {text.splitlines()[-1] if text else 'no output'}"
        )

    def close(self) -> None:
        """Thaw, unmount, end the daemon; safe to call twice and after any failure. Never
        looks at the mount (a stat could hang) before the rules are lifted."""
        answered = self._try(lambda: self._command("clear"))
        if not answered or not self._unmount(lazy=False):
            # A daemon that does not answer may hold requests: killing it ends its
            # connection, which fails them, so nothing stays blocked.
            self._kill()
            if self.mounted():
                self._unmount(lazy=True)
        self._reap()
        if self.mounted():
            lazy_unmount(str(self.mount))
        if self._lines is not None:
            self._lines.close()
        if self._sock is not None:
            self._sock.close()
        self._sock = self._lines = None

    def _unmount(self, lazy: bool) -> bool:
        """Unmount (a busy mount: detach lazily); True when no longer mounted."""
        if not self.mounted():
            return True
        for command in unmount_commands(str(self.mount), lazy=lazy):
            done = subprocess.run(command, capture_output=True, timeout=60, check=False)
            if done.returncode == 0:
                return True
            self._note(f"{' '.join(command)}: exit {done.returncode}: {done.stderr!r}")
        return not lazy and self._unmount(lazy=True)

    def _reap(self) -> None:
        """The daemon's loop ends with the mount; give it a moment, then end it."""
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._note("the daemon did not end within 10 s of the unmount: killed")
            self._kill()

    def _note(self, text: str) -> None:
        """A line of the teardown's own into the daemon's log (why a teardown was slow)."""
        with contextlib.suppress(OSError), open(self.log, "a", encoding="utf-8") as f:
            f.write(f"faultfs teardown: {text}\n")

    def _kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=30)

    def mounted(self) -> bool:
        """Is ``mount`` a mount point now (from /proc/self/mountinfo: a stat could hang)?"""
        return is_mounted(str(self.mount))

    # -- commands

    def freeze(self, ops: str | Iterable[str] = "all", path_glob: str | None = None) -> None:
        """Hold every operation of ``ops`` on ``path_glob`` (ones already waiting too) until
        :meth:`thaw`; a safety limit lifts it after the daemon's freeze limit."""
        self._command("freeze", ops=_ops(ops), glob=path_glob)

    def thaw(self) -> None:
        """Lift every freeze: the held operations go on. Delays stay."""
        self._command("thaw")

    def delay(self, ops: str | Iterable[str], seconds: float, path_glob: str | None = None) -> None:
        """Make each operation of ``ops`` on ``path_glob`` take ``seconds`` longer (0: remove
        the delays of those classes)."""
        self._command("delay", ops=_ops(ops), seconds=seconds, glob=path_glob)

    def clear(self) -> None:
        """Lift every freeze and delay: a healthy mount."""
        self._command("clear")

    def stats(self) -> dict[str, dict[str, int]]:
        """Counters since the mount: ``calls`` (per class), ``ops`` (per operation name:
        getattr, link, rename, ...); and now: ``blocked`` (waiting in a freeze; per class, and
        per name in ``blocked_ops``) and ``delayed`` (sleeping in a delay, per class)."""
        doc = self._command("stats")
        return {k: doc[k] for k in ("calls", "ops", "blocked", "blocked_ops", "delayed")}

    def wait_blocked(
        self, ops: str | Iterable[str] = "all", count: int = 1, timeout_s: float = 20.0
    ) -> dict[str, dict[str, int]]:
        """Wait until at least ``count`` operations of ``ops`` are held by a freeze (someone is
        really stuck in the mount, not just about to be); the stats then. AssertionError on
        timeout, with the stats."""
        wanted = gate_mod.op_classes(_ops(ops))
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            # a class by its own counter, an operation name by the per-name one
            held = sum(n for c, n in stats["blocked"].items() if c in wanted)
            held += sum(
                n
                for c, n in stats["blocked_ops"].items()
                if c in wanted and c not in gate_mod.OP_CLASSES
            )
            if held >= count:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"faultfs: expected {count} held {sorted(wanted)}: {stats}")
            time.sleep(0.05)

    @contextlib.contextmanager
    def frozen(
        self, ops: str | Iterable[str] = "all", path_glob: str | None = None
    ) -> Iterator[FaultFS]:
        """``freeze`` for the block, thawed however it ends."""
        self.freeze(ops, path_glob)
        try:
            yield self
        finally:
            self.thaw()

    def _command(self, cmd: str, **args: Any) -> dict[str, Any]:
        if self._sock is None:
            raise RuntimeError("faultfs: not mounted")
        with self._lock:
            self._sock.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
            line = self._lines.readline()
        if not line:
            raise RuntimeError(f"faultfs: the daemon is gone (see {self.log})")
        doc: dict[str, Any] = json.loads(line)
        if not doc.get("ok"):
            raise ValueError(f"faultfs {cmd}: {doc.get('error')}")
        return doc

    @staticmethod
    def _try(step: Any) -> bool:
        try:
            step()
        except (OSError, RuntimeError, ValueError):
            return False
        return True


def _ops(ops: str | Iterable[str]) -> list[str]:
    """``ops`` as the daemon takes it, checked here so that a typo fails in the test."""
    return sorted(gate_mod.op_classes(ops))


def _pythonpath() -> str:
    """The daemon imports ``tests.faultfs`` from this checkout."""
    old = os.environ.get("PYTHONPATH", "")
    return f"{REPO}{os.pathsep}{old}" if old else str(REPO)

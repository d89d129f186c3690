"""Child processes that work on a faultfs mount, watched without ever blocking the test.

A process held in a frozen FUSE request cannot be waited for, killed, or read to the end of
its output until the freeze lifts: ``subprocess.run(timeout=...)`` kills, then waits forever,
and ``communicate()`` waits for an end of file that the blocked process never gives (its
descriptors stay open while one thread is stuck). :class:`Child` therefore reads stdout and
stderr on threads as lines arrive, and every wait has a deadline.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[2]


class Child:
    """A started process whose output lines are collected as they come."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: Path = REPO,
    ) -> None:
        self.argv = list(argv)
        self.started = time.monotonic()
        # cwd off the mount: Python's start (sys.path[0], imports) must not touch it
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, **(env or {})},
            cwd=cwd,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self.arrived: dict[str, float] = {}  # line -> seconds after the start it came
        self._changed = threading.Condition()
        for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            assert stream is not None
            threading.Thread(target=self._collect, args=(stream, lines), daemon=True).start()

    @classmethod
    def python(cls, code: str, *args: str, env: Mapping[str, str] | None = None) -> Child:
        """``python -c code args...`` with this checkout importable."""
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        return cls([sys.executable, "-c", code, *args], env={"PYTHONPATH": path, **(env or {})})

    def _collect(self, stream: IO[bytes], lines: list[str]) -> None:
        for raw in stream:
            line = raw.decode(errors="replace").rstrip("\n")
            with self._changed:
                lines.append(line)
                self.arrived.setdefault(line, self.seconds())
                self._changed.notify_all()
        stream.close()

    def wait_line(self, text: str, timeout_s: float, stream: str = "err") -> str | None:
        """The first line of ``stream`` ("out" or "err") containing ``text``, waiting up to
        ``timeout_s``; None when none came."""
        lines = self.err if stream == "err" else self.out
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                found = next((line for line in lines if text in line), None)
                left = deadline - time.monotonic()
                if found is not None or left <= 0:
                    return found
                self._changed.wait(min(left, 0.1))

    def exited_within(self, timeout_s: float) -> bool:
        """Did the process end (it can be reaped) within ``timeout_s``?"""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def wait(self, timeout_s: float) -> int:
        """The exit code, waiting up to ``timeout_s`` (AssertionError naming the command and
        its stderr so far when it has not ended)."""
        if not self.exited_within(timeout_s):
            raise AssertionError(
                f"{self.argv} still running after {timeout_s} s; stderr: {self.err[-5:]}"
            )
        return self.proc.returncode

    def seconds(self) -> float:
        """Seconds since the start."""
        return time.monotonic() - self.started

    def state(self) -> str:
        """The kernel's state letter of the process (R, S, D, Z...), "" once reaped."""
        try:
            with open(f"/proc/{self.proc.pid}/stat", encoding="ascii") as f:
                return f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return ""

    def kill(self) -> None:
        """End the process if it still runs (it goes once no FUSE request holds it)."""
        if self.proc.poll() is None:
            self.proc.kill()

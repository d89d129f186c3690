"""Run one call in a forked child, so that a crash of the call (a signal, a hang, an abrupt
exit) is a failed test instead of a dead test runner.

:func:`run_isolated` forks, runs the callable in the child and sends the parent a small JSON
description of what happened (its return value, or the exception it raised: type name, words
and errno); the parent waits for it with a timeout and describes a child that never reported
by how it ended (the signal that killed it, its exit status, or the timeout after which it was
killed). Files the child creates are on the same file system, so a test checks them in the
parent once the child is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import pytest

Kind = Literal["ok", "raised", "signal", "exit", "timeout"]

_MESSAGE_LIMIT = 4000  # characters of an exception's words (or a value's repr) sent back


@dataclass(frozen=True)
class Outcome:
    """How a call made by :func:`run_isolated` ended.

    ``kind``: "ok" (``value``: what it returned, as JSON gives it back, or its ``repr`` when
    that is not JSON), "raised" (``type``: the exception's class name, ``message``: its
    ``str``, ``errno``: its errno or None, ``mro``: the names of its classes), "signal"
    (``signal``: the name of the signal that killed the child, e.g. "SIGSEGV"), "exit" (the
    child ended without reporting; ``exit_code``: its status) or "timeout" (killed after the
    timeout)."""

    kind: Kind
    value: Any = None
    type: str | None = None
    message: str | None = None
    errno: int | None = None
    signal: str | None = None
    exit_code: int | None = None
    mro: tuple[str, ...] = ()  # the raised exception's class names, its own first
    detail: str = ""  # the child's traceback of a raised exception, for failure messages

    def describe(self) -> str:
        """One line saying how the call ended, for assertion messages."""
        if self.kind == "ok":
            return f"returned {self.value!r}"
        if self.kind == "raised":
            return f"raised {self.type} (errno {self.errno}): {self.message}"
        if self.kind == "signal":
            return f"killed by {self.signal}"
        if self.kind == "exit":
            return f"exited with status {self.exit_code} without reporting"
        return "timed out (killed)"


def _jsonable(value: object) -> object:
    """``value`` if JSON can carry it, else its (truncated) repr."""
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)[:_MESSAGE_LIMIT]
    return value


def _describe_child(fn: Callable[[], object]) -> dict[str, Any]:
    """Run ``fn`` (in the child) and describe its outcome as a JSON-able dict."""
    try:
        value = fn()
    except BaseException as exc:  # every outcome is reported, none re-raised
        err = getattr(exc, "errno", None)
        return {
            "kind": "raised",
            "type": type(exc).__name__,
            "mro": [cls.__name__ for cls in type(exc).__mro__],
            "message": str(exc)[:_MESSAGE_LIMIT],
            "errno": err if isinstance(err, int) else None,
            "detail": "".join(traceback.format_exception(exc))[-_MESSAGE_LIMIT:],
        }
    return {"kind": "ok", "value": _jsonable(value)}


def _child(fn: Callable[[], object], write_fd: int) -> None:
    """The child's whole life: run, report, ``os._exit`` (never returns to pytest)."""
    code = 0
    try:
        data = json.dumps(_describe_child(fn)).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(write_fd, view) :]
        os.close(write_fd)
    except BaseException:  # the parent sees "exit" with this status
        code = 3
    finally:
        os._exit(code)


def run_isolated(fn: Callable[[], object], timeout: float = 30.0) -> Outcome:
    """Run ``fn()`` in a forked child and return how it ended (:class:`Outcome`). A child
    still running after ``timeout`` seconds is killed (SIGKILL): kind "timeout"."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read_fd)
        _child(fn, write_fd)
    os.close(write_fd)
    deadline = time.monotonic() + timeout
    received = bytearray()
    timed_out = False
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            ready, _, _ = select.select([read_fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(read_fd, 65536)
            if not chunk:  # end of file: the child reported, or died
                break
            received += chunk
    finally:
        os.close(read_fd)
    if timed_out:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return Outcome(kind="timeout")
    status = _wait(pid, deadline)
    if status is None:
        return Outcome(kind="timeout")
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        return Outcome(kind="signal", signal=name)
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    try:
        report = json.loads(received.decode())
    except (UnicodeDecodeError, ValueError):
        return Outcome(kind="exit", exit_code=code)
    if code != 0 or not isinstance(report, dict):
        return Outcome(kind="exit", exit_code=code)
    if report.get("kind") == "ok":
        return Outcome(kind="ok", value=report.get("value"))
    return Outcome(
        kind="raised",
        type=report.get("type"),
        message=report.get("message"),
        errno=report.get("errno"),
        mro=tuple(report.get("mro", ())),
        detail=report.get("detail", ""),
    )


def _wait(pid: int, deadline: float) -> int | None:
    """The child's wait status once it has ended (after closing its end of the pipe it only
    exits); killed at ``deadline`` (then None)."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return status
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.005)


def assert_clean(outcome: Outcome) -> None:
    """Fail the test unless the call ended by returning or raising (not by a signal, an
    abrupt exit or a timeout: a crash or a hang of the code under test)."""
    if outcome.kind in ("signal", "exit", "timeout"):
        pytest.fail(f"the isolated call did not end cleanly: {outcome.describe()}", pytrace=False)

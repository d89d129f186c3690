"""A tool that waits on a hung file system says so and exits, instead of hanging forever.

An NFS server that stops answering under a hard mount, a frozen brick, a wedged FUSE daemon:
a ``stat`` or ``read`` on such a mount blocks without an error. The admin and inspection tools
(``kvstore``, ``kvstore-inspect``) therefore run a watchdog (:func:`watching`): the file-system
paths they go through (directory listings, block reads, progress updates) call :func:`beat`;
when no beat came for the stall timeout, the watchdog prints one line naming the root and
what to check, and exits the process with :data:`EXIT_STALLED`. Leaving the process through
``os._exit`` ends it at once where the blocked wait is killable (NFS hard mounts); on FUSE a
request the daemon has already taken is waited for uninterruptibly (the kernel's
``request_wait_answer``), so there the line comes on time but the process ends, with exit 3,
only once the mount answers (tests/admin/test_stall.py, the faultfs tests).

The timeout is ``KVSTORE_STALL_TIMEOUT_S`` (seconds, default :data:`DEFAULT_TIMEOUT_S`; 0 turns
the watchdog off). It measures silence, not duration: a long ``gc`` pass beats all the way.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvstore.errors import ConfigError

ENV = "KVSTORE_STALL_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
EXIT_STALLED = 3

_last_beat = time.monotonic()
_paused = 0  # > 0 while the tool waits on something else than the store (a person, a timer)


def beat() -> None:
    """A file-system call just returned: the mount answers (cheap: one store of a float)."""
    global _last_beat  # noqa: PLW0603 - one process-wide clock the watchdog reads
    _last_beat = time.monotonic()


@contextmanager
def paused() -> Iterator[None]:
    """Silence that is not the store's (a prompt, ``gc --watch`` between passes): not counted."""
    global _paused  # noqa: PLW0603 - the watchdog's process-wide switch
    _paused += 1
    try:
        yield
    finally:
        _paused -= 1
        beat()


def timeout_from_env() -> float:
    """The stall timeout ``KVSTORE_STALL_TIMEOUT_S`` asks for (0: no watchdog)."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ConfigError(f"{ENV}: expected a number of seconds >= 0, got {text!r}")
    return value


@contextmanager
def watching(program: str, root: object, timeout_s: float | None = None) -> Iterator[None]:
    """The watchdog of this process, for the duration: a tool working on the store at
    ``root`` (``timeout_s``: None reads :data:`ENV`). It stops when the block ends, so a
    process that goes on (a test calling the CLI's ``main``) is never ended by it later."""
    limit = timeout_from_env() if timeout_s is None else timeout_s
    if limit <= 0:
        yield
        return
    beat()
    done = threading.Event()
    thread = threading.Thread(
        target=_run, args=(program, str(root), limit, done), name="kvstore-stall", daemon=True
    )
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _run(program: str, root: str, limit: float, done: threading.Event) -> None:
    while not done.is_set():
        silent = 0.0 if _paused else time.monotonic() - _last_beat
        if _paused:
            beat()
        if silent >= limit:
            sys.stderr.write(
                f"{program}: error: the file system of {root} did not answer for {silent:.0f} s "
                "(a hung mount: an NFS server, a FUSE daemon or a brick that stopped "
                f"answering?); giving up. Check the mount; {ENV} sets this limit.\n"
            )
            sys.stderr.flush()
            os._exit(EXIT_STALLED)
        done.wait(min(1.0, max(0.05, limit - silent)))

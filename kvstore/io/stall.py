"""A tool that waits on a hung file system says so and exits, instead of hanging forever.

An NFS server that stops answering under a hard mount, a frozen brick, a wedged FUSE daemon:
a ``stat`` or ``read`` on such a mount blocks without an error. The admin and inspection tools
(``kvstore``, ``kvstore-inspect``) therefore run a watchdog (:func:`watching`): the file-system
paths they go through (directory listings, block reads, progress updates) call :func:`beat`;
when no beat came for the stall timeout, the watchdog prints one line naming the root and
what to check, and exits the process with :data:`EXIT_STALLED`.

Where: in the process itself (a thread that leaves through ``os._exit``: a test calling a
CLI's ``main``), or, for the console scripts, in a supervising parent
(:mod:`kvstore.io.supervise`). The difference is the FUSE case: a request the daemon has
already taken is waited for uninterruptibly (the kernel's ``request_wait_answer``), so a
process with a thread held there cannot end until the mount answers; its ``os._exit`` prints
the line on time but exits only after the thaw. A parent that touches no mount can exit at
once. For it the clock lives in shared memory (:func:`share`: the worker's :func:`beat`
stays one store of a float) and :func:`watching` publishes the watch there (:func:`overdue`
is the parent's check) instead of starting a thread.

The timeout is ``KVSTORE_STALL_TIMEOUT_S`` (seconds, default :data:`DEFAULT_TIMEOUT_S`; 0 turns
the watchdog off). It measures silence, not duration: a long ``gc`` pass beats all the way.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvstore.errors import ConfigError

ENV = "KVSTORE_STALL_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
EXIT_STALLED = 3

# The clock, three doubles: the last beat (time.monotonic(), one clock for every process of
# the machine), the depth of paused() (> 0 while the tool waits on something else than the
# store: a person, a timer), the limit of the watch under way (0: none; only a supervisor reads
# it). Process memory, or the first bytes of the memory shared with a supervisor (share).
BEAT, PAUSED, LIMIT = 0, 1, 2
_TEXT = 32  # shared memory: at _TEXT a 4-byte length, then "program\0root" in UTF-8
SHARED_BYTES = 4096
_clock = memoryview(bytearray(_TEXT)).cast("d")
_shared: mmap.mmap | None = None


def beat() -> None:
    """A file-system call just returned: the mount answers (cheap: one store of a float)."""
    _clock[BEAT] = time.monotonic()


def beat_slot() -> memoryview[float]:
    """Where :func:`beat` stores the time: one native double (``time.monotonic()``'s
    ``CLOCK_MONOTONIC`` seconds), for a native call that beats as it goes (one that lists or
    reads many entries without the GIL: ``kvstore._native._fileproto``'s ``list_dir_step`` and
    ``read_files``). Taken at each call: :func:`share` moves the clock."""
    return _clock[BEAT : BEAT + 1]


@contextmanager
def paused() -> Iterator[None]:
    """Silence that is not the store's (a prompt, ``gc --watch`` between passes): not counted."""
    _clock[PAUSED] += 1
    try:
        yield
    finally:
        _clock[PAUSED] -= 1
        beat()


def share(shared: mmap.mmap) -> None:
    """In a worker process under a supervisor: keep the clock in ``shared`` (``SHARED_BYTES``,
    mapped before the fork) and publish watches there instead of running a watchdog here."""
    global _clock, _shared  # noqa: PLW0603 - the process-wide clock, moved once at the start
    _clock = memoryview(shared)[:_TEXT].cast("d")
    _shared = shared
    beat()


def overdue(shared: mmap.mmap) -> tuple[str | None, float]:
    """The supervisor's check of its worker's clock: (the stall line when the watch under way
    heard nothing for its limit, else None; seconds until it could be at the earliest)."""
    clock = memoryview(shared)[:_TEXT].cast("d")
    try:
        limit = clock[LIMIT]
        if limit <= 0 or clock[PAUSED] > 0:
            return None, 1.0
        silent = time.monotonic() - clock[BEAT]
        if silent < limit:
            return None, limit - silent
        (size,) = struct.unpack_from("<I", shared, _TEXT)
        text = shared[_TEXT + 4 : _TEXT + 4 + size].decode(errors="surrogateescape")
    finally:
        clock.release()  # an exported view would keep the mapping from closing
    program, _, root = text.partition("\0")
    return _line(program, root, silent), 0.0


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
    if _shared is not None:  # a supervisor watches (kvstore.io.supervise)
        text = f"{program}\0{root}".encode(errors="surrogateescape")[: SHARED_BYTES - _TEXT - 4]
        struct.pack_into("<I", _shared, _TEXT, len(text))
        _shared[_TEXT + 4 : _TEXT + 4 + len(text)] = text
        _clock[LIMIT] = limit  # last: the watch is on once its words are there
        try:
            yield
        finally:
            _clock[LIMIT] = 0.0
        return
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
        silent = 0.0 if _clock[PAUSED] else time.monotonic() - _clock[BEAT]
        if _clock[PAUSED]:
            beat()
        if silent >= limit:
            sys.stderr.write(_line(program, root, silent))
            sys.stderr.flush()
            os._exit(EXIT_STALLED)
        done.wait(min(1.0, max(0.05, limit - silent)))


def _line(program: str, root: str, silent: float) -> str:
    return (
        f"{program}: error: the file system of {root} did not answer for {silent:.0f} s "
        "(a hung mount: an NFS server, a FUSE daemon or a brick that stopped "
        f"answering?); giving up. Check the mount; {ENV} sets this limit.\n"
    )

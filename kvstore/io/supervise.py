"""The console scripts' supervisor: the work in a child, so a hung mount cannot keep the tool.

``kvstore`` and ``kvstore-inspect`` start through :func:`run` (their ``entry``). It forks: the
child (the worker) runs the command exactly as ``main()`` runs it in-process, with stdin,
stdout and stderr inherited (it writes its output, prompts and exit status itself); the parent
touches no file system and only watches. Why: on a frozen FUSE mount a thread held in a
request the daemon has taken cannot end until the daemon answers, so a process that has one
cannot exit, whatever it calls (:mod:`kvstore.io.stall`); its parent can.

The contract:

* The worker's :func:`stall.beat` goes to memory shared with the parent (an anonymous mapping
  made before the fork: still one store of a float), and its :func:`stall.watching` publishes
  the watch (program, root, limit) there. When a watch heard nothing for its limit, the parent
  sends the worker SIGKILL (pending while it is held: it dies the moment the kernel lets it go
  and never continues its work), prints the watchdog's one line and exits
  :data:`stall.EXIT_STALLED`.
* Otherwise the parent exits with the worker's status; a worker killed by signal N gives
  128 + N, as shells report it.
* Ctrl-C (SIGINT from the terminal to the foreground process group) reaches both: the
  parent leaves it to the worker and waits for its answer (one line, 130). SIGINT sent to the
  parent by ``kill`` (a script, a test), SIGTERM and SIGHUP (systemd stopping ``kvstore gc
  --watch``) are passed on to the worker. A worker whose parent dies (``kill -9``) is killed.
* ``KVSTORE_STALL_TIMEOUT_S=0`` (no watchdog), or a value the command will refuse: no fork,
  the command runs in this process.

A worker's peak RSS is in its parent's ``wait4`` usage (the parent reaps it before it exits:
Linux reports the larger of a process's peak and its reaped children's), so the scale suite
(kvstore/bench/scale.py) still measures the command's work.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import signal
import sys
import time
from collections.abc import Callable

from kvstore.errors import ConfigError
from kvstore.io import stall

# The parent keeps these blocked and takes them with sigtimedwait: no handler can interrupt it
# anywhere, SIGCHLD wakes it when the worker ends, and it sees who sent SIGINT.
PASSED_ON = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
WAITED = PASSED_ON | {signal.SIGCHLD}
SI_KERNEL = 0x80  # siginfo's si_code of a signal the kernel sent: a terminal's Ctrl-C
PR_SET_PDEATHSIG = 1  # prctl: the signal a process gets when its parent dies
REAP_S = 1.0  # after the SIGKILL: how long the parent waits to reap a worker that can die


def run(main: Callable[[], int]) -> int:
    """``main()``'s exit status, from a worker process watched as the module says (in this
    process where the watchdog is off). Returns in both processes: the worker returns
    ``main()``'s value (or raises as ``main`` does), the parent its exit status."""
    try:
        limit = stall.timeout_from_env()
    except ConfigError:
        return main()  # the command itself reports the setting it refuses, as before
    if limit <= 0:
        return main()
    shared = mmap.mmap(-1, stall.SHARED_BYTES)  # anonymous, MAP_SHARED: one page both see
    # Blocked before the fork: nothing sent in between is lost (or the parent's death).
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, WAITED)
    for stream in (sys.stdout, sys.stderr):  # nothing buffered before the fork is written twice
        if stream is not None:  # None: started without that descriptor
            with contextlib.suppress(OSError):
                stream.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        _die_with(parent)
        stall.share(shared)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return main()
    return _Worker(pid).watch(shared)


def _die_with(parent: int) -> None:
    """The worker ends with its parent: a tool killed with ``kill -9`` does not go on."""
    with contextlib.suppress(OSError, AttributeError):  # no libc prctl: the risk stays
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL))
    if os.getppid() != parent:  # it died before the prctl
        os._exit(128 + signal.SIGKILL)


class _Worker:
    """The parent's view of its worker: its end, its clock, the signals it is passed."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.reaped = False

    def watch(self, shared: mmap.mmap) -> int:
        """Wait for the worker's end (its status) or a stall (kill it, one line, exit 3)."""
        while True:
            status = self.reap()
            if status is not None:
                return status
            line, wait_s = stall.overdue(shared)
            if line is not None:
                os.kill(self.pid, signal.SIGKILL)
                with contextlib.suppress(OSError):  # a closed stderr: the status still says it
                    sys.stderr.write(line)
                    sys.stderr.flush()
                # A worker whose wait was killable (NFS) goes now: reaped, it is no zombie.
                # One held by FUSE goes at the thaw (its new parent reaps it).
                deadline = time.monotonic() + REAP_S
                while self.reap() is None and time.monotonic() < deadline:
                    signal.sigtimedwait({signal.SIGCHLD}, max(0.0, deadline - time.monotonic()))
                return stall.EXIT_STALLED
            got = signal.sigtimedwait(WAITED, min(1.0, wait_s))
            if got is None or got.si_signo == signal.SIGCHLD:
                continue
            if got.si_signo == signal.SIGINT and got.si_code == SI_KERNEL:
                continue  # a Ctrl-C: the terminal sent it to the worker too
            os.kill(self.pid, got.si_signo)  # unreaped, the pid is still the worker's

    def reap(self) -> int | None:
        """The worker's exit status (128 + N for signal N) once it ended, else None."""
        if self.reaped:
            return None
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid == 0:
            return None
        self.reaped = True
        code = os.waitstatus_to_exitcode(status)
        return 128 - code if code < 0 else code

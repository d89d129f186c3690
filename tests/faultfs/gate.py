"""The faults of faultfs: rules that freeze or delay operation classes, and the gate where every
file-system operation of the daemon waits while a rule holds it.

Operation classes (what a hung network mount blocks, grouped as kvstore meets them):

* ``lookup``: getattr (every path resolution: the kernel's LOOKUP arrives here as getattr),
  access, readlink, statfs, opendir, readdir, open of an existing file;
* ``read``: read;
* ``write``: create, write, truncate, fsync, fsyncdir, mkdir, mknod, symlink, link, rename,
  unlink, rmdir, chmod, chown, utimens.

A rule may also name single operations (``"fsync"``, ``"link"``: freeze only the publish
step); ``"read"`` and ``"write"`` always mean the classes.

A rule may be limited to paths matching a glob (:func:`fnmatch.fnmatchcase` on the path
relative to the mount, without a leading slash: ``""`` is the mount's root; ``*`` also matches
``/``, so ``"store/*"`` is everything below ``store``). An operation on two paths (rename,
link) matches when either does.
"""

from __future__ import annotations

import fnmatch
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

OP_CLASSES = ("lookup", "read", "write")
# The operations of each class, as tests/faultfs/daemon.py passes them through the gate.
OPERATIONS = {
    "lookup": ("getattr", "access", "readlink", "statfs", "opendir", "readdir", "open"),
    "read": ("read",),
    "write": (
        "create", "write", "truncate", "fsync", "fsyncdir", "mkdir", "mknod", "symlink",
        "link", "rename", "unlink", "rmdir", "chmod", "chown", "utimens",
    ),
}  # fmt: skip
_NAMES = frozenset(n for names in OPERATIONS.values() for n in names) - set(OP_CLASSES)
# A freeze that nobody lifts ends by itself after this long: a test that forgot to thaw (or
# died without its teardown) must not leave processes in uninterruptible sleep forever.
DEFAULT_FREEZE_LIMIT_S = 300.0


def op_classes(ops: str | Iterable[str]) -> frozenset[str]:
    """``ops`` as a set of operation classes and operation names ("all", one, or several),
    checked."""
    names = [ops] if isinstance(ops, str) else list(ops)
    if "all" in names:
        return frozenset(OP_CLASSES)
    unknown = [n for n in names if n not in OP_CLASSES and n not in _NAMES]
    if unknown or not names:
        raise ValueError(
            f"expected operation classes from {OP_CLASSES}, operation names from "
            f"{sorted(_NAMES)} or 'all', got {names!r}"
        )
    return frozenset(names)


@dataclass(frozen=True)
class Rule:
    """Freeze (``seconds`` None) or delay by ``seconds`` the classes or operations ``ops``
    on paths matching
    ``glob`` (None: every path), until ``until`` (monotonic seconds; inf: until removed)."""

    ops: frozenset[str]
    glob: str | None
    seconds: float | None
    until: float = float("inf")

    @property
    def freezes(self) -> bool:
        return self.seconds is None

    def matches(self, op_class: str, name: str, paths: tuple[str, ...], now: float) -> bool:
        """Does this rule hold operation ``name`` of ``op_class`` on ``paths`` at ``now``?"""
        if (op_class not in self.ops and name not in self.ops) or now >= self.until:
            return False
        if self.glob is None:
            return True
        return any(fnmatch.fnmatchcase(p, self.glob) for p in paths)


class Gate:
    """The rules in force and the operations waiting on them (thread-safe)."""

    def __init__(self, freeze_limit_s: float = DEFAULT_FREEZE_LIMIT_S) -> None:
        self._cond = threading.Condition()
        self._rules: list[Rule] = []
        self._freeze_limit_s = freeze_limit_s
        self.calls: Counter[str] = Counter()  # operations seen, by class
        self.ops: Counter[str] = Counter()  # operations seen, by name (getattr, rename, ...)
        self.blocked: Counter[str] = Counter()  # operations waiting in a freeze now, by class
        self.blocked_ops: Counter[str] = Counter()  # the same, by operation name
        self.delayed: Counter[str] = Counter()  # operations sleeping in a delay now, by class

    def freeze(self, ops: str | Iterable[str], glob: str | None = None) -> None:
        """Hold every later (and every waiting) operation of ``ops`` on ``glob`` until thaw."""
        until = time.monotonic() + self._freeze_limit_s
        self._add(Rule(op_classes(ops), glob, None, until))

    def delay(self, ops: str | Iterable[str], seconds: float, glob: str | None = None) -> None:
        """Make operations of ``ops`` on ``glob`` take ``seconds`` longer; 0 removes the delays
        of those classes (whatever their glob)."""
        classes = op_classes(ops)
        if seconds < 0:
            raise ValueError(f"delay: expected seconds >= 0, got {seconds}")
        with self._cond:
            # one rule per class: removing the delay of one class keeps the others'
            self._rules = [r for r in self._rules if r.freezes or not r.ops & classes]
            if seconds > 0:
                self._rules += [Rule(frozenset({c}), glob, float(seconds)) for c in classes]
            self._cond.notify_all()

    def thaw(self) -> None:
        """Lift every freeze; the held operations go on (delays stay)."""
        with self._cond:
            self._rules = [r for r in self._rules if not r.freezes]
            self._cond.notify_all()

    def clear(self) -> None:
        """Lift every rule: a healthy mount again."""
        with self._cond:
            self._rules = []
            self._cond.notify_all()

    def _add(self, rule: Rule) -> None:
        with self._cond:
            self._rules.append(rule)
            self._cond.notify_all()

    def stats(self) -> dict[str, dict[str, int]]:
        """Counters: ``calls`` (by class), ``ops`` (by operation name), and the operations
        held now by a freeze (``blocked`` by class, ``blocked_ops`` by name) or by a delay
        (``delayed``, by class)."""
        with self._cond:
            return {
                "calls": dict(self.calls),
                "ops": dict(self.ops),
                "blocked": dict(self.blocked),
                "blocked_ops": dict(self.blocked_ops),
                "delayed": dict(self.delayed),
            }

    def passage(self, op_class: str, name: str, *paths: str) -> None:
        """Called by operation ``name`` (of ``op_class``) on ``paths`` before it runs: returns
        once no freeze holds it and its delay (from the call's start) has passed."""
        start = time.monotonic()
        with self._cond:
            self.calls[op_class] += 1
            self.ops[name] += 1
            while True:
                now = time.monotonic()
                wait = self._wait_for(op_class, name, paths, start, now)
                if wait is None:
                    return
                counters = [(self.delayed, op_class)]
                if wait[0]:
                    counters = [(self.blocked, op_class), (self.blocked_ops, name)]
                for counter, key in counters:
                    counter[key] += 1
                try:
                    self._cond.wait(wait[1])
                finally:
                    for counter, key in counters:
                        counter[key] -= 1

    def _wait_for(
        self, op_class: str, name: str, paths: tuple[str, ...], start: float, now: float
    ) -> tuple[bool, float] | None:
        """(frozen?, how long to wait at most before looking again), or None: go on. Called
        with the lock held; every change of the rules wakes the waiters, so they re-check."""
        held = [r for r in self._rules if r.matches(op_class, name, paths, now)]
        freezes = [r.until - now for r in held if r.freezes]
        if freezes:
            return True, min(freezes)
        delays = [start + (r.seconds or 0.0) - now for r in held]
        longest = max(delays, default=0.0)
        return (False, longest) if longest > 0 else None

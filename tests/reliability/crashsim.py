"""Power-loss simulation: record every mutating file-system call, rebuild what a disk could
hold after a crash at any point.

:class:`CrashRecorder` is a :class:`~kvstore.io.fileio.FileIO` that performs each call for real
(the workload runs normally) and logs the mutating ones with their bytes, in the order they
happened (one lock around call + log). Files are tracked as inodes, so a rename moves data.

:func:`crash_state` rebuilds, from the first ``prefix`` operations, one state the disk may be in
after a power loss at that point. The model is POSIX's, pessimistic:

* a data operation (``write``, ``truncate``) of an inode survives for certain only if an
  ``fdatasync`` of that inode follows it (within the prefix);
* a directory operation (``create`` by ``O_CREAT``, ``rename``, ``unlink``, ``mkdir``) survives
  for certain only if an ``fsync`` of every directory it changed follows it (the parent of each
  affected name; a new directory's entry lives in its parent);
* everything else may or may not have reached the disk. The policies pick which:
  ``synced`` (only what was synced), ``meta`` (every directory operation persisted, unsynced
  data lost: the classic zero-length file after rename), ``zeros`` (names and sizes persisted,
  unsynced bytes read back as zeros), ``all`` (everything: a process crash), and ``random-<n>``
  (each unsynced operation kept or dropped by a seeded coin, writes possibly torn at a 512-byte
  sector boundary).

Operations are applied in log order; a kept operation whose source is gone (a rename of a name
whose creation was dropped) does nothing. A file is in the state only if every directory above
it is. Paths are rebased from the recorded base directory to the replay directory.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.io.fileio import FileIO

SECTOR = 512
DIR = -1  # names[path] == DIR: a directory

# Log entries: ("mkdir", path) ("create", path, ino) ("write", ino, offset, bytes)
# ("truncate", ino, length) ("datasync", ino) ("dirsync", path) ("rename", src, dst)
# ("unlink", path)
Op = tuple[Any, ...]


class CrashRecorder(FileIO):
    """Runs every call for real; logs mutating calls (with written bytes) in execution order."""

    def __init__(self) -> None:
        self.log: list[Op] = []
        self._lock = threading.RLock()
        self._names: dict[str, int] = {}  # volatile namespace: file path -> inode id
        self._fd_ino: dict[int, int | None] = {}
        self._inodes = 0

    @property
    def position(self) -> int:
        """Number of operations logged so far (a crash point)."""
        with self._lock:
            return len(self.log)

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        with self._lock:
            known = self._names.get(path)
            fd = super().open(path, flags, mode)
            if known is None and flags & os.O_CREAT:
                self._inodes += 1
                known = self._inodes
                self._names[path] = known
                self.log.append(("create", path, known))
            self._fd_ino[fd] = known
            return fd

    def close(self, fd: int) -> None:
        with self._lock:
            self._fd_ino.pop(fd, None)
            super().close(fd)

    def pwritev(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        with self._lock:
            done = super().pwritev(fd, buffers, offset)
            data = b"".join(memoryview(b).cast("B").tobytes() for b in buffers)[:done]
            self._data_op(fd, ("write", offset, data))
            return done

    def ftruncate(self, fd: int, length: int) -> None:
        with self._lock:
            super().ftruncate(fd, length)
            self._data_op(fd, ("truncate", length))

    def fdatasync(self, fd: int) -> None:
        with self._lock:
            super().fdatasync(fd)
            ino = self._fd_ino.get(fd)
            if ino is not None:
                self.log.append(("datasync", ino))

    def fsync_dir(self, path: str) -> None:
        with self._lock:
            super().fsync_dir(path)
            self.log.append(("dirsync", os.path.abspath(path)))

    def rename(self, src: str, dst: str) -> None:
        with self._lock:
            super().rename(src, dst)
            ino = self._names.pop(src, None)
            if ino is not None:
                self._names[dst] = ino
            self.log.append(("rename", src, dst))

    def unlink(self, path: str) -> None:
        with self._lock:
            super().unlink(path)
            self._names.pop(path, None)
            self.log.append(("unlink", path))

    def makedirs(self, path: str, mode: int = 0o700) -> list[str]:
        with self._lock:
            missing = []
            current = os.path.abspath(path)
            while not os.path.isdir(current):
                missing.append(current)
                current = os.path.dirname(current)
            result = super().makedirs(path, mode)
            for directory in reversed(missing):
                self.log.append(("mkdir", directory))
            return result

    def _data_op(self, fd: int, op: tuple[Any, ...]) -> None:
        ino = self._fd_ino.get(fd)
        if ino is not None:
            self.log.append((op[0], ino, *op[1:]))


def _affected_dirs(op: Op) -> tuple[str, ...]:
    if op[0] in ("mkdir", "create", "unlink"):
        return (os.path.dirname(op[1]),)
    if op[0] == "rename":
        return (os.path.dirname(op[1]), os.path.dirname(op[2]))
    return ()


@dataclass
class CrashModel:
    """A recorded log, with, per operation, the first later sync that makes it durable."""

    log: list[Op]
    base: str  # recorded paths start with this directory (it exists before and after)
    durable_at: list[int] = field(default_factory=list)  # op i is durable in prefixes > this

    def __post_init__(self) -> None:
        n = len(self.log)
        never = n + 1
        self.durable_at = [never] * n
        next_datasync: dict[int, int] = {}
        next_dirsync: dict[str, int] = {}
        for i in range(n - 1, -1, -1):
            op = self.log[i]
            kind = op[0]
            if kind in ("write", "truncate"):
                self.durable_at[i] = next_datasync.get(op[1], never)
            elif kind in ("mkdir", "create", "rename", "unlink"):
                self.durable_at[i] = max(next_dirsync.get(d, never) for d in _affected_dirs(op))
            if kind == "datasync":
                next_datasync[op[1]] = i
            elif kind == "dirsync":
                next_dirsync[op[1]] = i

    def __len__(self) -> int:
        return len(self.log)


POLICIES = ("synced", "meta", "zeros", "all")


def crash_state(model: CrashModel, prefix: int, policy: str) -> dict[str, bytes | None]:
    """{path relative to the base: file bytes, or None for a directory} after a crash that
    interrupts the log after ``prefix`` operations, under ``policy``."""
    rng = random.Random(f"{policy}-{prefix}") if policy.startswith("random") else None
    names: dict[str, int] = {}
    data: dict[int, bytearray] = {}
    for i in range(prefix):
        op = model.log[i]
        kind = op[0]
        durable = model.durable_at[i] < prefix
        if kind in ("datasync", "dirsync"):
            continue
        if kind in ("write", "truncate"):
            ino = op[1]
            buf = data.setdefault(ino, bytearray())
            if kind == "truncate":
                keep = durable or policy == "all" or (rng is not None and rng.random() < 0.5)
                if keep or policy == "zeros":
                    _resize(buf, op[2])
                continue
            offset, payload = op[2], op[3]
            if durable or policy == "all":
                _write(buf, offset, payload)
            elif policy == "zeros":
                _write(buf, offset, bytes(len(payload)))
            elif rng is not None:
                roll = rng.random()
                if roll < 0.4:
                    _write(buf, offset, payload)
                elif roll < 0.7 and len(payload) > SECTOR:
                    cut = rng.randrange(1, -(-len(payload) // SECTOR)) * SECTOR
                    _write(buf, offset, payload[:cut])  # torn at a sector boundary
            continue
        keep_dir = durable or policy in ("all", "meta", "zeros")
        if not keep_dir and rng is not None:
            keep_dir = rng.random() < 0.5
        if not keep_dir:
            continue
        if kind == "mkdir":
            names.setdefault(op[1], DIR)
        elif kind == "create":
            names.setdefault(op[1], op[2])
            data.setdefault(op[2], bytearray())
        elif kind == "rename":
            moved = names.pop(op[1], None)
            if moved is not None:
                names[op[2]] = moved
        elif kind == "unlink":
            names.pop(op[1], None)
    base = model.base.rstrip(os.sep) + os.sep
    memo: dict[str, bool] = {model.base: True}

    def reachable(directory: str) -> bool:
        known = memo.get(directory)
        if known is None:
            known = names.get(directory) == DIR and reachable(os.path.dirname(directory))
            memo[directory] = known
        return known

    out: dict[str, bytes | None] = {}
    for path, ino in names.items():
        if reachable(os.path.dirname(path)):
            out[path[len(base) :]] = None if ino == DIR else bytes(data.get(ino, b""))
    return out


def _resize(buf: bytearray, length: int) -> None:
    if length < len(buf):
        del buf[length:]
    else:
        buf.extend(bytes(length - len(buf)))


def _write(buf: bytearray, offset: int, payload: bytes) -> None:
    if len(buf) < offset:
        buf.extend(bytes(offset - len(buf)))
    buf[offset : offset + len(payload)] = payload


def essential(state: dict[str, bytes | None]) -> dict[str, bytes | None]:
    """``state`` without empty fan-out directories (a directory named by a number, holding
    nothing): reading through a missing one is the same miss as through an empty one, and a
    writer recreates it, so the 256 created with an array do not multiply the states."""
    parents = {os.path.dirname(rel) for rel in state}
    return {
        rel: content
        for rel, content in state.items()
        if not (content is None and rel not in parents and os.path.basename(rel).isdigit())
    }


def fingerprint(state: dict[str, bytes | None]) -> str:
    """A digest of a crash state (equal digests: identical states, checked once)."""
    h = hashlib.sha256()
    for rel in sorted(state):
        content = state[rel]
        h.update(rel.encode() + b"\0")
        h.update(b"D" if content is None else hashlib.sha256(content).digest())
    return h.hexdigest()


def materialize(state: dict[str, bytes | None], target: Path) -> None:
    """Write a crash state below ``target`` (which must not exist) with plain file operations."""
    target.mkdir(mode=0o700)
    for rel in sorted(state, key=lambda r: r.count(os.sep)):
        content = state[rel]
        path = target / rel
        if content is None:
            path.mkdir(mode=0o700, exist_ok=True)
        else:
            path.write_bytes(content)
            path.chmod(0o600)

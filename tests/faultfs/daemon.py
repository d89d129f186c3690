"""The faultfs daemon: a fusepy passthrough of a backing directory whose operations pass
:class:`~tests.faultfs.gate.Gate` first, run as its own process.

    python -m tests.faultfs.daemon BACKING MOUNT CONTROL_FD FREEZE_LIMIT_S

Its own process because a frozen operation blocks the FUSE thread that serves it: in the
test's process, any access to the mount by the test itself (or by Python's import machinery,
a garbage collector closing a file) would then wait on a thread of the same process. libfuse
runs every request on a worker thread of its own (fuse_loop_mt starts more as they block), so
a frozen operation holds one thread and never the others or the control channel.

Control: one JSON document per line on the socket ``CONTROL_FD`` (the other end is the test's
:class:`~tests.faultfs.handle.FaultFS`): ``{"cmd": "freeze"|"delay"|"thaw"|"clear"|"stats"}``
with ``ops``, ``glob`` and ``seconds`` as :class:`Gate` takes them; one reply line each,
``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``. The first line the daemon sends is
``{"ready": true}``, once the kernel's INIT arrived (the mount answers). When the socket
closes (the test process ended, whatever way) the daemon lifts every rule and unmounts
lazily: no mount is left hung behind a test that died.

Passthrough details that matter to kvstore:

* O_DIRECT is dropped on the backing descriptors: the kernel's FUSE side already sends such
  I/O uncached, and the backing file system (tmpfs, or ext4 with F_SETFL turning O_DIRECT
  off on the FUSE descriptor only) need not take it.
* ``rename`` has no flags: libfuse 2 does not implement RENAME2, so the kernel answers
  ``renameat2(RENAME_NOREPLACE)`` with EINVAL, as on GlusterFS; kvstore then publishes with
  ``link`` + ``unlink`` (kvstore/io/rename.py), which this file system passes through.
* ``create`` passes O_EXCL to the backing ``open``: the exclusive create is atomic.
* Mount options: attribute, entry and negative caches off (every lookup reaches the daemon,
  as on a network mount), ``hard_remove`` (no ``.fuse_hidden*`` files in the store's
  directories), ``use_ino`` (real inode numbers), big writes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import fuse  # type: ignore[import-untyped]  # fusepy: no type information

from tests.faultfs.gate import Gate
from tests.faultfs.mounts import lazy_unmount

MOUNT_OPTIONS: dict[str, Any] = {
    "fsname": "faultfs",
    "subtype": "faultfs",  # the kernel names the type "fuse.faultfs"
    "attr_timeout": 0,
    "entry_timeout": 0,
    "negative_timeout": 0,
    "hard_remove": True,
    "use_ino": True,
    "big_writes": True,
}
UTIME_NOW = (1 << 30) - 1  # linux/stat.h: utimensat's special nanosecond values
UTIME_OMIT = (1 << 30) - 2
_NO_DIRECT = ~getattr(os, "O_DIRECT", 0)


class Passthrough:
    """The file-system operations fusepy calls (``raw_fi``: the ``fuse_file_info`` struct comes
    as is, so ``open``/``create`` see the flags and keep the backing descriptor in ``fh``).

    Not a ``fuse.Operations`` subclass: fusepy registers an operation with libfuse only where
    the object has the method, so everything not defined here is ENOSYS to the kernel."""

    use_ns = True  # times in nanoseconds, not floats
    # Operations on an open file get a NULL path (None) once the name is gone (hard_remove):
    # they work on the descriptor, as on a local file system.
    flag_nullpath_ok = 1
    flag_utime_omit_ok = 1  # utimens sees UTIME_NOW / UTIME_OMIT (handled there)

    def __init__(self, backing: str, gate: Gate, on_ready: Callable[[], None]) -> None:
        self.backing = backing
        self.gate = gate
        self.on_ready = on_ready

    def __call__(self, op: str, *args: Any) -> Any:
        """fusepy's dispatch: every operation by name."""
        return getattr(self, op)(*args)

    def _full(self, path: str) -> str:
        return self.backing + path

    def _pass(self, op_class: str, name: str, *paths: str) -> None:
        """The gate, with paths relative to the mount (what the rules' globs match)."""
        self.gate.passage(op_class, name, *(p.lstrip("/") for p in paths))

    # -- the mount's life

    def init(self, path: str) -> None:
        self.on_ready()

    def destroy(self, path: str) -> None:
        return None

    # -- lookups

    def getattr(self, path: str, fi: Any = None) -> dict[str, int]:
        self._pass("lookup", "getattr", path or "")
        # fusepy passes a NULL pointer (false), not None, when no file is open
        st = os.fstat(fi.fh) if fi else os.lstat(self._full(path))
        keys = ("st_mode", "st_ino", "st_nlink", "st_uid", "st_gid", "st_size", "st_blocks")
        attrs = {k: getattr(st, k) for k in keys}
        attrs.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        attrs["st_blksize"] = st.st_blksize
        return attrs

    def access(self, path: str, amode: int) -> None:
        self._pass("lookup", "access", path)
        if not os.access(self._full(path), amode, follow_symlinks=False):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES))

    def readlink(self, path: str) -> str:
        self._pass("lookup", "readlink", path)
        return os.readlink(self._full(path))

    def statfs(self, path: str) -> dict[str, int]:
        self._pass("lookup", "statfs", path)
        sv = os.statvfs(self._full(path))
        keys = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree")
        return {k: getattr(sv, k) for k in (*keys, "f_favail", "f_namemax")}

    def opendir(self, path: str) -> int:
        self._pass("lookup", "opendir", path)
        fd = os.open(self._full(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        os.close(fd)  # checked it opens; readdir lists by path
        return 0

    def readdir(self, path: str, fh: int) -> list[Any]:
        self._pass("lookup", "readdir", path)
        # Each entry's type travels with it (d_type), as a local or GlusterFS listing gives
        # it: a listing then costs no extra lookups through the mount.
        with os.scandir(self._full(path)) as it:
            listed = [(e.name, {"st_ino": e.inode(), "st_mode": _kind(e)}, 0) for e in it]
        return [".", "..", *listed]

    def releasedir(self, path: str, fh: int) -> None:
        return None

    # -- open and data

    def open(self, path: str, fi: Any) -> int:
        self._pass("lookup", "open", path)
        flags = fi.flags & _NO_DIRECT & ~(os.O_CREAT | os.O_EXCL)
        fi.fh = os.open(self._full(path), flags | os.O_CLOEXEC)
        return 0

    def create(self, path: str, mode: int, fi: Any) -> int:
        self._pass("write", "create", path)
        flags = (fi.flags & _NO_DIRECT) | os.O_CREAT | os.O_CLOEXEC  # O_EXCL kept: atomic
        fi.fh = os.open(self._full(path), flags, mode)
        return 0

    def read(self, path: str, size: int, offset: int, fi: Any) -> bytes:
        self._pass("read", "read", path or "")
        return os.pread(fi.fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fi: Any) -> int:
        self._pass("write", "write", path or "")
        return os.pwrite(fi.fh, data, offset)

    def truncate(self, path: str, length: int, fi: Any = None) -> None:
        self._pass("write", "truncate", path or "")
        if fi:
            os.ftruncate(fi.fh, length)
        else:
            os.truncate(self._full(path), length)

    def flush(self, path: str, fi: Any) -> None:
        return None  # close(2): not gated, nothing buffered here

    def release(self, path: str, fi: Any) -> None:
        os.close(fi.fh)

    def fsync(self, path: str, datasync: int, fi: Any) -> None:
        self._pass("write", "fsync", path or "")
        (os.fdatasync if datasync else os.fsync)(fi.fh)

    def fsyncdir(self, path: str, datasync: int, fh: int) -> None:
        self._pass("write", "fsyncdir", path)
        fd = os.open(self._full(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- names

    def mkdir(self, path: str, mode: int) -> None:
        self._pass("write", "mkdir", path)
        os.mkdir(self._full(path), mode)

    def mknod(self, path: str, mode: int, dev: int) -> None:
        self._pass("write", "mknod", path)
        os.mknod(self._full(path), mode, dev)

    def unlink(self, path: str) -> None:
        self._pass("write", "unlink", path)
        os.unlink(self._full(path))

    def rmdir(self, path: str) -> None:
        self._pass("write", "rmdir", path)
        os.rmdir(self._full(path))

    def rename(self, old: str, new: str) -> None:
        self._pass("write", "rename", old, new)
        os.rename(self._full(old), self._full(new))

    def link(self, target: str, source: str) -> None:
        """fusepy's order: the new name ``target`` for the existing ``source``."""
        self._pass("write", "link", target, source)
        os.link(self._full(source), self._full(target))

    def symlink(self, target: str, source: str) -> None:
        """fusepy's order: the link ``target`` (a path in the mount) holding ``source``."""
        self._pass("write", "symlink", target)
        os.symlink(source, self._full(target))

    # -- attributes

    def chmod(self, path: str, mode: int) -> None:
        self._pass("write", "chmod", path)
        os.chmod(self._full(path), mode, follow_symlinks=False)

    def chown(self, path: str, uid: int, gid: int) -> None:
        self._pass("write", "chown", path)
        os.chown(self._full(path), uid, gid, follow_symlinks=False)

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> None:
        self._pass("write", "utimens", path)
        full = self._full(path)
        if times is None:
            os.utime(full, follow_symlinks=False)
            return
        # libfuse 2 hands utimensat's UTIME_NOW / UTIME_OMIT on as (0 s, that many ns).
        st = os.lstat(full)
        now = time.time_ns()
        atime, mtime = (
            now if t == UTIME_NOW else current if t == UTIME_OMIT else t
            for t, current in zip(times, (st.st_atime_ns, st.st_mtime_ns), strict=True)
        )
        os.utime(full, ns=(atime, mtime), follow_symlinks=False)


def _kind(entry: os.DirEntry[str]) -> int:
    """The file-type bits of a directory entry (from d_type where the backing gives it)."""
    if entry.is_symlink():
        return stat.S_IFLNK
    if entry.is_dir(follow_symlinks=False):
        return stat.S_IFDIR
    if entry.is_file(follow_symlinks=False):
        return stat.S_IFREG
    try:
        return stat.S_IFMT(entry.stat(follow_symlinks=False).st_mode)
    except OSError:
        return 0


class Control:
    """The daemon's end of the control socket: commands in, replies (and "ready") out."""

    def __init__(self, sock: socket.socket, gate: Gate, mount: str) -> None:
        self.sock = sock
        self.gate = gate
        self.mount = mount
        self._send_lock = threading.Lock()

    def send(self, doc: dict[str, Any]) -> None:
        with self._send_lock, contextlib.suppress(OSError):
            self.sock.sendall(json.dumps(doc).encode() + b"\n")

    def serve(self) -> None:
        """Answer commands until the socket closes; then leave a healthy, unmounted mount."""
        with self.sock.makefile("rb") as lines:
            for line in lines:
                self.send(self.answer(line))
        self.gate.clear()  # the test is gone: nothing may stay frozen
        lazy_unmount(self.mount)
        # The loop ends once the kernel drops the mount; a user keeping a file open there
        # would keep it alive, so the process ends regardless after a grace period.
        time.sleep(10)
        os._exit(0)

    def answer(self, line: bytes) -> dict[str, Any]:
        """The reply to one command line."""
        try:
            return {"ok": True, **self._run(json.loads(line))}
        except (ValueError, KeyError, TypeError) as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}

    def _run(self, doc: dict[str, Any]) -> dict[str, Any]:
        cmd = doc["cmd"]
        if cmd == "freeze":
            self.gate.freeze(doc["ops"], doc.get("glob"))
        elif cmd == "delay":
            self.gate.delay(doc["ops"], float(doc["seconds"]), doc.get("glob"))
        elif cmd == "thaw":
            self.gate.thaw()
        elif cmd == "clear":
            self.gate.clear()
        elif cmd == "stats":
            return dict(self.gate.stats())
        else:
            raise ValueError(f"unknown command {cmd!r}")
        return {}


def main(argv: list[str]) -> int:
    backing, mount, control_fd, freeze_limit = argv
    os.umask(0)  # the kernel applied the caller's umask already: modes pass through as sent
    gate = Gate(float(freeze_limit))
    control = Control(socket.socket(fileno=int(control_fd)), gate, mount)
    operations = Passthrough(os.path.realpath(backing), gate, lambda: control.send({"ready": True}))
    threading.Thread(target=control.serve, name="faultfs-control", daemon=True).start()
    fuse.FUSE(operations, mount, raw_fi=True, foreground=True, **MOUNT_OPTIONS)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

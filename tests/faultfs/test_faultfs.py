"""faultfs itself: a faithful passthrough for what kvstore does, faults that hold and release
exactly the operations asked for, and a teardown that never leaves anything hung."""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path

import pytest

from kvstore.io.align import ALIGN
from kvstore.io.buffers import aligned_buffer
from kvstore.io.fileio import O_DIRECT, filesystem_type
from kvstore.io.host import probe_direct_io
from kvstore.io.rename import rename_noreplace, renameat2_noreplace
from tests.faultfs.child import Child
from tests.faultfs.fixture import mounted
from tests.faultfs.handle import FaultFS

READER = "import sys; print(open(sys.argv[1]).read())"


def test_files_and_directories_pass_through(faultfs: FaultFS) -> None:
    """Exclusive create, vectored writes and reads, syncs, names, links and times."""
    m = faultfs.mount
    os.mkdir(m / "d", 0o700)
    fd = os.open(m / "d" / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    assert os.pwritev(fd, [b"abc", b"defg"], 10) == 7
    os.fdatasync(fd)
    os.fsync(fd)
    os.close(fd)
    with pytest.raises(FileExistsError):
        os.open(m / "d" / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    dir_fd = os.open(m / "d", os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(dir_fd)  # kvstore syncs the directory after a publish
    os.close(dir_fd)
    assert (faultfs.backing / "d" / "f").read_bytes() == b"\0" * 10 + b"abcdefg"
    fd = os.open(m / "d" / "f", os.O_RDONLY)
    buffers = [bytearray(3), bytearray(4)]
    assert os.preadv(fd, buffers, 10) == 7 and buffers == [b"abc", b"defg"]
    os.close(fd)
    st = os.lstat(m / "d" / "f")
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 17
    assert st.st_ino == os.lstat(faultfs.backing / "d" / "f").st_ino  # use_ino
    os.utime(m / "d" / "f", ns=(1_000_000_000_123, 2_000_000_000_456))
    assert os.stat(m / "d" / "f").st_mtime_ns == 2_000_000_000_456
    os.link(m / "d" / "f", m / "d" / "g")
    assert os.stat(m / "d" / "g").st_nlink == 2
    os.symlink("f", m / "d" / "s")
    assert os.readlink(m / "d" / "s") == "f" and stat.S_ISLNK(os.lstat(m / "d" / "s").st_mode)
    with pytest.raises(OSError, match="Too many levels"):
        os.open(m / "d" / "s", os.O_RDONLY | os.O_NOFOLLOW)
    assert sorted(os.listdir(m / "d")) == ["f", "g", "s"]
    assert {e.name: e.is_dir() for e in os.scandir(m)} == {"d": True}
    os.rename(m / "d" / "g", m / "d" / "h")
    for name in ("f", "h", "s"):
        os.unlink(m / "d" / name)
    os.rmdir(m / "d")
    assert os.listdir(faultfs.backing) == []
    assert os.statvfs(m).f_blocks == os.statvfs(faultfs.backing).f_blocks
    assert filesystem_type(m) == "fuse.faultfs"


def test_an_unlinked_open_file_leaves_no_hidden_name(faultfs: FaultFS) -> None:
    """hard_remove: libfuse's ``.fuse_hidden*`` renames would be foreign files to verify."""
    path = faultfs.mount / "f"
    path.write_bytes(b"x")
    with open(path, "rb") as f:
        os.unlink(path)
        assert os.listdir(faultfs.mount) == []
        assert f.read() == b"x"


def test_rename_noreplace_falls_back_to_link(faultfs: FaultFS) -> None:
    """libfuse 2 has no RENAME2: the kernel refuses the flag with EINVAL (as GlusterFS does),
    and kvstore's rename_noreplace publishes with link + unlink instead."""
    m = faultfs.mount
    (m / "a").write_bytes(b"a")
    (m / "b").write_bytes(b"b")
    assert renameat2_noreplace(bytes(m / "a"), bytes(m / "c")) == errno.EINVAL
    before = faultfs.stats()["ops"]
    rename_noreplace(str(m / "a"), str(m / "c"))
    assert not (m / "a").exists() and (m / "c").read_bytes() == b"a"
    with pytest.raises(FileExistsError):
        rename_noreplace(str(m / "b"), str(m / "c"))
    assert (m / "b").read_bytes() == b"b" and (m / "c").read_bytes() == b"a"
    ops = faultfs.stats()["ops"]
    # published by link (the refused one may never reach the daemon: the kernel's lookup
    # finds the name first), never by a plain rename
    assert ops.get("link", 0) > before.get("link", 0)
    assert ops.get("rename", 0) == before.get("rename", 0)


def test_o_direct_through_the_mount(faultfs: FaultFS) -> None:
    """O_DIRECT opens work (the backing descriptor drops the flag); kvstore's probe passes
    with direct_io=on, and "auto" leaves FUSE buffered without probing."""
    path = faultfs.mount / "direct"
    buffer = aligned_buffer(ALIGN)
    buffer[:] = ord("z")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_DIRECT, 0o600)
    assert os.pwritev(fd, [buffer.data], 0) == ALIGN
    os.close(fd)
    fd = os.open(path, os.O_RDONLY | O_DIRECT)
    back = aligned_buffer(ALIGN)
    assert os.preadv(fd, [back.data], 0) == ALIGN and back.tobytes() == b"z" * ALIGN
    os.close(fd)
    assert probe_direct_io(faultfs.mount, "on").enabled
    auto = probe_direct_io(faultfs.mount, "auto")
    assert not auto.enabled and "fuse.faultfs" in auto.reason


def test_a_frozen_read_blocks_a_reader_until_thaw(faultfs: FaultFS) -> None:
    (faultfs.mount / "f").write_text("payload")
    faultfs.freeze("read")
    child = Child.python(READER, str(faultfs.mount / "f"))
    faultfs.wait_blocked("read")
    assert not child.exited_within(1.0)  # held, not slow
    thawed = time.monotonic()
    faultfs.thaw()
    assert child.wait(20) == 0 and child.out == ["payload"]
    after = time.monotonic() - thawed
    print(f"reader held {thawed - child.started:.1f} s, done {after:.2f} s after thaw")


def test_a_freeze_holds_only_its_class_and_glob(faultfs: FaultFS) -> None:
    for name in ("held", "free"):
        (faultfs.mount / name).mkdir()
        (faultfs.mount / name / "f").write_text(name)
    faultfs.freeze("lookup", path_glob="held/*")
    free = Child.python(READER, str(faultfs.mount / "free" / "f"))
    held = Child.python(READER, str(faultfs.mount / "held" / "f"))
    assert free.wait(20) == 0 and free.out == ["free"]
    faultfs.wait_blocked("lookup")
    assert not held.exited_within(0.5)
    # the test process may use the rest of the mount meanwhile
    assert (faultfs.mount / "free" / "f").read_text() == "free"
    faultfs.thaw()
    assert held.wait(20) == 0 and held.out == ["held"]


def test_a_frozen_write_holds_the_create(faultfs: FaultFS) -> None:
    faultfs.freeze("write")
    writer = Child.python("import sys; open(sys.argv[1], 'x').write('w')", str(faultfs.mount / "w"))
    faultfs.wait_blocked("write")
    assert not (faultfs.backing / "w").exists()  # the backing may be looked at while frozen
    faultfs.thaw()
    assert writer.wait(20) == 0 and (faultfs.backing / "w").read_text() == "w"


def test_delay_slows_each_operation(faultfs: FaultFS) -> None:
    path = faultfs.mount / "f"
    path.write_text("x")
    faultfs.delay("read", 0.5)
    start = time.monotonic()
    assert path.read_text() == "x"  # a delayed mount does not deadlock the test process
    slow = time.monotonic() - start
    faultfs.delay("read", 0)
    start = time.monotonic()
    assert path.read_text() == "x"
    fast = time.monotonic() - start
    assert slow >= 0.5 and fast < slow - 0.25, (slow, fast)
    print(f"read with a 0.5 s delay: {slow:.2f} s; without: {fast:.3f} s")


def test_teardown_releases_a_process_held_in_the_mount(tmp_path: Path) -> None:
    """Closing while frozen thaws first: the held reader finishes, the mount is gone."""
    with mounted(tmp_path) as fs:
        (fs.mount / "f").write_text("late")
        fs.freeze("all")
        child = Child.python(READER, str(fs.mount / "f"))
        fs.wait_blocked()
    assert not fs.mounted()
    assert child.wait(20) == 0 and child.out == ["late"]
    assert fs._proc.returncode == 0  # the daemon ended with its mount


def test_a_wedged_daemon_is_killed_and_its_waiters_fail(tmp_path: Path) -> None:
    """When the daemon does not answer, close() kills it: the kernel then fails the held
    requests (ENOTCONN / ECONNABORTED) instead of keeping the process asleep."""
    with mounted(tmp_path) as fs:
        (fs.mount / "f").write_text("x")
        fs.freeze("lookup")
        child = Child.python(READER, str(fs.mount / "f"))
        fs.wait_blocked("lookup")
        fs._proc.kill()  # as a daemon that crashed, or was killed by an operator
        assert child.wait(20) == 1
        assert "Transport endpoint is not connected" in "\n".join(child.err) or any(
            "aborted" in line for line in child.err
        ), child.err
    assert not fs.mounted()


def test_the_daemon_cleans_up_when_its_test_is_gone(tmp_path: Path) -> None:
    """The control socket closing (the test process died) lifts every freeze and unmounts."""
    with mounted(tmp_path) as fs:
        (fs.mount / "f").write_text("x")
        fs.freeze("all")
        child = Child.python(READER, str(fs.mount / "f"))
        fs.wait_blocked()
        assert fs._sock is not None
        fs._lines.close()
        fs._sock.close()  # as the kernel closes it when the test process ends
        fs._sock = fs._lines = None
        assert child.wait(20) == 0 and child.out == ["x"]
        deadline = time.monotonic() + 20
        while fs.mounted() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not fs.mounted()
        fs._proc.wait(timeout=20)

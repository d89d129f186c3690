"""The file-system primitives that keep a hostile tree harmless (issue 14, items 2-4).

* no open blocks: a FIFO where a file belongs is refused at once, not waited on;
* no symbolic link below the root is followed when a directory is entered or created;
* a file is moved or removed only while it is still the file that was read.

Each open that could block runs under ``finishes`` (a deadline), so a regression fails the
test instead of hanging the suite.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.errors import EntryKindError
from kvstore.io import entries
from kvstore.io.entries import file_id, move_if_same, open_dir_nofollow, remove_if_same
from kvstore.io.fileio import FileIO
from tests.store.test_hostile_store import finishes


def test_open_of_a_fifo_does_not_block(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(EntryKindError, match="expected a regular file, got a FIFO"):
        finishes(lambda: FileIO().open_regular(str(fifo)))


@pytest.mark.parametrize("kind", ["fifo", "dir", "symlink"])
def test_exists_is_true_only_for_a_regular_file(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "block"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"x")
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "dir":
        target.mkdir()
    else:
        target.symlink_to(elsewhere)
    with pytest.raises(EntryKindError, match="expected a regular file"):
        FileIO().exists(str(target))
    assert FileIO().exists(str(elsewhere))
    assert not FileIO().exists(str(tmp_path / "absent"))


def test_open_regular_names_the_path_and_closes(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(EntryKindError, match=f"{tmp_path}/d: expected a regular file, got a dir"):
        FileIO().open_regular(str(tmp_path / "d"))
    assert len(os.listdir("/proc/self/fd")) == before


def test_open_dir_refuses_a_link_at_any_depth(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    (root / "ns").mkdir(parents=True)
    (root / "ns" / "quarantine").symlink_to(outside)
    (root / "linked").symlink_to(root / "ns")
    for parts in (["ns", "quarantine"], ["linked", "quarantine"], ["ns", "quarantine", "x"]):
        with pytest.raises(EntryKindError, match="expected a directory, got a symbolic link"):
            open_dir_nofollow(root, parts, create_mode=0o700)
    assert list(outside.iterdir()) == []  # nothing created through the link


def test_open_dir_refuses_a_file_or_fifo(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(EntryKindError, match="got a regular file"):
        open_dir_nofollow(tmp_path, ["file"], create_mode=0o700)
    with pytest.raises(EntryKindError, match="got a FIFO"):
        finishes(lambda: open_dir_nofollow(tmp_path, ["fifo"], create_mode=0o700))


def test_open_dir_creates_and_accepts_a_linked_root(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "root").symlink_to(real)  # the root itself may be a link
    fd = open_dir_nofollow(tmp_path / "root", ["ns", "quarantine"], create_mode=0o700)
    os.close(fd)
    assert (real / "ns" / "quarantine").is_dir()
    with pytest.raises(FileNotFoundError):
        open_dir_nofollow(tmp_path / "root", ["other"])
    with pytest.raises(ValueError, match="one plain name"):
        open_dir_nofollow(tmp_path / "root", [".."])


def test_makedirs_refuses_a_link_created_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    target = tmp_path / "store" / "a" / "b"
    real_mkdir = os.mkdir

    def plant_then_mkdir(path: Any, mode: int = 0o777, **kw: Any) -> None:
        if os.fspath(path) == str(tmp_path / "store" / "a"):
            os.symlink(outside, path)  # another party made a link where our directory goes
        real_mkdir(path, mode, **kw)

    monkeypatch.setattr(os, "mkdir", plant_then_mkdir)
    with pytest.raises(EntryKindError, match="expected a directory, got a symbolic link"):
        FileIO().makedirs(str(target))
    assert list(outside.iterdir()) == []


class _SwapBeforeRename(FileIO):
    """Replaces the name by another file just before the first rename (the race of item 4)."""

    def __init__(self, swap: Callable[[], None]) -> None:
        self.swap: Callable[[], None] | None = swap

    def rename_at(self, src_dir_fd: int | None, src: str, dst_dir_fd: int | None, dst: str) -> None:
        if self.swap is not None:
            swap, self.swap = self.swap, None
            swap()
        super().rename_at(src_dir_fd, src, dst_dir_fd, dst)


def _replace(path: Path, content: bytes) -> None:
    path.unlink()
    path.write_bytes(content)


def test_move_if_same_moves_the_file_read(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"bad")
    read = file_id(os.lstat(tmp_path / "a"))
    assert move_if_same(FileIO(), None, str(tmp_path / "a"), None, str(tmp_path / "q"), read) == (
        "moved"
    )
    assert (tmp_path / "q").read_bytes() == b"bad" and not (tmp_path / "a").exists()
    assert move_if_same(FileIO(), None, str(tmp_path / "a"), None, str(tmp_path / "r"), read) == (
        "gone"
    )


def test_move_if_same_leaves_a_replaced_file(tmp_path: Path) -> None:
    name = tmp_path / "a"
    name.write_bytes(b"bad")
    read = file_id(os.lstat(name))
    with name.open("rb"):  # the file read stays alive: its inode number cannot be reused
        _replace(name, b"good")  # replaced before the caller looked again
        assert move_if_same(FileIO(), None, str(name), None, str(tmp_path / "q"), read) == (
            "replaced"
        )
    assert name.read_bytes() == b"good" and not (tmp_path / "q").exists()


def test_move_if_same_puts_back_a_file_replaced_during_the_rename(tmp_path: Path) -> None:
    name = tmp_path / "a"
    name.write_bytes(b"bad")
    read = file_id(os.lstat(name))
    held = name.open("rb")  # keep the inode alive so the new file cannot reuse its number
    try:
        fio = _SwapBeforeRename(lambda: _replace(name, b"good"))
        assert move_if_same(fio, None, str(name), None, str(tmp_path / "q"), read) == "replaced"
    finally:
        held.close()
    assert name.read_bytes() == b"good" and not (tmp_path / "q").exists()


def test_remove_if_same(tmp_path: Path) -> None:
    name = tmp_path / "a"
    name.write_bytes(b"bad")
    read = file_id(os.lstat(name))
    held = name.open("rb")
    try:
        fio = _SwapBeforeRename(lambda: _replace(name, b"good"))
        assert remove_if_same(fio, None, str(name), read) == "replaced"
        assert name.read_bytes() == b"good"
        assert remove_if_same(FileIO(), None, str(name), read) == "replaced"
        assert remove_if_same(FileIO(), None, str(name), file_id(os.lstat(name))) == "removed"
    finally:
        held.close()
    assert os.listdir(tmp_path) == []


def test_describe_os_error_drops_the_descriptor_number(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as info:
            os.fdopen(fd, "rb")
    finally:
        os.close(fd)
    assert entries.describe_os_error(info.value) == "[Errno 21] Is a directory"

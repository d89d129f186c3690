"""The server side of a hostile tree (issue 14): what a reader and a writer do when entries of
the store are links, FIFOs, sockets or directories, or change under them.

* item 2: ``<ns>/quarantine`` a symbolic link (or a file, or a FIFO): a corrupt block is never
  moved out of the root, and never served;
* item 3: a FIFO, socket, directory or link at a block's name is absent for ``contains`` and a
  logged miss for ``read_blocks``; a FIFO at a ``zarr.json`` is a clear error, never a hang;
* item 4: a reader quarantines the file it read, never a good copy published under the name
  since; a writer whose directory sync failed withdraws its own file, never another's;
* item 8: errors name the file, not a descriptor number.

Anything that could block runs under :func:`finishes` (a deadline), so a regression fails
instead of hanging the suite.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.errors import StoreFormatError
from kvstore.io.entries import FileId
from kvstore.io.fileio import FileIO
from kvstore.store.group_store import GroupStore
from kvstore.store.page_store import KVStore
from kvstore.store.paths import QUARANTINE
from kvstore.store.read import Reader
from kvstore.store.types import BlockRead, BlockWrite, ReadStatus, WriteStatus
from tests.helpers import StoreFactory, block_bytes, block_hash, make_small_identity

DEADLINE_S = 10.0


def finishes(fn: Callable[[], Any]) -> Any:
    """``fn()``'s result or exception; fails the test if it does not return in time (a
    blocked ``open`` of a FIFO is left behind in a daemon thread)."""
    outcome: list[tuple[str, Any]] = []

    def run() -> None:
        try:
            outcome.append(("ok", fn()))
        except BaseException as exc:  # handed back to the test
            outcome.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    if thread.is_alive():
        pytest.fail(f"blocked for {DEADLINE_S} s (an open that waits on a FIFO?)")
    kind, value = outcome[0]
    if kind == "raised":
        raise value
    return value


def _write(group: GroupStore, i: int) -> tuple[bytes, np.ndarray]:
    h = block_hash(i, "hostile")
    data = block_bytes(group.layout, i)
    assert group.write_blocks([BlockWrite(h, data)])[0].status is WriteStatus.WRITTEN
    return h, data


def _read(group: GroupStore, h: bytes) -> tuple[ReadStatus, np.ndarray]:
    out = np.zeros(group.layout.block_nbytes, dtype=np.uint8)
    (result,) = finishes(lambda: group.read_blocks([BlockRead(h, out)]))
    return result.status, out


def _corrupt(path: str | Path) -> None:
    """Flip a byte of the first inner chunk (a checksum mismatch; raw and compressed)."""
    offset = 4096  # format v1: the header is one 4 KiB page, the first chunk follows
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def _republish(path: str, content: bytes) -> None:
    """Another process's copy under ``path``: a new file (new inode), published by rename."""
    tmp = path + ".other"
    Path(tmp).write_bytes(content)
    os.rename(tmp, path)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.fixture
def group(make_store: StoreFactory) -> GroupStore:
    return make_store().namespace(make_small_identity()).group(0)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory outside the store root that nothing may ever reach."""
    directory = tmp_path / "outside"
    directory.mkdir()
    return directory


def _quarantine_path(group: GroupStore) -> Path:
    return group.array_path.parent / QUARANTINE


# -- item 2: quarantine through a link ----------------------------------------------------------


def test_quarantine_link_does_not_take_the_block_out_of_the_root(
    group: GroupStore, outside: Path, caplog: pytest.LogCaptureFixture
) -> None:
    h, _ = _write(group, 1)
    path = group.path_of(h)
    _corrupt(path)
    _quarantine_path(group).symlink_to(outside, target_is_directory=True)
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        status, _ = _read(group, h)
    assert status is ReadStatus.CORRUPT
    assert list(outside.iterdir()) == []  # nothing moved through the link
    assert not os.path.lexists(path)  # removed instead: never served again
    (line,) = _warnings(caplog)
    assert "is corrupt" in line and "symbolic link" in line and "removed" in line, line
    assert _read(group, h)[0] is ReadStatus.MISS


@pytest.mark.parametrize("kind", ["file", "fifo"])
def test_quarantine_not_a_directory_removes_the_block(
    group: GroupStore, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    h, _ = _write(group, 2)
    _corrupt(group.path_of(h))
    if kind == "file":
        _quarantine_path(group).write_bytes(b"not a directory")
    else:
        os.mkfifo(_quarantine_path(group))
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        status, _ = _read(group, h)
    assert status is ReadStatus.CORRUPT
    assert not os.path.lexists(group.path_of(h))
    (line,) = _warnings(caplog)
    assert "cannot quarantine" in line and "expected a directory" in line, line


def test_quarantine_into_a_real_directory_still_works(group: GroupStore) -> None:
    h, _ = _write(group, 3)
    bad = Path(group.path_of(h))
    _corrupt(bad)
    content = bad.read_bytes()
    assert _read(group, h)[0] is ReadStatus.CORRUPT
    (moved,) = _quarantine_path(group).iterdir()
    assert moved.read_bytes() == content and not bad.exists()


# -- item 3: non-regular files at a block's name -----------------------------------------------


def _plant(path: str, kind: str, elsewhere: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        os.mkdir(path)
    elif kind == "symlink":
        os.symlink(elsewhere, path)
    else:
        sock = socket.socket(socket.AF_UNIX)
        monkeypatch.chdir(os.path.dirname(path))  # AF_UNIX paths are short
        sock.bind(os.path.basename(path))
        try:
            yield
        finally:
            sock.close()
        return
    yield


@pytest.mark.parametrize("kind", ["fifo", "dir", "socket", "symlink"])
def test_non_regular_block_is_a_logged_miss_and_never_blocks(
    make_store: StoreFactory,
    kind: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    group = make_store().namespace(make_small_identity()).group(0)
    h, _ = _write(group, 4)
    good, _ = _write(group, 5)  # a valid block a link points at
    path = group.path_of(h)
    for _ in _plant(path, kind, group.path_of(good), monkeypatch):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvstore"):
            assert finishes(lambda: group.contains([h, good])) == [False, True]
        (line,) = _warnings(caplog)
        assert "expected a regular file" in line, line
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvstore"):
            status, _ = _read(group, h)
        assert status is ReadStatus.ERROR  # a miss, logged; not quarantined
        (line,) = _warnings(caplog)
        assert "served as a miss" in line and "expected a regular file" in line, line
        assert os.path.lexists(path)  # left where it is: it is not a block file
        assert not _quarantine_path(group).exists()
        assert finishes(lambda: group.longest_prefix([h])) == 0


def test_fifo_at_a_compressed_block_is_a_miss(make_store: StoreFactory) -> None:
    group = make_store(compression="lz4").namespace(make_small_identity()).group(0)
    h, _ = _write(group, 6)
    path = group.path_of(h)
    os.unlink(path)
    os.mkfifo(path)
    assert finishes(lambda: group.contains([h])) == [False]
    assert _read(group, h)[0] is ReadStatus.ERROR
    with pytest.raises(OSError, match="expected a regular file, got a FIFO"):
        finishes(lambda: group.read_header(h))


def test_write_over_a_fifo_fails_cleanly(group: GroupStore) -> None:
    h = block_hash(7, "hostile")
    os.mkfifo(group.path_of(h))
    (result,) = finishes(lambda: group.write_blocks([BlockWrite(h, block_bytes(group.layout, 7))]))
    assert result.status is WriteStatus.FAILED and "expected a regular file" in result.error


# -- item 3: FIFOs at the documents ----------------------------------------------------------------


def _fifo_instead(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def test_fifo_at_the_root_document_is_an_error_not_a_hang(
    make_store: StoreFactory, root: Path
) -> None:
    make_store().close()
    _fifo_instead(root / "zarr.json")
    with pytest.raises(StoreFormatError, match=r"zarr\.json: expected .*got a FIFO"):
        finishes(make_store)


@pytest.mark.parametrize("level", ["namespace", "array"])
def test_fifo_at_a_namespace_document_is_an_error_not_a_hang(
    make_store: StoreFactory, level: str
) -> None:
    identity = make_small_identity()
    ns = make_store().namespace(identity)
    doc = ns.path / "zarr.json" if level == "namespace" else ns.path / "g0" / "zarr.json"
    _fifo_instead(doc)
    store = make_store()
    with pytest.raises(StoreFormatError, match="got a FIFO"):
        finishes(lambda: store.namespace(identity))
    with (
        KVStore(store.config, read_only=True) as tool,
        pytest.raises(StoreFormatError, match="got a FIFO"),
    ):
        finishes(lambda: tool.open_namespace(identity.namespace))


def test_linked_namespace_directory_is_not_listed(
    make_store: StoreFactory, root: Path, outside: Path
) -> None:
    identity = make_small_identity()
    store = make_store()
    store.namespace(identity)
    (outside / "zarr.json").write_bytes((root / identity.namespace / "zarr.json").read_bytes())
    (root / "planted-0123456789ab").symlink_to(outside)
    os.mkdir(root / "fifo-0123456789ab")
    os.mkfifo(root / "fifo-0123456789ab" / "zarr.json")
    assert finishes(store.namespace_names) == [identity.namespace]


# -- item 8: the file name, not a descriptor number ------------------------------------------------


def test_document_errors_name_the_file(make_store: StoreFactory, root: Path) -> None:
    make_store().close()
    (root / "zarr.json").unlink()
    (root / "zarr.json").mkdir()
    with pytest.raises(StoreFormatError) as info:
        make_store()
    message = str(info.value)
    assert str(root / "zarr.json") in message and "got a directory" in message, message
    assert not re.search(r": \d+\)", message), message


# -- item 4: quarantine what was read ------------------------------------------------------------


def _race_before_quarantine(
    monkeypatch: pytest.MonkeyPatch, group: GroupStore, action: Callable[[], None]
) -> None:
    """Run ``action`` after the corrupt read, before the reader quarantines."""
    original = Reader.quarantine

    def raced(self: Reader, block_hash: bytes, read_id: FileId | None) -> str:
        action()
        return original(self, block_hash, read_id)

    monkeypatch.setattr(Reader, "quarantine", raced)


def test_reader_does_not_quarantine_a_copy_republished_since_its_read(
    group: GroupStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    h, data = _write(group, 8)
    path = group.path_of(h)
    good = Path(path).read_bytes()
    _corrupt(path)
    # Another reader (or verify --fix) removed the corrupt file and a writer re-published a
    # good copy - acknowledged - between this reader's read and its quarantine.
    _race_before_quarantine(monkeypatch, group, lambda: _republish(path, good))
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        status, _ = _read(group, h)
    assert status is ReadStatus.CORRUPT  # what it read was corrupt
    (line,) = _warnings(caplog)
    assert "left in place" in line, line
    monkeypatch.undo()
    status, out = _read(group, h)
    assert status is ReadStatus.HIT and np.array_equal(out, data)
    assert not _quarantine_path(group).exists() or list(_quarantine_path(group).iterdir()) == []


class _RepublishOnRename(FileIO):
    """Re-publishes a good copy of ``path`` just before the quarantine rename: the race lands
    between the reader's last look at the name and its rename."""

    def __init__(self) -> None:
        self.armed: tuple[str, bytes] | None = None

    def rename_at(self, src_dir_fd: int | None, src: str, dst_dir_fd: int | None, dst: str) -> None:
        if self.armed is not None:
            path, content = self.armed
            self.armed = None
            _republish(path, content)
        super().rename_at(src_dir_fd, src, dst_dir_fd, dst)


def test_reader_puts_back_a_copy_republished_during_its_rename(make_store: StoreFactory) -> None:
    fio = _RepublishOnRename()
    group = make_store(fio=fio).namespace(make_small_identity()).group(0)
    h, data = _write(group, 9)
    path = group.path_of(h)
    good = Path(path).read_bytes()
    _corrupt(path)
    with open(path, "rb"):  # the corrupt inode stays alive: its number cannot be reused
        fio.armed = (path, good)
        assert _read(group, h)[0] is ReadStatus.CORRUPT
    status, out = _read(group, h)
    assert status is ReadStatus.HIT and np.array_equal(out, data)
    assert list(_quarantine_path(group).iterdir()) == []


class _OtherNodeThenFailingDirSync(FileIO):
    """A directory sync that fails after another node re-published the block under its name."""

    def __init__(self) -> None:
        self.republish: Callable[[], None] | None = None

    def fsync_dir(self, path: str) -> None:
        if self.republish is not None:
            self.republish()
            self.republish = None
            raise OSError(5, "Input/output error (injected)", path)
        super().fsync_dir(path)


def test_failed_directory_sync_withdraws_only_its_own_file(make_store: StoreFactory) -> None:
    fio = _OtherNodeThenFailingDirSync()
    group = make_store(fio=fio, durability="full").namespace(make_small_identity()).group(0)
    h = block_hash(10, "hostile")
    data = block_bytes(group.layout, 10)
    path = group.path_of(h)
    theirs: list[bytes] = []
    held: list[object] = []

    def other_node() -> None:  # removed ours and published its own copy (acknowledged there)
        held.append(open(path, "rb"))  # noqa: SIM115 - our inode stays alive: its number cannot be reused
        content = Path(path).read_bytes()
        os.unlink(path)
        _republish(path, content)
        theirs.append(content)

    fio.republish = other_node
    try:
        (result,) = group.write_blocks([BlockWrite(h, data)])
    finally:
        for f in held:
            f.close()  # type: ignore[attr-defined]
    assert result.status is WriteStatus.FAILED and "directory fsync failed" in result.error
    assert theirs and Path(path).read_bytes() == theirs[0]  # the other node's copy stays
    status, out = _read(group, h)
    assert status is ReadStatus.HIT and np.array_equal(out, data)


def test_failed_directory_sync_withdraws_its_own_file(make_store: StoreFactory) -> None:
    fio = _OtherNodeThenFailingDirSync()
    group = make_store(fio=fio, durability="full").namespace(make_small_identity()).group(0)
    h = block_hash(11, "hostile")
    fio.republish = lambda: None  # nobody else: the file is ours
    (result,) = group.write_blocks([BlockWrite(h, block_bytes(group.layout, 11))])
    assert result.status is WriteStatus.FAILED
    assert not os.path.lexists(group.path_of(h))
    assert [p for p in os.listdir(group.fanout_dir(h[0])) if ".tmp-" in p] == []


def test_store_opens_through_a_linked_root(tmp_path: Path, make_store: StoreFactory) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "linked").symlink_to(real)
    group = make_store(tmp_path / "linked").namespace(make_small_identity()).group(0)
    h, _ = _write(group, 12)
    _corrupt(group.path_of(h))
    assert _read(group, h)[0] is ReadStatus.CORRUPT
    assert len(list((real / make_small_identity().namespace / QUARANTINE).iterdir())) == 1


# -- item 2: directories the store creates -----------------------------------------------------


def test_lost_fanout_is_not_recreated_through_a_link(
    group: GroupStore, outside: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A link planted above a fan-out directory that then goes missing: the writer recreates
    the fan-out from the root without following it, and fails the write instead of putting
    the block (prompts) outside the root."""
    h = block_hash(13, "hostile")
    above = group.fanout_dir(h[0]).parent  # g0/c/0/0/0/0/0
    for child in above.iterdir():
        child.rmdir()
    above.rmdir()
    above.symlink_to(outside, target_is_directory=True)
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        (result,) = group.write_blocks([BlockWrite(h, block_bytes(group.layout, 13))])
    assert result.status is WriteStatus.FAILED and "symbolic link" in result.error
    assert list(outside.iterdir()) == []


def test_array_directory_link_is_refused_before_anything_is_created(
    make_store: StoreFactory, root: Path, outside: Path
) -> None:
    identity = make_small_identity()
    ns = make_store().namespace(identity)
    array = ns.path / "g0"
    shutil.rmtree(array)
    array.symlink_to(outside, target_is_directory=True)
    with pytest.raises(StoreFormatError, match="symbolic link"):
        make_store().namespace(identity)
    assert list(outside.iterdir()) == []


# -- the hot path's cost stays what it was ---------------------------------------------------------


class _CountingFileIO(FileIO):
    """Counts the calls the checks above could have added to the hot path."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        self._count("open")
        return super().open(path, flags, mode)

    def fstat(self, fd: int) -> os.stat_result:
        self._count("fstat")
        return super().fstat(fd)

    def exists(self, path: str) -> bool:
        self._count("exists")
        return super().exists(path)

    def lstat_at(self, dir_fd: int | None, name: str) -> os.stat_result:
        self._count("lstat")
        return super().lstat_at(dir_fd, name)


def test_reads_and_lookups_cost_one_call_each(make_store: StoreFactory) -> None:
    """A read of some chunks: one open, one fstat (regular-file check, size and identity
    together); a lookup: one probe per hash, nothing opened (plus, the first time, one check
    of a fan-out directory not seen before)."""
    fio = _CountingFileIO()
    group = make_store(fio=fio).namespace(make_small_identity()).group(0)
    h, _ = _write(group, 14)
    fio.calls.clear()
    out = np.zeros(2 * group.layout.chunk_nbytes, dtype=np.uint8)
    (result,) = group.read_blocks([BlockRead(h, out, [0, group.layout.num_chunks - 1])])
    assert result.status is ReadStatus.HIT
    assert fio.calls == {"open": 1, "fstat": 1}
    fio.calls.clear()
    assert group.contains([h, block_hash(15, "hostile")]) == [True, False]
    # a fan-out directory not seen yet is checked once (GroupArray.block_path), then trusted
    assert fio.calls.get("exists") == 2 and fio.calls.get("lstat", 0) <= 1, fio.calls
    fio.calls.clear()
    assert group.contains([h, block_hash(15, "hostile")]) == [True, False]
    assert fio.calls == {"exists": 2}

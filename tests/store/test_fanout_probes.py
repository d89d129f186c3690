"""Existence probes against held fan-out directory descriptors (kvstore.store.fanout_fds).

A hit is a regular file at the block's name reached without following a link; the held
descriptors must never make a removed or moved directory answer (a false hit is impossible,
a false miss is bounded), and their number stays bounded and drops to nothing on close.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from kvstore.io.fileio import FileIO
from kvstore.keys import hash_coords
from kvstore.store import fanout_fds
from kvstore.store.group_store import GroupStore
from kvstore.store.lookup import Lookup
from kvstore.store.types import BlockWrite, WriteStatus
from tests.helpers import StoreFactory, block_bytes, block_hash, make_small_identity


def _group(make_store: StoreFactory) -> GroupStore:
    return make_store().namespace(make_small_identity()).group(0)


def _write(group: GroupStore, hashes: list[bytes]) -> None:
    results = group.write_blocks(
        [BlockWrite(h, block_bytes(group.layout, i)) for i, h in enumerate(hashes)]
    )
    assert all(r.status is WriteStatus.WRITTEN for r in results), results


def _same_fanout(hi: int, n: int, salt: str) -> list[bytes]:
    """``n`` block hashes whose files live in fan-out directory ``hi``."""
    out = [b for b in (block_hash(i, salt) for i in range(4096)) if hash_coords(b)[0] == hi]
    assert len(out) >= n
    return out[:n]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_hits_and_misses(make_store: StoreFactory) -> None:
    group = _group(make_store)
    hashes = [block_hash(i, "hm") for i in range(300)]
    _write(group, hashes[::2])
    expected = [i % 2 == 0 for i in range(300)]
    assert group.contains(hashes) == expected
    assert group.contains(hashes) == expected  # again, through the held descriptors
    assert group.contains(hashes[:1]) == [True]
    assert group.contains(hashes[1:2]) == [False]
    assert group.contains([]) == []


def test_symlinked_block_file_is_a_miss(
    make_store: StoreFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    group = _group(make_store)
    real, linked = block_hash(1, "link"), block_hash(2, "link")
    _write(group, [real])
    os.symlink(group.path_of(real), group.path_of(linked))
    assert group.contains([real, linked]) == [True, False]
    assert any(
        "expected a regular file, got a symbolic link" in r.getMessage() for r in caplog.records
    )


@pytest.mark.parametrize("held_before", [False, True])
def test_symlinked_fanout_dir_is_a_miss(
    make_store: StoreFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture, held_before: bool
) -> None:
    """A link at a fan-out directory's name (to a directory holding the very block files) is
    not entered: its blocks are misses, logged; whether its real directory was held or not."""
    group = _group(make_store)
    hi = 7
    hashes = _same_fanout(hi, 3, "fanlink")
    _write(group, hashes)
    if held_before:
        assert group.contains(hashes) == [True] * 3
    fanout = group.fanout_dir(hi)
    outside = tmp_path / "outside"
    os.rename(fanout, outside)
    os.symlink(outside, fanout)
    assert all(os.path.exists(group.path_of(h)) for h in hashes)  # a path lookup would hit
    assert group.contains(hashes) == [False] * 3
    assert any(
        "expected a directory, got a symbolic link" in r.getMessage() for r in caplog.records
    )


def test_fanout_dir_removed_and_recreated_is_seen(make_store: StoreFactory) -> None:
    """A held descriptor of a removed fan-out directory answers "missing" forever; the
    directory recreated with a new block in it must be found by the next call."""
    group = _group_with(make_store, DirTimes())  # an old store: its times are trusted
    old, new = _same_fanout(11, 2, "recreate")
    _write(group, [old])
    assert group.contains([old, new]) == [True, False]  # holds fan-out directory 11 now
    _recreate_with(group, 11, old, new)  # an operator removing empty directories, a writer
    assert group.contains([old, new]) == [False, True]


def test_renamed_namespace_gives_no_hit(make_store: StoreFactory) -> None:
    """``kvstore rm`` renames the namespace away: its blocks, still in the held directories,
    must not be hits (a read of them misses)."""
    group = _group_with(make_store, DirTimes())
    hashes = [block_hash(i, "rm") for i in range(40)]
    _write(group, hashes)
    assert group.contains(hashes) == [True] * 40
    namespace = group.array_path.parent
    os.rename(namespace, namespace.with_name(f".trash-{namespace.name}-1"))
    assert group.contains(hashes) == [False] * 40


def test_fifo_or_directory_at_a_block_name_is_a_miss_and_never_blocks(
    make_store: StoreFactory,
) -> None:
    group = _group(make_store)
    fifo, directory, real = (block_hash(i, "kinds") for i in range(3))
    _write(group, [real])
    os.mkfifo(group.path_of(fifo))
    os.mkdir(group.path_of(directory))
    answers: list[list[bool]] = []
    worker = threading.Thread(
        target=lambda: answers.append(group.contains([fifo, directory, real])), daemon=True
    )
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "a lookup blocked on a FIFO"
    assert answers == [[False, False, True]]


def test_fanout_file_or_missing_fanout_dir_is_a_miss(make_store: StoreFactory) -> None:
    group = _group(make_store)
    a, b = _same_fanout(3, 1, "file")[0], _same_fanout(4, 1, "gone")[0]
    fanout3 = group.fanout_dir(3)
    os.rmdir(fanout3)
    fanout3.write_bytes(b"not a directory")
    os.rmdir(group.fanout_dir(4))
    assert group.contains([a, b]) == [False, False]


def test_held_descriptors_are_bounded_and_closed(make_store: StoreFactory) -> None:
    store = make_store()
    group = store.namespace(make_small_identity()).group(0)
    hashes = [block_hash(i, "fds") for i in range(2000)]  # every fan-out directory
    _write(group, hashes[:50])
    before = _open_fds()
    small = Lookup(group.array, max_held=8)
    for _ in range(5):
        assert small.contains(hashes)[:50] == [True] * 50
        assert small.longest_prefix(hashes[:50]) == 50
        assert _open_fds() - before <= 8 + 1  # fan-out dirs + the fan-out root
    small.close()
    assert _open_fds() == before
    for _ in range(3):
        group.contains(hashes)
    held = group._lookup.fanout.held
    assert 0 < held <= group._lookup.fanout.max_held + 1
    assert _open_fds() - before == held
    store.close()
    assert group._lookup.fanout.held == 0
    assert _open_fds() <= before


def test_concurrent_lookups_while_descriptors_are_dropped(make_store: StoreFactory) -> None:
    """Lookups on several threads while the fan-out root keeps changing (every call then
    drops what is held): every answer right, and nothing left open after close."""
    group = _group(make_store)
    hashes = [block_hash(i, "threads") for i in range(200)]
    _write(group, hashes[::2])
    expected = [i % 2 == 0 for i in range(200)]
    before = _open_fds()
    lookup = Lookup(group.array, max_held=32)
    stop = threading.Event()
    wrong: list[list[bool]] = []

    def probe() -> None:
        while not stop.is_set():
            found = lookup.contains(hashes)
            if found != expected:
                wrong.append(found)

    def churn() -> None:
        extra = group.fanout_dir(0).parent / "extra"
        while not stop.is_set():
            os.mkdir(extra)
            os.rmdir(extra)

    threads = [threading.Thread(target=probe) for _ in range(3)] + [threading.Thread(target=churn)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(30)
    assert wrong == []
    lookup.close()
    assert _open_fds() == before


class DirTimes(FileIO):
    """The fan-out root's times as its ``lstat`` shows them: an hour earlier than they are
    (a store created long ago: its times are trusted at once), or ``frozen`` (a clock too
    coarse to tell two changes apart)."""

    def __init__(self, frozen: int | None = None) -> None:
        self.frozen = frozen
        self.path = ""

    def lstat_at(self, dir_fd: int | None, name: str) -> os.stat_result:
        st = super().lstat_at(dir_fd, name)
        if dir_fd is not None or name != self.path:
            return st
        hour = 3_600 * 10**9
        mtime = st.st_mtime_ns - hour if self.frozen is None else self.frozen
        ctime = st.st_ctime_ns - hour if self.frozen is None else self.frozen
        shown = SimpleNamespace(
            st_dev=st.st_dev, st_ino=st.st_ino, st_mtime_ns=mtime, st_ctime_ns=ctime
        )
        return cast(os.stat_result, shown)


def _group_with(make_store: StoreFactory, fio: DirTimes) -> GroupStore:
    group = make_store(fio=fio).namespace(make_small_identity()).group(0)
    fio.path = str(group.fanout_dir(0).parent)
    return group


def _recreate_with(group: GroupStore, hi: int, old: bytes, new: bytes) -> None:
    fanout = group.fanout_dir(hi)
    os.unlink(group.path_of(old))
    os.rmdir(fanout)
    os.mkdir(fanout)
    _write(group, [new])


def test_young_directory_times_are_not_trusted(make_store: StoreFactory) -> None:
    """Times recorded less than RACY_S after they were set cannot tell a later change in the
    same clock tick: every call then reopens the fan-out directories."""
    group = _group_with(make_store, DirTimes(frozen=time.time_ns()))  # "just changed", forever
    old, new = _same_fanout(9, 2, "racy")
    _write(group, [old])
    assert group.contains([old, new]) == [True, False]
    _recreate_with(group, 9, old, new)
    assert group.contains([old, new]) == [False, True]


def test_a_change_the_times_miss_is_seen_after_max_age(
    make_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Old times that stay the same across a change (a server clock behind ours): the false
    miss lasts until the fan-out descriptors are MAX_AGE_S old, then they are reopened."""
    group = _group_with(make_store, DirTimes(frozen=time.time_ns() - 3_600 * 10**9))
    old, new = _same_fanout(10, 2, "age")
    _write(group, [old])
    assert group.contains([old, new]) == [True, False]
    _recreate_with(group, 10, old, new)
    assert group.contains([old, new]) == [False, False]  # the bounded false miss
    later = time.monotonic() + 2 * fanout_fds.MAX_AGE_S
    monkeypatch.setattr(fanout_fds, "monotonic", lambda: later)
    assert group.contains([old, new]) == [False, True]

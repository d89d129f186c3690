"""``contains`` on a slow (shared) file system: probes spread over the I/O threads.

A FileIO whose ``exists`` takes a millisecond stands in for a network round trip. The batch
must then run on several threads, give the same answers as one thread would, turn I/O errors
into misses (counted, logged once), and count every probe exactly once.
"""

from __future__ import annotations

import errno
import threading
import time
import types

import pytest

from kvstore.errors import KvstoreError
from kvstore.io.fileio import FileIO
from kvstore.store import lookup
from kvstore.store.types import BlockWrite
from tests.helpers import StoreFactory, block_bytes, block_hash, make_small_identity


class SlowFileIO(FileIO):
    def __init__(self, delay_s: float, failing: set[str]) -> None:
        self.delay_s = delay_s
        self.failing = failing
        self.threads: set[str] = set()
        self._lock = threading.Lock()

    def exists(self, path: str) -> bool:
        with self._lock:
            self.threads.add(threading.current_thread().name)
        time.sleep(self.delay_s)
        if path in self.failing:
            raise OSError(errno.EIO, "injected", path)
        return super().exists(path)


@pytest.mark.parametrize("delay_s", [0.0, 0.001])
def test_contains_answers_alike_serial_or_threaded(
    make_store: StoreFactory, delay_s: float, caplog: pytest.LogCaptureFixture
) -> None:
    identity = make_small_identity()
    writer = make_store().namespace(identity).group(0)
    hashes = [block_hash(i, "probe") for i in range(64)]
    stored = hashes[::3]
    writer.write_blocks(
        [BlockWrite(h, block_bytes(writer.layout, i)) for i, h in enumerate(stored)]
    )
    failing = {writer.path_of(h) for h in hashes[1::7]}
    fio = SlowFileIO(delay_s, failing)
    store = make_store(fio=fio, io_threads=4)
    group = store.namespace(identity).group(0)
    before = store.stats.snapshot()
    found = group.contains(hashes)
    after = store.stats.snapshot()
    expected = [h in set(stored) and group.path_of(h) not in failing for h in hashes]
    assert found == expected
    assert after["probes"] - before["probes"] == len(hashes)
    assert after["read_errors"] - before["read_errors"] == len(failing)
    assert sum("existence probes" in r.getMessage() for r in caplog.records) == 1
    if delay_s > lookup.SLOW_PROBE_S:  # (a fast one may still be slow on a busy machine)
        assert any(name.startswith("kvstore-io") for name in fio.threads), fio.threads


def test_contains_rejects_a_bad_hash_on_any_path(make_store: StoreFactory) -> None:
    group = make_store(fio=SlowFileIO(0.001, set())).namespace(make_small_identity()).group(0)
    with pytest.raises(KvstoreError):
        group.contains([block_hash(i) for i in range(8)] + [b"short"])


class OneSlowProbe(FileIO):
    """The first probe is slow (a preemption, a wait for the GIL); the others are local.

    Time is this object's clock, read by the lookup in place of ``time.perf_counter``: the
    first probe advances it by 2 ms, the others by nothing, so the test does not depend on
    how fast this machine is at the moment (a real second probe on a loaded CI machine took
    longer than ``SLOW_PROBE_S``)."""

    def __init__(self) -> None:
        self.calls = 0
        self.now = 0.0
        self.threads: set[str] = set()

    def clock(self) -> float:
        return self.now

    def exists(self, path: str) -> bool:
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        if self.calls == 1:
            self.now += 0.002
        return super().exists(path)


def test_one_slow_probe_keeps_the_batch_on_this_thread(
    make_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local disk whose first probe stalled once is still probed in one loop on this thread
    (handing 254 microsecond probes to the I/O threads costs more than it overlaps)."""
    fio = OneSlowProbe()
    monkeypatch.setattr(lookup, "time", types.SimpleNamespace(perf_counter=fio.clock))
    group = make_store(fio=fio, io_threads=4).namespace(make_small_identity()).group(0)
    assert group.contains([block_hash(i, "one-slow") for i in range(64)]) == [False] * 64
    assert fio.threads == {threading.current_thread().name}

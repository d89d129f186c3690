"""A hung file system never stalls SGLang's threads (issue 35): the kvstore backend on SGLang
0.5.23's own pools, its store calls made to block until the test releases them, as a call on
a frozen mount does.

Past its deadline a lookup is a miss, a read a miss that never reaches the host pool, a write
a failed set; during the unresponsive episode calls fail at once and one trial at a time
reaches the store, at most one per ``unresponsive_retry_s``; after the thaw one line says so and
hits return; a write frozen between its temporary file and its rename publishes whole.

Runs in the SGLang venv (scripts/sglang_venv.sh); skipped where SGLang is not installed.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolTransfer

from connector.sglang import extra_config
from connector.sglang.backend import KVStoreHiCacheStorage
from connector.sglang.deadlines import WORKER_THREADS
from connector.sglang.pool_store import PoolStore
from kvstore.admin.verify import VerifyOptions, verify_store
from tests.sglang.real_pools import fill, mha_pools

T, L, H, D, SIZE = 4, 3, 2, 16, 256
KEYS = [hashlib.sha256(bytes([i])).hexdigest() for i in range(1, 5)]
DEADLINE = 0.3
MARGIN = 1.0  # scheduling slack on a loaded 2-core machine; a stalled call waits 30 s
STUCK = "did not answer"
BACK = "answers again"
# Every call has a short deadline; no trial unless a test asks for one.
SHORT = {
    "lookup_deadline_s": DEADLINE,
    "load_deadline_s": DEADLINE,
    "store_deadline_s": DEADLINE,
    "deadline_min_mb_per_s": 0,
    "unresponsive_retry_s": 60,
}


class Freeze:
    """Makes named methods of a pool's store block on entry until :meth:`thaw` (as on a hung
    mount), then run; counts the calls that reached the store."""

    def __init__(self, target: object, *names: str) -> None:
        self.thawed = threading.Event()
        self.entered = 0
        self._lock = threading.Lock()
        for name in names:
            setattr(target, name, self._frozen(getattr(target, name)))

    def _frozen(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.entered += 1
            assert self.thawed.wait(30), "never thawed"
            return real(*args, **kwargs)

        return call

    def thaw(self) -> None:
        self.thawed.set()


def _host(seed: int) -> Any:
    _, host = mha_pools("page_first", SIZE, T, H, D, L)
    fill(host.kv_buffer, seed)
    return host


def _backend(root: Path, host: Any, **extra: Any) -> KVStoreHiCacheStorage:
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=True, is_page_first_layout=True,
        model_name="test/sglang-model", extra_config=extra_config(str(root), **extra),
    )  # fmt: skip
    backend = KVStoreHiCacheStorage(config, {})
    backend.register_mem_pool_host(host)
    return backend


def _kv(backend: KVStoreHiCacheStorage) -> PoolStore:
    pool = backend._pools["kv"]
    assert pool is not None
    return pool


def _indices(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * T, (p + 1) * T) for p in pages])


def _page(host: Any, page: int) -> torch.Tensor:
    data: torch.Tensor = host.get_data_page(page * T, flat=True).clone()
    return data


def _timed(call: Callable[[], Any]) -> tuple[Any, float]:
    start = time.monotonic()
    result = call()
    return result, time.monotonic() - start


def _settle(backend: KVStoreHiCacheStorage, what: str, expected: float) -> None:
    """Wait (generously) until the backend's gauge ``what`` reads ``expected``."""
    deadline = time.monotonic() + 20
    while backend.get_stats().kvstore[what] != expected:
        assert time.monotonic() < deadline, f"{what} never reached {expected}"
        time.sleep(0.01)


def _at_deadline(waited: float) -> bool:
    """Whether a call answered at its deadline: it waited for the store, then no longer."""
    return DEADLINE - 0.02 <= waited < DEADLINE + MARGIN


def _lines(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records)


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "store"


@pytest.fixture
def stored(root: Path) -> Any:
    """Pages 1..4 of a source pool stored under KEYS (by a backend that is not frozen)."""
    source = _host(seed=1)
    writer = _backend(root, source)
    assert writer.batch_set_v1(KEYS, _indices([1, 2, 3, 4])) == [True] * 4
    writer.close()
    return source


def _exists(b: KVStoreHiCacheStorage) -> Any:
    return b.batch_exists(KEYS)


def _exists_v2(b: KVStoreHiCacheStorage) -> Any:
    return b.batch_exists_v2(KEYS, []).kv_hit_pages


LOOKUPS = {"batch_exists": _exists, "batch_exists_v2": _exists_v2}


@pytest.mark.parametrize("name", sorted(LOOKUPS))
def test_a_lookup_past_its_deadline_is_a_miss(
    root: Path, stored: Any, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    backend = _backend(root, _host(seed=2), **SHORT)
    freeze = Freeze(_kv(backend).group, "contains")
    caplog.set_level(logging.WARNING, logger="kvstore.sglang")
    try:
        found, waited = _timed(lambda: LOOKUPS[name](backend))
        assert found == 0 and _at_deadline(waited)
        stats = backend.get_stats().kvstore
        assert stats["lookup_timeouts"] == len(KEYS) and stats["unresponsive"] == 1
        assert stats["held_calls"] == 1 and _lines(caplog, STUCK) == 1
    finally:
        freeze.thaw()
    _settle(backend, "held_calls", 0)
    assert _lines(caplog, BACK) == 1 and backend.get_stats().kvstore["unresponsive"] == 0
    assert LOOKUPS[name](backend) == len(KEYS)  # the store answers again: hits


def _get_v1(b: KVStoreHiCacheStorage) -> list[bool]:
    return b.batch_get_v1(KEYS[:2], _indices([5, 6]))


def _get_v2(b: KVStoreHiCacheStorage) -> list[bool]:
    return b.batch_get_v2([PoolTransfer(name="kv", host_indices=_indices([5, 6]), keys=KEYS[:2])])[
        "kv"
    ]


def _get_generic(b: KVStoreHiCacheStorage) -> list[bool]:
    host = b._pool_objects["kv"]
    targets = [host.get_dummy_flat_data_page() for _ in range(2)]
    got = b.batch_get(KEYS[:2], targets)
    for page, data in zip([5, 6], got, strict=True):
        if data is not None:  # as SGLang's controller does with a page served
            host.set_from_flat_data_page(page * T, data)
    return [g is not None for g in got]


GETS = {"batch_get_v1": _get_v1, "batch_get_v2": _get_v2, "batch_get": _get_generic}


@pytest.mark.parametrize("name", sorted(GETS))
def test_a_late_read_is_a_miss_and_never_reaches_the_host_pool(
    root: Path, stored: Any, name: str
) -> None:
    host = _host(seed=2)
    backend = _backend(root, host, **SHORT)
    freeze = Freeze(_kv(backend).group, "read_blocks")
    before = host.kv_buffer.clone()
    try:
        served, waited = _timed(lambda: GETS[name](backend))
        assert served == [False, False] and _at_deadline(waited)
        stats = backend.get_stats().kvstore
        assert stats["read_timeouts"] == 2 and stats["misses"] == 2 and stats["hits"] == 0
        assert stats["held_calls"] == 1 and stats["held_buffer_bytes"] > 0
    finally:
        freeze.thaw()
    _settle(backend, "held_calls", 0)  # the late read returned, with the pages' bytes
    assert backend.get_stats().kvstore["held_buffer_bytes"] == 0
    assert torch.equal(host.kv_buffer, before)  # none of them reached the pool
    assert GETS[name](backend) == [True, True]  # the store answers again
    assert torch.equal(_page(host, 5), _page(stored, 1))


def _set_v1(b: KVStoreHiCacheStorage, keys: list[str]) -> bool:
    return all(b.batch_set_v1(keys, _indices([1, 2])))


def _set_v2(b: KVStoreHiCacheStorage, keys: list[str]) -> bool:
    transfer = PoolTransfer(name="kv", host_indices=_indices([1, 2]), keys=keys)
    return all(b.batch_set_v2([transfer])["kv"])


def _set_generic(b: KVStoreHiCacheStorage, keys: list[str]) -> bool:
    host = b._pool_objects["kv"]
    return b.batch_set(keys, [_page(host, 1), _page(host, 2)])


SETS = {"batch_set_v1": _set_v1, "batch_set_v2": _set_v2, "batch_set": _set_generic}


@pytest.mark.parametrize("name", sorted(SETS))
def test_a_set_frozen_before_its_rename_fails_then_publishes_whole(
    root: Path, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The write is frozen after its temporary file is written, before it is synced and
    renamed: the set is reported failed at the deadline; no block is visible while frozen;
    after the thaw the late write publishes the pages as they were at the call (a block
    appears whole or not at all), and verify finds nothing wrong."""
    host = _host(seed=3)
    backend = _backend(root, host, **SHORT)
    keys = KEYS[:2]
    freeze = Freeze(_kv(backend).group._publisher, "_publish")  # white box: between the passes
    caplog.set_level(logging.WARNING, logger="kvstore.sglang")
    try:
        ok, waited = _timed(lambda: SETS[name](backend, keys))
        assert ok is False and _at_deadline(waited)
        stats = backend.get_stats().kvstore
        assert stats["write_timeouts"] == 2 and stats["write_failures"] == 2
        assert stats["pages_written"] == 0 and _lines(caplog, STUCK) == 1
        fill(host.kv_buffer, seed=4)  # SGLang reuses the pages: the late write must not see it
        frozen = _report(root)  # the temporary file, in flight: not a block, not a finding
        assert frozen["blocks"]["found"] == 0 and len(frozen["in_flight_temps"]) == 2
    finally:
        freeze.thaw()
    _settle(backend, "held_calls", 0)
    reader = _backend(root, _host(seed=5))
    assert reader.batch_get_v1(keys, _indices([7, 8])) == [True, True]
    source = _host(seed=3)  # the pages as they were when the set was called
    assert torch.equal(_page(reader._pool_objects["kv"], 7), _page(source, 1))
    assert torch.equal(_page(reader._pool_objects["kv"], 8), _page(source, 2))
    report = _report(root)
    assert report["blocks"]["checked"] == 2 and report["findings"] == []
    assert report["in_flight_temps"] == []


def _report(root: Path) -> dict[str, Any]:
    return verify_store(root, VerifyOptions(progress=False))


def test_during_an_episode_calls_fail_fast_and_one_trial_reaches_the_store(
    root: Path, stored: Any, caplog: pytest.LogCaptureFixture
) -> None:
    host = _host(seed=2)
    interval = 0.6
    backend = _backend(root, host, **{**SHORT, "unresponsive_retry_s": interval})
    pool = _kv(backend)
    freeze = Freeze(pool.group, "contains", "read_blocks", "write_blocks")
    caplog.set_level(logging.WARNING, logger="kvstore.sglang")
    try:
        assert _exists(backend) == 0  # the first call: stuck past its deadline
        workers = _worker_threads()  # the backend's threads start with its first call
        episode = time.monotonic()
        calls: list[tuple[float, float]] = []  # (when, how long)
        while time.monotonic() - episode < 3 * interval:  # three retry intervals
            when = time.monotonic()
            results, took = _timed(
                lambda: (_exists(backend), _get_v1(backend), _set_v1(backend, KEYS[2:4]))
            )
            assert results == (0, [False, False], False)
            calls.append((when - episode, took))
            time.sleep(0.02)
        # One trial, admitted once the interval passed; it is stuck like the first call, so
        # no other reached the store in the two intervals since.
        assert freeze.entered == 2
        slow = [(when, took) for when, took in calls if took > DEADLINE * 0.9]
        assert len(slow) == 1 and slow[0][0] >= interval * 0.9, calls
        assert len(calls) > 10 and backend.stats.failed_fast >= 3 * (len(calls) - 1)
        assert _worker_threads() == workers  # the pool never grew
        stats = backend.get_stats().kvstore
        assert stats["unresponsive"] == 1 and stats["held_calls"] == 2
        assert stats["unresponsive_seconds"] >= 3 * interval
    finally:
        freeze.thaw()
    _settle(backend, "unresponsive", 0)
    _settle(backend, "held_calls", 0)
    assert _lines(caplog, STUCK) == 1 and _lines(caplog, BACK) == 1  # one episode
    assert _exists(backend) == len(KEYS) and _get_v1(backend) == [True, True]
    assert backend.get_stats().kvstore["unresponsive_episodes"] == 1


def test_calls_queued_behind_stuck_workers_time_out_and_do_no_io(root: Path, stored: Any) -> None:
    """More concurrent calls than workers, all frozen: every one answers at its deadline;
    the one that waited in the queue does no I/O once a worker frees up."""
    backend = _backend(root, _host(seed=2), **SHORT)
    freeze = Freeze(_kv(backend).group, "contains")
    callers = WORKER_THREADS + 1
    results: list[tuple[int, float]] = []
    start = threading.Barrier(callers)

    def lookup() -> None:
        start.wait()
        results.append(_timed(lambda: _exists(backend)))

    threads = [threading.Thread(target=lookup) for _ in range(callers)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(DEADLINE + 2 * MARGIN)
        assert len(results) == callers and all(found == 0 for found, _ in results)
        assert all(took < DEADLINE + MARGIN for _, took in results), results
        assert freeze.entered == WORKER_THREADS  # the last one never left the queue
        assert backend.get_stats().kvstore["held_calls"] == callers
    finally:
        freeze.thaw()
    _settle(backend, "held_calls", 0)
    assert freeze.entered == WORKER_THREADS  # dequeued after the thaw, given up: no I/O
    assert _exists(backend) == len(KEYS)


def _worker_threads() -> int:
    return sum(t.name.startswith("kvstore-sglang") for t in threading.enumerate())

"""The SGLang backend's deadlines without SGLang (connector.sglang.deadlines, and the runner
path of connector.sglang.pool_store): steps answered in time, past the deadline, with a size
allowance; what a step given up on holds; a slice given up on never reaches the pool; the
deadline settings' checks. test_sglang_hung.py drives the same through SGLang's own pools."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from connector.sglang.config import SGLangBackendConfig
from connector.sglang.deadlines import StoreCalls
from connector.sglang.pages import PoolPages
from connector.sglang.pool_store import PoolStore, Step, block_hash
from connector.sglang.stats import BackendStats
from kvstore import ConfigError, KVStore, StoreConfig
from tests.sglang.fakes import FakeMHAPool, FakeStorageConfig

DEADLINE = 0.2
MARGIN = 1.0  # scheduling slack on a loaded machine


def _config(**values: float) -> SGLangBackendConfig:
    base = {"lookup_deadline_s": DEADLINE, "load_deadline_s": DEADLINE, "unresponsive_retry_s": 60}
    return SGLangBackendConfig.from_extra_config({"root": "/unused", **base, **values})


@pytest.fixture
def calls() -> Iterator[StoreCalls]:
    made = StoreCalls(_config(deadline_min_mb_per_s=0), "/store", BackendStats(), threads=2)
    yield made
    made.close()


def test_a_step_answered_in_time_returns_its_result_or_raises(calls: StoreCalls) -> None:
    call = calls.begin("lookup")
    assert call.run(lambda: 7) == 7
    with pytest.raises(ValueError, match="bad"):
        call.run(_raise)
    assert calls.snapshot()["unresponsive"] == 0


def _raise() -> int:
    raise ValueError("bad")


def test_a_step_past_the_deadline_is_given_up_and_holds_until_it_returns(
    calls: StoreCalls,
) -> None:
    release, returned = threading.Event(), threading.Event()

    def stuck() -> int:
        release.wait(30)
        returned.set()
        return 1

    call = calls.begin("load")
    start = time.monotonic()
    assert call.run(stuck, held_bytes=4096) is None
    assert DEADLINE <= time.monotonic() - start < DEADLINE + MARGIN
    assert call.given_up and call.run(lambda: 2) is None  # later steps do nothing
    gauges = calls.snapshot()
    assert gauges["held_calls"] == 1 and gauges["held_buffer_bytes"] == 4096
    assert gauges["unresponsive"] == 1 and gauges["unresponsive_episodes"] == 1
    assert calls.begin("lookup").run(lambda: 3) is None  # fails fast: no trial yet
    assert calls.stats.failed_fast == 1
    release.set()
    assert returned.wait(5)
    _settle(calls, "held_calls", 0)
    assert calls.snapshot() | {"unresponsive_seconds": 0} == {
        "held_calls": 0,
        "held_buffer_bytes": 0,
        "unresponsive": 0,
        "unresponsive_episodes": 1,
        "unresponsive_seconds": 0,
    }
    assert calls.begin("lookup").run(lambda: 3) == 3  # the store answers again


def test_a_large_call_gets_its_size_allowance() -> None:
    # 1000 bytes/s: 300 bytes allow 0.3 s more than the 0.2 s base.
    calls = StoreCalls(_config(deadline_min_mb_per_s=1e-3), "/store", BackendStats(), threads=1)
    try:
        assert calls.begin("load", nbytes=300).run(lambda: _sleep(0.35)) == 0.35
        assert calls.begin("load").run(lambda: _sleep(0.35)) is None
    finally:
        calls.close()


def _sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _settle(calls: StoreCalls, gauge: str, expected: float) -> None:
    deadline = time.monotonic() + 20
    while calls.snapshot()[gauge] != expected:
        assert time.monotonic() < deadline, f"{gauge} never reached {expected}"
        time.sleep(0.01)


def test_a_slice_given_up_on_never_reaches_the_pool(tmp_path: Path) -> None:
    """Two slices of one page: the first is served, the runner gives up on the second (its
    I/O still completes, into rows the pool never sees)."""
    source, target = FakeMHAPool("page_first", 4, 3, 2, 8), FakeMHAPool("page_first", 4, 3, 2, 8)
    source.fill_random(1)
    target.fill_random(2)
    store = KVStore(StoreConfig(root=tmp_path))
    writer = PoolStore(store, "kv", source, FakeStorageConfig(), "m", (0, 0))
    reader = PoolStore(store, "kv", target, FakeStorageConfig(), "m", (0, 0))
    hashes = [block_hash(f"{i:02x}" * 32) for i in (1, 2)]
    assert writer.write_pages(hashes, [None, hashes[0]], torch.tensor([1, 2]), BackendStats()) == [
        True,
        True,
    ]
    reader.pages_per_slice = 1
    before = PoolPages(reader.geometry, [target.kv_buffer.clone()])
    ran: list[list[bool]] = []

    def give_up_on_the_second(step: Step, held_bytes: int) -> list[bool] | None:
        ran.append(step())  # every slice's I/O completes (into its rows) ...
        return ran[-1] if len(ran) == 1 else None  # ... but the second came too late

    first_rows = reader._rows(1)
    stats = BackendStats()
    ids = torch.tensor([3, 4])
    assert reader.read(hashes, ids, stats, run=give_up_on_the_second) == [True, None]
    assert ran == [[True], [True]] and stats.hits == 1 and stats.misses == 0
    assert reader._rows(1).data_ptr() != first_rows.data_ptr()  # the late rows were left
    assert torch.equal(reader.pages.gather(ids[:1]), writer.pages.gather(torch.tensor([1])))
    assert torch.equal(reader.pages.gather(ids[1:]), before.gather(ids[1:]))  # untouched


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"lookup_deadline_s": 0}, "lookup_deadline_s: expected a number of seconds > 0, got 0"),
        ({"load_deadline_s": -1}, "load_deadline_s: expected a number of seconds > 0, got -1"),
        ({"store_deadline_s": "inf"}, "store_deadline_s: expected a number of seconds > 0"),
        ({"unresponsive_retry_s": 0}, "unresponsive_retry_s: expected a number of seconds > 0"),
        ({"deadline_min_mb_per_s": -100}, "deadline_min_mb_per_s: expected a number of MB/s >= 0"),
        ({"load_deadline_s": "soon"}, "load_deadline_s: expected a number, got 'soon'"),
    ],
)
def test_the_deadline_settings_are_checked(values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        SGLangBackendConfig.from_extra_config({"root": "/unused", **values})


def test_the_deadline_defaults() -> None:
    config = SGLangBackendConfig.from_extra_config({"root": "/unused"})
    assert (config.lookup_deadline_s, config.load_deadline_s, config.store_deadline_s) == (
        2.0,
        5.0,
        30.0,
    )
    assert (config.deadline_min_mb_per_s, config.unresponsive_retry_s) == (100.0, 5.0)

"""The scheduler-side manager on its own: answers, skips, back-off and resets.

The manager is built on the namespace of a real engine (tests/connector/harness.py) but driven
directly, with a fake clock where time matters.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the connector tests need vllm==0.33.0 (a separate venv)")

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    make_offload_key,
)

from connector.offload.manager import KVStoreManager
from connector.offload.transfer_specs import KVStoreStoreSpec
from connector.offload.worker import KVStoreWorker
from kvstore.store.paths import TMP_MARK

from .harness import Engine, EngineOptions, gpu_side


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def manager_of(engine: Engine, clock: Clock) -> KVStoreManager:
    base = engine.manager
    return KVStoreManager(
        store=base.store,
        namespace=base.namespace,
        key_map=base.key_map,
        options=base.options,
        commit_checksum_all=False,
        monotonic=clock,
    )


def finish(worker: KVStoreWorker, job_id: int) -> None:
    """Wait until the job is reported (``wait`` on a store returns after the snapshot)."""
    deadline = time.monotonic() + 10
    while job_id not in {r.job_id for r in worker.get_finished()}:
        assert time.monotonic() < deadline, f"job {job_id} never finished"
        time.sleep(0.005)


def keys(*seeds: int) -> list[OffloadKey]:
    return [make_offload_key(bytes([s]) * 32, 0) for s in seeds]


@pytest.fixture
def engine(tmp_path: Path) -> Engine:
    return Engine(EngineOptions(root=tmp_path, extra={"miss_ttl_s": 5, "write_backoff_s": 30}))


def test_a_miss_is_trusted_for_miss_ttl_seconds(engine: Engine) -> None:
    clock, context = Clock(), ReqContext(req_id="r")
    manager = manager_of(engine, clock)
    [key] = keys(1)
    assert manager.lookup(key, context) is LookupResult.RETRY
    assert manager.lookup(key, context) is LookupResult.RETRY  # probed once, not twice
    manager.drain()
    assert manager.lookup(key, context) is LookupResult.MISS
    clock.now += 6  # another server may have written it meanwhile: ask the store again
    assert manager.lookup(key, context) is LookupResult.RETRY
    engine.shutdown()


def test_prepare_store_skips_present_pending_and_repeated_keys(engine: Engine) -> None:
    manager, context = manager_of(engine, Clock()), ReqContext(req_id="r")
    first = manager.prepare_store(keys(1, 2, 2), context)
    assert first.keys_to_store == keys(1, 2)
    assert isinstance(first.store_spec, KVStoreStoreSpec)
    assert manager.prepare_store(keys(2, 3), context).keys_to_store == keys(3)  # 2 is pending
    assert manager.lookup(keys(1)[0], context) is LookupResult.MISS  # being stored elsewhere
    manager.complete_store(keys(1, 2, 3), context)  # nothing was written: not published
    manager.drain()
    assert manager.counters["blocks_not_published"] == 3
    assert manager.prepare_store(keys(1), context).keys_to_store == keys(1)
    engine.shutdown()


def test_failed_store_is_rolled_back_and_backs_off(engine: Engine) -> None:
    clock, context = Clock(), ReqContext(req_id="r")
    manager = manager_of(engine, clock)
    out = manager.prepare_store(keys(1, 2), context)
    worker = engine.ranks[0].worker
    assert worker.submit_store(5, gpu_side(engine.ranks[0], [3, 4], [2]), out.store_spec)
    worker.wait({5})
    finish(worker, 5)
    root = engine.options.root
    assert len(list(root.rglob(f"*{TMP_MARK}*"))) == 2  # written, not yet published
    manager.note_worker_failures([keys(2)[0]], [])  # as if another rank failed block 2
    manager.complete_store(out.keys_to_store, context)
    manager.drain()
    assert manager.counters["blocks_published"] == 1
    assert not list(root.rglob(f"*{TMP_MARK}*"))
    assert manager.lookup(keys(1)[0], context) is LookupResult.HIT
    assert manager.prepare_store(keys(7), context).keys_to_store == []  # backing off
    clock.now += 31
    assert manager.prepare_store(keys(7), context).keys_to_store == keys(7)
    engine.shutdown()


def test_reset_aborts_stores_in_flight_once_workers_flushed(engine: Engine) -> None:
    manager, context = manager_of(engine, Clock()), ReqContext(req_id="r")
    out = manager.prepare_store(keys(1, 2), context)
    worker = engine.ranks[0].worker
    assert worker.submit_store(5, gpu_side(engine.ranks[0], [3, 4], [2]), out.store_spec)
    worker.wait({5})
    finish(worker, 5)
    manager.reset_cache()  # vLLM will never call complete_store for this job
    root = engine.options.root
    assert len(list(root.rglob(f"*{TMP_MARK}*"))) == 2  # a worker may still be writing
    manager.on_reset_flushed()
    manager.drain()
    assert not list(root.rglob(f"*{TMP_MARK}*"))
    assert manager.prepare_store(keys(1), context).keys_to_store == keys(1)  # offered again
    engine.shutdown()

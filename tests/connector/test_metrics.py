"""The kvstore series move exactly as each scenario dictates, once per block at any TP size.

Driven through vLLM 0.33's real Scheduler (tests/connector/harness.py); the stats are what
vLLM's scheduler drains from the connector every step (tests/connector/metered.py), merged as
vLLM's frontend merges them. The last test feeds them to vLLM's own Prometheus exporter.
"""

from __future__ import annotations

import logging
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector tests need vllm==0.33.0 (a separate venv)")

import prometheus_client
from prometheus_client.parser import text_string_to_metric_families
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadPromMetrics
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash
from vllm.v1.kv_offload.base import (
    OffloadingEvent,
    ReqContext,
    make_offload_key,
)

import connector.store
from connector.offload import events
from connector.offload import metrics as m
from kvstore import KVStore

from .harness import BLOCK, Engine, EngineOptions, gpu_side, prompt
from .metered import Metered, engine
from .test_failures import PROMPT, FullDisk, _block_path, _corrupt, _store_prompt
from .test_manager import Clock, finish, keys, manager_of


def external(block_hash: bytes) -> Any:
    """A block hash as vLLM's KV events carry it."""
    return maybe_convert_block_hash(BlockHash(block_hash))


def block_bytes(e: Metered) -> int:
    return int(e.engine.manager.namespace.group(0).layout.block_nbytes)


@pytest.mark.parametrize("tp", [1, 2])
def test_stores_lookups_and_loads_count_each_block_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tp: int
) -> None:
    writer = engine(monkeypatch, root=tmp_path, tp=tp)
    writer.engine.serve("writer", PROMPT)
    nbytes = block_bytes(writer)
    assert writer.value(m.STORED_BLOCKS) == 5
    assert writer.value(m.STORED_BYTES) == 5 * nbytes  # whole blocks: every rank's share, once
    assert len(writer.value(m.STORE_SECONDS)) >= 1  # one observation per published job
    assert writer.value(m.LOOKUP_BLOCKS, m.MISS) == 1  # the first block missed: lookup stops
    assert writer.value(m.LOOKUP_BLOCKS, m.HIT) == 0
    assert writer.value(m.LOOKUP_TOKENS, m.MISS) == BLOCK
    assert writer.labelled(m.FAILED_BLOCKS) == {}
    assert writer.labelled(m.STORE_DROPPED_BLOCKS) == {}
    assert writer.value(m.PENDING_STORE_BYTES) == 0  # the last value reported
    assert writer.value(m.PENDING_STORE_BLOCKS) == 0
    assert writer.value(m.WRITE_BACKOFF) == 0
    # vLLM's own transfer counter sums what each worker wrote: the elected writers' shares
    assert writer.value("vllm:kv_offload_store_bytes") == 5 * nbytes
    writer.engine.shutdown()

    reader = engine(monkeypatch, root=tmp_path, tp=tp)
    reader.engine.serve("reader", [*PROMPT, 999], max_tokens=1)
    assert reader.engine.first_start["reader"] == 5 * BLOCK
    assert reader.value(m.LOOKUP_BLOCKS, m.HIT) == 5
    assert reader.value(m.LOOKUP_TOKENS, m.HIT) == 5 * BLOCK
    assert reader.value(m.LOADED_BLOCKS) == 5
    assert reader.value(m.LOADED_BYTES) == 5 * nbytes
    assert len(reader.value(m.LOAD_SECONDS)) == 1  # one load job
    assert reader.value(m.STORED_BLOCKS) == 0
    assert reader.labelled(m.FAILED_BLOCKS) == {}
    reader.engine.shutdown()


def test_a_second_request_offering_a_block_being_stored_skips_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests with one prompt in the same step both compute and offer its blocks; the
    second finds them being stored: skipped as present, stored once."""
    e = engine(monkeypatch, root=tmp_path)
    e.engine.add("a", PROMPT)
    e.engine.add("b", [*PROMPT, 7])
    e.engine.run()
    assert e.value(m.STORED_BLOCKS) == 5
    assert e.value(m.STORE_SKIPPED_BLOCKS, m.PRESENT) == 5
    e.engine.shutdown()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_corrupt_block_is_one_failure_and_a_removal_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tp: int
) -> None:
    name, hashes = _store_prompt(tmp_path, tp=tp)
    _corrupt(tmp_path, name, hashes[2])
    e = engine(monkeypatch, kv_events=True, root=tmp_path, tp=tp)
    e.engine.serve("reader", [*PROMPT, 999], max_tokens=1)
    # rank 0 finds the bad chunk and quarantines the file; at TP=2 rank 1 may find it gone:
    # one block, one failure, the most telling cause
    assert e.labelled(m.FAILED_BLOCKS) == {(m.LOAD, m.CORRUPT): 1}
    assert e.value(m.LOADED_BLOCKS) == 4
    removed = [ev for ev in e.events() if type(ev).__name__ == "BlockRemoved"]
    assert len(removed) == 1
    assert removed[0].medium == "STORAGE"
    assert removed[0].locality == "LOCAL"
    assert removed[0].block_hashes == [external(hashes[2])]
    e.engine.shutdown()


def test_a_block_under_another_key_is_an_identity_mismatch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name, hashes = _store_prompt(tmp_path)
    shutil.copyfile(_block_path(tmp_path, name, hashes[1]), _block_path(tmp_path, name, hashes[3]))
    e = engine(monkeypatch, root=tmp_path)
    e.engine.serve("reader", [*PROMPT, 999], max_tokens=1)
    assert e.engine.first_start["reader"] == 3 * BLOCK
    assert e.labelled(m.FAILED_BLOCKS) == {(m.LOAD, m.IDENTITY_MISMATCH): 1}
    e.engine.shutdown()


def test_a_file_gone_at_load_time_is_a_missing_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    e = engine(monkeypatch, root=tmp_path)
    request = e.engine.serve("writer", PROMPT)
    name = e.engine.manager.namespace.name
    _block_path(tmp_path, name, request.block_hashes[3]).unlink()
    e.engine.wipe_kv()
    assert e.engine.scheduler.reset_prefix_cache()  # GPU prefix cache only; index kept
    e.engine.serve("reader", [*PROMPT, 999], max_tokens=1)
    assert e.labelled(m.FAILED_BLOCKS) == {(m.LOAD, m.MISSING): 1}
    assert e.value(m.LOOKUP_BLOCKS, m.HIT) == 5  # the index said present
    e.engine.shutdown()


def test_a_full_disk_counts_failures_backoff_and_dropped_stores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    disk = FullDisk()
    monkeypatch.setattr(connector.store, "open_store", lambda config: KVStore(config, fio=disk))
    e = engine(monkeypatch, root=tmp_path, tp=2)
    disk.full = True
    with caplog.at_level(logging.WARNING):
        e.engine.serve("r1", PROMPT)
    assert e.labelled(m.FAILED_BLOCKS) == {(m.STORE, m.DISK_FULL): 5}  # 5 blocks, 2 ranks
    assert e.value(m.STORED_BLOCKS) == 0
    assert e.value(m.WRITE_BACKOFF) == 1
    disk.full = False
    e.engine.serve("r2", prompt(2 * BLOCK + 1, start=5000))
    assert e.value(m.STORE_DROPPED_BLOCKS, m.WRITE_BACKOFF_REASON) == 2
    e.engine.manager._backoff_until = 0.0  # the back-off has expired
    e.engine.serve("r3", prompt(2 * BLOCK + 1, start=7000))
    assert e.value(m.STORED_BLOCKS) == 2
    assert e.value(m.WRITE_BACKOFF) == 0
    e.engine.shutdown()


def test_kv_events_announce_published_blocks_on_storage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    e = engine(
        monkeypatch,
        kv_events=True,
        root=tmp_path,
        extra={"self_describing_kv_events": True, "kv_events_locality": "remote"},
    )
    request = e.engine.serve("writer", PROMPT)
    stored = [
        ev for ev in e.events() if type(ev).__name__ == "BlockStored" and ev.medium == "STORAGE"
    ]
    announced = sorted(h for ev in stored for h in ev.block_hashes)
    assert announced == sorted(external(h) for h in request.block_hashes)  # each block once
    assert {ev.locality for ev in stored} == {"REMOTE"}
    # self-describing: vLLM adds the tokens and the parent of each block
    [second] = [ev for ev in stored if ev.block_hashes == [external(request.block_hashes[1])]]
    assert second.token_ids == PROMPT[BLOCK : 2 * BLOCK]
    assert second.parent_block_hash == external(request.block_hashes[0])
    assert second.block_size == BLOCK
    e.engine.shutdown()


def test_no_events_are_kept_when_vllm_publishes_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    e = engine(monkeypatch, root=tmp_path)
    e.engine.serve("writer", PROMPT)
    assert not e.engine.manager.events.enabled
    assert e.engine.manager.events.take() == []
    e.engine.shutdown()


def test_the_series_reach_vllms_prometheus_exporter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's own exporter (OffloadPromMetrics, what ``vllm serve`` builds for /metrics)
    accepts every series kvstore reports, with the spec's definitions and info labels."""
    e = engine(monkeypatch, root=tmp_path)
    e.engine.serve("writer", PROMPT)
    registry = prometheus_client.CollectorRegistry()
    types: dict[Any, Any] = {
        prometheus_client.Gauge: partial(prometheus_client.Gauge, registry=registry),
        prometheus_client.Counter: partial(prometheus_client.Counter, registry=registry),
        prometheus_client.Histogram: partial(prometheus_client.Histogram, registry=registry),
    }
    exporter = OffloadPromMetrics(e.engine.config, types, ["engine"], {0: ["0"]})
    exporter.observe(e.stats.data, 0)
    text = prometheus_client.generate_latest(registry).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("vllm:kvstore_stored_blocks_total", (("engine", "0"),))] == 5
    assert samples[("vllm:kvstore_store_seconds_count", (("engine", "0"),))] >= 1
    info = [k for k in samples if k[0] == "vllm:kv_offload_config_info"]
    assert len(info) == 1
    labels = dict(info[0][1])
    assert labels["kvstore_root"] == str(tmp_path)
    assert labels["kvstore_admit_after"] == "1"
    e.engine.shutdown()


def test_events_buffer_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events, "MAX_EVENTS", 3)
    buffer = events.StoreEvents(enabled=True, locality="LOCAL")
    for i in range(5):
        buffer.stored([make_offload_key(bytes([i]) * 32, 0)])
    kept = buffer.take()
    assert all(isinstance(ev, OffloadingEvent) for ev in kept)
    assert [ev.keys[0][0] for ev in kept] == [2, 3, 4]  # the oldest were dropped


def test_stores_pending_at_a_cache_reset_count_as_dropped(tmp_path: Path) -> None:
    engine_ = Engine(EngineOptions(root=tmp_path))
    manager, context = manager_of(engine_, Clock()), ReqContext(req_id="r")
    out = manager.prepare_store(keys(1, 2), context)
    assert manager.ledger.pending_bytes == 2 * manager.namespace.group(0).layout.block_nbytes
    worker = engine_.ranks[0].worker
    assert worker.submit_store(5, gpu_side(engine_.ranks[0], [3, 4], [2]), out.store_spec)
    finish(worker, 5)
    manager.reset_cache()  # vLLM will never call complete_store for this job
    manager.on_reset_flushed()
    manager.drain()
    assert manager.metrics.counter(m.STORE_DROPPED_BLOCKS, m.CACHE_RESET) == 2
    assert manager.metrics.counter(m.FAILED_BLOCKS, m.STORE, m.IO_ERROR) == 0
    assert manager.ledger.pending_bytes == 0
    engine_.shutdown()

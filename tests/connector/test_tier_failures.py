"""The kvstore tier never fails the engine: bad blocks are misses, failed or slow stores drop.

Driven like tests/connector/test_tier.py (vLLM 0.33's real Scheduler and
``TieringOffloadingManager``, tests/connector/tier_harness.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

pytest.importorskip("vllm", reason="the connector tests need vllm==0.33.0 (a separate venv)")

from vllm.v1.kv_offload.tiering.backpressure import EMABackpressureDetector

import connector.compat
import connector.store
import connector.tier.manager
from connector.tier import KVStoreTier
from connector.tier.chunks import build_chunk_map, rows_of
from connector.tier.config import TierConfig
from connector.tier.jobs import LOAD, STORE, JobRunner, Outcome, Part
from kvstore import ConfigError, KVStore, StoreConfig
from kvstore.io.deadline import Deadline, DeliveryGate
from kvstore.store.group_store import GroupStore
from kvstore.store.paths import TMP_MARK

from .harness import BLOCK, EngineOptions, prompt
from .test_failures import FullDisk
from .tier_harness import TierEngine

PROMPT = prompt(5 * BLOCK + 3)
LONG = Deadline(60.0)  # a job deadline no test reaches


def part(run: Callable[[DeliveryGate], Outcome], *keys: bytes) -> Part:
    """A job part of ``keys`` (no bytes: its deadline is the base)."""
    return Part(run, frozenset(keys), 0)


def _stored(
    root: Path, block_size: int = BLOCK, tokens: list[int] = PROMPT
) -> tuple[str, list[bytes]]:
    engine = TierEngine(EngineOptions(root=root, block_size=block_size))
    request = engine.serve("writer", tokens)
    engine.flush_tier()
    name = engine.tier.namespace.name
    engine.shutdown()
    return name, list(request.block_hashes)


def _block_file(root: Path, name: str, block_hash: bytes) -> tuple[Path, int]:
    with KVStore(StoreConfig(root=root)) as store:
        group = store.open_namespace(name).group(0)
        return Path(group.path_of(block_hash)), group.layout.data_offset


def test_corrupt_block_is_a_miss_from_that_block_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    name, hashes = _stored(tmp_path)
    path, data_offset = _block_file(tmp_path, name, hashes[2])
    raw = bytearray(path.read_bytes())
    raw[data_offset + 7] ^= 0xFF
    path.write_bytes(bytes(raw))
    engine = TierEngine(EngineOptions(root=tmp_path))
    with caplog.at_level(logging.WARNING):
        engine.serve("reader", [*PROMPT, 999], max_tokens=1)
    # blocks 0 and 1 promoted, block 2 failed its promotion (a miss), 3 and 4 are after it
    assert engine.first_start["reader"] == 2 * BLOCK
    assert engine.prefix_ok["reader"]
    assert min(engine.computed["reader"]) == 2 * BLOCK
    assert engine.tier.store.stats.snapshot()["corrupt"] == 1
    assert list((tmp_path / name / "quarantine").iterdir())  # never served again
    assert any("corrupt" in r.getMessage() for r in caplog.records)
    engine.shutdown()


def test_block_vanished_after_it_was_known_present_is_a_miss(tmp_path: Path) -> None:
    """The tier remembers what it stored; ``kvstore gc`` may remove a file meanwhile."""
    name, hashes = _stored(tmp_path)
    engine = TierEngine(EngineOptions(root=tmp_path))
    for h in hashes:
        engine.tier._remember(h + bytes(4))  # OffloadKey: hash + group id 0
    path = _block_file(tmp_path, name, hashes[3])[0]
    path.unlink()
    engine.serve("reader", [*PROMPT, 999], max_tokens=1)
    assert engine.first_start["reader"] == 3 * BLOCK
    assert engine.prefix_ok["reader"]
    engine.flush_tier()
    assert path.exists()  # vLLM recomputed block 3 and stored it through the tier again
    engine.shutdown()


def test_full_disk_fails_store_jobs_and_backpressure_drops_stores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    disk = FullDisk()
    monkeypatch.setattr(connector.store, "open_store", lambda config: KVStore(config, fio=disk))
    engine = TierEngine(EngineOptions(root=tmp_path))
    detector = engine.tier.bp_detector
    assert isinstance(detector, EMABackpressureDetector)  # the default: fs tier's settings
    disk.full = True
    with caplog.at_level(logging.WARNING):
        for i in range(4):  # one store job per request
            engine.serve(f"r{i}", prompt(2 * BLOCK + 1, start=1000 * (i + 1)))
            engine.flush_tier()
    assert detector.is_under_pressure()  # 3 failed store jobs in a row
    # the 4th request's store was dropped, not submitted (vLLM counts it in its metrics)
    assert engine.tier.store.stats.snapshot()["write_failures"] == 3 * 2
    assert not list(tmp_path.rglob(f"*{TMP_MARK}*"))  # temporary files rolled back
    # one line per failed job, from the store, until backpressure stops submitting them
    assert sum(1 for r in caplog.records if "No space left" in r.getMessage()) == 3
    assert engine.tier.store.stats.snapshot()["blocks_written"] == 0
    engine.shutdown()


def test_slow_store_is_dropped_by_configured_backpressure(tmp_path: Path) -> None:
    """vLLM's backpressure entry reaches the tier: a store slower than the high watermark
    (here: any store) has later stores dropped instead of queued."""
    backpressure = {
        "backpressure_cls": "EMABackpressureDetector",
        "policy_cls": "DropStorePolicy",
        "high_water_s": 1e-12,
        "low_water_s": 1e-12,
        "warmup_completions": 1,
        "decay_half_life_s": 0,
    }
    engine = TierEngine(EngineOptions(root=tmp_path), backpressure=backpressure)
    for i in range(4):
        engine.serve(f"r{i}", prompt(2 * BLOCK + 1, start=1000 * (i + 1)))
        engine.flush_tier()
    detector = engine.tier.bp_detector
    assert detector is not None and detector.is_under_pressure()
    assert engine.tier.store.stats.snapshot()["blocks_written"] < 4 * 2  # some were dropped
    engine.shutdown()


def test_tier_keys_are_parsed_strictly() -> None:
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['rooot'\].*accepted keys"):
        TierConfig.from_options({"rooot": "/x"})
    with pytest.raises(ConfigError, match="expected 'root'"):
        TierConfig.from_options({"durability": "full"})
    with pytest.raises(ConfigError, match="load_threads: expected an int"):
        TierConfig.from_options({"root": "/x", "load_threads": "many"})
    with pytest.raises(ConfigError, match="durability"):
        TierConfig.from_options({"root": "/x", "durability": "sometimes"})
    config = TierConfig.from_options(
        {"root": "/x", "io_threads": "3", "default_backpressure": "false"}
    )
    assert (config.store.durability, config.store.io_threads) == ("none", 3)
    assert not config.default_backpressure


def test_tier_outside_kvstore_connector_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="KVStoreConnector"):
        KVStoreTier(cast(Any, None), memoryview(b""), "KVStoreTier", root=str(tmp_path))


def test_unmappable_chunk_configurations_are_refused_at_startup(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="blocks_per_chunk=2"):
        TierEngine(EngineOptions(root=tmp_path, extra={"block_size": 2 * BLOCK}))
    engine = TierEngine(EngineOptions(root=tmp_path, tp=2))
    tier = engine.tier
    rows = rows_of(tier._primary_kv_view)
    small = dataclasses.replace(tier.geometry, cell_bytes=tier.geometry.cell_bytes // 2)
    with pytest.raises(ConfigError, match=r"per-worker cells.*needs \d+ bytes per cell"):
        build_chunk_map(rows, tier.identity, tier.facts, small)
    wide = dataclasses.replace(tier.geometry, world_size=4)
    with pytest.raises(ConfigError, match="4 workers, but the parallel layout"):
        build_chunk_map(rows, tier.identity, tier.facts, wide)
    del rows
    engine.shutdown()


def test_a_job_part_that_raises_fails_only_its_keys(caplog: pytest.LogCaptureFixture) -> None:
    """A job's parts run concurrently; one raising (a bug, not an I/O error: those are results)
    is logged, fails its own keys, and the job still finishes; an empty job finishes at once."""
    runner = JobRunner(load_threads=2, store_threads=2)

    def broken(gate: DeliveryGate) -> Outcome:
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR):
        good = part(lambda gate: Outcome(frozenset({b"a"}), 10), b"a")
        runner.submit(1, LOAD, [good, part(broken, b"b")], LONG)
        runner.submit(2, STORE, [], LONG)
        runner.wait_idle()
    done = {f.job_id: f for f in runner.finished()}
    assert done[1].outcome == Outcome(frozenset({b"a"}), 10)
    assert done[2].outcome == Outcome(frozenset(), 0)
    assert any("job 1 failed" in r.getMessage() for r in caplog.records)
    runner.shutdown()


def test_a_jobs_parts_run_on_the_pool_concurrently_never_on_the_submitting_thread() -> None:
    """submit (vLLM's scheduler thread) hands the pool one task, which submits the job's
    other parts and runs the first: every part runs on a pool thread, two of them at once
    (a barrier of two parts passes with two load threads), and the job ends once."""
    runner = JobRunner(load_threads=2, store_threads=2)
    barrier = threading.Barrier(2, timeout=30)
    threads: list[int] = []

    def run(key: bytes, gate: DeliveryGate) -> Outcome:
        threads.append(threading.get_ident())
        barrier.wait()
        return Outcome(frozenset({key}), 1)

    parts = [part(functools.partial(run, k), k) for k in (b"a", b"b", b"c", b"d")]
    runner.submit(7, LOAD, parts, LONG)
    runner.wait_idle()
    (done,) = runner.finished()
    assert done.job_id == 7 and done.outcome == Outcome(frozenset({b"a", b"b", b"c", b"d"}), 4)
    assert len(threads) == 4 and threading.get_ident() not in threads
    runner.shutdown()


def test_corrupt_block_promoted_into_the_rows_is_a_miss_and_never_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """128-token blocks (raw dense arrays) promoted at TP=1 are read straight into the CPU
    tier's rows (vLLM 0.34; 0.33 stages them): a corrupt one leaves its row partly written, is
    a miss (quarantined, one log line), and vLLM drops its chunk (complete_write(..., False)),
    so the CPU tier never serves it; the other keys of the same promotion job arrive and stay
    in the CPU tier."""
    big = 8 * BLOCK
    tokens = prompt(3 * big + 3)
    writer = TierEngine(EngineOptions(root=tmp_path, block_size=big))
    request = writer.serve("writer", tokens)
    writer.flush_tier()
    name = writer.tier.namespace.name
    writer.shutdown()
    hashes = list(request.block_hashes)
    path, data_offset = _block_file(tmp_path, name, hashes[1])
    raw = bytearray(path.read_bytes())
    raw[data_offset + len(raw) // 3] ^= 0xFF  # inside a chunk in the middle of the block
    path.write_bytes(bytes(raw))
    engine = TierEngine(EngineOptions(root=tmp_path, block_size=big))
    # the path under test is taken (vLLM 0.34; 0.33 stages every load: the same outcome)
    assert engine.tier._transfers.loads_in_place == [connector.compat.TIER_DEFERS_RELEASE]
    cpu_tier = engine.tiering.primary_tier
    completed: list[tuple[set[bytes], bool]] = []
    complete_write = cpu_tier.complete_write

    def spy(keys: Any, req_context: Any, success: bool = True) -> None:
        completed.append(({bytes(k) for k in keys}, success))
        complete_write(keys, req_context, success)

    monkeypatch.setattr(cpu_tier, "complete_write", spy)
    with caplog.at_level(logging.WARNING):
        engine.serve("reader", [*tokens, 999], max_tokens=1)
    assert engine.first_start["reader"] == big  # block 0 promoted, block 1 a miss
    assert engine.prefix_ok["reader"]  # what the request started with is the right KV
    assert min(engine.computed["reader"]) == big
    stats = engine.tier.store.stats.snapshot()
    assert stats["corrupt"] == 1 and stats["hits"] >= 1
    assert list((tmp_path / name / "quarantine").iterdir())
    assert sum("corrupt" in r.getMessage() for r in caplog.records) == 1
    # vLLM freed the chunk the corrupt block was read into (never made ready, never served)
    # and kept the job's other keys
    key = [h + bytes(4) for h in hashes]
    failed = set().union(*(keys for keys, ok in completed if not ok))
    done = set().union(*(keys for keys, ok in completed if ok))
    assert key[1] in failed and key[1] not in done
    assert key[0] in done and key[0] not in failed
    engine.shutdown()


def test_a_failed_promotion_is_reported_once_settled_and_releases_after_its_last_read() -> None:
    """With deferred releases (vLLM 0.34): parts 0 and 1 ended, part 1 failed a key, part 2
    still reading into the rows (its gate claimed): the job is reported at once, part 2's keys
    cut short, and its release is set only when part 2 has ended. Without them (0.33), the
    job waits for part 2."""
    for defers in (True, False):
        runner = JobRunner(load_threads=2, store_threads=2, defers_release=defers)
        thaw, reading = threading.Event(), threading.Event()

        def slow(
            gate: DeliveryGate, thaw: threading.Event = thaw, reading: threading.Event = reading
        ) -> Outcome:
            assert gate.claim()  # as a read straight into the rows does
            reading.set()
            assert thaw.wait(30)
            gate.release()
            return Outcome(frozenset({b"e"}), 1)

        def failing(gate: DeliveryGate, reading: threading.Event = reading) -> Outcome:
            assert reading.wait(30)  # fails once part 2 reads: it is cut short, not skipped
            return Outcome(frozenset(), 0)

        parts = [
            part(lambda gate: Outcome(frozenset({b"a", b"b"}), 2), b"a", b"b"),
            part(failing, b"c", b"d"),
            part(slow, b"e"),
        ]
        runner.submit(5, LOAD, parts, LONG)
        assert reading.wait(30)
        deadline = time.monotonic() + 30
        done: list[Any] = []
        while defers and not done and time.monotonic() < deadline:
            done = runner.finished()
            time.sleep(0.005)
        if defers:
            (report,) = done
            assert report.outcome.ok_keys == {b"a", b"b"}
            assert report.cut_short == {b"e"} and not report.timed_out
            assert report.release is not None and not report.release.is_set()
        else:
            time.sleep(0.05)
            assert runner.finished() == []  # 0.33: reported only once every part has ended
        thaw.set()
        runner.wait_idle()  # waits for the part cut short too
        if defers:
            assert report.release.is_set()
            assert runner.finished() == []  # reported once, never again
        else:
            (report,) = runner.finished()
            assert report.outcome.ok_keys == {b"a", b"b", b"e"} and report.release is None
        runner.shutdown()


@pytest.mark.skipif(
    not connector.compat.TIER_DEFERS_RELEASE, reason="vLLM 0.34's JobResult.deferred_release"
)
@pytest.mark.parametrize("into_rows", [True, False], ids=["into-rows", "staged"])
def test_a_failed_promotion_holds_its_chunks_until_the_reads_into_them_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, into_rows: bool
) -> None:
    """vLLM 0.34: block 1 is corrupt, block 3's read hangs. The promotion (one part per block)
    is reported failed once blocks 0 and 1 are settled. Read straight into the rows (128-token
    blocks), it carries ``deferred_release``: vLLM fails the keys but keeps their CPU chunks
    out of its free pool until block 3's read has ended (then releases them). Staged (16-token
    blocks), block 3's part is cut short before it claimed its gate: nothing is held, its read
    goes on in the tier's buffer only. Either way the request goes on from block 0,
    byte-exact."""
    size = 8 * BLOCK if into_rows else BLOCK
    tokens = prompt(5 * size + 3)
    name, hashes = _stored(tmp_path, size, tokens)
    path, data_offset = _block_file(tmp_path, name, hashes[1])
    raw = bytearray(path.read_bytes())
    raw[data_offset + 7] ^= 0xFF  # present at lookup, bad at promotion
    path.write_bytes(bytes(raw))
    monkeypatch.setattr(connector.tier.manager, "JOB_BATCH", 1)
    gate, reading = threading.Event(), threading.Event()
    read_blocks = GroupStore.read_blocks

    def gated(group: GroupStore, reads: Any) -> Any:
        read = {r.block_hash for r in reads}
        if hashes[1] in read:  # fails only once block 3 reads (a part still queued is
            assert reading.wait(60)  # cut short before it starts: it never reads)
        if hashes[3] in read:
            reading.set()
            assert gate.wait(60)
        return read_blocks(group, reads)

    monkeypatch.setattr(GroupStore, "read_blocks", gated)
    engine = TierEngine(EngineOptions(root=tmp_path, block_size=size))
    assert engine.tier._transfers.loads_in_place == [into_rows]
    tiering: Any = engine.tiering  # 0.34's attributes (mypy runs on 0.33)
    held: list[int] = []  # chunks vLLM held once it collected the failed promotion

    def collected() -> bool:  # reported, block 3 still reading, and vLLM has taken it
        promoting = any(m.transfer_job.is_promotion for m in list(tiering._jobs.values()))
        return bool(engine.tier.stats()["late_load_parts"]) and not promoting

    def release_when_collected() -> None:  # the engine keeps stepping meanwhile (serve)
        deadline = time.monotonic() + 60
        while not held and time.monotonic() < deadline:
            if collected():
                held.append(tiering.primary_tier.num_deferred_release_chunks)
            time.sleep(0.002)
        gate.set()

    watcher = threading.Thread(target=release_when_collected)
    watcher.start()
    engine.serve("reader", [*tokens, 999], max_tokens=1)
    watcher.join()
    assert held, "the promotion was never reported while block 3 was still reading"
    if into_rows:  # block 3's chunk (and those cut short with it) were held
        assert held[0] >= 1
    else:
        assert held[0] == 0
    assert tiering.primary_tier.num_deferred_release_chunks == 0  # released after
    assert engine.first_start["reader"] == size  # block 0 promoted, 1.. recomputed
    assert engine.prefix_ok["reader"]
    engine.shutdown()

"""A hung file system never stalls an engine running kvstore as vLLM's secondary tier.

The store's calls (``GroupStore.contains`` / ``read_blocks`` / ``write_blocks``) are made to
block until the test releases them, as calls on a frozen mount do (:class:`FrozenStore`);
vLLM's real Scheduler and ``TieringOffloadingManager`` drive the tier
(tests/connector/tier_harness.py), on vLLM 0.33 and 0.34. Deadlines are short (0.3 s), waits
generous.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the connector tests need vllm==0.33.0 (a separate venv)")

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import LookupResult
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

import connector.tier.manager
from connector.compat import TIER_DEFERS_RELEASE
from connector.tier import KVStoreTier
from connector.tier import health as h
from connector.tier.config import TierConfig
from connector.tier.jobs import LOAD, STORE, JobRunner, Outcome, Part
from kvstore import BlockRead, ConfigError, KVStore, StoreConfig
from kvstore.io.deadline import Deadline, DeliveryGate
from kvstore.store.group_store import GroupStore

from .harness import BLOCK, EngineOptions, prompt
from .tier_harness import TierEngine, tier_extra

DEADLINE_S = 0.3
MARGIN_S = 5.0  # generous: a loaded 2-core machine steps the engine slowly
FAST: dict[str, Any] = {"lookup_deadline_s": DEADLINE_S, "load_deadline_s": DEADLINE_S}
PROMPT = prompt(5 * BLOCK + 3)
CALLS = ("contains", "read_blocks", "write_blocks")


class FrozenStore:
    """Makes the store's calls block, as on a hung mount: while frozen, every call of the
    chosen ``GroupStore`` methods waits until :meth:`thaw`, then runs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, methods: tuple[str, ...] = CALLS) -> None:
        self.thawed = threading.Event()
        self.thawed.set()
        self.stuck: dict[str, int] = dict.fromkeys(methods, 0)  # calls that blocked, by method
        self.items: dict[str, list[Any]] = {m: [] for m in methods}  # ... and their items
        self._lock = threading.Lock()
        for name in methods:
            monkeypatch.setattr(GroupStore, name, self._frozen(name, getattr(GroupStore, name)))

    def freeze(self) -> None:
        self.thawed.clear()

    def thaw(self) -> None:
        self.thawed.set()

    def _frozen(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(group: GroupStore, items: Any) -> Any:
            if not self.thawed.is_set():
                with self._lock:
                    self.stuck[name] += 1
                    self.items[name].extend(items)
                assert self.thawed.wait(60), "never thawed"
            return real(group, items)

        return call


class Spy:
    """Records the tier's jobs as vLLM sees them: submissions and results, with times."""

    def __init__(self, tier: KVStoreTier, monkeypatch: pytest.MonkeyPatch) -> None:
        self.submitted: dict[int, tuple[float, TransferJob]] = {}
        self.results: dict[int, tuple[float, JobResult]] = {}
        self.lookups: list[LookupResult] = []
        self.stats = OffloadingConnectorStats()  # every payload the tier gave vLLM, merged
        for name in ("submit_load", "submit_store"):
            monkeypatch.setattr(tier, name, self._submit(getattr(tier, name)))
        finished, lookup, get_stats = tier.get_finished_jobs, tier.lookup, tier.get_stats

        def get_finished_jobs() -> list[JobResult]:
            results = list(finished())
            self.results.update((r.job_id, (time.monotonic(), r)) for r in results)
            return results

        def spied_lookup(key: Any, req_context: Any) -> LookupResult:
            self.lookups.append(lookup(key, req_context))
            return self.lookups[-1]

        def spied_stats() -> OffloadingConnectorStats | None:
            stats = get_stats()
            if stats is not None:
                self.stats.aggregate(stats)
            return stats

        monkeypatch.setattr(tier, "get_finished_jobs", get_finished_jobs)
        monkeypatch.setattr(tier, "lookup", spied_lookup)
        monkeypatch.setattr(tier, "get_stats", spied_stats)

    def _submit(self, real: Callable[[TransferJob], None]) -> Callable[[TransferJob], None]:
        def submit(job: TransferJob) -> None:
            self.submitted[job.job_id] = (time.monotonic(), job)
            real(job)

        return submit

    def jobs(self, promotion: bool) -> list[int]:
        return [i for i, (_, job) in self.submitted.items() if job.is_promotion == promotion]

    def waited(self, job_id: int) -> float:
        """Seconds from the job's submission to vLLM collecting its result."""
        return self.results[job_id][0] - self.submitted[job_id][0]


def stored(root: Path, block_size: int = BLOCK, tokens: list[int] = PROMPT) -> list[bytes]:
    """Store ``tokens`` through a tier engine; their block hashes."""
    engine = TierEngine(EngineOptions(root=root, block_size=block_size))
    request = engine.serve("writer", tokens)
    engine.flush_tier()
    engine.shutdown()
    return list(request.block_hashes)


def known_present(engine: TierEngine, hashes: list[bytes]) -> None:
    """The tier stored or loaded these blocks before (lookups HIT from memory, no probe)."""
    for block_hash in hashes:
        engine.tier._remember(block_hash + bytes(4))  # OffloadKey: hash + group id 0


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The tier's warnings (vLLM's own are not counted)."""
    return [r.getMessage() for r in caplog.records if r.name == "kvstore.connector"]


@pytest.fixture
def frozen(monkeypatch: pytest.MonkeyPatch) -> Iterator[FrozenStore]:
    store = FrozenStore(monkeypatch)
    yield store
    store.thaw()  # a failing test leaves no thread stuck


def test_a_probe_past_its_deadline_is_a_miss_and_hits_resume_after_the_thaw(
    tmp_path: Path,
    frozen: FrozenStore,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first lookup's probe hangs: vLLM hears RETRY until lookup_deadline_s, then MISS
    (recompute), one warning. While hung, lookups miss at once (no RETRY, no new probe, even
    for keys the tier knows present) and stores are dropped, but for one trial at a time
    every unresponsive_retry_s. The stuck probe's return ends the episode (one more line);
    lookups probe again and promote byte-exact from the store."""
    later = prompt(5 * BLOCK + 3, start=5000)
    stored(tmp_path)
    later_hashes = stored(tmp_path, tokens=later)
    engine = TierEngine(
        EngineOptions(root=tmp_path), unresponsive_retry_s=0.2, store_deadline_s=DEADLINE_S, **FAST
    )
    spy = Spy(engine.tier, monkeypatch)
    caplog.set_level(logging.WARNING, logger="kvstore.connector")
    frozen.freeze()
    started = time.monotonic()
    engine.serve("r1", [*PROMPT, 999], max_tokens=1)
    assert time.monotonic() - started >= DEADLINE_S
    assert engine.first_start["r1"] == 0  # nothing came from the store: all recomputed
    assert LookupResult.RETRY in spy.lookups and spy.lookups[-1] is LookupResult.MISS
    lines = warnings(caplog)
    assert len(lines) == 1 and "did not answer a lookup within 0.3 s" in lines[0]
    assert "lookup_deadline_s" in lines[0]
    stats = engine.tier.stats()
    assert stats["unresponsive"] == 1 and stats["lookup_deadline_blocks"] >= 1
    # Hung: every lookup a miss at once, even of a key the tier knows present; no new probe;
    # stores dropped but for one trial (which hangs: no second one joins it).
    spy.lookups.clear()
    known_present(engine, later_hashes)
    for i in range(3):
        time.sleep(0.25)  # past unresponsive_retry_s: a trial may go
        engine.serve(f"r2-{i}", [*later[: 2 * BLOCK], 100 + i], max_tokens=1)
        engine.serve(f"new-{i}", prompt(2 * BLOCK + 1, start=1000 * (i + 1)))
    assert spy.lookups and set(spy.lookups) == {LookupResult.MISS}
    assert frozen.stuck == {"contains": 1, "read_blocks": 0, "write_blocks": 1}
    stats = engine.tier.stats()
    assert stats["lookup_unresponsive_blocks"] >= 1 and stats["store_unresponsive_blocks"] >= 1
    assert len(warnings(caplog)) == 1  # one line for the whole episode
    engine.tiering.get_stats()  # vLLM's tiering manager collects the tier's payload
    values = spy.stats.metric_sections()[1]
    assert values[h.UNRESPONSIVE_GAUGE][()] == 1
    assert values[h.TIMEOUT_BLOCKS][("lookup", h.DEADLINE)] >= 1
    assert values[h.TIMEOUT_BLOCKS][("store", h.UNRESPONSIVE)] >= 1
    frozen.thaw()
    wait_for(lambda: not engine.tier.stats()["unresponsive"], "the episode to end")
    lines = warnings(caplog)
    assert len(lines) == 2 and "answers again after" in lines[1]
    engine.flush_tier()
    engine.serve("r3", [*later, 997], max_tokens=1)
    assert engine.first_start["r3"] == 5 * BLOCK  # hits resume: promoted from the store
    assert engine.prefix_ok["r3"]
    assert engine.tier.stats()["unresponsive_seconds"] >= DEADLINE_S
    engine.shutdown()


def promote_hung(
    root: Path, monkeypatch: pytest.MonkeyPatch, frozen: FrozenStore, block_size: int
) -> tuple[TierEngine, Spy, list[int]]:
    """A reader engine knowing ``root``'s blocks present, its reads frozen: the tier engine,
    its spy and the request's tokens."""
    tokens = prompt(5 * block_size + 3)
    hashes = stored(root, block_size, tokens)
    engine = TierEngine(EngineOptions(root=root, block_size=block_size), **FAST)
    known_present(engine, hashes)
    frozen.freeze()
    return engine, Spy(engine.tier, monkeypatch), tokens


def check_failed_in_time(spy: Spy) -> list[int]:
    """Every promotion failed, reported within load_deadline_s (+ margin); their ids. The
    first one waited for its deadline; vLLM may submit another promotion while the first
    hangs, and one submitted after the first passed its deadline (the store is then
    unresponsive) fails at once, by design."""
    promotions = sorted(spy.jobs(promotion=True), key=lambda i: spy.submitted[i][0])
    assert promotions
    for job_id in promotions:
        assert not spy.results[job_id][1].success
        assert spy.waited(job_id) < DEADLINE_S + MARGIN_S
    assert spy.waited(promotions[0]) >= DEADLINE_S
    return promotions


@pytest.mark.parametrize("block_size", [BLOCK, 8 * BLOCK], ids=["small", "big"])
def test_a_promotion_past_its_deadline_fails_and_its_late_read_never_reaches_vllms_rows(
    tmp_path: Path, frozen: FrozenStore, monkeypatch: pytest.MonkeyPatch, block_size: int
) -> None:
    """Blocks the tier knows present; their read hangs. The promotion (staged: vLLM 0.33
    always, 0.34 where a block has no single place in the row) is reported failed within
    load_deadline_s (+ margin), vLLM frees its chunks and recomputes: the request finishes
    while the read still hangs. Once the late read has ended, the rows still hold what vLLM
    wrote there meanwhile (here: a pattern)."""
    engine, spy, tokens = promote_hung(tmp_path, monkeypatch, frozen, block_size)
    if engine.tier._transfers.loads_in_place == [True]:
        pytest.skip("read straight into the rows: the next test")
    engine.serve("reader", [*tokens, 999], max_tokens=1)  # returns while the read hangs
    assert engine.first_start["reader"] == 0 and engine.prefix_ok["reader"]
    assert frozen.stuck["read_blocks"] >= 1
    promotions = check_failed_in_time(spy)
    # vLLM 0.33's JobResult has no deferred_release: nothing is held there either
    assert all(getattr(spy.results[i][1], "deferred_release", None) is None for i in promotions)
    stats = engine.tier.stats()
    assert stats["load_deadline_blocks"] >= 1 and stats["late_load_parts"] >= 1
    assert stats["held_chunks"] == 0
    chunks = sorted({int(c) for i in promotions for c in spy.submitted[i][1].chunk_ids})
    rows = np.asarray(engine.tier._primary_kv_view)
    rows[chunks] = 0x5A  # vLLM reuses the freed chunks
    frozen.thaw()
    wait_for(lambda: not engine.tier.stats()["late_load_parts"], "the late reads to end")
    assert (rows[chunks] == 0x5A).all()  # the late reads never wrote into the rows
    engine.shutdown()


@pytest.mark.skipif(not TIER_DEFERS_RELEASE, reason="vLLM 0.34's JobResult.deferred_release")
def test_a_promotion_read_into_the_rows_past_its_deadline_holds_its_chunks_until_the_read_ends(
    tmp_path: Path, frozen: FrozenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.34, 128-token blocks read straight into the rows; the read hangs. The
    promotion is reported failed within load_deadline_s (+ margin) with ``deferred_release``:
    not set while the read hangs (vLLM keeps the chunks out of its free pool, and keeps
    stepping), set once it has ended; then vLLM releases the chunks."""
    engine, spy, tokens = promote_hung(tmp_path, monkeypatch, frozen, 8 * BLOCK)
    assert engine.tier._transfers.loads_in_place == [True]
    tiering: Any = engine.tiering  # 0.34's attributes (mypy runs on 0.33)
    seen: dict[str, Any] = {}

    def thaw_once_held() -> None:  # vLLM steps until the release: serve returns after it
        wait_for(
            lambda: (
                bool(spy.jobs(promotion=True))
                and all(i in spy.results for i in spy.jobs(promotion=True))
            ),
            "the promotion's result",
        )
        results: list[Any] = [spy.results[i][1] for i in spy.jobs(promotion=True)]  # 0.34's
        seen["releases"] = [result.deferred_release for result in results]
        seen["set"] = [r is not None and r.is_set() for r in seen["releases"]]
        seen["held"] = engine.tier.stats()["held_chunks"]
        seen["vllm_held"] = tiering.primary_tier.num_deferred_release_chunks
        frozen.thaw()

    watcher = threading.Thread(target=thaw_once_held)
    watcher.start()
    engine.serve("reader", [*tokens, 999], max_tokens=1)
    watcher.join()
    first = check_failed_in_time(spy)[0]
    assert seen["set"] and not any(seen["set"])  # held while the read hung
    assert seen["held"] >= 1 and seen["vllm_held"] >= 1
    # The hung promotion holds its chunks until its read ended; one vLLM submitted while the
    # store was unresponsive failed at once and read nothing: it holds none (no release).
    first_release: Any = spy.results[first][1]  # 0.34's JobResult
    assert first_release.deferred_release is not None
    assert all(r.is_set() for r in seen["releases"] if r is not None)
    assert engine.tier.stats()["held_chunks"] == 0
    assert tiering.primary_tier.num_deferred_release_chunks == 0
    assert engine.first_start["reader"] == 0 and engine.prefix_ok["reader"]
    engine.shutdown()


@pytest.mark.parametrize("block_size", [BLOCK, 8 * BLOCK], ids=["gathered", "pieces"])
def test_a_store_past_its_deadline_fails_and_what_had_not_started_never_publishes(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    block_size: int,
) -> None:
    """Writes hang; a request's five blocks are stored in parts of one block, on two store
    threads (16-token blocks are gathered into canonical order, 128-token ones written as
    pieces). The store jobs are reported failed within store_deadline_s (+ margin): vLLM's
    backpressure counts them. The three parts still queued then never write, not even after
    the thaw; the two inside the
    store's write had copied their blocks out of the rows first, so what they publish after
    the thaw is the blocks' own bytes (as an ordinary store writes them), although vLLM
    overwrote the rows meanwhile. While the store is unresponsive, later stores are dropped
    at once; a trial finds no free thread and times out: no call joins the stuck ones."""
    frozen = FrozenStore(monkeypatch, ("write_blocks",))
    monkeypatch.setattr(connector.tier.manager, "JOB_BATCH", 1)
    options = EngineOptions(root=tmp_path, block_size=block_size)
    engine = TierEngine(options, store_deadline_s=DEADLINE_S, unresponsive_retry_s=0.2)
    assert engine.tier._transfers.in_place == [block_size > BLOCK]
    spy = Spy(engine.tier, monkeypatch)
    caplog.set_level(logging.WARNING, logger="kvstore.connector")
    frozen.freeze()
    tokens = prompt(5 * block_size + 3)
    request = engine.serve("writer", tokens)  # returns once its store jobs are reported
    jobs = spy.jobs(promotion=False)  # one or more (prefill steps)
    keys = [bytes(k)[:-4] for i in jobs for k in spy.submitted[i][1].keys]
    assert sorted(keys) == sorted(request.block_hashes) and len(keys) == 5
    for job_id in jobs:
        assert not spy.results[job_id][1].success
        assert DEADLINE_S <= spy.waited(job_id) < DEADLINE_S + MARGIN_S
    assert frozen.stuck["write_blocks"] == 2  # two threads; the three parts queued wait
    writing = [w.block_hash for w in frozen.items["write_blocks"]]  # in the store's write
    chunks = [int(c) for i in jobs for c in spy.submitted[i][1].chunk_ids]
    np.asarray(engine.tier._primary_kv_view)[chunks] = 0x5A  # vLLM reuses the chunks
    wait_for(lambda: engine.tier.stats()["unresponsive"] == 1, "the episode")
    # More requests while hung: their stores are dropped at once, but for a trial, which
    # hangs too: never more than one call joins the two stuck ones.
    for i in range(3):
        engine.serve(f"more{i}", prompt(2 * block_size + 1, start=1000 * (i + 1)))
        time.sleep(0.25)  # past unresponsive_retry_s: a trial may go
    assert frozen.stuck["write_blocks"] <= 3
    assert engine.tier.stats()["store_unresponsive_blocks"] >= 1
    assert sum("did not answer a store" in line for line in warnings(caplog)) == 1
    frozen.thaw()
    wait_for(lambda: not engine.tier.stats()["late_store_parts"], "the late writes to end")
    engine.flush_tier()
    name = engine.tier.namespace.name
    engine.shutdown()
    # Two parts were in the store's write; the three others were queued: never written.
    late = block_data(tmp_path, name, keys)
    assert {k for k, data in zip(keys, late, strict=True) if data is not None} == set(writing)
    stored(tmp_path / "reference", block_size, tokens)  # the same blocks, the ordinary way
    reference = block_data(tmp_path / "reference", name, writing)
    for got, expected in zip(block_data(tmp_path, name, writing), reference, strict=True):
        assert got is not None and expected is not None
        assert np.array_equal(got, expected)


def block_data(root: Path, name: str, hashes: list[bytes]) -> list[np.ndarray | None]:
    """The verified data of each block in the store at ``root`` (None: not there)."""
    with KVStore(StoreConfig(root=root)) as store:
        group = store.open_namespace(name).group(0)
        out = [np.zeros(group.layout.block_nbytes, np.uint8) for _ in hashes]
        results = group.read_blocks([BlockRead(h, o) for h, o in zip(hashes, out, strict=True)])
    return [o if r.ok else None for o, r in zip(out, results, strict=True)]


def test_a_deadline_fails_jobs_queued_behind_stuck_threads_and_they_do_no_io() -> None:
    """Two load threads stuck in calls; three more jobs queue behind them. All five are
    reported failed (``timed_out``) by their deadline, the queued ones cut short before they
    ran; the two stuck calls are overdue once each; no thread is added. After the thaw the
    queued parts run no function at all."""
    runner = JobRunner(load_threads=2, store_threads=1)
    thaw, calls = threading.Event(), []

    def stuck(gate: DeliveryGate) -> Outcome:
        calls.append(threading.get_ident())
        assert thaw.wait(60)
        return Outcome(frozenset({b"k"}), 1)

    for job_id in range(5):
        runner.submit(job_id, LOAD, [Part(stuck, frozenset({b"k"}), 0)], Deadline(DEADLINE_S))
        if job_id == 0:  # the load threads start with the first job
            threads = threading.active_count()
    started = time.monotonic()
    reported: list[Any] = []
    while len(reported) < 5:
        assert time.monotonic() - started < DEADLINE_S + MARGIN_S
        reported += runner.finished()
        time.sleep(0.005)
    assert time.monotonic() - started >= DEADLINE_S * 0.9
    assert all(f.timed_out and f.cut_short == {b"k"} and f.release is None for f in reported)
    assert all(not f.outcome.ok_keys for f in reported)
    overdue = runner.overdue_calls()
    assert [kind for kind, _ in overdue] == [LOAD, LOAD]
    assert all(waited > DEADLINE_S for _, waited in overdue)
    assert runner.overdue_calls() == []  # once per call
    assert threading.active_count() == threads and len(calls) == 2
    assert runner.late() == ({LOAD: 2, STORE: 0}, {LOAD: 0, STORE: 0})
    thaw.set()
    runner.shutdown()
    time.sleep(0.05)
    assert len(calls) == 2  # the queued parts never ran their function
    assert runner.finished() == []  # each job reported once


def test_a_job_given_up_on_while_copying_into_the_rows_is_reported_after_the_copy() -> None:
    """Without deferred release (vLLM 0.33, and every store): a part that claimed its gate
    (copying into or out of vLLM's rows) is waited for; one that had not claimed it is cut
    short at once and its claim is refused afterwards."""
    runner = JobRunner(load_threads=2, store_threads=1)
    copying, copied, reading, read = (threading.Event() for _ in range(4))
    refused: list[bool] = []

    def copy(gate: DeliveryGate) -> Outcome:
        assert gate.claim()
        copying.set()
        assert copied.wait(60)
        gate.release()
        return Outcome(frozenset({b"a"}), 1)

    def staged(gate: DeliveryGate) -> Outcome:
        reading.set()
        assert read.wait(60)
        refused.append(not gate.claim())  # given up while it read: nothing reaches the rows
        return Outcome(frozenset(), 0)

    runner.submit(1, LOAD, [Part(copy, frozenset({b"a"}), 0)], Deadline(DEADLINE_S))
    runner.submit(2, LOAD, [Part(staged, frozenset({b"b"}), 0)], Deadline(DEADLINE_S))
    assert copying.wait(30) and reading.wait(30)
    time.sleep(DEADLINE_S + 0.1)
    (second,) = runner.finished()  # the copy holds job 1 back
    assert second.job_id == 2 and second.timed_out and second.cut_short == {b"b"}
    copied.set()
    done: list[Any] = []

    def reported() -> bool:
        done.extend(runner.finished())
        return bool(done)

    wait_for(reported, "job 1")
    (first,) = done  # reported once its copy ended: its key arrived (ended) or cut short
    assert first.job_id == 1 and first.timed_out and first.release is None
    assert {b"a"} in (first.outcome.ok_keys, first.cut_short)
    read.set()
    wait_for(lambda: bool(refused), "the late read to end")
    assert refused == [True]
    runner.shutdown()


def test_deadline_keys_are_parsed_and_checked() -> None:
    config = TierConfig.from_options({"root": "/x"})
    assert (config.lookup_deadline_s, config.load_deadline_s, config.store_deadline_s) == (
        2.0,
        5.0,
        30.0,
    )
    assert (config.deadline_min_mb_per_s, config.unresponsive_retry_s) == (100.0, 5.0)
    parsed = TierConfig.from_options({"root": "/x", "load_deadline_s": "0.5"})
    assert parsed.load_deadline_s == 0.5
    for key in ("lookup_deadline_s", "load_deadline_s", "store_deadline_s", "unresponsive_retry_s"):
        for bad in (0, -1, float("inf"), float("nan")):
            with pytest.raises(ConfigError, match=f"{key}: expected a number of seconds > 0"):
                TierConfig.from_options({"root": "/x", key: bad})
    with pytest.raises(ConfigError, match="deadline_min_mb_per_s: expected a number of MB/s >= 0"):
        TierConfig.from_options({"root": "/x", "deadline_min_mb_per_s": -1})
    assert (
        TierConfig.from_options({"root": "/x", "deadline_min_mb_per_s": 0}).deadline_min_mb_per_s
        == 0
    )
    with pytest.raises(ConfigError, match="load_deadline_s: expected a number"):
        TierConfig.from_options({"root": "/x", "load_deadline_s": "soon"})


def test_the_tier_series_are_declared_to_vllm(tmp_path: Path) -> None:
    """vLLM's tiering spec declares the series of its tiers: ours reach /metrics."""
    metrics = TieringOffloadingSpec.build_metric_definitions(tier_extra(tmp_path))
    for name in (h.TIMEOUT_BLOCKS, h.UNRESPONSIVE_GAUGE, h.UNRESPONSIVE_SECONDS, h.HELD_CHUNKS):
        assert name in metrics
    assert metrics[h.TIMEOUT_BLOCKS].labelnames == ("op", "cause")

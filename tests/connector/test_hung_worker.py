"""A hung store never stalls a worker: its loads and stores have deadlines (issue 35).

One rank's group operations are made to block until the test releases them, as calls on a
frozen mount do (:class:`Freeze`): block reads (``read_blocks``) or writes into pending files
(``write_chunks``). Driven directly on the worker of a real engine, and through vLLM's real
Scheduler (0.33 or 0.34, tests/connector/harness.py). The frozen rank's deadlines are 0.3 s
while it is frozen; the engine's are set (``kv_connector_extra_config``) to 10 s, which the
calls that are not frozen never take, even on a loaded test machine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector tests need vllm==0.33.0 (a separate venv)")

import torch
from vllm.v1.kv_offload.base import TransferResult, make_offload_key

from connector import compat
from connector.config import ConnectorConfig
from connector.offload import metrics as m
from connector.offload.deadlines import MB, JobDeadlines
from connector.offload.transfer_specs import KVStoreLoadSpec, KVStoreStoreSpec
from connector.offload.worker import KVStoreWorker
from kvstore import ConfigError
from kvstore.checksum import checksum_id
from kvstore.cli import main as kvstore_cli
from kvstore.io.deadline import Deadline
from kvstore.store.group_store import GroupStore
from kvstore.store.paths import TMP_MARK

from .harness import BLOCK, Engine, EngineOptions, Rank, gpu_side, kv_value, prompt
from .metered import engine as metered_engine

PROMPT = prompt(5 * BLOCK + 3)
DEADLINE = 0.3
MARGIN = 3.0  # scheduling noise on a loaded test machine, far below "hung"
HUNG = 60.0  # how long a frozen call blocks when nothing thaws it
# A whole request through the fake engine (prefill written and checked token by token): far
# longer than the deadline on a loaded machine, far shorter than waiting for a frozen call.
SERVED = 30.0
FAST = 0.2  # a job failed at once is reported within this (it never waits for I/O)
# write_backoff_s 0: a failed store does not suspend the next ones (the tests store again)
EXTRA = {
    "load_deadline_s": 10.0,
    "store_deadline_s": 10.0,
    "unresponsive_retry_s": 0.5,
    "write_backoff_s": 0,
}
SENTINEL = 7.0


class Freeze:
    """Replaces one method of a rank's :class:`GroupStore`: every call blocks until
    :meth:`thaw` (then runs the real one), as a call on a hung mount does. Meanwhile the
    rank's jobs have deadlines of :data:`DEADLINE` (jobs submitted before the thaw keep them)."""

    def __init__(self, rank: Rank, method: str) -> None:
        self.worker = rank.worker
        group = group_of(rank)
        self.real = getattr(group, method)
        self.thawed = threading.Event()
        self.calls = 0
        setattr(group, method, self)
        self.relaxed = self.worker.deadlines
        rate = self.relaxed.load.min_bytes_per_s
        self.worker.deadlines = dataclasses.replace(
            self.relaxed, load=Deadline(DEADLINE, rate), store=Deadline(DEADLINE, rate)
        )

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        self.thawed.wait(HUNG)
        return self.real(*args)

    def thaw(self) -> None:
        self.worker.deadlines = self.relaxed
        self.thawed.set()


def until(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def finished(worker: KVStoreWorker, timeout: float) -> list[TransferResult]:
    """Poll ``get_finished`` (as vLLM does every step) until it reports something."""
    deadline = time.monotonic() + timeout
    while not (results := worker.get_finished()):
        assert time.monotonic() < deadline, f"nothing reported within {timeout} s"
        time.sleep(0.005)
    return results


def episode_lines(caplog: pytest.LogCaptureFixture) -> tuple[list[str], list[str]]:
    """(episode starts, episode ends) the workers logged."""
    lines = [r.getMessage() for r in caplog.records if r.name == "kvstore.connector"]
    return [s for s in lines if "did not answer" in s], [s for s in lines if "answers again" in s]


def group_of(rank: Rank) -> GroupStore:
    return rank.worker.groups[0].rank_io.group


def load_keys(hashes: list[Any]) -> list[bytes]:
    return [make_offload_key(bytes(h), 0) for h in hashes]


def fill(rank: Rank, blocks: list[int], value: float) -> None:
    for tensor in rank.kv.values():
        tensor[blocks] = value


def snapshot(engine: Engine) -> list[torch.Tensor]:
    return [t.clone() for rank in engine.ranks for t in rank.kv.values()]


def unchanged(engine: Engine, before: list[torch.Tensor]) -> bool:
    after = [t for rank in engine.ranks for t in rank.kv.values()]
    return all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def holds_prompt_blocks(engine: Engine, rank: Rank, gpu_blocks: list[int]) -> bool:
    """Whether ``gpu_blocks`` hold the KV of PROMPT's first blocks, in order."""
    for logical, block in enumerate(gpu_blocks):
        for name, tensor in rank.kv.items():
            layer = engine.layer_index(name)
            positions = range(logical * BLOCK, (logical + 1) * BLOCK)
            expected = torch.stack(
                [kv_value(layer, p, PROMPT[p], engine.heads, engine.width) for p in positions],
                dim=1,
            )[rank.heads]
            if not torch.equal(tensor[block], expected):
                return False
    return True


def store_spec(worker: KVStoreWorker, hashes: list[bytes]) -> KVStoreStoreSpec:
    group = worker.groups[0].rank_io.group
    pendings = group.begin_blocks(hashes)
    checksum = checksum_id(worker.store.checksum)
    return KVStoreStoreSpec(group.namespace, checksum, load_keys(hashes), pendings)


@pytest.fixture
def stored(tmp_path: Path) -> Iterator[tuple[Engine, list[Any]]]:
    """An engine with short deadlines whose store holds PROMPT's 5 blocks."""
    built = Engine(EngineOptions(root=tmp_path, extra=EXTRA))
    assert built.ranks[0].worker.deadlines.load == Deadline(10.0, 100 * MB)  # from the config
    request = built.serve("writer", PROMPT)
    assert built.manager.counters["blocks_published"] == 5
    yield built, list(request.block_hashes)
    built.shutdown()


def test_a_load_past_its_deadline_fails_and_its_late_read_never_lands(
    stored: tuple[Engine, list[Any]], caplog: pytest.LogCaptureFixture
) -> None:
    engine, hashes = stored
    rank = engine.ranks[0]
    worker = rank.worker
    caplog.set_level(logging.WARNING, logger="kvstore.connector")
    blocks = [10, 11, 12]
    fill(rank, blocks, SENTINEL)
    before = snapshot(engine)
    keys = load_keys(hashes[:3])
    read = Freeze(rank, "read_blocks")
    started = time.monotonic()
    assert worker.submit_load(1, KVStoreLoadSpec(keys, "r"), gpu_side(rank, blocks, [3]))
    [result] = finished(worker, DEADLINE + MARGIN)
    waited = time.monotonic() - started
    assert DEADLINE <= waited < DEADLINE + MARGIN
    assert read.calls == 1  # the read is still blocked in the "file system"
    # Reported exactly as a failed read: vLLM recomputes those blocks (0.32, 0.33), or the
    # request (0.34 takes a failed job).
    assert result.job_id == 1
    if compat.VLLM_REPORTS_FAILED_JOBS:
        assert not result.success
        assert worker.take_load_error_blocks() == set()
    else:
        assert result.success
        assert worker.take_load_error_blocks() == set(blocks)
    assert worker.take_failed_keys() == ([], keys)
    assert worker.take_failure_causes() == dict.fromkeys(keys, m.TIMEOUT)
    health = worker.take_health()
    assert (health.late_loads, health.unresponsive) == (1, 1)
    assert health.late_bytes == 3 * worker.groups[0].rank_io.read_nbytes
    starts, ends = episode_lines(caplog)
    assert len(starts) == 1 and "load" in starts[0] and "load_deadline_s" in starts[0]
    assert not ends

    read.thaw()  # the mount answers: the late read completes, and must not land
    until(lambda: worker.get_finished() == [] and worker.watch.late == 0, "the late read")
    assert unchanged(engine, before)
    health = worker.take_health()
    assert (health.late_loads, health.unresponsive) == (-1, -1)
    assert health.late_bytes == -3 * worker.groups[0].rank_io.read_nbytes
    assert health.unresponsive_seconds > 0
    starts, ends = episode_lines(caplog)
    assert len(starts) == 1 and len(ends) == 1

    # The store answers again: the same load now delivers.
    assert worker.submit_load(2, KVStoreLoadSpec(keys, "r"), gpu_side(rank, blocks, [3]))
    worker.wait({2})
    [result] = finished(worker, MARGIN)
    assert result.success and worker.take_load_error_blocks() == set()
    assert worker.take_failed_keys() == ([], [])
    assert holds_prompt_blocks(engine, rank, blocks)


def test_waiting_for_a_load_returns_at_its_deadline(stored: tuple[Engine, list[Any]]) -> None:
    """vLLM waits for synchronous loads inside the step (``wait``): never past the deadline."""
    engine, hashes = stored
    rank = engine.ranks[0]
    worker = rank.worker
    read = Freeze(rank, "read_blocks")
    keys = load_keys(hashes[:2])
    sync = {"expedited": True} if compat.VLLM_HAS_SYNC_LOADS else {}
    started = time.monotonic()
    assert worker.submit_load(1, KVStoreLoadSpec(keys, "r"), gpu_side(rank, [8, 9], [2]), **sync)
    worker.wait({1})
    assert DEADLINE <= time.monotonic() - started < DEADLINE + MARGIN
    [result] = worker.get_finished()  # reported at once: given up by wait
    # A synchronous load's request already runs this step: block-level errors on every version
    # (vLLM 0.34 would stop the engine on a failed synchronous job).
    assert result.job_id == 1 and result.success
    assert worker.take_load_error_blocks() == {8, 9}
    assert worker.take_failure_causes() == dict.fromkeys(keys, m.TIMEOUT)
    read.thaw()
    until(lambda: worker.get_finished() == [] and worker.watch.late == 0, "the late read")


def test_while_unresponsive_jobs_fail_at_once_but_for_one_trial_per_interval(
    stored: tuple[Engine, list[Any]], caplog: pytest.LogCaptureFixture
) -> None:
    engine, hashes = stored
    rank = engine.ranks[0]
    worker = rank.worker
    caplog.set_level(logging.WARNING, logger="kvstore.connector")
    read = Freeze(rank, "read_blocks")

    def load(job_id: int, block: int) -> None:
        spec = KVStoreLoadSpec(load_keys(hashes[:1]), f"r{job_id}")
        assert worker.submit_load(job_id, spec, gpu_side(rank, [block], [1]))

    def failed_at_once(job_ids: set[int], cause: str) -> None:
        results = worker.get_finished()  # right after the submission: no I/O was waited for
        assert {r.job_id for r in results} == job_ids
        causes = worker.take_failure_causes()
        assert set(causes.values()) == {cause}

    load(1, 10)
    finished(worker, DEADLINE + MARGIN)  # given up: the episode starts
    worker.take_failure_causes()
    load(2, 11)
    failed_at_once({2}, m.UNRESPONSIVE_REASON)
    # A store while unresponsive is dropped: nothing snapshot, nothing written, no thread.
    spec = store_spec(worker, [bytes(range(32))])
    assert worker.submit_store(3, gpu_side(rank, [12], [1]), spec)
    failed_at_once({3}, m.UNRESPONSIVE_REASON)
    assert worker.take_failed_keys()[0] == list(spec.keys)
    assert not Path(group_of(rank).temp_path(spec.pending(0))).exists()
    assert read.calls == 1

    # After retry_interval_s one job (of three) goes to the store as a trial; the trial is
    # blocked too and given up at its deadline, and until it returns no other job is tried,
    # however long it takes.
    time.sleep(0.6)
    for job_id in (4, 5, 6):
        load(job_id, 10 + job_id)
    failed_at_once({5, 6}, m.UNRESPONSIVE_REASON)
    until(lambda: read.calls == 2, "the trial read")
    [trial] = finished(worker, DEADLINE + MARGIN)
    assert trial.job_id == 4
    assert worker.take_failure_causes() == {load_keys(hashes[:1])[0]: m.TIMEOUT}
    time.sleep(0.6)
    load(7, 17)
    failed_at_once({7}, m.UNRESPONSIVE_REASON)
    assert read.calls == 2 and worker.watch.late == 2
    starts, ends = episode_lines(caplog)
    assert (len(starts), len(ends)) == (1, 0)  # one line for the whole episode

    read.thaw()
    until(lambda: worker.get_finished() == [] and worker.watch.late == 0, "the late reads")
    starts, ends = episode_lines(caplog)
    assert (len(starts), len(ends)) == (1, 1)
    load(8, 20)  # loads go to the store again, and hit
    [result] = finished(worker, MARGIN)
    assert result.success and worker.take_failure_causes() == {}
    assert read.calls == 3
    assert holds_prompt_blocks(engine, rank, [20])


@pytest.mark.parametrize("tp", [1, 2])
def test_a_stuck_load_is_recomputed_through_the_scheduler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tp: int
) -> None:
    """vLLM's real Scheduler: the request whose load hangs (on rank 0) is recomputed from its
    start, the metrics tell what happened (each block once), the late read never lands, and
    after the store answers again requests load from it as before."""
    # No trial during the test: every store is dropped while the store is unresponsive.
    metered = metered_engine(
        monkeypatch, root=tmp_path, tp=tp, extra={**EXTRA, "unresponsive_retry_s": 60}
    )
    engine = metered.engine
    caplog.set_level(logging.WARNING, logger="kvstore.connector")
    engine.serve("writer", PROMPT)
    engine.wipe_kv()
    assert engine.scheduler.reset_prefix_cache()
    read = Freeze(engine.ranks[0], "read_blocks")
    started = time.monotonic()
    engine.add("reader", [*PROMPT, 999], max_tokens=1)
    engine.run(max_steps=20_000)
    assert time.monotonic() - started < SERVED
    assert read.calls == 1
    assert engine.first_start["reader"] == 0  # recomputed from its first token
    assert engine.prefix_ok["reader"] and min(engine.computed["reader"]) == 0
    assert metered.value(m.FAILED_BLOCKS, m.LOAD, m.TIMEOUT) == 5
    assert metered.value(m.LOADED_BLOCKS) == 0
    assert metered.value(m.LATE_JOBS, m.LOAD) == 1
    assert metered.value(m.LATE_BYTES) > 0
    assert metered.value(m.WORKER_UNRESPONSIVE) == 1
    assert metered.value(m.WORKER_UNRESPONSIVE_SECONDS) >= DEADLINE
    # The recomputed blocks were offered to the store again, and dropped by the worker at
    # once (no thread, no write); so are a new prompt's.
    assert metered.value(m.STORE_DROPPED_BLOCKS, m.UNRESPONSIVE_REASON) == 5
    engine.serve("other", prompt(2 * BLOCK + 1, start=5000))
    assert metered.value(m.STORE_DROPPED_BLOCKS, m.UNRESPONSIVE_REASON) == 7
    assert metered.value(m.LOOKUP_TIMEOUTS) >= 1  # its lookup: a miss, the store not asked
    assert metered.labelled(m.FAILED_BLOCKS) == {(m.LOAD, m.TIMEOUT): 5}

    before = snapshot(engine)
    read.thaw()
    worker = engine.ranks[0].worker
    until(lambda: worker.get_finished() == [] and worker.watch.late == 0, "the late read")
    assert unchanged(engine, before)  # the late read never reached the KV cache
    engine.step()  # the workers tell the scheduler in their next step's metadata

    engine.wipe_kv()
    assert engine.scheduler.reset_prefix_cache()
    engine.serve("again", [*PROMPT, 998], max_tokens=1)
    assert engine.first_start["again"] == 5 * BLOCK  # loaded from the store again
    assert engine.prefix_ok["again"]
    assert metered.value(m.LOADED_BLOCKS) == 5
    assert metered.value(m.LATE_JOBS, m.LOAD) == 0
    assert metered.value(m.LATE_BYTES) == 0
    assert metered.value(m.WORKER_UNRESPONSIVE) == 0
    starts, ends = episode_lines(caplog)
    assert (len(starts), len(ends)) == (1, 1)


def test_a_store_past_its_deadline_is_never_published(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The write hangs: the store is reported failed at its deadline and its blocks are not
    published, not even once the write completes; what it leaves is a temporary file, which
    ``kvstore verify`` does not count as a published block and ``--fix`` removes."""
    metered = metered_engine(monkeypatch, root=tmp_path, extra=EXTRA)
    engine = metered.engine
    caplog.set_level(logging.WARNING, logger="kvstore.connector")
    worker = engine.ranks[0].worker
    group = group_of(engine.ranks[0])
    write = Freeze(engine.ranks[0], "write_chunks")
    started = time.monotonic()
    request = engine.add("writer", PROMPT)
    engine.run(max_steps=20_000)
    assert time.monotonic() - started < SERVED
    assert write.calls == 1
    assert engine.manager.counters["blocks_published"] == 0
    assert metered.value(m.FAILED_BLOCKS, m.STORE, m.TIMEOUT) == 5
    assert metered.value(m.STORED_BLOCKS) == 0
    assert metered.value(m.LATE_JOBS, m.STORE) == 1
    assert metered.value(m.LATE_BYTES) == 5 * worker.groups[0].rank_io.mapping.share_bytes
    starts, _ = episode_lines(caplog)
    assert len(starts) == 1 and "store_deadline_s" in starts[0]

    write.thaw()  # the write completes, after the scheduler aborted the block
    until(lambda: worker.get_finished() == [] and worker.watch.late == 0, "the late write")
    hashes = [bytes(h) for h in request.block_hashes]
    assert group.contains(hashes) == [False] * 5
    assert not any(Path(group.path_of(h)).exists() for h in hashes)
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file() and TMP_MARK in p.name]
    assert all(p.name.startswith(".") for p in leftovers)  # temporaries, never block names
    assert kvstore_cli(["verify", str(tmp_path), "--json"]) == 0  # no bad block, nothing published
    capsys.readouterr()
    assert kvstore_cli(["verify", str(tmp_path), "--tmp-age", "0s", "--fix", "--json"]) in (0, 1)
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["counts"]) <= {"orphan-temp"}
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and TMP_MARK in p.name]

    # The late write returned: the episode ended, and stores publish again.
    _, ends = episode_lines(caplog)
    assert len(ends) == 1
    engine.serve("rewriter", PROMPT)
    assert engine.manager.counters["blocks_published"] == 5
    assert metered.value(m.LATE_JOBS, m.STORE) == 0


def test_deadline_keys_are_checked_and_allow_for_size() -> None:
    config = ConnectorConfig.from_extra_config(
        {"root": "/data/kv", "load_deadline_s": "1.5", "deadline_min_mb_per_s": 50}
    )
    deadlines = JobDeadlines.of(config)
    assert deadlines.load.seconds(100 * MB) == pytest.approx(1.5 + 2.0)
    assert deadlines.store.seconds(0) == 30.0
    assert JobDeadlines.of(ConnectorConfig(deadline_min_mb_per_s=0)).load.seconds(10**12) == 5.0
    for key in ("load_deadline_s", "store_deadline_s", "unresponsive_retry_s"):
        for bad in (0, -1.0, float("inf"), "2", True):
            values: dict[str, Any] = {key: bad}
            with pytest.raises(ConfigError, match=f"{key}: expected a number of seconds > 0"):
                ConnectorConfig(**values)
    for bad in (-1, float("inf"), "100"):
        with pytest.raises(ConfigError, match="deadline_min_mb_per_s: expected a number of MB/s"):
            ConnectorConfig(deadline_min_mb_per_s=bad)  # type: ignore[arg-type]

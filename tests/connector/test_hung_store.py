"""A hung store (a frozen NFS server, a wedged FUSE daemon) never stalls the scheduler.

The manager of a real engine's namespace, driven directly with a fake clock; its existence
probe, or its publish (``commit_blocks``: the rename into place) or abort (``abort_blocks``)
of blocks a real rank wrote, is made to block until the test releases it, as a call on a
frozen mount does. ``drain`` and ``shutdown`` are timed on vLLM's own manager (real clock).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector tests need vllm==0.33.0 (a separate venv)")

from vllm.v1.kv_offload.base import LookupResult, ReqContext

from connector.offload import metrics as m
from connector.offload.manager import KVStoreManager
from kvstore.store.paths import TMP_MARK

from .harness import Engine, EngineOptions, gpu_side
from .test_manager import Clock, finish, keys, manager_of


class FrozenProbe:
    """Replaces a manager's probe: blocks every call until :meth:`thaw` (then answers)."""

    def __init__(self, manager: KVStoreManager) -> None:
        self.real = manager.probes.probe
        self.thawed = threading.Event()
        self.calls = 0
        manager.probes.probe = self  # type: ignore[method-assign]

    def __call__(self, keys: Sequence[bytes]) -> list[tuple[bytes, bool]]:
        self.calls += 1
        self.thawed.wait(30)
        return self.real(keys)

    def thaw(self) -> None:
        self.thawed.set()


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    built = Engine(EngineOptions(root=tmp_path, extra={"lookup_deadline_s": 2.0}))
    yield built
    built.shutdown()


def settle(probe: FrozenProbe, calls: int) -> None:
    """Wait until ``calls`` probes are blocked in the (frozen) store."""
    deadline = time.monotonic() + 10
    while probe.calls < calls:
        assert time.monotonic() < deadline, "the probe never started"
        time.sleep(0.005)


def test_lookups_answer_miss_past_the_deadline_and_resume_after_thaw(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    clock, context = Clock(), ReqContext(req_id="r")
    manager = manager_of(engine, clock)
    probe = FrozenProbe(manager)
    first, second, third = keys(1, 2, 3)
    caplog.set_level(logging.WARNING, logger="kvstore.connector")
    try:
        assert manager.lookup(first, context) is LookupResult.RETRY
        manager.on_schedule_end(None)  # flush: the probe is now stuck in the store
        settle(probe, 1)
        clock.now += 1.0  # within the deadline: vLLM hears "retry" and asks again
        assert manager.lookup(first, context) is LookupResult.RETRY
        clock.now += 1.5  # past it: a miss (recompute), and the store is unresponsive
        assert manager.lookup(first, context) is LookupResult.MISS
        assert manager.metrics.counter(m.LOOKUP_TIMEOUTS) == 1
        # A new key while unresponsive: a miss at once, and no new probe is started.
        assert manager.lookup(second, context) is LookupResult.MISS
        manager.on_schedule_end(None)
        time.sleep(0.05)
        assert probe.calls == 1 and manager.metrics.counter(m.LOOKUP_TIMEOUTS) == 2
        assert not manager.has_pending_work()  # the engine does not spin on a stuck probe
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 1 and "did not answer" in warnings[0]
        # More lookups while hung: still one line for the whole episode.
        for _ in range(5):
            assert manager.lookup(third, context) is LookupResult.MISS
        assert len(caplog.records) == 1
        stats = manager.get_stats()
        assert stats is not None
    finally:
        probe.thaw()
    # The store answers: the late probe's result is applied, the episode ends (one line,
    # its length counted), and lookups probe the store again.
    deadline = time.monotonic() + 10
    while manager.probes.late and not all(f.done() for _, f in manager.probes.late):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    clock.now += 3.0
    manager._drain()
    assert manager.ledger.since is None
    assert manager.metrics.counter(m.UNRESPONSIVE_SECONDS) == pytest.approx(5.5, abs=0.01)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "answered again after" in lines[1]
    clock.now += 10  # past miss_ttl_s: the keys answered miss are probed again
    assert manager.lookup(third, context) is LookupResult.RETRY
    settled(manager)
    assert manager.lookup(third, context) is LookupResult.MISS  # really absent now
    assert probe.calls >= 2


def test_a_deadline_must_be_positive(tmp_path: Path) -> None:
    from connector.config import ConnectorConfig  # noqa: PLC0415
    from kvstore.errors import ConfigError  # noqa: PLC0415

    for bad in (0, -1.0, float("inf"), "2"):
        with pytest.raises(ConfigError, match="lookup_deadline_s: expected a number of seconds"):
            ConnectorConfig(lookup_deadline_s=bad)  # type: ignore[arg-type]


# -- publishes and aborts (store_deadline_s) ---------------------------------------------------

PUBLISH_DEADLINE = 0.5  # store_deadline_s of these tests (no size allowance)
MARGIN = 3.0  # scheduling noise on a loaded test machine, far below "hung"
HUNG = 60.0  # how long a frozen call blocks when nothing thaws it


class FrozenGroup:
    """Replaces one method of the namespace's :class:`GroupStore` (``commit_blocks``: the
    rename into place; ``abort_blocks``: removing temporary files): every call blocks until
    :meth:`thaw`, then runs the real one, as a call on a hung mount does."""

    def __init__(self, manager: KVStoreManager, method: str) -> None:
        self.group = manager.namespace.group(0)
        self.method = method
        self.real = getattr(self.group, method)
        self.thawed = threading.Event()
        self.calls = 0
        setattr(self.group, method, self)

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        self.thawed.wait(HUNG)
        return self.real(*args)

    def thaw(self) -> None:
        self.thawed.set()
        if self.group.__dict__.get(self.method) is self:
            delattr(self.group, self.method)


@pytest.fixture
def publishing(tmp_path: Path) -> Iterator[Engine]:
    extra = {
        "lookup_deadline_s": 2.0,
        "store_deadline_s": PUBLISH_DEADLINE,
        "deadline_min_mb_per_s": 0,
        "write_backoff_s": 0,
    }
    built = Engine(EngineOptions(root=tmp_path, extra=extra))
    yield built
    built.shutdown()


def written(engine: Engine, manager: KVStoreManager, seeds: Sequence[int], job: int) -> list[Any]:
    """Offer blocks ``seeds`` to ``manager`` and have the rank write them (not yet
    published); returns the keys to store."""
    out = manager.prepare_store(keys(*seeds), ReqContext(req_id=f"store-{job}"))
    assert out.keys_to_store == keys(*seeds)
    worker = engine.ranks[0].worker
    blocks = [10 + 4 * job + i for i in range(len(seeds))]  # jobs of up to 4 blocks
    assert worker.submit_store(job, gpu_side(engine.ranks[0], blocks, [len(seeds)]), out.store_spec)
    worker.wait({job})
    finish(worker, job)
    return list(out.keys_to_store)


def temporaries(engine: Engine) -> list[Path]:
    return list(engine.options.root.rglob(f"*{TMP_MARK}*"))


def in_store(manager: KVStoreManager, stored: Sequence[Any]) -> list[bool]:
    """Whether the store holds a published block of each key (a probe, on this thread)."""
    return [present for _, present in manager.probes.probe([bytes(k) for k in stored])]


def started(frozen: FrozenGroup) -> None:
    """Until the frozen call is blocked in the (frozen) store."""
    deadline = time.monotonic() + 10
    while frozen.calls < 1:
        assert time.monotonic() < deadline, "the frozen call never started"
        time.sleep(0.005)


def wait_returned(manager: KVStoreManager) -> None:
    """Until every late publish's thread returned (after a thaw)."""
    deadline = time.monotonic() + 10
    while not all(job.future.done() for job in manager.publishes.late):
        assert time.monotonic() < deadline, "the late publish never returned"
        time.sleep(0.005)


def settled(manager: KVStoreManager) -> None:
    """Until every probe and publish in flight returned (however loaded the machine: the
    deadlines of these tests are short), then apply them."""
    manager.on_schedule_end(None)
    deadline = time.monotonic() + 10
    while not all(f.done() for _, f, _ in manager.probes.in_flight) or not all(
        job.future.done() for job in manager.publishes.in_time
    ):
        assert time.monotonic() < deadline, "a job never returned"
        time.sleep(0.005)
    manager.on_schedule_end(None)


def gauges(manager: KVStoreManager, sent: dict[str, Any]) -> dict[str, Any]:
    """The scheduler's hung-store gauges as its stats payloads sent them so far (``sent``
    keeps them: a gauge is sent when it changes). Takes the counters too."""
    stats = manager.get_stats()
    data = stats.data["data"] if stats is not None else {}
    series = {
        "unresponsive": (m.UNRESPONSIVE, ()),
        "late": (m.LATE_JOBS, (m.PUBLISH,)),
        "pending": (m.PENDING_JOBS, (m.PUBLISH,)),
    }
    for what, (name, labels) in series.items():
        if labels in data.get(name, {}):
            sent[what] = data[name][labels]
    return sent


def hung_lines(caplog: pytest.LogCaptureFixture) -> tuple[list[str], list[str]]:
    """(episode starts, episode ends) the scheduler side logged."""
    lines = [r.getMessage() for r in caplog.records if r.name == "kvstore.connector"]
    return [s for s in lines if "did not answer" in s], [s for s in lines if "answered again" in s]


def test_a_late_publish_stops_counting_and_applies_after_the_thaw(
    publishing: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    engine, clock, context = publishing, Clock(), ReqContext(req_id="r")
    manager = manager_of(engine, clock)
    caplog.set_level(logging.WARNING, logger="kvstore.connector")
    first = written(engine, manager, (1, 2), job=1)
    second = written(engine, manager, (3, 4), job=2)  # completes while the store is hung
    frozen = FrozenGroup(manager, "commit_blocks")
    sent: dict[str, Any] = {}
    probe_threads = [t for t in threading.enumerate() if t.name.startswith("kvstore-probe")]
    try:
        manager.complete_store(first, context)
        started(frozen)
        clock.now += PUBLISH_DEADLINE / 2  # within the deadline: still pending work
        manager.on_schedule_end(None)
        assert manager.has_pending_work()
        assert manager.lookup(first[0], context) is LookupResult.HIT_PENDING
        clock.now += PUBLISH_DEADLINE  # past it: late
        manager.on_schedule_end(None)
        assert not manager.has_pending_work()  # an idle engine does not spin on the mount
        assert manager.metrics.counter(m.FAILED_BLOCKS, m.STORE, m.TIMEOUT) == 2
        # Not believed present (nor being published) until the late publish returns.
        for key in first:
            assert manager.lookup(key, context) is LookupResult.MISS
        assert manager.prepare_store(first, context).keys_to_store == []
        starts, ends = hung_lines(caplog)
        assert len(starts) == 1 and "publish" in starts[0] and "store_deadline_s" in starts[0]
        assert not ends
        # Unresponsive: nothing new goes to the store. A new store is not offered, a finished
        # store job is not published (dropped; its temporary files stay until it answers).
        assert manager.prepare_store(keys(5), context).keys_to_store == []
        manager.complete_store(second, context)
        assert manager.publishes.in_time == [] and frozen.calls == 1
        assert manager.metrics.counter(m.STORE_DROPPED_BLOCKS, m.UNRESPONSIVE_REASON) == 3
        assert len(temporaries(engine)) == 4  # both jobs' blocks, neither published
        for _ in range(5):
            assert manager.lookup(keys(6)[0], context) is LookupResult.MISS
            manager.on_schedule_end(None)
        # one line per episode
        assert manager.probes.in_flight == [] and len(hung_lines(caplog)[0]) == 1
        assert gauges(manager, sent) == {"unresponsive": 1, "late": 1, "pending": 1}
        assert manager.ledger.pending_bytes == 0  # nothing holds back new stores once it answers
        now_threads = [t for t in threading.enumerate() if t.name.startswith("kvstore-probe")]
        assert len(now_threads) == len(probe_threads)  # the pool did not grow
    finally:
        frozen.thaw()
    wait_returned(manager)
    clock.now += 1.0
    manager.on_schedule_end(None)
    # The late publish applied: its blocks are present (one rename each: whole), found
    # without a probe, and not counted a second time; the episode ended (one line).
    assert manager.publishes.late == [] and manager.ledger.since is None
    for key in first:
        assert manager.lookup(key, context) is LookupResult.HIT
    assert in_store(manager, first) == [True, True]
    assert manager.counters["blocks_published_late"] == 2
    assert manager.metrics.counter(m.STORED_BLOCKS) == 0
    assert manager.metrics.counter(m.UNRESPONSIVE_SECONDS) == pytest.approx(
        PUBLISH_DEADLINE * 1.5 + 1.0, abs=0.01
    )
    starts, ends = hung_lines(caplog)
    assert len(starts) == 1 and len(ends) == 1
    assert {k: v for k, v in gauges(manager, sent).items() if k != "pending"} == {
        "unresponsive": 0,
        "late": 0,
    }
    # The dropped job's temporary files are removed now; the other job's were renamed.
    settled(manager)
    assert temporaries(engine) == []
    assert in_store(manager, second) == [False, False]
    # Stores go to the store again.
    assert manager.prepare_store(keys(5), context).keys_to_store == keys(5)


def test_a_late_publish_that_failed_leaves_its_keys_absent(publishing: Engine) -> None:
    """A late publish whose rename then fails (the mount came back with an error): the keys
    are not present, lookups probe them again; the failure was counted at the deadline."""
    engine, clock, context = publishing, Clock(), ReqContext(req_id="r")
    manager = manager_of(engine, clock)
    stored = written(engine, manager, (1,), job=1)
    frozen = FrozenGroup(manager, "commit_blocks")

    def fail(*_args: Any) -> Any:
        raise OSError(5, "Input/output error")

    frozen.real = fail
    try:
        manager.complete_store(stored, context)
        started(frozen)
        clock.now += PUBLISH_DEADLINE * 2
        manager.on_schedule_end(None)
        assert manager.lookup(stored[0], context) is LookupResult.MISS
    finally:
        frozen.thaw()
    wait_returned(manager)
    clock.now += 10  # past miss_ttl_s
    manager.on_schedule_end(None)
    assert manager.ledger.since is None and not manager.ledger.late_keys
    assert manager.lookup(stored[0], context) is LookupResult.RETRY  # probed again
    settled(manager)
    assert manager.lookup(stored[0], context) is LookupResult.MISS
    assert manager.metrics.counter(m.FAILED_BLOCKS, m.STORE, m.TIMEOUT) == 1
    assert manager.metrics.counter(m.FAILED_BLOCKS, m.STORE, m.IO_ERROR) == 0  # counted once
    assert temporaries(engine) == []  # the failed publish removed its temporary file


def test_a_late_abort_is_not_waited_for(
    publishing: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    engine, clock, context = publishing, Clock(), ReqContext(req_id="r")
    manager = manager_of(engine, clock)
    caplog.set_level(logging.WARNING, logger="kvstore.connector")
    stored = written(engine, manager, (1, 2), job=1)
    frozen = FrozenGroup(manager, "abort_blocks")
    try:
        manager.note_worker_failures([bytes(k) for k in stored], [])  # a rank failed them
        manager.complete_store(stored, context)
        started(frozen)
        assert manager.has_pending_work()
        clock.now += PUBLISH_DEADLINE * 2
        manager.on_schedule_end(None)
        assert not manager.has_pending_work()
        # Counted with the rank's cause, at the deadline; the store is unresponsive.
        assert manager.metrics.counter(m.FAILED_BLOCKS, m.STORE, m.IO_ERROR) == 2
        assert len(hung_lines(caplog)[0]) == 1
        assert manager.lookup(keys(7)[0], context) is LookupResult.MISS
        assert len(temporaries(engine)) == 2
    finally:
        frozen.thaw()
    wait_returned(manager)
    manager.on_schedule_end(None)
    assert manager.ledger.since is None and len(hung_lines(caplog)[1]) == 1
    assert temporaries(engine) == []
    assert manager.metrics.counter(m.FAILED_BLOCKS, m.STORE, m.IO_ERROR) == 2  # not again


@pytest.mark.parametrize("method", ["commit_blocks", "abort_blocks"])
def test_drain_and_shutdown_wait_no_longer_than_the_deadline(
    publishing: Engine, method: str, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's own manager (the real clock): a publish or abort frozen in the store holds up
    neither ``drain`` nor ``shutdown`` past ``store_deadline_s``; shutdown says so in one
    line and leaves the thread behind, and the store's blocks stay whole."""
    engine, context = publishing, ReqContext(req_id="r")
    manager = engine.manager
    caplog.set_level(logging.WARNING, logger="kvstore.connector")
    stored = written(engine, manager, (1, 2), job=1)
    written(engine, manager, (3,), job=2)  # never completed: aborted at shutdown
    frozen = FrozenGroup(manager, method)
    try:
        if method == "abort_blocks":
            manager.note_worker_failures([bytes(k) for k in stored], [])
        manager.complete_store(stored, context)
        started(frozen)
        start = time.monotonic()
        manager.drain(timeout=HUNG)
        assert time.monotonic() - start < PUBLISH_DEADLINE + MARGIN
        assert frozen.calls == 1
        start = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - start < PUBLISH_DEADLINE + MARGIN
        lines = [r.getMessage() for r in caplog.records if "at shutdown" in r.getMessage()]
        assert len(lines) == 1 and "1 publishes are still blocked" in lines[0]
        assert "1 temporary block files left" in lines[0]  # not removed on a hung store
        assert frozen.calls == 1  # nothing more went to the hung store
    finally:
        frozen.thaw()
    wait_returned(manager)
    if method == "commit_blocks":  # the late rename still lands, whole
        assert in_store(manager, stored) == [True, True]
    assert len(temporaries(engine)) == 1  # the job never completed: left for kvstore gc


def test_a_late_publish_keeps_its_keys_absent_after_another_job_answered(
    publishing: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """The episode ends with the first late job that returns (here a probe); a publish still
    stuck keeps its keys out of the index: a miss without a probe, not stored again."""
    engine, clock, context = publishing, Clock(), ReqContext(req_id="r")
    manager = manager_of(engine, clock)
    caplog.set_level(logging.WARNING, logger="kvstore.connector")
    stored = written(engine, manager, (1, 2), job=1)
    publish = FrozenGroup(manager, "commit_blocks")
    probe = FrozenProbe(manager)
    try:
        manager.complete_store(stored, context)
        assert manager.lookup(keys(9)[0], context) is LookupResult.RETRY
        manager.on_schedule_end(None)
        settle(probe, 1)
        clock.now += 2.5  # past both deadlines
        manager.on_schedule_end(None)
        assert len(manager.publishes.late) == 1 and len(manager.probes.late) == 1
        assert len(hung_lines(caplog)[0]) == 1  # one episode for both
        probe.thaw()
        deadline = time.monotonic() + 10
        while not all(f.done() for _, f in manager.probes.late):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        manager.on_schedule_end(None)
        assert manager.ledger.since is None and len(hung_lines(caplog)[1]) == 1
        for key in stored:
            assert manager.lookup(key, context) is LookupResult.MISS
        assert manager.probes.queue == []  # answered without a probe
        assert manager.prepare_store(stored, context).keys_to_store == []  # not stored twice
        assert not manager.has_pending_work()
    finally:
        publish.thaw()
        probe.thaw()
    wait_returned(manager)
    manager.on_schedule_end(None)
    assert [manager.lookup(k, context) for k in stored] == [LookupResult.HIT] * 2
    assert in_store(manager, stored) == [True, True]

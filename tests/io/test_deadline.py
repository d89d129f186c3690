"""kvstore.io.deadline: call deadlines, the delivery gate, unresponsive episodes."""

from __future__ import annotations

import errno
import functools
import logging
import threading
import time

import pytest

from kvstore import ConfigError, StoreIOError, StoreTimeoutError
from kvstore.io.deadline import CLOSE_WAIT_S, DaemonWorkers, Deadline, DeliveryGate, Responsiveness

LOG = logging.getLogger("kvstore.test.deadline")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_deadline_adds_time_for_bytes_at_the_floor_rate() -> None:
    assert Deadline(5.0).seconds(10**12) == 5.0
    deadline = Deadline(5.0, min_bytes_per_s=100e6)
    assert deadline.seconds() == 5.0
    assert deadline.seconds(1_000_000_000) == pytest.approx(15.0)


@pytest.mark.parametrize("base", [0, -1.0, float("inf"), float("nan"), "5", True])
def test_deadline_refuses_a_bad_base(base: object) -> None:
    with pytest.raises(ConfigError, match="expected seconds > 0"):
        Deadline(base)  # type: ignore[arg-type]


@pytest.mark.parametrize("rate", [-1.0, float("inf"), "fast", None])
def test_deadline_refuses_a_bad_rate(rate: object) -> None:
    with pytest.raises(ConfigError, match="bytes/s >= 0"):
        Deadline(1.0, min_bytes_per_s=rate)  # type: ignore[arg-type]


def test_deadline_refuses_negative_sizes() -> None:
    with pytest.raises(ValueError, match="nbytes"):
        Deadline(1.0).seconds(-1)


def test_timeout_error_is_a_store_io_error_with_etimedout() -> None:
    error = StoreTimeoutError("load of 3 blocks: no answer within 5.0 s")
    assert isinstance(error, StoreIOError)
    assert error.errno == errno.ETIMEDOUT
    assert str(error) == "load of 3 blocks: no answer within 5.0 s"


def test_gate_claimed_first_cannot_be_abandoned() -> None:
    gate = DeliveryGate()
    assert gate.claim()
    assert not gate.abandon()  # the copy is under way: the caller waits for it
    gate.release()
    assert not gate.abandon()
    assert not gate.abandoned
    assert not gate.claim()  # one delivery only


def test_gate_abandoned_first_is_never_claimed() -> None:
    gate = DeliveryGate()
    assert gate.abandon()
    assert gate.abandon()  # idempotent
    assert gate.abandoned
    assert not gate.claim()
    gate.release()  # a late release changes nothing
    assert gate.abandoned


def test_gate_decides_once_under_a_race() -> None:
    """Claim and abandon racing from two threads: exactly one of them wins, every time."""
    for _ in range(300):
        gate = DeliveryGate()
        start = threading.Barrier(2)
        outcome: dict[str, bool] = {}

        def claim(
            g: DeliveryGate = gate,
            b: threading.Barrier = start,
            out: dict[str, bool] = outcome,
        ) -> None:
            b.wait()
            out["claimed"] = g.claim()

        thread = threading.Thread(target=claim)
        thread.start()
        start.wait()
        outcome["abandoned"] = gate.abandon()
        thread.join()
        assert outcome["claimed"] != outcome["abandoned"]


def hung(state: Responsiveness) -> bool:
    """``state.hung`` read anew (mypy would carry an asserted property value forward)."""
    return state.hung


def responsiveness(clock: Clock, retry_s: float = 5.0) -> Responsiveness:
    return Responsiveness(where="/mnt/kv", retry_interval_s=retry_s, logger=LOG, clock=clock)


def test_an_episode_logs_once_fails_fast_and_ends_on_an_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    state = responsiveness(clock)
    caplog.set_level(logging.WARNING, logger=LOG.name)
    assert state.admit() and state.episodes == 0
    state.timed_out("load", 5.2, "load_deadline_s")
    state.timed_out("lookup", 2.1, "lookup_deadline_s")  # same episode: no second line
    assert hung(state) and state.episodes == 1
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert "/mnt/kv" in lines[0] and "load_deadline_s" in lines[0] and "5.2 s" in lines[0]
    # The episode started when the late call was made, not when it was noticed.
    clock.now += 0.8
    assert state.hung_seconds() == pytest.approx(6.0)
    assert not state.admit()  # fails fast
    clock.now += 10.0
    assert state.answered() == pytest.approx(16.0)
    assert not hung(state) and state.admit()
    assert len(caplog.records) == 2 and "answers again after 16.0 s" in caplog.messages[1]
    assert state.hung_seconds() == pytest.approx(16.0)
    assert state.answered() == 0.0  # outside an episode: nothing to end, no line
    assert len(caplog.records) == 2


def test_one_trial_at_a_time_at_most_once_per_interval() -> None:
    clock = Clock()
    state = responsiveness(clock, retry_s=5.0)
    state.timed_out("store", 31.0, "store_deadline_s")
    assert not state.admit()  # the interval counts from the episode's detection
    clock.now += 5.0
    assert state.admit()  # the trial
    assert not state.admit()  # one at a time
    clock.now += 60.0
    assert not state.admit()  # the trial is stuck too: still none, however long
    state.timed_out("store", 31.0, "store_deadline_s")  # reported late: still in flight
    assert not state.admit()
    state.answered()  # it returned: the store answers
    assert not hung(state) and state.admit() and state.admit()


def test_a_trial_that_returns_in_time_ends_the_episode() -> None:
    clock = Clock()
    state = responsiveness(clock, retry_s=1.0)
    state.timed_out("lookup", 2.0, "lookup_deadline_s")
    clock.now += 1.0
    assert state.admit()
    assert state.answered() == pytest.approx(3.0)
    assert state.episodes == 1
    state.timed_out("lookup", 2.0, "lookup_deadline_s")
    assert state.episodes == 2


@pytest.mark.parametrize("retry", [0, -1, float("inf"), "5", None])
def test_responsiveness_refuses_a_bad_interval(retry: object) -> None:
    with pytest.raises(ConfigError, match="retry_interval_s: expected seconds > 0"):
        Responsiveness(where="/x", retry_interval_s=retry, logger=LOG)  # type: ignore[arg-type]


def test_daemon_workers_run_in_order_on_a_fixed_set_of_daemon_threads() -> None:
    workers = DaemonWorkers(2, "kvstore-test-workers")
    release, done = threading.Event(), threading.Event()
    ran: list[int] = []
    names: set[str] = set()

    def stuck() -> None:
        names.add(threading.current_thread().name)
        release.wait(10)

    def record(i: int) -> None:
        names.add(threading.current_thread().name)
        ran.append(i)
        if i == 4:
            done.set()

    workers.submit(stuck)  # one thread blocked, as in a hung mount
    before = threading.active_count()
    for i in range(5):
        workers.submit(functools.partial(record, i))
    assert done.wait(10)
    assert ran == [0, 1, 2, 3, 4]  # the free thread took them in order
    assert threading.active_count() == before  # none added while one is stuck
    threads = [t for t in threading.enumerate() if t.name in names]
    assert threads and all(t.daemon for t in threads)
    workers.close()
    release.set()
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive()


def test_daemon_workers_start_their_threads_at_the_first_submit() -> None:
    before = threading.active_count()
    unused = DaemonWorkers(3, "kvstore-test-unused")
    assert threading.active_count() == before
    unused.close()
    unused.submit(lambda: None)  # after close: queued, never run, no thread started
    assert threading.active_count() == before
    used = DaemonWorkers(3, "kvstore-test-used")
    ran = threading.Event()
    used.submit(ran.set)
    assert ran.wait(10)
    assert threading.active_count() == before + 3
    used.close()
    assert threading.active_count() == before  # idle threads ended before close returned


def test_daemon_workers_close_leaves_a_stuck_thread_behind_in_bounded_time() -> None:
    """close waits for idle threads to end (a process exiting right after must not meet them
    at interpreter shutdown), but not for one stuck in a hung mount: at most CLOSE_WAIT_S."""
    workers = DaemonWorkers(2, "kvstore-test-close")
    release, started = threading.Event(), threading.Event()

    def stuck() -> None:
        started.set()
        release.wait(30)

    before = threading.active_count()
    workers.submit(stuck)
    assert started.wait(10)
    start = time.monotonic()
    workers.close()
    assert time.monotonic() - start < CLOSE_WAIT_S + 1.0
    assert threading.active_count() == before + 1  # the idle one ended, the stuck one stays
    release.set()


def test_daemon_workers_refuse_no_threads() -> None:
    with pytest.raises(ConfigError, match="at least 1 thread, got 0"):
        DaemonWorkers(0, "kvstore-test")

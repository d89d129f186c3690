"""A hung store (a frozen NFS server, a wedged FUSE daemon) never stalls the scheduler.

The manager of a real engine's namespace, driven directly with a fake clock; its existence
probe is made to block until the test releases it, as a probe on a frozen mount does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the connector tests need vllm==0.33.0 (a separate venv)")

from vllm.v1.kv_offload.base import LookupResult, ReqContext

from connector.offload import metrics as m
from connector.offload.manager import KVStoreManager

from .harness import Engine, EngineOptions
from .test_manager import Clock, keys, manager_of


class FrozenProbe:
    """Replaces a manager's probe: blocks every call until :meth:`thaw` (then answers)."""

    def __init__(self, manager: KVStoreManager) -> None:
        self.real = manager._probe
        self.thawed = threading.Event()
        self.calls = 0
        manager._probe = self  # type: ignore[method-assign]

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
    while manager._late and not all(f.done() for _, f in manager._late):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    clock.now += 3.0
    manager._drain()
    assert manager._unresponsive_since is None
    assert manager.metrics.counter(m.UNRESPONSIVE_SECONDS) == pytest.approx(5.5, abs=0.01)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "answered again after" in lines[1]
    clock.now += 10  # past miss_ttl_s: the keys answered miss are probed again
    assert manager.lookup(third, context) is LookupResult.RETRY
    manager.drain(timeout=10)
    assert manager.lookup(third, context) is LookupResult.MISS  # really absent now
    assert probe.calls >= 2


def test_a_deadline_must_be_positive(tmp_path: Path) -> None:
    from connector.config import ConnectorConfig  # noqa: PLC0415
    from kvstore.errors import ConfigError  # noqa: PLC0415

    for bad in (0, -1.0, float("inf"), "2"):
        with pytest.raises(ConfigError, match="lookup_deadline_s: expected a number of seconds"):
            ConnectorConfig(lookup_deadline_s=bad)  # type: ignore[arg-type]

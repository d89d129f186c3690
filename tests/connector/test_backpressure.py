"""Backpressure: a store that cannot keep up costs dropped blocks, counted, never engine waits.

``max_pending_store_bytes`` bounds the bytes of blocks offered to the store and not yet
published. Driven through vLLM 0.33's real Scheduler (tests/connector/harness.py); the
stalled disk is a :class:`kvstore.io.fileio.FileIO` whose writes into temporary block files
wait until released.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector tests need vllm==0.33.0 (a separate venv)")

import connector.store
from connector.config import ConnectorConfig
from connector.offload import metrics as m
from kvstore import KVStore

from .disks import TempWrites
from .harness import prompt
from .metered import engine
from .test_failures import PROMPT

# tiny_llama: 4 KV heads x 2 layers x 16 tokens x (K, V) x 8 x fp16
TINY_BLOCK = 4 * 2 * 16 * 2 * 8 * 2


class StalledDisk(TempWrites):
    """While :attr:`stalled`, writes into temporary block files wait until :attr:`release`."""

    def __init__(self) -> None:
        super().__init__()
        self.stalled = False
        self.release = threading.Event()
        self.waiting = 0

    def on_temp_write(self, buffers: Any) -> None:
        if self.stalled and not self.release.is_set():
            self.waiting += 1
            self.release.wait()


def test_stores_past_the_bound_are_dropped_with_the_rest_of_their_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    e = engine(monkeypatch, root=tmp_path, extra={"max_pending_store_bytes": 2 * TINY_BLOCK + 1})
    assert e.engine.manager.namespace.group(0).layout.block_nbytes == TINY_BLOCK
    request = e.engine.serve("r1", PROMPT)
    assert e.value(m.STORED_BLOCKS) == 2
    assert e.value(m.STORE_DROPPED_BLOCKS, m.BACKPRESSURE) == 3
    assert e.value(m.PENDING_STORE_BYTES) == 0  # all published: room again
    name = e.engine.manager.namespace.name
    with KVStore(ConnectorConfig.from_extra_config({"root": tmp_path}).store) as s:
        present = s.open_namespace(name).group(0).contains(request.block_hashes)
    assert present == [True, True, False, False, False]  # a prefix: parents first
    e.engine.shutdown()


def test_a_stalled_store_never_holds_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every write hangs: requests still finish, pending bytes stay within the bound, and each
    block that did not fit is counted dropped. Released, the admitted blocks are published."""
    disk = StalledDisk()
    monkeypatch.setattr(connector.store, "open_store", lambda config: KVStore(config, fio=disk))
    bound = 3 * TINY_BLOCK
    e = engine(monkeypatch, root=tmp_path, extra={"max_pending_store_bytes": bound})
    disk.stalled = True
    try:
        for i in range(4):
            e.engine.add(f"r{i}", prompt(5 * 16 + 3, start=1000 * (i + 1)))
        for _ in range(400):  # steps go on while the disk holds the writes
            e.engine.step()
            assert e.engine.manager.ledger.pending_bytes <= bound
            if not e.engine.scheduler.has_unfinished_requests() and disk.waiting:
                break
            time.sleep(0.005)
        assert not e.engine.scheduler.has_unfinished_requests()  # nothing waited for the disk
        assert disk.waiting >= 1  # the disk did hold writes meanwhile
        assert e.value(m.STORED_BLOCKS) == 0
        assert e.value(m.STORE_DROPPED_BLOCKS, m.BACKPRESSURE) == 4 * 5 - 3
        assert e.value(m.PENDING_STORE_BYTES) == bound
        assert e.value(m.PENDING_STORE_BLOCKS) == 3
    finally:
        disk.release.set()
    e.engine.run()
    assert e.value(m.STORED_BLOCKS) == 3
    assert e.value(m.PENDING_STORE_BYTES) == 0
    e.engine.shutdown()

"""A bad store never crashes the engine: failed loads are recomputed, failed stores dropped.

Driven through vLLM's real Scheduler (0.33 or 0.34) with ``kv_load_failure_policy="recompute"``
(tests/connector/harness.py). A load that misses or hits a corrupt block is reported for
exactly those GPU blocks (single-group models; vLLM recomputes from the first of them) or as a
failed request load (multi-group models, which vLLM cannot handle block by block: on 0.33
through the connector's ``failed_recving``, on 0.34 as a failed job).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector tests need vllm==0.33.0 (a separate venv)")

from vllm.v1.kv_offload.base import make_offload_key

import connector.store
from connector import compat
from connector.offload.transfer_specs import KVStoreLoadSpec
from kvstore import KVStore, StoreConfig, StoreFormatError
from kvstore.store.paths import TMP_MARK

from .disks import TempWrites
from .harness import BLOCK, Engine, EngineOptions, gpu_side, prompt

PROMPT = prompt(5 * BLOCK + 3)


def _block_path(root: Path, namespace: str, block_hash: bytes) -> Path:
    with KVStore(StoreConfig(root=root)) as store:
        return Path(store.open_namespace(namespace).group(0).path_of(block_hash))


def _corrupt(root: Path, namespace: str, block_hash: bytes) -> None:
    """Flip a byte of inner chunk 0 (head 0, layer 0: TP rank 0's share)."""
    with KVStore(StoreConfig(root=root)) as store:
        group = store.open_namespace(namespace).group(0)
        path = Path(group.path_of(block_hash))
        offset = group.layout.data_offset + 7
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


def _store_prompt(root: Path, **options: Any) -> tuple[str, list[bytes]]:
    engine = Engine(EngineOptions(root=root, **options))
    request = engine.serve("writer", PROMPT if "hybrid" not in options else prompt(8 * BLOCK + 3))
    name = engine.manager.namespace.name
    engine.shutdown()
    return name, list(request.block_hashes)


@pytest.mark.parametrize("tp", [1, 2])
def test_corrupt_page_is_recomputed_from_that_block(
    tmp_path: Path, tp: int, caplog: pytest.LogCaptureFixture
) -> None:
    name, hashes = _store_prompt(tmp_path, tp=tp)
    _corrupt(tmp_path, name, hashes[2])
    engine = Engine(EngineOptions(root=tmp_path, tp=tp))
    with caplog.at_level(logging.WARNING):
        engine.serve("reader", [*PROMPT, 999], max_tokens=1)
    assert engine.first_start["reader"] == 2 * BLOCK  # blocks 0 and 1 loaded, 2.. recomputed
    assert engine.prefix_ok["reader"]
    assert min(engine.computed["reader"]) == 2 * BLOCK
    assert engine.manager.counters["load_failures"] >= 1
    failures = [r.getMessage() for r in caplog.records if r.name == "kvstore.connector"]
    # one line per failed job and rank: rank 0 finds the bad chunk and quarantines the file;
    # at TP=2 rank 1 may find it gone already (its own chunks were intact)
    assert len(failures) <= tp
    assert any("1 corrupt, quarantined" in m for m in failures)
    assert all("1 of 5 blocks failed" in m and "recomputes" in m for m in failures)
    assert list((tmp_path / name / "quarantine").iterdir())  # never served again
    # vLLM does not store again what it meant to load; the next request that misses the
    # block stores it, and the store has healed.
    assert not _block_path(tmp_path, name, hashes[2]).exists()
    engine.wipe_kv()
    assert engine.scheduler.reset_prefix_cache()
    engine.serve("healer", [*PROMPT, 998], max_tokens=1)
    assert engine.first_start["healer"] == 2 * BLOCK
    assert _block_path(tmp_path, name, hashes[2]).exists()
    engine.shutdown()


def test_file_vanishing_after_lookup_is_recomputed(tmp_path: Path) -> None:
    """The manager believes the block present (its index), the file is gone at load time
    (evicted by ``kvstore gc`` or another server): a load error, then recompute."""
    engine = Engine(EngineOptions(root=tmp_path))
    request = engine.serve("writer", PROMPT)
    name = engine.manager.namespace.name
    os.unlink(_block_path(tmp_path, name, request.block_hashes[3]))
    engine.wipe_kv()
    assert engine.scheduler.reset_prefix_cache()  # GPU prefix cache only; index kept
    engine.serve("reader", [*PROMPT, 999], max_tokens=1)
    assert engine.first_start["reader"] == 3 * BLOCK
    assert engine.prefix_ok["reader"]
    assert engine.manager.counters["load_failures"] == 1
    engine.shutdown()


def test_file_vanished_before_lookup_is_a_plain_miss(tmp_path: Path) -> None:
    name, hashes = _store_prompt(tmp_path)
    os.unlink(_block_path(tmp_path, name, hashes[1]))
    engine = Engine(EngineOptions(root=tmp_path))
    engine.serve("reader", [*PROMPT, 999], max_tokens=1)
    assert engine.first_start["reader"] == BLOCK
    assert engine.prefix_ok["reader"]
    assert engine.manager.counters["load_failures"] == 0
    engine.shutdown()


def test_hybrid_model_corrupt_page_recomputes_the_request(tmp_path: Path) -> None:
    """vLLM 0.33 refuses block-level load errors for multi-group models: the connector
    reports the request's load as failed and vLLM recomputes it from the start."""
    options: dict[str, Any] = {"hybrid": True, "model": "tiny_hybrid"}
    name, hashes = _store_prompt(tmp_path, **options)
    _corrupt(tmp_path, name, hashes[4])
    engine = Engine(EngineOptions(root=tmp_path, **options))
    engine.serve("reader", [*prompt(8 * BLOCK + 3), 999], max_tokens=1)
    assert engine.first_start["reader"] == 0
    assert min(engine.computed["reader"]) == 0
    assert engine.manager.counters["load_failures"] == 1
    engine.shutdown()


class FullDisk(TempWrites):
    """Block writes into temporary files fail with ENOSPC while ``full`` is set."""

    blocks_only = False

    def __init__(self) -> None:
        super().__init__()
        self.full = False

    def on_temp_write(self, buffers: Any) -> None:
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_full_disk_drops_stores_and_backs_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    disk = FullDisk()
    monkeypatch.setattr(connector.store, "open_store", lambda config: KVStore(config, fio=disk))
    engine = Engine(EngineOptions(root=tmp_path, tp=2))
    disk.full = True
    with caplog.at_level(logging.WARNING):
        engine.serve("r1", PROMPT)
    assert engine.manager.counters["blocks_published"] == 0
    assert engine.manager.counters["blocks_not_published"] == 5
    assert not list(tmp_path.rglob(f"*{TMP_MARK}*"))  # temporary files rolled back
    messages = [r.getMessage() for r in caplog.records if r.name == "kvstore.connector"]
    assert any("No space left" in m for m in messages)
    assert any("no new blocks are offered" in m for m in messages)
    # During the back-off (write_backoff_s, 30 s) nothing is offered to the store.
    disk.full = False
    engine.serve("r2", prompt(2 * BLOCK + 1, start=5000))
    assert engine.manager.counters["blocks_prepared"] == 5
    engine.manager._backoff_until = 0.0  # the back-off has expired
    engine.serve("r3", prompt(2 * BLOCK + 1, start=7000))
    assert engine.manager.counters["blocks_published"] == 2
    engine.shutdown()


def test_workers_opening_a_new_store_together_wait_for_its_creation(tmp_path: Path) -> None:
    """Another process is creating the store: its temporary root document is all there is."""
    root = tmp_path / "store"
    root.mkdir()
    temporary = root / ".zarr.json.tmp-123-abcd"
    temporary.write_bytes(b"")

    def finish_creation() -> None:
        time.sleep(0.2)
        temporary.unlink()
        KVStore(StoreConfig(root=root)).close()

    creator = threading.Thread(target=finish_creation)
    creator.start()
    store = connector.store.open_store(StoreConfig(root=root))
    creator.join()
    store.close()
    (root / "stranger.txt").write_text("not a store")
    (root / "zarr.json").unlink()
    with pytest.raises(StoreFormatError, match="non-empty directory"):
        connector.store.open_store(StoreConfig(root=root), wait_s=0.1)


def test_a_job_that_cannot_start_is_reported_not_raised(tmp_path: Path) -> None:
    """A malformed job (here: keys that do not match the GPU blocks) never raises into vLLM.
    vLLM 0.33 asserts success: the job is reported finished, its GPU blocks as load errors and
    its request as failed. vLLM 0.34 takes failed jobs: it is reported ``success=False`` (vLLM
    recomputes the request) and nothing block-level."""
    engine = Engine(EngineOptions(root=tmp_path))
    worker = engine.ranks[0].worker
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(3)]
    gpu = gpu_side(engine.ranks[0], [4, 5], [2])
    assert worker.submit_load(7, KVStoreLoadSpec(keys, "req"), gpu)
    worker.wait({7})
    [result] = worker.get_finished()
    if compat.VLLM_REPORTS_FAILED_JOBS:
        assert (result.job_id, result.success) == (7, False)
        assert worker.take_load_error_blocks() == set()
        assert worker.take_failed_load_requests() == set()
    else:
        assert (result.job_id, result.success) == (7, True)
        assert worker.take_load_error_blocks() == {4, 5}
        assert worker.take_failed_load_requests() == {"req"}
    assert worker.take_failed_keys() == ([], keys)  # the manager forgets them either way
    engine.shutdown()

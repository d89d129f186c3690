"""What differs between vLLM 0.33 and 0.34 under the connector, on the installed vLLM's real
Scheduler and OffloadingConnector (tests/connector/harness.py).

0.34 hands the worker resolved ``DevicePointers`` instead of GPU block ids, takes failed jobs
(``success=False``, ``failed_jobs`` in the worker metadata) and moved the default block size
to 64. The same tests run on both versions (CI runs this directory on each); where the
expected outcome differs, the test says which version does what.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the connector tests need vllm (0.33 or 0.34)")

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.v1.kv_offload.base import make_offload_key

import connector
from connector import compat
from connector.offload.job_blocks import BlockResolver
from connector.offload.transfer_specs import KVStoreLoadSpec
from connector.offload.vllm_connector import KVStoreWorkerMetadata
from kvstore import Identity, KVStore, StoreConfig
from kvstore.identity import attention_group

from .harness import VLLM_PASSES_POINTERS, Engine, EngineOptions, gpu_side, prompt


class _SeenJobs:
    """Records the form of every GPU side the workers resolved (pointers or block ids)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.forms: list[str] = []
        resolve = BlockResolver.resolve

        def spy(resolver: BlockResolver, gpu: Any) -> Any:
            self.forms.append("pointers" if hasattr(gpu, "ptrs") else "block ids")
            return resolve(resolver, gpu)

        monkeypatch.setattr(BlockResolver, "resolve", spy)

    def check(self) -> None:
        assert self.forms, "no job reached a worker"
        expected = "pointers" if VLLM_PASSES_POINTERS else "block ids"
        assert set(self.forms) == {expected}


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"], ids=["per-layer", "packed"])
@pytest.mark.parametrize("block_size", [16, 64])
def test_store_wipe_load_is_byte_exact_through_what_vllm_hands_the_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block_size: int, layout: str
) -> None:
    seen = _SeenJobs(monkeypatch)
    tokens = prompt(3 * block_size + 5)
    options: dict[str, Any] = {"root": tmp_path, "block_size": block_size, "layout": layout}
    writer = Engine(EngineOptions(**options))
    writer.serve("writer", tokens)
    assert writer.manager.counters["blocks_published"] == 3
    writer.shutdown()
    reader = Engine(EngineOptions(**options, tp=2))  # and another layout reads them
    reader.serve("reader", [*tokens, 999], max_tokens=1)
    assert reader.first_start["reader"] == 3 * block_size  # every block from the store
    assert reader.prefix_ok["reader"]  # byte-exact in every rank's pages
    reader.wipe_kv()  # the GPU pages gone, the prefix cache reset: the store serves again
    assert reader.scheduler.reset_prefix_cache()
    reader.serve("again", [*tokens, 998], max_tokens=1)
    assert reader.first_start["again"] == 3 * block_size
    assert reader.prefix_ok["again"]
    reader.shutdown()
    seen.check()


@pytest.mark.parametrize("block_size", [16, 64])
def test_a_corrupt_block_is_recomputed_and_the_scheduler_goes_on(
    tmp_path: Path, block_size: int, caplog: pytest.LogCaptureFixture
) -> None:
    tokens = prompt(4 * block_size + 3)
    writer = Engine(EngineOptions(root=tmp_path, block_size=block_size))
    request = writer.serve("writer", tokens)
    name, hashes = writer.manager.namespace.name, list(request.block_hashes)
    writer.shutdown()
    with KVStore(StoreConfig(root=tmp_path)) as store:
        group = store.open_namespace(name).group(0)
        path, offset = Path(group.path_of(hashes[1])), group.layout.data_offset + 3
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x5A
    path.write_bytes(bytes(raw))
    reader = Engine(EngineOptions(root=tmp_path, block_size=block_size))
    with caplog.at_level(logging.WARNING, logger="kvstore.connector"):
        reader.serve("reader", [*tokens, 999], max_tokens=1)
    assert reader.first_start["reader"] == block_size  # block 0 loaded, 1.. recomputed
    assert reader.prefix_ok["reader"]
    assert any("corrupt, quarantined" in r.getMessage() for r in caplog.records)
    # the scheduler goes on: a later request with the same prefix is served
    reader.serve("next", [*tokens, 998], max_tokens=1)
    assert reader.prefix_ok["next"]
    reader.shutdown()


def _pointer_job(engine: Engine, shift: int) -> Any:
    """Rank 0's GPU side of blocks 4 and 5, every pointer moved by ``shift`` bytes."""
    gpu = gpu_side(engine.ranks[0], [4, 5], [2])
    gpu.ptrs = gpu.ptrs + np.uint64(shift)
    return gpu


@pytest.mark.skipif(not VLLM_PASSES_POINTERS, reason="vLLM 0.34 passes device pointers")
@pytest.mark.parametrize("expedited", [False, True], ids=["async", "expedited"])
def test_pointers_that_are_not_this_workers_pages_fail_the_job_never_the_engine(
    tmp_path: Path, expedited: bool
) -> None:
    """A pointer off a page start (inside the tensor) or outside every KV tensor is never
    read or written: the job fails. An async load is a failed job (vLLM recomputes the
    request); an expedited one stays a success with its blocks reported block-level (vLLM
    stops the engine on a failed expedited load), unless no block can be named at all."""
    engine = Engine(EngineOptions(root=tmp_path))
    worker = engine.ranks[0].worker
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(2)]
    before = [t.clone() for t in engine.ranks[0].kv.values()]
    worker.submit_load(1, KVStoreLoadSpec(keys, "r1"), _pointer_job(engine, 8), expedited)
    worker.submit_load(2, KVStoreLoadSpec(keys, "r2"), _pointer_job(engine, 1 << 40), expedited)
    worker.wait({1, 2})
    results = {r.job_id: r.success for r in worker.get_finished()}
    if expedited:
        assert results == {1: True, 2: False}
        assert worker.take_load_error_blocks() == {4, 5}
    else:
        assert results == {1: False, 2: False}
        assert worker.take_load_error_blocks() == set()
    after = list(engine.ranks[0].kv.values())
    assert all(a.equal(b) for a, b in zip(before, after, strict=True))  # nothing written
    engine.shutdown()


def test_the_worker_metadata_keeps_every_field_of_vllms() -> None:
    """``failed_jobs`` (0.34) survives the connector's metadata, built and aggregated."""
    ours = KVStoreWorkerMetadata(completed_jobs={1: 1}, failed_store_keys=[b"a"])
    theirs = OffloadingWorkerMetadata(completed_jobs={1: 1, 2: 1})
    if compat.VLLM_REPORTS_FAILED_JOBS:
        mark: Any = OffloadingWorkerMetadata.mark_completed  # 0.34 signature
        mark(ours, 3, success=False)
        mark(theirs, 4, success=False)
    merged = ours.aggregate(theirs)
    assert isinstance(merged, KVStoreWorkerMetadata)
    expected = OffloadingWorkerMetadata.aggregate(ours, theirs)
    assert isinstance(expected, OffloadingWorkerMetadata)
    assert compat.worker_metadata_fields(merged) == compat.worker_metadata_fields(expected)
    assert merged.failed_store_keys == [b"a"]
    if compat.VLLM_REPORTS_FAILED_JOBS:
        assert getattr(merged, "failed_jobs", None) == {3, 4}


def test_a_server_of_another_block_size_says_so_at_start_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A 0.33-default store (16 tokens per block) under a 0.34-default server (64): all
    misses, and one line at start-up that says why, naming the store's sizes and the server's."""
    old = Engine(EngineOptions(root=tmp_path, block_size=16))
    old.serve("old", prompt(2 * 16 + 1))
    old.shutdown()
    with caplog.at_level(logging.WARNING, logger="kvstore.connector"):
        new = Engine(EngineOptions(root=tmp_path, block_size=64))
    lines = [r.getMessage() for r in caplog.records if "tokens per block" in r.getMessage()]
    assert len(lines) == 1
    assert "at 16 tokens per block; this server uses 64 " in lines[0]
    assert "--block-size 16" in lines[0]
    new.shutdown()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvstore.connector"):
        both = Engine(EngineOptions(root=tmp_path, block_size=32))
    [line] = [r.getMessage() for r in caplog.records if "tokens per block" in r.getMessage()]
    assert "at 16, 64 tokens per block; this server uses 32 " in line
    both.shutdown()


def test_a_hash_lookahead_is_part_of_the_identity() -> None:
    """vLLM 0.34 may hash tokens past a block into its hash (speculative decoding): those keys
    match only servers with the same lookahead, so the namespace records it when set, and an
    identity without it keeps its digest."""
    base = Identity(
        model="m",
        kv_dtype="float16",
        tokens_per_block=64,
        groups=(attention_group("full", ["l0"], 4, 8),),
    )
    ahead = dataclasses.replace(base, hash_lookahead_tokens=3)
    assert "hash_lookahead_tokens" not in base.to_json()
    assert ahead.namespace != base.namespace
    assert Identity.from_json(ahead.to_json()) == ahead
    assert "hash_lookahead_tokens: expected None, got 3" in base.describe_difference(ahead)


@pytest.mark.skipif(compat.kv_cache_access(False) is None, reason="vLLM 0.34 asks for it")
@pytest.mark.parametrize(
    ("extra", "registers"),
    [
        ({}, True),  # io_mode auto: the gds engine may run
        ({"io_mode": "gds"}, True),
        ({"io_mode": "pinned"}, False),
        ({"io_mode": "host"}, False),
        ({"spec_name": "TieringOffloadingSpec", "spec_module_path": None}, False),
    ],
    ids=["auto", "gds", "pinned", "host", "tier"],
)
def test_the_connector_declares_how_it_reaches_the_kv_cache(
    tmp_path: Path, extra: dict[str, Any], registers: bool
) -> None:
    """vLLM 0.34 allocates the KV cache by what the connector declares: kvstore's gds engine
    has cuFile DMA the pages (REGISTERS: one physical allocation per segment); the pinned
    and host engines and the secondary tier copy with torch (IN_PROCESS)."""
    from vllm.config import KVTransferConfig  # noqa: PLC0415
    from vllm.config.kv_transfer import KVCacheAccess  # type: ignore[attr-defined, unused-ignore]  # noqa: PLC0415

    config = connector.kv_transfer_config(str(tmp_path))
    config["kv_connector_extra_config"].update(extra)
    transfer: Any = KVTransferConfig(**config)
    access = transfer.kv_cache_access()  # vLLM's own question (0.34)
    assert access == (KVCacheAccess.REGISTERS if registers else KVCacheAccess.IN_PROCESS)

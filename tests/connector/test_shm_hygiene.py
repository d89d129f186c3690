"""Tier tests leave nothing in /dev/shm: vLLM's shared CPU-tier region of a test engine
(``/dev/shm/vllm_offload_test-engine-<tag>.mmap``) loses its name once the engine is built,
so an engine that is never shut down (a failed or killed test) leaves no file behind."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the connector tests need vllm==0.33.0 (a separate venv)")

from .harness import BLOCK, EngineOptions, prompt
from .tier_harness import TierEngine, region_files

PROMPT = prompt(3 * BLOCK + 1)


def offload_files() -> set[Path]:
    return set(Path("/dev/shm").glob("vllm_offload_*"))


@pytest.mark.parametrize("tp", [1, 2])
def test_an_engine_never_shut_down_leaves_no_region_file(tmp_path: Path, tp: int) -> None:
    before = offload_files()
    writer = TierEngine(EngineOptions(root=tmp_path, tp=tp))
    assert region_files(writer.region_tag) == []  # unlinked while the engine runs
    writer.serve("writer", PROMPT)  # the region still carries the KV (mapped, not named)
    writer.flush_tier()
    assert writer.tier.store.stats.snapshot()["blocks_written"] == 3
    # a later engine (new tag, new region) still promotes what the first stored, byte-exact
    reader = TierEngine(EngineOptions(root=tmp_path, tp=tp))
    reader.serve("reader", [*PROMPT[: 3 * BLOCK], 999], max_tokens=1)
    assert reader.first_start["reader"] == 3 * BLOCK and reader.prefix_ok["reader"]
    reader.shutdown()
    # ``writer`` is left running, as a test that fails half way leaves its engine
    assert region_files(writer.region_tag) == region_files(reader.region_tag) == []
    assert not {p for p in offload_files() - before if writer.region_tag in p.name}
    writer.shutdown()

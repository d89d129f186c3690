"""kvstore as vLLM's secondary tier: stored, restarted, promoted back byte-exact.

Every test drives vLLM 0.33's real Scheduler, ``TieringOffloadingManager`` and CPU primary
tier with :class:`connector.tier.KVStoreTier` loaded from ``secondary_tiers`` by
``module_path`` (tests/connector/tier_harness.py; the CUDA-only CPU-tier worker is replaced by
a CPU copy into vLLM's own shared region).

"Promoted back byte-exact" is checked when the request is first scheduled on a new engine
(empty CPU tier, zeroed KV tensors): the KV of every token it starts with must already equal
the fake model's values on every rank, so it came from the store through the CPU tier.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import pytest

pytest.importorskip("vllm", reason="the connector tests need vllm==0.33.0 (a separate venv)")

from connector.compat import TIER_DEFERS_RELEASE
from connector.tier.chunks import ChunkMap
from kvstore import KVStore, StoreConfig

from .harness import BLOCK, Engine, EngineOptions, prompt
from .tier_harness import TierEngine

PROMPT = prompt(5 * BLOCK + 3)  # five full blocks and a partial one


def store_through_tier(root: Path, canonical: bool = False, **options: Any) -> list[bytes]:
    """Serve PROMPT on a tiering engine; return the request's block hashes once stored."""
    engine = TierEngine(EngineOptions(root=root, **options), canonical=canonical)
    request = engine.serve("writer", PROMPT)
    engine.flush_tier()
    engine.shutdown()
    return list(request.block_hashes)


E = TypeVar("E", bound=Engine)


def promote(engine: E, tokens: list[int] = PROMPT) -> E:
    engine.serve("reader", [*tokens, 999], max_tokens=1)
    return engine


def test_restarted_engine_promotes_stored_blocks_byte_exact(tmp_path: Path) -> None:
    hashes = store_through_tier(tmp_path)
    assert len(hashes) == 5
    engine = promote(TierEngine(EngineOptions(root=tmp_path)))
    assert engine.first_start["reader"] == 5 * BLOCK  # all five blocks came from the store
    assert engine.prefix_ok["reader"]
    assert min(engine.computed["reader"]) == 5 * BLOCK
    assert engine.tier.store.stats.snapshot()["hits"] == 5
    name = engine.tier.namespace.name
    engine.shutdown()
    with KVStore(StoreConfig(root=tmp_path)) as store:  # format v1, readable by the tools
        group = store.open_namespace(name).group(0)
        assert group.contains(hashes) == [True] * 5
        parents = [group.read_header(h)[0].parent_hash for h in hashes]
        assert parents == [None, *hashes[:-1]]


@pytest.mark.parametrize(
    ("write", "read"),
    [
        ({"tp": 2}, {"tp": 1}),
        ({"tp": 1, "layout": "BLHNC"}, {"tp": 4}),  # packed rows -> per-worker cells
        ({"tp": 8}, {"tp": 2, "layout": "LBNHC"}),  # replicated heads; NHD pages
        ({"tp": 2, "canonical": True}, {"tp": 4}),  # vLLM's canonical pages -> cells
        ({"tp": 4}, {"tp": 2, "canonical": True}),
        ({"tp": 8, "canonical": True}, {"tp": 1}),  # canonical pages of replicated heads
    ],
    ids=[
        "tp2-to-tp1",
        "packed-to-tp4",
        "tp8-to-nhd-tp2",
        "canonical-to-tp4",
        "tp4-to-canonical",
        "canonical-tp8-to-tp1",
    ],
)
def test_tiers_of_other_layouts_share_blocks(
    tmp_path: Path, write: dict[str, Any], read: dict[str, Any]
) -> None:
    store_through_tier(tmp_path, **write)
    canonical = read.pop("canonical", False)
    engine = promote(TierEngine(EngineOptions(root=tmp_path, **read), canonical=canonical))
    assert engine.first_start["reader"] == 5 * BLOCK
    assert engine.prefix_ok["reader"]
    engine.shutdown()


@pytest.mark.parametrize(
    ("write", "read"),
    [({"tp": 2}, {"tp": 1, "layout": "BLHNC"}), ({"tp": 1, "canonical": True}, {"tp": 4})],
    ids=["tier-tp2-to-connector-packed", "tier-canonical-to-connector-tp4"],
)
def test_direct_connector_reads_what_the_tier_stored(
    tmp_path: Path, write: dict[str, Any], read: dict[str, Any]
) -> None:
    store_through_tier(tmp_path, **write)
    engine = promote(Engine(EngineOptions(root=tmp_path, **read)))
    assert engine.manager.counters["blocks_loaded"] == 5
    assert engine.first_start["reader"] == 5 * BLOCK
    assert engine.prefix_ok["reader"]
    engine.shutdown()


@pytest.mark.parametrize(
    ("write", "read"),
    [({"tp": 4}, {"tp": 1}), ({"tp": 1, "layout": "LBNHC"}, {"tp": 2, "canonical": True})],
    ids=["connector-tp4-to-tier-tp1", "connector-nhd-to-tier-canonical-tp2"],
)
def test_tier_promotes_what_the_direct_connector_stored(
    tmp_path: Path, write: dict[str, Any], read: dict[str, Any]
) -> None:
    first = Engine(EngineOptions(root=tmp_path, **write))
    first.serve("writer", PROMPT)
    assert first.manager.counters["blocks_published"] == 5
    first.shutdown()
    canonical = read.pop("canonical", False)
    engine = promote(TierEngine(EngineOptions(root=tmp_path, **read), canonical=canonical))
    assert engine.first_start["reader"] == 5 * BLOCK
    assert engine.prefix_ok["reader"]
    engine.shutdown()


def test_stored_blocks_are_announced_as_kv_events(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``enable_kv_events`` (and vLLM's KV events on) every block the tier stored is
    announced once, on the STORAGE medium, to vLLM's scheduler (as vLLM's fs tier does)."""
    engine = TierEngine(EngineOptions(root=tmp_path), enable_kv_events=True)
    tier = engine.tier
    assert tier._events is None  # vLLM's KV cache events are off in this engine: none
    tier._events = []  # as if --kv-events-config enabled them
    taken: list[Any] = []
    original = tier.take_events

    def spy() -> list[Any]:
        events = list(original())
        taken.extend(events)
        return events

    monkeypatch.setattr(tier, "take_events", spy)  # vLLM's scheduler drains it every step
    request = engine.serve("writer", PROMPT)
    engine.flush_tier()
    stored = [k for e in taken for k in e.keys]
    assert sorted(stored) == sorted(h + bytes(4) for h in request.block_hashes)
    assert all(e.medium.name == "STORAGE" and not e.removed for e in taken)
    engine.shutdown()


def test_decode_context_parallel_cells_map_to_blocks_of_the_same_span(tmp_path: Path) -> None:
    """DCP=2 interleaves a block's tokens over two workers' cells; the tier assembles the
    32-token block, which the direct connector at DCP=1 with --block-size 32 loads, and a new
    DCP=2 tier engine splits it back into both workers' cells."""
    mqa: dict[str, Any] = {"model": "tiny_mqa"}
    tokens = prompt(5 * 32 + 3)
    first = TierEngine(EngineOptions(root=tmp_path, tp=2, dcp=2, **mqa))
    first.serve("writer", tokens)
    first.flush_tier()
    first.shutdown()
    reader = promote(Engine(EngineOptions(root=tmp_path, block_size=32, **mqa)), tokens)
    assert reader.first_start["reader"] == 5 * 32
    assert reader.prefix_ok["reader"]
    reader.shutdown()
    engine = promote(TierEngine(EngineOptions(root=tmp_path, tp=2, dcp=2, **mqa)), tokens)
    assert engine.first_start["reader"] == 5 * 32
    assert engine.prefix_ok["reader"]
    engine.shutdown()


def test_mla_and_hybrid_models_round_trip(tmp_path: Path) -> None:
    """MLA (latent replicated on every TP rank) and two KV-cache groups (full + sliding)."""
    store_through_tier(tmp_path / "mla", mla=True, tp=2)
    engine = promote(TierEngine(EngineOptions(root=tmp_path / "mla", mla=True)))
    assert engine.first_start["reader"] == 5 * BLOCK
    assert engine.prefix_ok["reader"]
    engine.shutdown()
    hybrid: dict[str, Any] = {"hybrid": True, "model": "tiny_hybrid"}
    long_prompt = prompt(8 * BLOCK + 3)
    first = TierEngine(EngineOptions(root=tmp_path / "hybrid", **hybrid, tp=2))
    first.serve("writer", long_prompt)
    first.flush_tier()
    first.shutdown()
    second = promote(TierEngine(EngineOptions(root=tmp_path / "hybrid", **hybrid)), long_prompt)
    assert second.first_start["reader"] == 8 * BLOCK
    assert second.prefix_ok["reader"]
    second.shutdown()


@pytest.mark.parametrize(
    ("write", "read"),
    [({"tp": 1}, {"tp": 2}), ({"tp": 2, "canonical": True}, {"tp": 1})],
    ids=["tp1-to-tp2", "canonical-to-tp1"],
)
def test_blocks_written_from_the_rows_promote_byte_exact(
    tmp_path: Path, write: dict[str, Any], read: dict[str, Any]
) -> None:
    """128-token blocks: 4 KiB inner chunks, a raw dense array, where the tier writes HND
    rows as pieces (views of a contiguous copy of the CPU tier's rows, no gather); another
    layout promotes them."""
    big = 8 * BLOCK
    tokens = prompt(2 * big + 3)
    canonical = write.pop("canonical", False)
    writer = TierEngine(EngineOptions(root=tmp_path, block_size=big, **write), canonical=canonical)
    assert writer.tier._transfers.in_place == [True]  # the path under test is taken
    request = writer.serve("writer", tokens)
    writer.flush_tier()
    writer.shutdown()
    assert len(request.block_hashes) == 2
    engine = promote(TierEngine(EngineOptions(root=tmp_path, block_size=big, **read)), tokens)
    assert engine.first_start["reader"] == 2 * big
    assert engine.prefix_ok["reader"]
    engine.shutdown()


@pytest.mark.parametrize(
    ("read", "in_place"),
    [
        ({"tp": 1}, True),
        ({"tp": 2}, True),
        ({"tp": 2, "canonical": True}, True),
        ({"layout": "LBNHC"}, False),  # NHD pages: 512-byte runs split the 4 KiB chunks
        ({"tp": 8}, False),  # 4 KV heads over 8 ranks: replicas, each byte in two cells
    ],
    ids=["tp1", "tp2", "canonical", "nhd-staged", "replicas-staged"],
)
def test_promotions_read_straight_into_the_rows_byte_exact(
    tmp_path: Path, read: dict[str, Any], in_place: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """128-token blocks (raw dense arrays) stored at TP=1 are promoted at other layouts:
    where each canonical byte has one place in the row, read and verified straight into the
    CPU tier's rows (no staging, no scatter: ChunkMap.from_blocks is never called) on vLLM
    0.34, which can hold a failed promotion's chunks while a read into them runs; elsewhere,
    and always on 0.33, staged and scattered. Byte-exact either way."""
    big = 8 * BLOCK
    tokens = prompt(2 * big + 3)
    writer = TierEngine(EngineOptions(root=tmp_path, block_size=big))
    writer.serve("writer", tokens)
    writer.flush_tier()
    writer.shutdown()
    scattered: list[int] = []
    from_blocks = ChunkMap.from_blocks

    def spy(self: ChunkMap, array: int, blocks: Any, chunk_ids: Any) -> None:
        scattered.append(len(chunk_ids))
        from_blocks(self, array, blocks, chunk_ids)

    monkeypatch.setattr(ChunkMap, "from_blocks", spy)
    canonical = read.pop("canonical", False)
    engine = TierEngine(EngineOptions(root=tmp_path, block_size=big, **read), canonical=canonical)
    in_place = in_place and TIER_DEFERS_RELEASE
    assert engine.tier._transfers.loads_in_place == [in_place]
    promote(engine, tokens)
    assert engine.first_start["reader"] == 2 * big
    assert engine.prefix_ok["reader"]
    assert engine.tier.store.stats.snapshot()["hits"] == 2
    assert bool(scattered) != in_place
    engine.shutdown()

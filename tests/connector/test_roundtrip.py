"""Blocks stored by one vLLM engine are loaded byte-exact by another, whatever its layout.

Every test drives vLLM 0.33's real Scheduler and the kvstore connector in both roles on CPU
(tests/connector/harness.py). Engines with TP > 1 run one worker-role connector per rank in
this process, each with its own ``VllmConfig`` rank and its own KV tensors (that rank's heads);
vLLM's worker processes themselves are not started.

"Loaded byte-exact" is checked when the request is first scheduled: the KV of every token it
starts with was never computed by that engine (a new engine, zeroed KV tensors) and must
already equal the fake model's values on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector tests need vllm==0.33.0 (a separate venv)")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

from kvstore import KVStore, StoreConfig

from .harness import BLOCK, Engine, EngineOptions, prompt

PROMPT = prompt(5 * BLOCK + 3)  # five full blocks and a partial one


def restart_and_load(
    root: Path, write: dict[str, Any], read: dict[str, Any], tokens: list[int] = PROMPT
) -> Engine:
    """Serve ``tokens`` on an engine built with ``write``, then on a new one built with
    ``read``; five blocks are stored and loaded."""
    first = Engine(EngineOptions(root=root, **write))
    first.serve("writer", tokens)
    assert first.manager.counters["blocks_published"] == 5
    first.shutdown()
    second = Engine(EngineOptions(root=root, **read))
    second.serve("reader", [*tokens, 999], max_tokens=1)
    assert second.manager.counters["blocks_loaded"] == 5
    return second


def test_prompt_blocks_are_stored_with_their_parents(tmp_path: Path) -> None:
    engine = Engine(EngineOptions(root=tmp_path))
    request = engine.serve("r1", PROMPT)
    name = engine.manager.namespace.name
    hashes = list(request.block_hashes)
    engine.shutdown()
    assert len(hashes) == 5
    with KVStore(StoreConfig(root=tmp_path)) as store:
        group = store.open_namespace(name).group(0)
        assert group.contains(hashes) == [True] * 5
        parents = [group.read_header(h)[0].parent_hash for h in hashes]
        assert parents == [None, *hashes[:-1]]  # the header's parent field rebuilds the chain
        assert not list(tmp_path.rglob("*.tmp-*"))  # every pending file was published


def test_restarted_engine_loads_blocks_byte_exact(tmp_path: Path) -> None:
    engine = restart_and_load(tmp_path, {}, {})
    assert engine.first_start["reader"] == 5 * BLOCK  # all five blocks came from the store
    assert engine.prefix_ok["reader"]
    assert min(engine.computed["reader"]) == 5 * BLOCK  # nothing before them was recomputed
    engine.shutdown()


def test_lookup_retries_while_the_store_is_probed(tmp_path: Path) -> None:
    engine = Engine(EngineOptions(root=tmp_path))
    request = engine.serve("r1", PROMPT)
    keys = [make_offload_key(h, 0) for h in request.block_hashes]
    engine.shutdown()
    engine = Engine(EngineOptions(root=tmp_path))
    manager, context = engine.manager, ReqContext(req_id="probe")
    assert [manager.lookup(k, context) for k in keys] == [LookupResult.RETRY] * 5
    assert manager.has_pending_work()
    manager.drain()
    assert [manager.lookup(k, context) for k in keys] == [LookupResult.HIT] * 5
    unknown = make_offload_key(bytes(32), 0)
    assert manager.lookup(unknown, context) is LookupResult.RETRY
    manager.drain()
    assert manager.lookup(unknown, context) is LookupResult.MISS
    engine.shutdown()


@pytest.mark.parametrize(
    ("write", "read"),
    [
        ({"tp": 1}, {"tp": 2}),
        ({"tp": 2}, {"tp": 4}),
        ({"tp": 4}, {"tp": 1}),
        ({"tp": 8}, {"tp": 2}),  # 4 KV heads at TP=8: replicated heads, elected writers
    ],
    ids=["tp1-to-tp2", "tp2-to-tp4", "tp4-to-tp1", "tp8-to-tp2"],
)
def test_another_tensor_parallel_size_loads_the_same_blocks(
    tmp_path: Path, write: dict[str, Any], read: dict[str, Any]
) -> None:
    engine = restart_and_load(tmp_path, write, read)
    assert engine.first_start["reader"] == 5 * BLOCK
    assert engine.prefix_ok["reader"]
    engine.shutdown()


@pytest.mark.parametrize(
    ("write", "read"),
    [
        ({"layout": "BLHNC"}, {"layout": "LBHNC", "tp": 2}),  # packed full rows -> per layer
        ({"layout": "LBNHC", "tp": 2}, {"layout": "BLNHC"}),  # NHD pages, packed NHD rows
    ],
    ids=["packed-hnd-to-per-layer", "nhd-to-packed-nhd"],
)
def test_packed_and_nhd_layouts_share_blocks(
    tmp_path: Path, write: dict[str, Any], read: dict[str, Any]
) -> None:
    engine = restart_and_load(tmp_path, write, read)
    assert engine.first_start["reader"] == 5 * BLOCK
    assert engine.prefix_ok["reader"]
    engine.shutdown()


@pytest.mark.parametrize(
    ("write", "read"),
    [
        ({"tp": 2, "dcp": 2}, {"block_size": 32}),
        ({"tp": 4, "dcp": 4, "block_size": 8, "layout": "BLNHC"}, {"tp": 2, "dcp": 2}),
    ],
    ids=["tp2-dcp2-to-tp1-block32", "tp4-dcp4-packed-nhd-to-tp2-dcp2"],
)
def test_decode_context_parallel_shares_blocks_of_the_same_span(
    tmp_path: Path, write: dict[str, Any], read: dict[str, Any]
) -> None:
    """DCP interleaves a block's tokens over ranks; a stored block spans block_size x dcp
    tokens, so DCP=2 with --block-size 16 shares blocks with DCP=1 with --block-size 32.
    Every rank writes byte ranges of every inner chunk; checksums are taken at publish.
    (One KV head: vLLM shards tokens only over ranks that hold the same heads.)"""
    mqa = {"model": "tiny_mqa"}
    engine = restart_and_load(tmp_path, {**mqa, **write}, {**mqa, **read}, prompt(5 * 32 + 3))
    assert engine.first_start["reader"] == 5 * 32
    assert engine.prefix_ok["reader"]
    engine.shutdown()


@pytest.mark.parametrize(
    ("write", "read"),
    [({"tp": 2}, {}), ({"layout": "BLHNC"}, {"tp": 4})],
    ids=["tp2-to-tp1", "packed-tp1-to-tp4"],
)
def test_mla_latent_round_trips(
    tmp_path: Path, write: dict[str, Any], read: dict[str, Any]
) -> None:
    """MLA: every TP rank holds the same latent; one elected rank writes each block."""
    mla = {"mla": True}
    engine = restart_and_load(tmp_path, {**mla, **write}, {**mla, **read})
    assert engine.first_start["reader"] == 5 * BLOCK
    assert engine.prefix_ok["reader"]
    assert engine.manager.namespace.identity.groups[0].kind == "mla"
    engine.shutdown()


@pytest.mark.parametrize(
    ("write", "read"),
    [({}, {"tp": 2}), ({"layout": "BLHNC"}, {})],
    ids=["per-layer-tp1-to-tp2", "packed-to-per-layer"],
)
def test_hybrid_model_round_trips(
    tmp_path: Path, write: dict[str, Any], read: dict[str, Any]
) -> None:
    """Full-attention and sliding-window layers in two KV-cache groups (two arrays)."""
    hybrid: dict[str, Any] = {"hybrid": True, "model": "tiny_hybrid"}
    long_prompt = prompt(8 * BLOCK + 3)
    first = Engine(EngineOptions(root=tmp_path, **hybrid, **write))
    first.serve("writer", long_prompt)
    name = first.manager.namespace.name
    published = first.manager.counters["blocks_published"]
    first.shutdown()
    # 8 full-attention blocks; the sliding group stores the blocks a later window can use
    assert published > 8
    with KVStore(StoreConfig(root=tmp_path)) as store:
        namespace = store.open_namespace(name)
        assert [g.kind for g in namespace.identity.groups] == ["full", "sliding"]
        assert sum(1 for _ in namespace.group(1).iter_blocks()) == published - 8
    second = Engine(EngineOptions(root=tmp_path, **hybrid, **read))
    second.serve("reader", [*long_prompt, 999], max_tokens=1)
    assert second.first_start["reader"] == 8 * BLOCK
    assert second.prefix_ok["reader"]
    full, sliding = second.prefix_checked["reader"]
    assert full == 8 * BLOCK
    assert 0 < sliding < 8 * BLOCK  # only the window's blocks are loaded for sliding layers
    second.shutdown()

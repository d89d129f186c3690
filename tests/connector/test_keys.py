"""Keys never collide: not across models (namespaces), not across cache salts (block hashes).

vLLM's OffloadKey is the prefix block hash plus a group id: it knows nothing of the model, so
the namespace must; the cache salt is inside the block hash chain, so salted prompts get keys
of their own. Engines are driven through vLLM 0.33's real Scheduler (tests/connector/harness.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector tests need vllm==0.33.0 (a separate venv)")

from kvstore import KVStore, StoreConfig

from .harness import BLOCK, Engine, EngineOptions, prompt

PROMPT = prompt(3 * BLOCK + 1)


def test_models_never_share_blocks(tmp_path: Path) -> None:
    first = Engine(EngineOptions(root=tmp_path))
    hashes = list(first.serve("a", PROMPT).block_hashes)
    first.shutdown()
    # Same geometry and prompt, another model name (e.g. a fine-tune): a namespace of its own.
    other = Engine(EngineOptions(root=tmp_path, extra={"model_name": "org/other-model"}))
    assert other.serve("b", [*PROMPT, 7], max_tokens=1).block_hashes[:3] == hashes
    assert other.first_start["b"] == 0  # nothing loaded from the first model's blocks
    other.shutdown()
    # Another geometry (four layers instead of two): yet another namespace.
    deeper = Engine(EngineOptions(root=tmp_path, model="tiny_hybrid"))
    deeper.serve("c", [*PROMPT, 7], max_tokens=1)
    assert deeper.first_start["c"] == 0
    deeper.shutdown()
    with KVStore(StoreConfig(root=tmp_path)) as store:
        names = store.namespace_names()
        assert len(names) == 3
        for name in names:  # each stored the same three hashes, in its own arrays
            group = store.open_namespace(name).group(0)
            assert group.contains(hashes) == [True] * 3
            assert group.read_header(hashes[0])[0].namespace_digest != b""
        digests = {store.open_namespace(n).digest for n in names}
        assert len(digests) == 3


def test_cache_salts_never_share_blocks(tmp_path: Path) -> None:
    engine = Engine(EngineOptions(root=tmp_path))
    alice = engine.serve("alice", PROMPT, cache_salt="alice").block_hashes
    engine.shutdown()
    engine = Engine(EngineOptions(root=tmp_path))
    bob = engine.serve("bob", [*PROMPT, 1], max_tokens=1, cache_salt="bob").block_hashes
    assert all(a != b for a, b in zip(alice, bob, strict=False))  # salt is in every chained hash
    assert engine.first_start["bob"] == 0
    engine.shutdown()
    engine = Engine(EngineOptions(root=tmp_path))
    engine.serve("alice-again", [*PROMPT, 1], max_tokens=1, cache_salt="alice")
    assert engine.first_start["alice-again"] == 3 * BLOCK
    assert engine.prefix_ok["alice-again"]
    engine.shutdown()


def test_namespace_identity_has_no_parallel_size(tmp_path: Path) -> None:
    names = set()
    layouts: list[dict[str, Any]] = [{"tp": 1}, {"tp": 4, "layout": "BLNHC"}]
    for options in layouts:
        engine = Engine(EngineOptions(root=tmp_path, **options))
        names.add(engine.manager.namespace.name)
        identity = engine.manager.namespace.identity.to_json()
        engine.shutdown()
        assert identity["groups"][0]["num_kv_heads"] == 4  # the model's, not a rank's
        assert set(identity) == {
            "model",
            "revision",
            "kv_dtype",
            "tokens_per_block",
            "hash_algo",
            "hash_seed",
            "format_version",
            "groups",
        }
    assert len(names) == 1

"""A running `vllm serve` shows the kvstore series on /metrics and sends its KV events.

The tiny Llama of tests/e2e/test_serve.py is served with vLLM's KV events on (ZMQ publisher on
127.0.0.1, a SUB socket in this test). First server: the prompt's blocks are stored; /metrics
counts them under ``vllm:kvstore_stored_blocks_total`` and the subscriber receives a
``BlockStored`` with ``medium="STORAGE"`` for each. Restarted server, same prompt: /metrics
shows the lookups as hits and the blocks as loaded.

The servers, the subscriber and the request are tests/e2e/servers.py's ``restart_scenario``,
run once per session for this test and test_serve.py (the ``served_restart`` fixture); the
events are decoded with msgspec without vLLM's classes (``servers.storage_events``).
"""

from __future__ import annotations

import pytest

from .servers import BLOCK, Restart

zmq = pytest.importorskip("zmq", reason="pyzmq comes with vLLM")
msgspec = pytest.importorskip("msgspec", reason="msgspec comes with vLLM")

pytestmark = pytest.mark.e2e


def test_metrics_and_kv_events_of_a_running_server(served_restart: Restart) -> None:
    run = served_restart
    stored, loaded, events, seen = run.stored, run.loaded, run.events, run.seen
    full_blocks, log1, log2 = run.full_blocks, run.log1, run.log2
    hit = (("result", "hit"),)

    assert stored.get(("vllm:kvstore_stored_blocks_total", ())) == full_blocks, log1
    assert stored.get(("vllm:kvstore_stored_bytes_total", ()), 0) > 0, log1
    assert stored.get(("vllm:kvstore_lookup_blocks_total", (("result", "miss"),)), 0) >= 1
    assert stored.get(("vllm:kvstore_pending_store_bytes", ())) is not None
    blocks_stored = [ev for ev in events if ev["type"] == "BlockStored"]
    assert len(blocks_stored) == full_blocks, (seen[:20], log1[-3000:])
    assert sum(len(ev["block_hashes"]) for ev in blocks_stored) == full_blocks  # one per block
    assert {ev.get("locality") for ev in blocks_stored} == {"LOCAL"}
    assert loaded.get(("vllm:kvstore_lookup_blocks_total", hit)) == full_blocks, log2
    assert loaded.get(("vllm:kvstore_lookup_tokens_total", hit)) == full_blocks * BLOCK
    assert loaded.get(("vllm:kvstore_loaded_blocks_total", ())) == full_blocks, log2
    assert loaded.get(("vllm:kvstore_load_seconds_count", ()), 0) >= 1
    assert not any(
        name == "vllm:kvstore_failed_blocks_total" and v for (name, _), v in loaded.items()
    )

"""A running `vllm serve` shows the kvstore series on /metrics and sends its KV events.

The tiny Llama of tests/e2e/test_serve.py is served with vLLM's KV events on (ZMQ publisher on
127.0.0.1, a SUB socket in this test). First server: the prompt's blocks are stored; /metrics
counts them under ``vllm:kvstore_stored_blocks_total`` and the subscriber receives a
``BlockStored`` with ``medium="STORAGE"`` for each. Restarted server, same prompt: /metrics
shows the lookups as hits and the blocks as loaded.

The events are decoded with msgspec without vLLM's classes (the server's vLLM may differ from
this venv's): a batch is ``[ts, [event, ...], dp_rank]``, an event a map with its ``type``.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .test_serve import (
    BLOCK,
    METRICS_TIMEOUT_S,
    PROMPT_TOKENS,
    Server,
    complete,
    free_port,
    http,
    serve_command,
    stop,
    wait_for_blocks,
    wait_ready,
)

zmq = pytest.importorskip("zmq", reason="pyzmq comes with vLLM")
msgspec = pytest.importorskip("msgspec", reason="msgspec comes with vLLM")

pytestmark = pytest.mark.e2e

EVENTS_TIMEOUT_S = 30.0


@contextmanager
def served_with_events(
    python: str, model: Path, root: Path, log: Path, env: dict[str, str], events_port: int
) -> Iterator[Server]:
    port = free_port()
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # vLLM's publisher binds wildcard endpoints only (and connects to any other, as to a
        # collector, which did not deliver here): bind, and the test subscribes on loopback.
        "endpoint": f"tcp://*:{events_port}",
        "topic": "kv",
    }
    command = [*serve_command(python, model, root, port), "--kv-events-config", json.dumps(events)]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    server = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        wait_ready(server)
        yield server
    finally:
        stop(proc)


def samples(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics by (sample name, labels other than vLLM's model_name / engine)."""
    text = http(server.url + "/metrics").decode()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(
                sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))
            )
            out[(s.name, labels)] = out.get((s.name, labels), 0.0) + s.value
    return out


def settled(server: Server, name: str, labels: tuple[tuple[str, str], ...], want: float) -> Any:
    """/metrics once ``name{labels}`` reached ``want``, or the last scrape at the deadline."""
    deadline = time.monotonic() + METRICS_TIMEOUT_S
    while True:
        got = samples(server)
        if got.get((name, labels), 0.0) >= want or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def storage_events(sub: Any, want: int, seen: list[Any]) -> list[dict[str, Any]]:
    """KV events with medium STORAGE received until ``want`` BlockStored or the deadline;
    every event received goes to ``seen``."""
    found: list[dict[str, Any]] = []
    deadline = time.monotonic() + EVENTS_TIMEOUT_S
    while time.monotonic() < deadline:
        if not sub.poll(500):
            continue
        _topic, _seq, payload = sub.recv_multipart()
        batch = msgspec.msgpack.decode(payload)
        seen += batch[1]
        found += [ev for ev in batch[1] if ev.get("medium") == "STORAGE"]
        if sum(ev["type"] == "BlockStored" for ev in found) >= want:
            break
    return found


def test_metrics_and_kv_events_of_a_running_server(
    tmp_path: Path, e2e_python: str, tiny_llama: Path, e2e_env: dict[str, str]
) -> None:
    root = tmp_path / "kvcache"
    env = {**e2e_env, "VLLM_CPU_KVCACHE_SPACE": "1"}
    prompt = [(7919 * i + 13) % 250 + 3 for i in range(PROMPT_TOKENS)]
    full_blocks = PROMPT_TOKENS // BLOCK
    events_port = free_port()
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"tcp://127.0.0.1:{events_port}")  # retried until the server binds
    try:
        with served_with_events(
            e2e_python, tiny_llama, root, tmp_path / "serve1.log", env, events_port
        ) as first:
            complete(first, prompt)
            wait_for_blocks(root, full_blocks, first)
            stored = settled(first, "vllm:kvstore_stored_blocks_total", (), full_blocks)
            seen: list[Any] = []
            events = storage_events(sub, full_blocks, seen)
            log1 = first.log_tail()
        with served_with_events(
            e2e_python, tiny_llama, root, tmp_path / "serve2.log", env, events_port
        ) as second:
            complete(second, prompt)
            hit = (("result", "hit"),)
            loaded = settled(second, "vllm:kvstore_loaded_blocks_total", (), full_blocks)
            log2 = second.log_tail()
    finally:
        sub.close()
        context.term()

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

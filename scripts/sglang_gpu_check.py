#!/usr/bin/env python3
"""A real SGLang server with kvstore as its HiCache L3 storage, on a GPU machine.

What CPU machines cannot run (SGLang's model runner needs CUDA): a tiny random-weight Llama
(built here with transformers, nothing downloaded) served by ``sglang.launch_server`` with the
launch line of docs/sglang.md at ``--tp`` W; one greedy request by token ids; the server
stopped once the store holds the prompt's pages; a new server at ``--tp`` R on the same store;
the same request. Passes when the tokens are identical and the second server reports cached
tokens for the prompt (its prefix came from the store: the new server's GPU and host caches
started empty). Prints one JSON summary line; exit 0 on a pass, 1 on a failure, 2 when SGLang
cannot serve here (not installed, no CUDA).

    python scripts/sglang_gpu_check.py --workdir /tmp/sgl-check --write-tp 1 --read-tp 1

scripts/gpu_check.sh runs it when SGLang is installed; tests/sglang/test_launch_line.py checks
:func:`launch_args` against SGLang's own argument parser on CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PAGE = 64
PROMPT_TOKENS = 4 * PAGE + 5  # four full pages to store, then a partial one
START_TIMEOUT_S = 600.0
STORE_TIMEOUT_S = 120.0


def extra_config(root: Path) -> dict[str, Any]:
    return {
        "backend_name": "kvstore",
        "module_path": "connector.sglang",
        "class_name": "KVStoreHiCacheStorage",
        "interface_v1": 1,
        "root": str(root),
    }


def launch_args(model: Path, root: Path, tp: int, port: int) -> list[str]:
    """``sglang.launch_server``'s arguments: docs/sglang.md's line, plus what a check needs
    (token ids in and out, write-through so pages reach the store at once, prefetches that
    wait for the store, a small memory share)."""
    return [
        "--model-path", str(model),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--tp", str(tp),
        "--skip-tokenizer-init",
        "--page-size", str(PAGE),
        "--enable-hierarchical-cache",
        "--hicache-storage-backend", "dynamic",
        "--hicache-storage-backend-extra-config", json.dumps(extra_config(root)),
        "--hicache-write-policy", "write_through",
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--mem-fraction-static", "0.3",
        "--random-seed", "0",
        "--disable-cuda-graph",
    ]  # fmt: skip


def build_model(directory: Path) -> None:
    """A 2-layer Llama with random weights (head_dim 64: every SGLang attention backend)."""
    import torch  # noqa: PLC0415 - the GPU machine's torch, only when building
    import transformers  # noqa: PLC0415

    llama_config: Any = transformers.LlamaConfig
    llama: Any = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    config = llama_config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    llama(config).to(torch.bfloat16).save_pretrained(directory)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def post(url: str, body: dict[str, Any], timeout: float) -> Any:
    headers = {"Content-Type": "application/json"}
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)  # noqa: S310 - loopback
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - http://127.0.0.1
        return json.loads(resp.read())


class Server:
    """One ``sglang.launch_server`` process group; its log in ``log``."""

    def __init__(self, model: Path, root: Path, tp: int, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        with log.open("wb") as out:
            self.proc = subprocess.Popen(  # noqa: S603 - this interpreter, our arguments
                [
                    sys.executable,
                    "-m",
                    "sglang.launch_server",
                    *launch_args(model, root, tp, self.port),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.tail()}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).read()  # noqa: S310
            except (urllib.error.URLError, OSError):
                time.sleep(2)
            else:
                return
        raise RuntimeError(f"server not ready after {START_TIMEOUT_S:.0f} s: {self.tail()}")

    def generate(self, prompt: list[int]) -> dict[str, Any]:
        body = {
            "input_ids": prompt,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
        }
        reply: dict[str, Any] = post(self.url + "/generate", body, 300)
        return reply

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the rest of its group (scheduler, TP)
        self.proc.wait(60)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def stored_pages(root: Path) -> int:
    """Published blocks in the store (``kvstore ls --json``'s totals)."""
    if not root.is_dir():
        return 0
    out = subprocess.run(  # noqa: S603 - this interpreter, our arguments
        [sys.executable, "-m", "kvstore.cli", "ls", str(root), "--json"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        doc = json.loads(out.stdout)
    except ValueError:
        return 0
    return sum(int(ns.get("blocks", 0)) for ns in doc.get("namespaces", []))


def serve_once(model: Path, root: Path, tp: int, log: Path, prompt: list[int]) -> dict[str, Any]:
    server = Server(model, root, tp, log)
    try:
        server.wait_ready()
        reply = server.generate(prompt)
        deadline = time.monotonic() + STORE_TIMEOUT_S
        while stored_pages(root) < PROMPT_TOKENS // PAGE and time.monotonic() < deadline:
            time.sleep(1)
        return reply
    finally:
        server.stop()


def cannot_serve() -> str:
    """Why SGLang cannot serve on this machine ("" when it can)."""
    try:
        import sglang.srt.entrypoints.http_server  # noqa: F401, PLC0415
        import torch  # noqa: PLC0415
    except ImportError as exc:
        return str(exc)
    return "" if torch.cuda.is_available() else "no CUDA device"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("sglang-gpu-check"))
    parser.add_argument("--write-tp", type=int, default=1)
    parser.add_argument("--read-tp", type=int, default=1)
    args = parser.parse_args()
    why = cannot_serve()
    if why:
        print(json.dumps({"ok": None, "skipped": f"SGLang cannot serve here: {why}"}))
        return 2
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    model, root = work / "model", work / "store"
    if not (model / "config.json").exists():
        build_model(model)
    prompt = [(7919 * i + 13) % 500 + 3 for i in range(PROMPT_TOKENS)]
    first = serve_once(model, root, args.write_tp, work / "server1.log", prompt)
    pages = stored_pages(root)
    second = serve_once(model, root, args.read_tp, work / "server2.log", prompt)
    cached = int(second.get("meta_info", {}).get("cached_tokens", 0))
    ok = first.get("output_ids") == second.get("output_ids") and cached >= PAGE and pages > 0
    summary = {
        "ok": ok,
        "write_tp": args.write_tp,
        "read_tp": args.read_tp,
        "stored_pages": pages,
        "tokens_first": first.get("output_ids"),
        "tokens_second": second.get("output_ids"),
        "cached_tokens_second": cached,
    }
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

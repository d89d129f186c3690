"""Threat 5, concurrency: 8 writer and 4 reader processes and ``kvstore gc --watch`` on one
store.

Two namespaces of identical geometry share the store and the block hashes (writers 0-5 and
readers 0-2 use the first, the others the second) and their blocks' bytes differ, so a read
served from the wrong namespace, the wrong block or a half-written file shows as wrong bytes.
Writers write random blocks of a pool (whole blocks and the multi-writer protocol; many
collide on the same hash), readers read random blocks (whole, or two chunks), and
``kvstore gc --watch`` keeps the store at a budget far below the pool, evicting (and, with no
grace, unlinking) blocks under the readers. Every read must be a HIT with exactly its bytes or a
MISS; no write may fail; ``kvstore verify`` finds nothing afterwards.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvstore.cli import main
from kvstore.config import StoreConfig
from kvstore.store.page_store import KVStore
from tests.helpers import make_small_identity
from tests.reliability import workers
from tests.reliability.common import figure, fork_context, tier

WRITERS, READERS, POOL = 8, 4, 300


def test_writers_readers_and_gc_watch(tmp_path: Path) -> None:
    write_ops = tier(1500, 10_000)
    read_ops = tier(3000, 20_000)
    root = tmp_path / "store"
    identities = [make_small_identity(), make_small_identity(model="test/tiny-llama-twin")]
    with KVStore(StoreConfig(root=root)) as store:
        groups = [store.namespace(i).group(0) for i in identities]
        assert groups[0].layout == groups[1].layout
        block_file = groups[0].layout.file_nbytes
    jsons = [i.to_json() for i in identities]
    stop_file = tmp_path / "stop"
    budget = 120 * block_file
    gc_out = tmp_path / "gc.jsonl"
    gc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstore.cli",
            "gc",
            str(root),
            "--max-bytes",
            str(budget),
            "--watch",
            "--interval",
            "0.05",
            "--grace",
            "0",
            "--json",
        ],
        stdout=gc_out.open("w"),
        stderr=subprocess.STDOUT,
    )
    _wait_for_first_pass(gc, gc_out)
    ctx = fork_context()
    procs: list[tuple[str, Any, Any]] = []
    t0 = time.monotonic()
    try:
        for w in range(WRITERS):
            receive, send = ctx.Pipe(duplex=False)
            ns = 0 if w < 6 else 1
            p = ctx.Process(  # type: ignore[attr-defined]
                daemon=True,
                target=workers.race_writer,
                args=(str(root), jsons, ns, POOL, write_ops, 1000 + w, send),
            )
            procs.append(("writer", p, receive))
        for r in range(READERS):
            receive, send = ctx.Pipe(duplex=False)
            ns = 0 if r < 3 else 1
            p = ctx.Process(  # type: ignore[attr-defined]
                daemon=True,
                target=workers.race_reader,
                args=(str(root), jsons, ns, POOL, read_ops, 2000 + r, str(stop_file), send),
            )
            procs.append(("reader", p, receive))
        for _, p, _ in procs:
            p.start()
        reports: list[tuple[str, dict[str, Any]]] = []
        for kind, _, receive in procs:
            if kind == "writer":
                assert receive.poll(600), "a writer did not finish"
                reports.append((kind, receive.recv()))
        stop_file.touch()
        for kind, _, receive in procs:
            if kind == "reader":
                assert receive.poll(600), "a reader did not finish"
                reports.append((kind, receive.recv()))
        for _, p, _ in procs:
            p.join(30)
    finally:
        stop_file.touch()
        for _, p, _ in procs:
            if p.is_alive():
                p.kill()
        gc.send_signal(signal.SIGTERM)
        gc.wait(timeout=60)
    elapsed = time.monotonic() - t0
    lines = gc_out.read_text().splitlines()
    assert gc.returncode == 0, lines[-5:]
    passes = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(passes) == len(lines), [line for line in lines if not line.startswith("{")][:5]

    writes: dict[str, int] = {}
    reads: dict[str, int] = {}
    bad: list[str] = []
    failures: list[str] = []
    for kind, report in reports:
        if kind == "writer":
            for k, v in report["counts"].items():
                writes[k] = writes.get(k, 0) + v
            failures += report["errors"]
        else:
            for k, v in report["counts"].items():
                reads[k] = reads.get(k, 0) + v
            bad += report["bad"]
    evicted = sum(p["evicted"]["blocks"] for p in passes)
    figure(
        "8 writers + 4 readers + gc --watch",
        operations=sum(writes.values()) + sum(reads.values()),
        writes=writes,
        reads=reads,
        gc_passes=len(passes),
        evicted=evicted,
        torn_or_foreign_reads=len(bad),
        seconds=round(elapsed, 1),
    )
    assert bad == [], bad[:10]
    assert failures == [] and writes.get("failed", 0) == 0, failures
    assert sum(writes.values()) + sum(reads.values()) >= tier(10_000, 100_000)
    assert reads.get("hit", 0) > 0 and reads.get("miss", 0) > 0
    assert evicted > 0 and len(passes) > 3
    assert main(["verify", str(root)]) == 0


def _wait_for_first_pass(gc: subprocess.Popen[bytes], out: Path, timeout: float = 180.0) -> None:
    """Block until ``gc --watch`` has printed its first pass.

    Only then are its SIGINT/SIGTERM handlers installed. Its start imports torch (seconds on
    a loaded machine), and a small-tier run of the writers can finish sooner; the SIGTERM
    that ends the test then killed gc before it ran a pass (exit -15, no output).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(line.startswith("{") for line in out.read_text().splitlines()):
            return
        if gc.poll() is not None:
            raise AssertionError(f"gc --watch exited {gc.returncode}: {out.read_text()[-500:]}")
        time.sleep(0.05)
    gc.kill()
    raise AssertionError(f"gc --watch printed no pass in {timeout:.0f} s")

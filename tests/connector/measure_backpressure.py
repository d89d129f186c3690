"""Measure: engine step time while the store is throttled below the offered write rate.

    .venv/bin/python -m tests.connector.measure_backpressure [--requests 48] [--fraction 0.1]

Runs vLLM 0.33's real Scheduler and the kvstore connector on CPU (tests/connector/harness.py,
tiny_llama with 256-token blocks: 64 KiB per block) three times over the same stream of
requests, each with its own store directory:

1. ``unthrottled``: the store as fast as the local disk; its stored bytes over its wall time
   is the offered write rate R;
2. ``throttled, bounded``: every write into a block file is paced to ``fraction`` x R (a
   token bucket around :class:`kvstore.io.fileio.FileIO`, the I/O engine's one replaceable
   syscall object: an honest stand-in for a slow filesystem; the container's cgroup v1 blkio
   throttle does not pace buffered writes and no FUSE throttle is installed), with
   ``max_pending_store_bytes`` = 16 blocks;
3. ``throttled, unbounded``: the same pace, ``max_pending_store_bytes`` = 1 TiB.

It prints per run the step-time percentiles, the most pending store bytes seen, and the
stored / dropped block counts. Timings are this machine's, shared with other work: compare the
runs with each other, not with other machines.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import connector.store
from connector.offload import metrics as m
from kvstore import KVStore

from .disks import TempWrites
from .harness import Engine, EngineOptions, prompt
from .metered import Metered

TOKENS_PER_BLOCK = 256
BLOCKS_PER_REQUEST = 4


class PacedDisk(TempWrites):
    """Writes into temporary block files are paced to ``rate`` bytes/s (0: unpaced)."""

    def __init__(self, rate: float) -> None:
        super().__init__()
        self.rate = rate
        self._next = 0.0
        self._lock = threading.Lock()

    def on_temp_write(self, buffers: Any) -> None:
        if self.rate:
            nbytes = sum(memoryview(b).nbytes for b in buffers)
            with self._lock:
                start = max(self._next, time.monotonic())
                self._next = start + nbytes / self.rate
            delay = self._next - time.monotonic()
            if delay > 0:
                time.sleep(delay)


def run(root: Path, requests: int, rate: float, bound: int) -> dict[str, Any]:
    disk = PacedDisk(rate)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(connector.store, "open_store", lambda config: KVStore(config, fio=disk))
        engine = Engine(
            EngineOptions(
                root=root,
                block_size=TOKENS_PER_BLOCK,
                num_blocks=4 * BLOCKS_PER_REQUEST * 4,
                extra={"max_pending_store_bytes": bound},
            )
        )
        metered = Metered(engine)
        steps: list[float] = []
        peak = 0
        started = time.monotonic()
        added = 0
        while added < requests or engine.scheduler.has_unfinished_requests():
            while added < requests and len(engine.scheduler.requests) < 4:
                tokens = prompt(BLOCKS_PER_REQUEST * TOKENS_PER_BLOCK + 1, start=10_000 * added)
                engine.add(f"r{added}", tokens, max_tokens=2)
                added += 1
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
            peak = max(peak, engine.manager.ledger.pending_bytes)
        served = time.monotonic() - started
        deadline = time.monotonic() + 900
        while engine.busy() and time.monotonic() < deadline:  # let the store catch up
            engine.step()
            time.sleep(0.01)
        engine.manager.drain()
        block = engine.manager.namespace.group(0).layout.block_nbytes
        out = {
            "steps": len(steps),
            "p50_ms": 1e3 * statistics.median(steps),
            "p99_ms": 1e3 * statistics.quantiles(steps, n=100)[98],
            "max_ms": 1e3 * max(steps),
            "serve_s": served,
            "peak_pending_bytes": peak,
            "stored": metered.value(m.STORED_BLOCKS),
            "dropped": metered.value(m.STORE_DROPPED_BLOCKS, m.BACKPRESSURE),
            "block_bytes": block,
        }
        engine.shutdown()
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--fraction", type=float, default=0.1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = run(Path(tmp) / "a", args.requests, 0.0, 1 << 40)
        offered = base["stored"] * base["block_bytes"] / base["serve_s"]
        pace = args.fraction * offered
        bounded = run(Path(tmp) / "b", args.requests, pace, 16 * base["block_bytes"])
        unbounded = run(Path(tmp) / "c", args.requests, pace, 1 << 40)
    print(
        f"offered write rate R = {offered / 1e6:.2f} MB/s; "
        f"throttled runs paced to {pace / 1e6:.3f} MB/s"
    )
    print("| run | steps | p50 ms | p99 ms | max ms | peak pending bytes | stored | dropped |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in (
        ("unthrottled", base),
        (f"throttled to {args.fraction:g} R, bound 16 blocks", bounded),
        (f"throttled to {args.fraction:g} R, unbounded", unbounded),
    ):
        print(
            f"| {name} | {r['steps']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
            f"{r['max_ms']:.1f} | {r['peak_pending_bytes']} | {r['stored']} | {r['dropped']} |"
        )


if __name__ == "__main__":
    main()

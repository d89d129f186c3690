"""The main job: write a realistic prefix-cache workload, then read it back as a restarted server.

Workload: ``requests`` prompts that share prefixes the way chat traffic does - one system
prompt shared by all, a few topic prefixes shared by groups of requests, then each request's
own turns. Token ids are drawn deterministically from a seed; block hashes chain like vLLM's
(each block's hash covers its parent's hash and its tokens). KV bytes are deterministic
functions of the block hash (bf16 bit patterns), so a process that never saw the writer can
regenerate and check every byte.

Phase 1 (this process) writes every block of every KV-cache group of the model. Phase 2 runs
in a new Python process, as a restarted server would: it opens the store cold, looks up each
request's longest cached prefix (plus one request the store has never seen the end of),
reads the hits, and compares every byte.

With ``--write-layout`` / ``--read-layout`` each phase runs every rank of a parallel layout
in its own process (:mod:`kvstore.demo.ranks`): a cache written at one layout, read at another.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.pool import Pool
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.config import StoreConfig
from kvstore.demo import ranks
from kvstore.demo.data import Plan, demo_identity, fill_block, make_plan, request_chain
from kvstore.io.buffers import aligned_buffer
from kvstore.store.group_store import GroupStore
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockRead, BlockWrite, WriteResult, WriteStatus

BATCH = 32


@dataclass(frozen=True)
class DemoSpec:
    """Parameters of one demo run (the CLI's options)."""

    root: Path  # store directory
    model: str  # key of models.json
    blocks: int  # unique blocks to write
    tokens: int  # tokens per block
    requests: int  # requests sharing prefixes
    threads: int  # I/O threads
    seed: int  # workload seed
    write_layout: str = ""  # e.g. "tp=2": write with every rank of it, one process each
    read_layout: str = ""  # e.g. "tp=4,pp=2": read back with every rank of it

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "root": str(self.root)})

    @classmethod
    def from_json(cls, text: str) -> DemoSpec:
        doc = json.loads(text)
        return cls(**{**doc, "root": Path(doc["root"])})


def _unique_blocks(
    plan: Plan, tokens: int, seed: int
) -> tuple[list[bytes], dict[bytes, bytes | None]]:
    """Every block of every request once, in first-use order, with its parent hash."""
    parents: dict[bytes, bytes | None] = {}
    order: list[bytes] = []
    for request in plan.requests:
        chain = request_chain(plan, request, tokens, seed)
        for i, h in enumerate(chain):
            if h not in parents:
                parents[h] = chain[i - 1] if i else None
                order.append(h)
    return order, parents


def _batches(items: Sequence[bytes]) -> list[Sequence[bytes]]:
    return [items[i : i + BATCH] for i in range(0, len(items), BATCH)]


def write_phase(spec: DemoSpec) -> dict[str, Any]:
    """Write every block of every request; returns counts and timing."""
    plan = make_plan(spec.blocks, spec.requests)
    identity = demo_identity(spec.model, spec.tokens)
    order, parents = _unique_blocks(plan, spec.tokens, spec.seed)
    totals = {"written": 0, "already_present": 0, "bytes": 0, "seconds": 0.0}
    pool = ranks.make_pool(len(ranks.rank_coords(spec.write_layout))) if spec.write_layout else None
    try:
        with KVStore(StoreConfig(root=spec.root, io_threads=spec.threads)) as store:
            ns = store.namespace(identity)
            for group in ns.groups:
                buffers = [aligned_buffer(group.layout.block_nbytes) for _ in range(BATCH)]
                for batch in _batches(order):
                    if pool is None:
                        for buf, h in zip(buffers, batch, strict=False):
                            fill_block(buf, h, group.index)
                        writes = [
                            BlockWrite(h, b, parents[h])
                            for b, h in zip(buffers, batch, strict=False)
                        ]
                        t0 = time.perf_counter()
                        results = group.write_blocks(writes)
                        seconds = time.perf_counter() - t0
                    else:
                        results, seconds = _write_with_ranks(spec, group, pool, batch, parents)
                    totals["seconds"] += seconds
                    failed = [r for r in results if r.status is WriteStatus.FAILED]
                    if failed:
                        raise RuntimeError(f"demo: block write failed: {failed[0].error}")
                    n_written = sum(r.status is WriteStatus.WRITTEN for r in results)
                    totals["written"] += n_written
                    totals["already_present"] += len(results) - n_written
                    totals["bytes"] += n_written * group.layout.block_nbytes
            namespace, engine = ns.name, store.engine.describe()
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return {
        "namespace": namespace,
        "engine": engine,
        "unique_blocks": len(order),
        "groups": len(identity.groups),
        "layout": spec.write_layout or "whole blocks",
        **totals,
    }


def _write_with_ranks(
    spec: DemoSpec,
    group: GroupStore,
    pool: Pool,
    batch: Sequence[bytes],
    parents: dict[bytes, bytes | None],
) -> tuple[list[WriteResult], float]:
    """Scheduler role: begin, let every rank process write its share, then commit.

    Returns the results and the store time: the slowest rank's write call (ranks run in
    parallel) plus the commit, not the ranks' start-up or data generation.
    """
    fresh = [h for h, present in zip(batch, group.contains(batch), strict=True) if not present]
    pendings = group.begin_blocks(fresh, [parents[h] for h in fresh])
    tasks = [
        _rank_task(spec, spec.write_layout, coord, group.index)
        for coord in ranks.rank_coords(spec.write_layout)
    ]
    exists = [WriteResult(WriteStatus.EXISTS)] * (len(batch) - len(fresh))
    if not pendings:
        return exists, 0.0
    per_rank = pool.starmap(ranks.write_rank, [(task, pendings) for task in tasks])
    failed = sum(f for f, _ in per_rank)
    if failed:
        group.abort_blocks(pendings)
        return [WriteResult(WriteStatus.FAILED, f"{failed} rank writes failed")], 0.0
    checksum, range_writers = ranks.commit_plan(tasks[0])
    t0 = time.perf_counter()
    committed = group.commit_blocks(pendings, [checksum] * len(pendings), range_writers)
    seconds = max(s for _, s in per_rank) + time.perf_counter() - t0
    return [*committed, *exists], seconds


def _rank_task(
    spec: DemoSpec, layout: str, coord: tuple[int, int, int], group: int
) -> ranks.RankTask:
    return ranks.RankTask(
        root=str(spec.root),
        model=spec.model,
        tokens=spec.tokens,
        threads=spec.threads,
        layout=layout,
        coord=coord,
        group=group,
    )


def read_phase(spec: DemoSpec) -> dict[str, Any]:
    """Cold-open the store, look up and read every request, verify every byte."""
    plan = make_plan(spec.blocks, spec.requests)
    identity = demo_identity(spec.model, spec.tokens)
    queries = [*plan.requests, plan.unseen]
    totals = {"asked_blocks": 0, "hit_blocks": 0, "read_bytes": 0, "mismatched": 0}
    lookup_s = read_s = 0.0
    per_request = []
    pool = ranks.make_pool(len(ranks.rank_coords(spec.read_layout))) if spec.read_layout else None
    try:
        with KVStore(StoreConfig(root=spec.root, io_threads=spec.threads), create=False) as store:
            ns = store.namespace(identity, create=False)
            for request in queries:
                chain = request_chain(plan, request, spec.tokens, spec.seed)
                t0 = time.perf_counter()
                found = min(group.longest_prefix(chain) for group in ns.groups)
                lookup_s += time.perf_counter() - t0
                verified = 0
                for group in ns.groups:
                    for batch in _batches(chain[:found]):
                        ok, bad, nbytes, seconds = (
                            _read_whole(group, batch)
                            if pool is None
                            else _read_with_ranks(spec, group, pool, batch)
                        )
                        read_s += seconds
                        verified += ok
                        totals["mismatched"] += bad
                        totals["read_bytes"] += nbytes
                totals["asked_blocks"] += len(chain)
                totals["hit_blocks"] += found
                per_request.append(
                    {"blocks": len(chain), "hit_blocks": found, "verified": verified}
                )
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return {
        "requests": len(queries),
        "layout": spec.read_layout or "whole blocks",
        **totals,
        "lookup_seconds": lookup_s,
        "read_seconds": read_s,
        "per_request": per_request,
    }


def _read_whole(group: GroupStore, batch: Sequence[bytes]) -> tuple[int, int, int, float]:
    """Read whole blocks in this process and compare: (verified, bad, bytes, read seconds)."""
    size = group.layout.block_nbytes
    outs = [aligned_buffer(size) for _ in batch]
    t0 = time.perf_counter()
    results = group.read_blocks([BlockRead(h, o) for h, o in zip(batch, outs, strict=True)])
    seconds = time.perf_counter() - t0
    expected = aligned_buffer(size)
    ok = 0
    for h, out, result in zip(batch, outs, results, strict=True):
        fill_block(expected, h, group.index)
        ok += result.ok and np.array_equal(out, expected)
    return ok, len(batch) - ok, ok * size, seconds


def _read_with_ranks(
    spec: DemoSpec, group: GroupStore, pool: Pool, batch: Sequence[bytes]
) -> tuple[int, int, int, float]:
    """Every rank process loads and checks its pages; a block verifies if every rank's did.

    Bytes are summed over ranks; seconds are the slowest rank's load call (they run at once).
    """
    tasks = [
        _rank_task(spec, spec.read_layout, coord, group.index)
        for coord in ranks.rank_coords(spec.read_layout)
    ]
    per_rank = pool.starmap(ranks.read_rank, [(task, list(batch)) for task in tasks])
    bad = max(b for _, b, _, _ in per_rank)
    return len(batch) - bad, bad, sum(n for _, _, n, _ in per_rank), max(s for *_, s in per_rank)


def run(spec: DemoSpec, as_json: bool) -> int:
    """Both phases (the second in a fresh process); prints the table. Exit 0 iff all verified."""
    spec = dataclasses.replace(spec, root=spec.root.absolute())
    root, model, tokens = spec.root, spec.model, spec.tokens
    for layout in (spec.write_layout, spec.read_layout):
        if layout:  # refuse an uncertifiable layout before any work, with the reason
            ranks.certify(model, tokens, layout)
    wrote = write_phase(spec)
    # A new interpreter, as a restarted server: nothing of the writer's state survives.
    cmd = [sys.executable, "-m", "kvstore.demo", "--read-phase", spec.to_json()]
    child = subprocess.run(  # noqa: S603 - our own interpreter and module
        cmd,
        capture_output=True,
        text=True,
        check=False,
    )
    if child.returncode != 0:
        sys.stderr.write(child.stderr)
        print(f"demo: the read phase (a new process) failed with exit code {child.returncode}")
        return 2
    read = json.loads(child.stdout)
    ok = read["mismatched"] == 0
    if as_json:
        print(json.dumps({"write": wrote, "read": read, "ok": ok}, indent=2))
        return 0 if ok else 1
    print(f"kvstore demo: {model}, {tokens} tokens per block, store {root}")
    print(f"  namespace {wrote['namespace']} ({wrote['groups']} KV group(s)); {wrote['engine']}")
    w_label = f"write, {spec.write_layout or 'whole blocks'}"
    r_label = f"read, {spec.read_layout or 'whole blocks'}, new process"
    print(f"  {'phase':<36}{'blocks':>8}{'bytes':>12}{'GB/s':>8}")
    print(
        f"  {w_label:<36}{wrote['written']:>8}{_size(wrote['bytes']):>12}"
        f"{gbs(wrote['bytes'], wrote['seconds']):>8.2f}"
        + (f"   ({wrote['already_present']} already present)" if wrote["already_present"] else "")
    )
    print(
        f"  {r_label:<36}{read['hit_blocks']:>8}{_size(read['read_bytes']):>12}"
        f"{gbs(read['read_bytes'], read['read_seconds']):>8.2f}"
    )
    print(
        f"  lookups: {read['requests']} requests, {read['hit_blocks']} of {read['asked_blocks']} "
        f"prefix blocks hit in {read['lookup_seconds'] * 1e3:.2f} ms"
        " (shared prefixes count once per"
    )
    print("  request; the last request's new turn was never written, so it misses by design)")
    if spec.write_layout or spec.read_layout:
        print(
            "  (layouts: one process per rank; GB/s counts store time only, bytes summed over "
            "ranks)"
        )
    verdict = "every byte verified" if ok else f"{read['mismatched']} blocks MISMATCHED"
    print(f"  verify: {verdict}")
    return 0 if ok else 1


def gbs(nbytes: int, seconds: float) -> float:
    """GB/s, 0 for an empty phase."""
    return nbytes / seconds / 1e9 if seconds else 0.0


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"  # pragma: no cover

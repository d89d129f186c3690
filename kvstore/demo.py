"""The main job: write a realistic prefix-cache workload, then read it back as a restarted server.

Workload: ``requests`` prompts that share prefixes the way chat traffic does - one system
prompt shared by all, a few topic prefixes shared by groups of requests, then each request's
own turns. Token ids are drawn deterministically from a seed; block hashes chain like vLLM's
(each block's hash covers its parent's hash and its tokens). KV bytes are deterministic
functions of the block hash (bf16 bit patterns of normal values), so a process that never saw
the writer can regenerate and check every byte.

Phase 1 (this process) writes every block of every KV-cache group of the model. Phase 2 runs
in a new Python process, as a restarted server would: it opens the store cold, looks up each
request's longest cached prefix (plus one request the store has never seen the end of),
reads the hits, and compares every byte.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.config import StoreConfig
from kvstore.identity import Identity
from kvstore.io.buffers import aligned_buffer
from kvstore.models import load_model
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockRead, BlockWrite, WriteStatus

BATCH = 32
ROOT_HASH = hashlib.sha256(b"kvstore-demo-chain-root").digest()
VOCAB = 128_000


@dataclass(frozen=True)
class Plan:
    """What the demo writes: requests as lists of segment ids, and segment lengths in blocks."""

    segments: dict[str, int]  # segment id -> blocks
    requests: list[list[str]]  # each request: its segment ids, in order
    unseen: list[str]  # a request whose last segment was never written


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

    def to_argv(self) -> list[str]:
        return [
            str(self.root),
            self.model,
            str(self.blocks),
            str(self.tokens),
            str(self.requests),
            str(self.threads),
            str(self.seed),
        ]

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> DemoSpec:
        root, model, *numbers = argv
        blocks, tokens, requests, threads, seed = (int(n) for n in numbers)
        return cls(Path(root), model, blocks, tokens, requests, threads, seed)


def make_plan(blocks: int, requests: int) -> Plan:
    """Split ``blocks`` unique blocks into a system prompt, topics and per-request turns."""
    if blocks < 8 or requests < 1:
        raise ValueError(
            f"demo: expected --blocks >= 8 and --requests >= 1, got {blocks}, {requests}"
        )
    topics = min(3, requests)
    system = max(1, blocks // 8)
    topic = max(1, blocks // 8)
    rest = blocks - system - topics * topic
    segments = {"system": system}
    segments.update({f"topic{t}": topic for t in range(topics)})
    own = [rest // requests + (1 if r < rest % requests else 0) for r in range(requests)]
    reqs = []
    for r in range(requests):
        segments[f"req{r}"] = own[r]
        reqs.append(
            ["system", f"topic{r % topics}", f"req{r}"]
            if own[r]
            else ["system", f"topic{r % topics}"]
        )
    segments["unseen"] = max(1, own[0] or 1)
    return Plan(segments, reqs, ["system", "topic0", "unseen"])


def segment_hashes(
    segment: str, parent: bytes, blocks: int, tokens_per_block: int, seed: int
) -> list[bytes]:
    """Chained block hashes of a segment's tokens (vLLM style: hash(parent, tokens))."""
    rng = np.random.default_rng([seed, *segment.encode()])
    tokens = rng.integers(0, VOCAB, size=(blocks, tokens_per_block), dtype=np.int32)
    out = []
    for row in tokens:
        parent = hashlib.sha256(parent + row.tobytes()).digest()
        out.append(parent)
    return out


def request_chain(
    plan: Plan, request: Sequence[str], tokens_per_block: int, seed: int
) -> list[bytes]:
    """The block hashes of a request: its segments' chains, each continuing the previous."""
    chain: list[bytes] = []
    for segment in request:
        parent = chain[-1] if chain else ROOT_HASH
        chain += segment_hashes(segment, parent, plan.segments[segment], tokens_per_block, seed)
    return chain


def fill_block(out: np.ndarray, block_hash: bytes, group: int) -> None:
    """Deterministic KV bytes of a block: bf16 bits of N(0, 1) values seeded by its hash."""
    rng = np.random.default_rng([group, *block_hash[:16]])
    values = rng.standard_normal(len(out) // 2, dtype=np.float32)
    out.view(np.uint16)[:] = values.view(np.uint32) >> 16


def _identity(model: str, tokens: int) -> Identity:
    return load_model(model).identity(tokens)


def write_phase(spec: DemoSpec) -> dict[str, Any]:
    """Write every block of every request; returns counts and timing."""
    root, model, blocks, tokens, requests, threads, seed = (
        spec.root,
        spec.model,
        spec.blocks,
        spec.tokens,
        spec.requests,
        spec.threads,
        spec.seed,
    )
    plan = make_plan(blocks, requests)
    identity = _identity(model, tokens)
    parents: dict[bytes, bytes | None] = {}
    order: list[bytes] = []
    for request in plan.requests:
        chain = request_chain(plan, request, tokens, seed)
        for i, h in enumerate(chain):
            if h not in parents:
                parents[h] = chain[i - 1] if i else None
                order.append(h)
    written = existing = nbytes = 0
    seconds = 0.0
    with KVStore(StoreConfig(root=root, io_threads=threads)) as store:
        ns = store.namespace(identity)
        for group in ns.groups:
            size = group.layout.block_nbytes
            buffers = [aligned_buffer(size) for _ in range(BATCH)]
            for start in range(0, len(order), BATCH):
                batch = order[start : start + BATCH]
                for buf, h in zip(buffers, batch, strict=False):
                    fill_block(buf, h, group.index)
                t0 = time.perf_counter()
                results = group.write_blocks(
                    [BlockWrite(h, buf, parents[h]) for buf, h in zip(buffers, batch, strict=False)]
                )
                seconds += time.perf_counter() - t0
                failed = [r for r in results if r.status is WriteStatus.FAILED]
                if failed:
                    raise RuntimeError(f"demo: block write failed: {failed[0].error}")
                n_written = sum(r.status is WriteStatus.WRITTEN for r in results)
                written += n_written
                existing += len(results) - n_written
                nbytes += n_written * size
        namespace, engine = ns.name, store.engine.describe()
    return {
        "namespace": namespace,
        "engine": engine,
        "unique_blocks": len(order),
        "groups": len(identity.groups),
        "written": written,
        "already_present": existing,
        "bytes": nbytes,
        "seconds": seconds,
    }


def read_phase(spec: DemoSpec) -> dict[str, Any]:
    """Cold-open the store, look up and read every request, verify every byte."""
    root, model, blocks, tokens, requests, threads, seed = (
        spec.root,
        spec.model,
        spec.blocks,
        spec.tokens,
        spec.requests,
        spec.threads,
        spec.seed,
    )
    plan = make_plan(blocks, requests)
    identity = _identity(model, tokens)
    queries = [*plan.requests, plan.unseen]
    asked = hits = mismatched = read_bytes = 0
    lookup_s = read_s = 0.0
    per_request = []
    with KVStore(StoreConfig(root=root, io_threads=threads), create=False) as store:
        ns = store.namespace(identity, create=False)
        for request in queries:
            chain = request_chain(plan, request, tokens, seed)
            found = len(chain)
            for group in ns.groups:
                t0 = time.perf_counter()
                found = min(found, group.longest_prefix(chain))
                lookup_s += time.perf_counter() - t0
            asked += len(chain)
            verified = 0
            for group in ns.groups:
                size = group.layout.block_nbytes
                outs = [aligned_buffer(size) for _ in range(min(BATCH, max(found, 1)))]
                expected = aligned_buffer(size)
                for start in range(0, found, BATCH):
                    batch = chain[start : min(found, start + BATCH)]
                    t0 = time.perf_counter()
                    results = group.read_blocks(
                        [BlockRead(h, o) for h, o in zip(batch, outs, strict=False)]
                    )
                    read_s += time.perf_counter() - t0
                    for h, out, result in zip(batch, outs, results, strict=False):
                        fill_block(expected, h, group.index)
                        if not result.ok or not np.array_equal(out, expected):
                            mismatched += 1
                        else:
                            verified += 1
                            read_bytes += size
            hits += found
            per_request.append({"blocks": len(chain), "hit_blocks": found, "verified": verified})
    return {
        "requests": len(queries),
        "asked_blocks": asked,
        "hit_blocks": hits,
        "read_bytes": read_bytes,
        "mismatched": mismatched,
        "lookup_seconds": lookup_s,
        "read_seconds": read_s,
        "per_request": per_request,
    }


def run(spec: DemoSpec, as_json: bool) -> int:
    """Both phases (the second in a fresh process); prints the table. Exit 0 iff all verified."""
    spec = dataclasses.replace(spec, root=spec.root.absolute())
    root, model, tokens = spec.root, spec.model, spec.tokens
    wrote = write_phase(spec)
    # A new interpreter, as a restarted server: nothing of the writer's state survives.
    cmd = [sys.executable, "-m", "kvstore.demo", "--read-phase", *spec.to_argv()]
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
    print(f"  {'phase':<26}{'blocks':>8}{'bytes':>12}{'GB/s':>8}")
    print(
        f"  {'write (this process)':<26}{wrote['written']:>8}{_size(wrote['bytes']):>12}"
        f"{gbs(wrote['bytes'], wrote['seconds']):>8.2f}"
        + (f"   ({wrote['already_present']} already present)" if wrote["already_present"] else "")
    )
    print(
        f"  {'read (restarted process)':<26}{read['hit_blocks']:>8}{_size(read['read_bytes']):>12}"
        f"{gbs(read['read_bytes'], read['read_seconds']):>8.2f}"
    )
    print(
        f"  lookups: {read['requests']} requests, {read['hit_blocks']} of {read['asked_blocks']} "
        f"prefix blocks hit in {read['lookup_seconds'] * 1e3:.2f} ms"
        " (shared prefixes count once per"
    )
    print("  request; the last request's new turn was never written, so it misses by design)")
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


def _read_phase_main(argv: Sequence[str]) -> int:
    print(json.dumps(read_phase(DemoSpec.from_argv(argv))))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--read-phase":
        sys.exit(_read_phase_main(sys.argv[2:]))
    sys.exit("usage: kvstore demo (this module is the demo's second process)")

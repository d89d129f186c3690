"""Benchmarks of the store against baselines measured in the same run.

Absolute figures on shared VMs drift by 20-30 % minutes apart, so every figure is paired with a
baseline measured right next to it, and the ratio is what counts:

* **throughput**: write then cold-read the same blocks through the store (checksums, header,
  atomic publish, fsync per the config) and through the *raw floor*: plain ``os.pwrite`` /
  ``os.preadv`` of the same bytes, one file per block, same thread count, same durability
  (fdatasync per file when the store fsyncs). Store and raw alternate ``--repeat`` times;
  the median of each is reported.
* **lookup**: longest-prefix search over a chain of ``--chain`` blocks vs one existence check
  per key (what vLLM's filesystem tier does).
* **overhead**: Python time per block of the store over the raw floor, with tiny blocks on
  ``/dev/shm`` so that I/O time vanishes.

Cold reads: block files are dropped from the page cache (``posix_fadvise(DONTNEED)``) before
every read pass; O_DIRECT-written files never enter it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.bench_layouts import DEFAULT_PAIRS, cross_layout
from kvstore.config import StoreConfig
from kvstore.identity import GroupSpec, Identity
from kvstore.io.buffers import aligned_buffer
from kvstore.io.fileio import O_DIRECT
from kvstore.io.fileio import drop_tree_cache as drop_cache
from kvstore.models import load_model
from kvstore.store.group_store import GroupStore
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockRead, BlockWrite, WriteStatus

BATCH = 32  # blocks per call: one scheduler step's worth of stores or loads


@dataclass(frozen=True)
class Workload:
    """N blocks with distinct hashes whose bytes cycle through a few realistic buffers."""

    hashes: list[bytes]
    parents: list[bytes | None]
    buffers: list[np.ndarray]  # page-aligned, as the connector's staging buffers are
    block_nbytes: int

    def data(self, i: int) -> np.ndarray:
        return self.buffers[i % len(self.buffers)]

    @property
    def total_bytes(self) -> int:
        return len(self.hashes) * self.block_nbytes


def make_workload(block_nbytes: int, count: int, distinct: int = 16, seed: int = 0) -> Workload:
    """Bytes drawn like bf16 activations (normal values, bf16 bit patterns)."""
    rng = np.random.default_rng(seed)
    buffers = []
    for _ in range(min(distinct, count)):
        buf = aligned_buffer(block_nbytes)
        values = rng.standard_normal(block_nbytes // 2, dtype=np.float32)
        buf.view(np.uint16)[:] = values.view(np.uint32) >> 16  # bf16 = top half of fp32
        buffers.append(buf)
    hashes = [hashlib.sha256(f"{seed}:{i}".encode()).digest() for i in range(count)]
    parents: list[bytes | None] = [None, *hashes[:-1]]
    return Workload(hashes, parents, buffers, block_nbytes)


def _batches(n: int, size: int = BATCH) -> list[range]:
    return [range(i, min(n, i + size)) for i in range(0, n, size)]


# -- store side ----------------------------------------------------------------------------


def store_write(group: GroupStore, work: Workload) -> float:
    start = time.perf_counter()
    for batch in _batches(len(work.hashes)):
        results = group.write_blocks(
            [BlockWrite(work.hashes[i], work.data(i), work.parents[i]) for i in batch]
        )
        bad = [r for r in results if r.status is not WriteStatus.WRITTEN]
        if bad:
            raise RuntimeError(f"store write failed: {bad[0]}")
    return time.perf_counter() - start


def store_read(group: GroupStore, work: Workload, outs: Sequence[np.ndarray]) -> float:
    start = time.perf_counter()
    for batch in _batches(len(work.hashes)):
        results = group.read_blocks([BlockRead(work.hashes[i], outs[i % len(outs)]) for i in batch])
        if not all(r.ok for r in results):
            raise RuntimeError(f"store read failed: {next(r for r in results if not r.ok)}")
    return time.perf_counter() - start


# -- raw floor -----------------------------------------------------------------------------


class RawFloor:
    """One file per block, plain pwrite/preadv, same threads and durability as the store.

    ``direct`` opens files for writing with O_DIRECT, as the store's engine does when its probe
    passed, so the comparison isolates what the store adds (checksums, header and index,
    temporary file and rename, directory fsync) from the choice of write mode.
    """

    def __init__(self, root: Path, threads: int, durable: bool, direct: bool = False) -> None:
        self.root = root
        self.durable = durable
        self.direct = direct
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads)
        for hi in range(256):
            (root / str(hi)).mkdir(parents=True, exist_ok=True)

    def path(self, block_hash: bytes) -> str:
        return f"{self.root}/{block_hash[0]}/{block_hash[1:9].hex()}"

    def _write_one(self, args: tuple[bytes, np.ndarray]) -> None:
        block_hash, data = args
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (O_DIRECT if self.direct else 0)
        fd = os.open(self.path(block_hash), flags, 0o644)
        try:
            os.pwrite(fd, data.data, 0)
            if self.durable:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def _read_one(self, args: tuple[bytes, np.ndarray]) -> None:
        block_hash, out = args
        fd = os.open(self.path(block_hash), os.O_RDONLY)
        try:
            if os.preadv(fd, [out.data], 0) != len(out):
                raise RuntimeError("raw read came back short")
        finally:
            os.close(fd)

    def _run(
        self, fn: Callable[[tuple[bytes, np.ndarray]], None], items: list[tuple[bytes, np.ndarray]]
    ) -> None:
        if self.threads == 1:  # the store runs inline with one thread too
            for item in items:
                fn(item)
        else:
            list(self.pool.map(fn, items))

    def write(self, work: Workload) -> float:
        start = time.perf_counter()
        for batch in _batches(len(work.hashes)):
            self._run(self._write_one, [(work.hashes[i], work.data(i)) for i in batch])
        return time.perf_counter() - start

    def read(self, work: Workload, outs: Sequence[np.ndarray]) -> float:
        start = time.perf_counter()
        for batch in _batches(len(work.hashes)):
            self._run(self._read_one, [(work.hashes[i], outs[i % len(outs)]) for i in batch])
        return time.perf_counter() - start

    def close(self) -> None:
        self.pool.shutdown()


# -- suites ---------------------------------------------------------------------------------


def _measure_pair(
    samples: dict[str, list[float]],
    rep: int,
    base: Path,
    pair: list[tuple[str, Callable[[], float]]],
) -> None:
    """Time both sides, alternating which goes first so VM drift does not favour one side.

    The page cache is dropped before each side, so reads are cold and writes start clean.
    """
    for name, fn in pair if rep % 2 == 0 else pair[::-1]:
        drop_cache(base)
        samples[name].append(fn())


def throughput(
    base: Path,
    model: str,
    block_tokens: int,
    gib: float,
    threads: int,
    durability: str,
    repeat: int,
) -> dict[str, Any]:
    """Store vs raw floor, write and cold read, alternating ``repeat`` times."""
    identity = load_model(model).identity(block_tokens)
    cfg = StoreConfig(root=base / "store", io_threads=threads, durability=durability)  # type: ignore[arg-type]
    samples: dict[str, list[float]] = {
        "store_write": [],
        "store_read": [],
        "raw_write": [],
        "raw_read": [],
    }
    engine = ""
    direct = False
    work: Workload | None = None
    outs: list[np.ndarray] = []
    for rep in range(repeat):
        shutil.rmtree(base, ignore_errors=True)
        with KVStore(cfg) as store:
            group = store.namespace(identity).group(0)
            engine = store.engine.describe()
            direct = store.engine.direct.enabled
            if work is None:
                count = max(BATCH, int(gib * 2**30) // group.layout.block_nbytes)
                work = make_workload(group.layout.block_nbytes, count, seed=block_tokens)
                outs = [
                    aligned_buffer(work.block_nbytes) for _ in range(BATCH)
                ]  # one per batch slot
            raw = RawFloor(base / "raw", threads, cfg.durable, direct)
            try:
                _measure_pair(
                    samples,
                    rep,
                    base,
                    [
                        ("store_write", partial(store_write, group, work)),
                        ("raw_write", partial(raw.write, work)),
                    ],
                )
                _measure_pair(
                    samples,
                    rep,
                    base,
                    [
                        ("store_read", partial(store_read, group, work, outs)),
                        ("raw_read", partial(raw.read, work, outs)),
                    ],
                )
            finally:
                raw.close()
    shutil.rmtree(base, ignore_errors=True)
    assert work is not None
    total = work.total_bytes
    med = {k: statistics.median(v) for k, v in samples.items()}

    def result(kind: str) -> dict[str, Any]:
        store_gbs = total / med[f"store_{kind}"] / 1e9
        raw_gbs = total / med[f"raw_{kind}"] / 1e9
        return {
            "store_gbs": round(store_gbs, 3),
            "raw_gbs": round(raw_gbs, 3),
            "ratio_to_raw": round(store_gbs / raw_gbs, 3),
            "samples_s": {
                "store": [round(x, 4) for x in samples[f"store_{kind}"]],
                "raw": [round(x, 4) for x in samples[f"raw_{kind}"]],
            },
        }

    return {
        "model": model,
        "block_tokens": block_tokens,
        "blocks": len(work.hashes),
        "block_bytes": work.block_nbytes,
        "total_bytes": total,
        "threads": threads,
        "durability": durability,
        "engine": engine,
        "raw_writes": "O_DIRECT" if direct else "buffered",
        "write": result("write"),
        "read": result("read"),
    }


def _tiny_identity(tokens: int = 16) -> Identity:
    return Identity(
        model="bench/tiny",
        kv_dtype="bfloat16",
        tokens_per_block=tokens,
        groups=(GroupSpec(kind="full", layer_names=("l0",), num_kv_heads=1, head_dim=64),),
    )


def lookup(base: Path, chain: int) -> dict[str, Any]:
    """Longest-prefix lookup of a ``chain``-block chain vs one existence check per key."""
    shutil.rmtree(base, ignore_errors=True)
    cfg = StoreConfig(root=base, durability="none", io_threads=2)
    with KVStore(cfg) as store:
        group = store.namespace(_tiny_identity()).group(0)
        work = make_workload(group.layout.block_nbytes, chain, distinct=4, seed=7)
        for batch in _batches(chain, 512):
            group.write_blocks(
                [BlockWrite(work.hashes[i], work.data(i), work.parents[i]) for i in batch]
            )
        query = work.hashes + [
            hashlib.sha256(f"miss{i}".encode()).digest() for i in range(chain // 8)
        ]
        prefix_times, per_key_times = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            found = group.longest_prefix(query)
            prefix_times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            flags = group.contains(query)
            per_key = next((i for i, f in enumerate(flags) if not f), len(flags))
            per_key_times.append(time.perf_counter() - t0)
        if found != chain or per_key != chain:
            raise RuntimeError(f"lookup found {found} / {per_key}, expected {chain}")
    shutil.rmtree(base, ignore_errors=True)
    prefix_ms = statistics.median(prefix_times) * 1e3
    per_key_ms = statistics.median(per_key_times) * 1e3
    return {
        "chain_blocks": chain,
        "query_blocks": len(query),
        "longest_prefix_ms": round(prefix_ms, 3),
        "per_key_exists_ms": round(per_key_ms, 3),
        "speedup": round(per_key_ms / prefix_ms, 1),
    }


def overhead(base: Path, blocks: int) -> dict[str, Any]:
    """Python time per block: store minus raw floor, tiny blocks, one thread, no fsync."""
    shutil.rmtree(base, ignore_errors=True)
    cfg = StoreConfig(root=base / "store", durability="none", io_threads=1, direct_io="off")
    with KVStore(cfg) as store:
        group = store.namespace(_tiny_identity()).group(0)
        work = make_workload(group.layout.block_nbytes, blocks, distinct=4, seed=11)
        outs = [aligned_buffer(work.block_nbytes)]
        raw = RawFloor(base / "raw", 1, durable=False)
        try:
            sw, rw = store_write(group, work), raw.write(work)
            sr, rr = store_read(group, work, outs), raw.read(work, outs)
        finally:
            raw.close()
    shutil.rmtree(base, ignore_errors=True)
    return {
        "blocks": blocks,
        "block_bytes": work.block_nbytes,
        "write_us_per_block": {
            "store": round(sw / blocks * 1e6, 1),
            "raw": round(rw / blocks * 1e6, 1),
            "overhead": round((sw - rw) / blocks * 1e6, 1),
        },
        "read_us_per_block": {
            "store": round(sr / blocks * 1e6, 1),
            "raw": round(rr / blocks * 1e6, 1),
            "overhead": round((sr - rr) / blocks * 1e6, 1),
        },
    }


def _print_table(report: dict[str, Any]) -> None:
    print(
        f"{'block tokens':>12} {'blocks':>7} {'GB':>6} |"
        f" {'write store':>11} {'raw':>6} {'ratio':>6} |"
        f" {'read store':>10} {'raw':>6} {'ratio':>6}"
    )
    for row in report["throughput"]:
        w, r = row["write"], row["read"]
        print(
            f"{row['block_tokens']:>12} {row['blocks']:>7} {row['total_bytes'] / 1e9:>6.2f} |"
            f" {w['store_gbs']:>9.2f}GB/s {w['raw_gbs']:>6.2f} {w['ratio_to_raw']:>6.2f} |"
            f" {r['store_gbs']:>8.2f}GB/s {r['raw_gbs']:>6.2f} {r['ratio_to_raw']:>6.2f}"
        )
    if report["throughput"]:
        print(
            f"engine: {report['throughput'][0]['engine']};"
            f" durability: {report['throughput'][0]['durability']}"
        )
    if "lookup" in report:
        lk = report["lookup"]
        print(
            f"lookup over a {lk['chain_blocks']}-block chain:"
            f" longest_prefix {lk['longest_prefix_ms']} ms,"
            f" per-key exists {lk['per_key_exists_ms']} ms ({lk['speedup']}x)"
        )
    for row in report.get("layouts", []):
        print(
            f"written at {row['written_at']:<10} read at {row['read_at']:<10}"
            f" {row['cross_gbs']:>6.2f} GB/s vs same-layout {row['same_layout_gbs']:>6.2f}"
            f" ({row['ratio_to_same_layout']:.2f}x)"
        )
    if "overhead" in report:
        ov = report["overhead"]
        print(
            f"python overhead per block (tmpfs, {ov['block_bytes']} B blocks): write"
            f" {ov['write_us_per_block']['overhead']} us,"
            f" read {ov['read_us_per_block']['overhead']} us"
        )


def _pairs(text: str) -> list[str]:
    """'a:b,c:d' or 'a,x:b;c:d' (layouts that contain commas) into ['a:b', 'c:d']."""
    if not text:
        return []
    if ";" in text:
        return [p.strip() for p in text.split(";") if p.strip()]
    parts = text.split(",")
    pairs: list[str] = []
    for part in parts:
        if ":" in part:
            pairs.append(part)
        elif pairs:  # a layout continued after a comma, e.g. "tp=2,pp=2"
            pairs[-1] += "," + part
    return pairs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="scratch directory on the filesystem to measure (default: ./bench-scratch)",
    )
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--block-tokens", default="16,256", help="comma-separated list")
    parser.add_argument("--gib", type=float, default=2.0, help="data per block size (GiB)")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--durability", choices=["full", "none"], default="full")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--chain", type=int, default=8192, help="lookup chain length (0: skip)")
    parser.add_argument("--overhead-blocks", type=int, default=4000, help="0: skip")
    parser.add_argument(
        "--layouts",
        default=",".join(DEFAULT_PAIRS),
        help="cross-layout read pairs WRITE:READ, comma-separated ('' to skip), "
        "e.g. 'tp=1:tp=4,tp=4:tp=1' (layouts with commas: separate pairs with ';')",
    )
    parser.add_argument("--layout-gib", type=float, default=0.5, help="data for the layout suite")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--markdown", type=Path, default=None, help="also write a markdown page")
    args = parser.parse_args(argv)
    base = (args.root or Path("bench-scratch")).absolute()
    base.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"throughput": []}
    for tokens in (int(t) for t in args.block_tokens.split(",") if t):
        report["throughput"].append(
            throughput(
                base / f"tp-{tokens}",
                args.model,
                tokens,
                args.gib,
                args.threads,
                args.durability,
                args.repeat,
            )
        )
    if args.chain:
        report["lookup"] = lookup(base / "lookup", args.chain)
    pairs = _pairs(args.layouts)
    if pairs:
        report["layouts"] = cross_layout(
            base / "layouts", args.model, 16, args.layout_gib, args.threads, pairs, repeat=1
        )
    if args.overhead_blocks:
        shm = Path("/dev/shm")  # noqa: S108 - tmpfs, so that I/O time vanishes
        scratch = Path(tempfile.mkdtemp(dir=shm if shm.is_dir() else None))
        try:
            report["overhead"] = overhead(scratch / "o", args.overhead_blocks)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    if args.root is None:
        shutil.rmtree(base, ignore_errors=True)
    # Top-level write/read of the first configuration, as the JSON contract asks.
    if report["throughput"]:
        report["write"] = report["throughput"][0]["write"]
        report["read"] = report["throughput"][0]["read"]
    if args.markdown:
        args.markdown.write_text(markdown_report(report, argv))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    return 0


def markdown_report(report: dict[str, Any], argv: Sequence[str] | None) -> str:
    """The figures as a markdown page (docs/performance.md), with the command that made them."""
    command = "python scripts/bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        "# kvstore performance",
        "",
        "Produced by the benchmark script; reproduce with:",
        "",
        f"    {command.strip()}",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on a 2-core VM with a",
        "virtio disk (ext4). Absolute figures drift 20-30 % between runs on this shared host;",
        "every ratio compares two measurements taken back to back in the same run.",
        "",
        "## Throughput: store vs the raw floor",
        "",
        "Raw floor: plain `pwrite`/`preadv` of the same bytes, one file per block, same threads, same",
        "write mode (O_DIRECT when the store's probe passed) and durability (fdatasync per file when",
        "the store fsyncs). The store additionally computes a checksum per inner chunk, writes the",
        "header and the zarr index, publishes through a temporary file and rename, fsyncs the",
        "directories, and on reads verifies header and checksums.",
        "",
        "| model | block tokens | blocks | GB | write store GB/s | raw | ratio | read store GB/s | raw | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["throughput"]:
        w, r = row["write"], row["read"]
        lines.append(
            f"| {row['model']} | {row['block_tokens']} | {row['blocks']} | "
            f"{row['total_bytes'] / 1e9:.2f} | {w['store_gbs']:.2f} | {w['raw_gbs']:.2f} | "
            f"**{w['ratio_to_raw']:.2f}** | {r['store_gbs']:.2f} | {r['raw_gbs']:.2f} | "
            f"**{r['ratio_to_raw']:.2f}** |"
        )
    if report["throughput"]:
        first = report["throughput"][0]
        lines += [
            "",
            f"Engine: {first['engine']}; durability `{first['durability']}`; "
            f"raw writes {first['raw_writes']}; {first['threads']} I/O threads.",
        ]
    if "lookup" in report:
        lk = report["lookup"]
        lines += [
            "",
            "## Lookup",
            "",
            f"Longest cached prefix of a {lk['query_blocks']}-block request whose first "
            f"{lk['chain_blocks']} blocks are stored: `longest_prefix` (binary search over the hash "
            f"chain, verified) **{lk['longest_prefix_ms']} ms** vs one existence check per key "
            f"{lk['per_key_exists_ms']} ms (**{lk['speedup']}x**).",
        ]
    if report.get("layouts"):
        lines += [
            "",
            "## Cross-layout reads",
            "",
            "Blocks written by every rank of one layout, read by every rank of another (each rank",
            "loads its own chunks into its own KV tensors on CPU; aggregate over ranks), against",
            "blocks written and read by the same layout, in the same run.",
            "",
            "| written at | read at | blocks | cross GB/s | same-layout GB/s | ratio |",
            "|---|---|---|---|---|---|",
        ]
        for row in report["layouts"]:
            lines.append(
                f"| {row['written_at']} | {row['read_at']} | {row['blocks']} | "
                f"{row['cross_gbs']:.2f} | {row['same_layout_gbs']:.2f} | "
                f"**{row['ratio_to_same_layout']:.2f}** |"
            )
    if "overhead" in report:
        ov = report["overhead"]
        lines += [
            "",
            "## Python overhead per block",
            "",
            f"{ov['blocks']} blocks of {ov['block_bytes']} bytes on tmpfs, one thread, no fsync, so",
            "that I/O time nearly vanishes; store time minus raw time per block:",
            "",
            f"* write: store {ov['write_us_per_block']['store']} µs, raw "
            f"{ov['write_us_per_block']['raw']} µs, **overhead {ov['write_us_per_block']['overhead']} µs**",
            f"* read: store {ov['read_us_per_block']['store']} µs, raw "
            f"{ov['read_us_per_block']['raw']} µs, **overhead {ov['read_us_per_block']['overhead']} µs**",
        ]
    return "\n".join(lines) + "\n"

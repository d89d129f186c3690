"""Scale-out benchmark: a store on a shared FUSE file system vs the local disk under it.

One run measures, on each target, with one model geometry:

* **write**: ``write_blocks`` of N whole blocks in batches (durability full/none, O_DIRECT
  probe on/off) into a fresh store, GB/s;
* **read**: ``read_blocks`` of all of them, verified, from the *other* node of the shared file
  system (the local target reads its own disk): cold (client and server page caches of those
  files dropped) and warm (read again);
* **lookup**: ``contains`` per key for present and absent keys, cold (after the clients'
  metadata caches expired) and warm, the same probes run one after another (``serial``, what
  ``contains`` did before its probes moved to the I/O threads), and ``longest_prefix`` of a chain half stored;
* **gc pass**: one ``kvstore gc --dry-run`` pass over the store (scan + stat of every file).

``python -m kvstore.bench.scaleout run --node-a A --node-b B --local L --json out.json``
measures (A and B: two mounts of the same shared directory, on two nodes or two FUSE clients;
L: a directory on the disk under the shared file system); ``render out.md run1.json
[run2.json ...]`` writes the markdown section (``docs/scaleout.md``). ``--lookup-only`` skips
throughput (for a second run under another metadata latency). The test environment of
``tests/scaleout/gluster.py`` provides A, B, L and the brick directories
(``scripts/bench_scaleout.sh`` runs everything).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.admin.gc import Policy, gc_pass
from kvstore.config import StoreConfig
from kvstore.io.fileio import drop_tree_cache
from kvstore.models import load_model
from kvstore.store.group_store import GroupStore
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockRead, BlockWrite, WriteStatus

GB = 1e9


def _chain(n: int, salt: str) -> list[bytes]:
    out: list[bytes] = []
    parent = salt.encode()
    for i in range(n):
        parent = hashlib.sha256(parent + i.to_bytes(4, "little")).digest()
        out.append(parent)
    return out


class Workload:
    """N blocks of one model group: hashes forming a chain, and their bytes."""

    def __init__(self, model: str, tokens: int, blocks: int, batch: int, salt: str) -> None:
        self.model = load_model(model)
        self.identity = self.model.identity(tokens)
        self.tokens = tokens
        self.blocks = blocks
        self.batch = batch
        self.hashes = _chain(2 * blocks, salt)  # the second half is never written
        self._data: np.ndarray | None = None

    def data(self, group: GroupStore) -> np.ndarray:
        if self._data is None:
            rng = np.random.default_rng(1)
            self._data = rng.integers(0, 256, (self.blocks, group.layout.block_nbytes), np.uint8)
        return self._data

    def batches(self) -> list[range]:
        return [
            range(i, min(i + self.batch, self.blocks)) for i in range(0, self.blocks, self.batch)
        ]


def _open(root: Path, **config: Any) -> KVStore:
    return KVStore(StoreConfig(root=root).replace(**config))


def _group(store: KVStore, work: Workload) -> GroupStore:
    return store.namespace(work.identity).group(0)


def _write(
    root: Path, work: Workload, threads: int, durability: str, direct: str
) -> dict[str, Any]:
    with _open(root, io_threads=threads, durability=durability, direct_io=direct) as store:
        group = _group(store, work)
        data = work.data(group)
        started = time.perf_counter()
        for batch in work.batches():
            writes = [
                BlockWrite(work.hashes[i], data[i], work.hashes[i - 1] if i else None)
                for i in batch
            ]
            results = group.write_blocks(writes)
            bad = [r for r in results if r.status is not WriteStatus.WRITTEN]
            if bad:
                raise RuntimeError(f"write failed: {bad[:3]}")
        seconds = time.perf_counter() - started
        nbytes = work.blocks * group.layout.block_nbytes
        return {
            "durability": durability,
            "direct_io": direct,
            "engine": store.engine.describe(),
            "seconds": round(seconds, 4),
            "gbps": round(nbytes / seconds / GB, 3),
            "blocks_per_s": round(work.blocks / seconds, 1),
        }


def _read(root: Path, work: Workload, threads: int) -> tuple[float, int]:
    """Seconds to read and verify every block through ``root``; number of hits."""
    with _open(root, io_threads=threads, access_granularity_s=0) as store:
        group = _group(store, work)
        out = np.empty((work.batch, group.layout.block_nbytes), np.uint8)
        hits = 0
        started = time.perf_counter()
        for batch in work.batches():
            reads = [BlockRead(work.hashes[i], out[k]) for k, i in enumerate(batch)]
            hits += sum(r.ok for r in group.read_blocks(reads))
        return time.perf_counter() - started, hits


_LookupCase = tuple[str, Callable[[Sequence[bytes]], list[bool]], Sequence[bytes], int]


def _lookups(root: Path, work: Workload, threads: int, expiry_s: float) -> dict[str, Any]:
    """Lookup latencies as a node that has not looked these names up before sees them.

    Every cold measurement uses names this node never probed (quarters of the stored blocks;
    fresh hashes for misses), after the metadata caches of the names above them expired; warm
    repeats it at once. ``longest_prefix`` runs first, on the whole chain.
    """
    present = work.hashes[: work.blocks]
    quarters = [present[q::4] for q in range(4)]
    out: dict[str, Any] = {}
    with _open(root, io_threads=threads, access_granularity_s=0) as store:
        group = _group(store, work)
        exists = group.engine.fio.exists

        def serial(keys: Sequence[bytes]) -> list[bool]:
            return [exists(group.path_of(k)) for k in keys]

        def longest(keys: Sequence[bytes]) -> list[bool]:
            n = group.longest_prefix(work.hashes)
            if n != work.blocks:
                raise RuntimeError(f"longest_prefix: expected {work.blocks}, got {n}")
            return []

        def fresh(n: int) -> list[bytes]:
            return _chain(n, f"absent-{time.time_ns()}")

        cases: list[_LookupCase] = [
            ("longest_prefix (per call)", longest, (), 1),
            ("contains hit", group.contains, quarters[0], len(quarters[0])),
            ("serial probes hit", serial, quarters[1], len(quarters[1])),
            ("contains miss", group.contains, fresh(work.blocks), work.blocks),
            ("serial probes miss", serial, fresh(work.blocks), work.blocks),
        ]
        for name, fn, keys, per in cases:
            row = {}
            for temperature in ("cold", "warm"):
                if temperature == "cold" and expiry_s:
                    time.sleep(expiry_s)  # cached names, attributes and misses expire
                started = time.perf_counter()
                found = fn(keys)
                seconds = time.perf_counter() - started
                if found and (any(found) if "miss" in name else not all(found)):
                    raise RuntimeError(f"{name}: wrong answers")
                row[temperature] = round(seconds / per * 1e3, 4)  # ms per key / call
            out[name] = row
    return out


def _gc_seconds(root: Path) -> float:
    started = time.perf_counter()
    gc_pass(root, Policy(max_bytes=1 << 62, dry_run=True))
    return time.perf_counter() - started


def _drop(paths: Sequence[Path]) -> None:
    for p in paths:
        if p.exists():
            drop_tree_cache(p)


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Workload(args.model, args.tokens, args.blocks, args.batch, salt=str(time.time_ns()))
    targets = [
        ("local disk", args.local, args.local, [args.local]),
        (args.shared_name, args.node_a, args.node_b, [args.node_b, *args.brick_dir]),
    ]
    report: dict[str, Any] = {
        "label": args.label,
        "machine": _machine(args),
        "workload": {
            "model": args.model,
            "tokens_per_block": args.tokens,
            "blocks": args.blocks,
            "batch": args.batch,
            "io_threads": args.threads,
            "repeats": args.repeats,
        },
        "targets": [],
    }
    for name, writer_dir, reader_dir, cache_dirs in targets:
        shared = writer_dir != reader_dir  # the local disk has no client caches to expire
        expiry = args.cache_expiry_s if shared else 0.0
        tag = f"bench-scaleout-{os.getpid()}-{time.time_ns()}"
        row: dict[str, Any] = {"target": name, "writes": [], "reads": {}}
        try:
            configs = [("full", "auto")] if args.lookup_only else [
                ("full", "auto"), ("full", "off"), ("none", "auto"), ("none", "off")
            ]  # fmt: skip
            for k, (durability, direct) in enumerate(configs):
                runs = []
                for rep in range(1 if args.lookup_only else args.repeats):
                    root = writer_dir / f"{tag}-{k}-{rep}"
                    runs.append(_write(root, work, args.threads, durability, direct))
                    if k or rep:  # the first store stays for the reads and lookups
                        shutil.rmtree(root, ignore_errors=True)
                result = sorted(runs, key=lambda r: r["gbps"])[len(runs) // 2]  # the median
                result["runs_gbps"] = [r["gbps"] for r in runs]
                if not args.lookup_only:
                    row["writes"].append(result)
            store_w, store_r = writer_dir / f"{tag}-0-0", reader_dir / f"{tag}-0-0"
            with _open(store_w) as store:
                nbytes = work.blocks * _group(store, work).layout.block_nbytes
            row["lookups"] = _lookups(store_r, work, args.threads, expiry)
            if not args.lookup_only:
                for temperature in ("cold", "warm"):
                    times = []
                    for _rep in range(args.repeats):
                        if temperature == "cold":
                            time.sleep(expiry)
                            _drop([store_r, *[Path(c) for c in cache_dirs[1:]]])
                        seconds, hits = _read(store_r, work, args.threads)
                        if hits != work.blocks:
                            raise RuntimeError(f"{name}: {hits} of {work.blocks} reads hit")
                        times.append(seconds)
                    seconds = sorted(times)[len(times) // 2]
                    row["reads"][temperature] = {
                        "seconds": round(seconds, 4),
                        "gbps": round(nbytes / seconds / GB, 3),
                        "runs_gbps": [round(nbytes / t / GB, 3) for t in times],
                    }
            row["gc_pass_s"] = round(_gc_seconds(store_w), 4)
        finally:
            for leftover in writer_dir.glob(f"{tag}-*"):
                shutil.rmtree(leftover, ignore_errors=True)
        report["targets"].append(row)
    return report


def _machine(args: argparse.Namespace) -> dict[str, Any]:
    version = ""
    binary = shutil.which("glusterfs")
    if binary:
        out = subprocess.run(  # noqa: S603 - the installed glusterfs, fixed arguments
            [binary, "--version"], capture_output=True, text=True, check=False
        )
        version = out.stdout.splitlines()[0] if out.stdout else ""
    return {
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "filesystems": {str(p): _fs_type(p) for p in (args.local, args.node_a, args.node_b)},
        "glusterfs": version,
        "mount": args.mount_note,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }


def _fs_type(path: Path) -> str:
    best, kind = "", "?"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _dev, mount, fs, *_ = line.split()
            if str(path).startswith(mount) and len(mount) >= len(best):
                best, kind = mount, fs
    except OSError:
        pass
    return kind


# -- markdown --------------------------------------------------------------------------------


def render(reports: Sequence[dict[str, Any]]) -> str:
    first = reports[0]
    m, w = first["machine"], first["workload"]
    lines = [
        "## Scale-out: a shared FUSE file system vs the local disk under it",
        "",
        "Produced by `kvstore/bench/scaleout.py`; reproduce with `scripts/bench_scaleout.sh`",
        "(starts the GlusterFS test environment of `tests/scaleout/gluster.py`).",
        "",
        f"Measured {m['date_utc']} UTC on a {m['cpus']}-core VM, kernel {m['kernel']}, "
        f"{m['glusterfs'] or 'no glusterfs'}. Shared file system: a 2-brick distribute "
        "GlusterFS volume whose two servers and two FUSE clients run in network namespaces "
        "of this one machine (veth round trips of microseconds, one CPU pair for servers, "
        f"clients and the benchmark); mount options {m['mount']}. Node A writes, node B (the "
        "other FUSE client) reads and looks up. The bricks and the local target are "
        f"directories of the same {m['filesystems'].get(first_local(first), '?')} disk.",
        "",
        f"Workload: {w['model']}, {w['tokens_per_block']} tokens per block, {w['blocks']} "
        f"blocks in batches of {w['batch']}, {w['io_threads']} I/O threads.",
        "",
    ]
    full = [r for r in reports if any(t["writes"] for t in r["targets"])]
    if full:
        rep = full[0]
        lines += [
            "### Throughput",
            "",
            "| target | write full, O_DIRECT probe | write full, buffered | write none, O_DIRECT "
            "probe | write none, buffered | read cold (other node) | read warm |",
            "|---|---|---|---|---|---|---|",
        ]
        for t in rep["targets"]:
            writes = {(x["durability"], x["direct_io"]): x["gbps"] for x in t["writes"]}
            lines.append(
                f"| {t['target']} | {writes.get(('full', 'auto'), '-')} | "
                f"{writes.get(('full', 'off'), '-')} | {writes.get(('none', 'auto'), '-')} | "
                f"{writes.get(('none', 'off'), '-')} | {t['reads']['cold']['gbps']} | "
                f"{t['reads']['warm']['gbps']} |"
            )
        lines += [
            "",
            f"GB/s, median of {rep['workload']['repeats']} runs (each run's figure in the JSON "
            "report). Cold reads: the reading node's page cache of the files and the bricks' "
            "(server) page cache dropped first. " + _ratio_note(rep),
            "",
        ]
        engines = {t["target"]: t["writes"][0]["engine"] for t in rep["targets"] if t["writes"]}
        lines += [f"Engine on {k}: {v}." for k, v in engines.items()] + [""]
    lines += ["### Lookup latency", ""]
    for rep in reports:
        label = rep["label"] or "no added latency"
        lines += [
            f"{label}: ms per key (`contains`: its probes go to the I/O "
            "threads once the first ones prove slow; `serial probes`: the same probes one after "
            "another) and per call "
            "(`longest_prefix` of a chain whose first half is stored). Cold: after the "
            "clients' cached names, attributes and misses expired; warm: again at once.",
            "",
            "| target | " + " | ".join(f"{k} cold | warm" for k in LOOKUP_ROWS) + " |",
            "|---|" + "---|---|" * len(LOOKUP_ROWS),
        ]
        for t in rep["targets"]:
            cells = []
            for k in LOOKUP_ROWS:
                v = t["lookups"][k]
                cells.append(f"{v['cold']} | {v['warm']}")
            lines.append(f"| {t['target']} | " + " | ".join(cells) + " |")
        gc = ", ".join(f"{t['target']} {t['gc_pass_s'] * 1e3:.0f} ms" for t in rep["targets"])
        lines += ["", f"One `gc` pass over the {rep['workload']['blocks']} blocks: {gc}.", ""]
    return "\n".join(lines).rstrip() + "\n"


LOOKUP_ROWS = (
    "contains hit",
    "contains miss",
    "serial probes hit",
    "serial probes miss",
    "longest_prefix (per call)",
)


def first_local(report: dict[str, Any]) -> str:
    return str(next(iter(report["machine"]["filesystems"])))


def _ratio_note(rep: dict[str, Any]) -> str:
    local, shared = rep["targets"][0], rep["targets"][1]
    parts = []
    for key, label in ((("full", "auto"), "durable writes"), (("none", "auto"), "writes")):
        a = next(
            (x["gbps"] for x in local["writes"] if (x["durability"], x["direct_io"]) == key), 0
        )
        b = next(
            (x["gbps"] for x in shared["writes"] if (x["durability"], x["direct_io"]) == key), 0
        )
        if a:
            parts.append(f"{label} {b / a:.2f}x")
    for temp in ("cold", "warm"):
        a, b = local["reads"][temp]["gbps"], shared["reads"][temp]["gbps"]
        if a:
            parts.append(f"{temp} reads {b / a:.2f}x")
    return f"{shared['target']} relative to the local disk: " + ", ".join(parts) + "."


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstore.bench.scaleout", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="measure; print or save the JSON report")
    r.add_argument("--node-a", type=Path, required=True, help="shared directory, writer's mount")
    r.add_argument("--node-b", type=Path, required=True, help="the same directory, reader's mount")
    r.add_argument("--local", type=Path, required=True, help="a directory on the disk under it")
    r.add_argument("--brick-dir", type=Path, action="append", default=[],
                   help="server-side directories whose page cache a cold read drops")  # fmt: skip
    r.add_argument("--shared-name", default="GlusterFS (FUSE)")
    r.add_argument("--mount-note", default="", help="mount options, for the report")
    r.add_argument("--label", default="", help="what differs in this run (report heading)")
    r.add_argument("--model", default="llama-3.1-8b")
    r.add_argument("--tokens", type=int, default=16)
    r.add_argument("--blocks", type=int, default=128)
    r.add_argument("--batch", type=int, default=16)
    r.add_argument("--threads", type=int, default=4)
    r.add_argument("--cache-expiry-s", type=float, default=1.5,
                   help="wait for the client caches to expire (entry/attribute/negative timeouts)")  # fmt: skip
    r.add_argument("--repeats", type=int, default=3, help="throughput runs (median reported)")
    r.add_argument("--lookup-only", action="store_true")
    r.add_argument("--json", type=Path, help="write the report here (else print it)")
    m = sub.add_parser("render", help="markdown section from one or more JSON reports")
    m.add_argument("out", type=Path)
    m.add_argument("reports", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.command == "render":
        reports = [json.loads(p.read_text()) for p in args.reports]
        args.out.write_text(render(reports))
        return 0
    report = run(args)
    text = json.dumps(report, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

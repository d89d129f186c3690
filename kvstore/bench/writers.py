"""Writers suite: N writer processes into one store, disjoint and overlapping keys, checked.

For every N of ``procs`` (default 1, 2, 4, 8) and every key mode, N processes (multiprocessing
``spawn``, started once for the whole suite and reused) write ``blocks`` blocks each into one
fresh store, all starting at one signal. Modes (:data:`MODES`):

* ``disjoint``: process p writes keys ``[p*b, (p+1)*b)``: no two processes share a key;
* ``half``: process p writes ``[p*b/2, p*b/2 + b)``: half of each process's keys are its
  neighbour's too (50 % overlap);
* ``same``: every process writes ``[0, b)`` in the same order: they race on every key at once.

Keys are chained (:data:`CHAIN` blocks per request, each naming its predecessor as parent) and
a block's bytes are derived from its hash alone (:func:`content_of`), so any process can check
any block. Reported per (N, mode): blocks submitted per second by all processes together (from
the common start to the last one's end), distinct blocks published per second, MB/s of block
payload submitted, and each figure over the same mode's at one process.

Checked after every run (``ok`` is all of them):

* no process failed (no exception, no ``FAILED`` write result);
* every key was published exactly once: the ``WRITTEN`` results of all processes add up to the
  number of distinct keys (the others are ``EXISTS``), and the store holds exactly one block
  file per key and nothing else (no other block, no temporary ``.<lo>.tmp-*`` file, no
  quarantine or trash entry, no foreign file; :func:`census`);
* every key reads back the exact bytes its writers stored (a read-only store, every byte);
* ``python -m kvstore.cli verify <root> --json`` exits 0.

The soak suite (:mod:`kvstore.bench.soak`) shares the keys, contents, census and verify run.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import queue
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.bench.common import BATCH
from kvstore.bench.lookup import tiny_identity
from kvstore.config import Durability, StoreConfig
from kvstore.io.buffers import aligned_buffer
from kvstore.keys import hash_coords
from kvstore.store.format import ShardLayout
from kvstore.store.group_store import GroupStore
from kvstore.store.page_store import KVStore
from kvstore.store.paths import QUARANTINE, TMP_MARK, TRASH, ZARR_JSON, parse_lo, parse_temp_lo
from kvstore.store.types import BlockRead, BlockWrite, ReadStatus, WriteStatus

MODES = ("disjoint", "half", "same")
CHAIN = 16  # blocks per chain (a request's prefix): block i's parent is i - 1 unless i % CHAIN == 0
WARMUP_BLOCKS = 64  # per process, before the timed runs
READ_BATCH = 512  # blocks per read-back call
# Seconds a run may wait for a worker's message before it counts as hung (spawn imports torch
# through the store: several seconds per process on a loaded 2-core machine).
WORKER_TIMEOUT_S = 300.0


# -- keys and contents (shared with the soak suite) ------------------------------------------


def key_of(tag: str, i: int) -> bytes:
    """Block hash number ``i`` of key space ``tag`` (sha256, like vLLM's default)."""
    return hashlib.sha256(f"{tag}:{i}".encode()).digest()


def parent_of(tag: str, i: int) -> bytes | None:
    """Block ``i``'s parent: the previous block of its chain of :data:`CHAIN`."""
    return None if i % CHAIN == 0 else key_of(tag, i - 1)


def content_of(block_hash: bytes, nbytes: int) -> bytes:
    """The bytes of the block named ``block_hash``: a function of the hash alone, so that any
    process can check any block, and different for every block and every offset in it (an
    extendable-output hash), so a block read under another name or a moved chunk shows."""
    return hashlib.shake_128(block_hash).digest(nbytes)


def store_config(root: Path, durability: Durability, threads: int) -> StoreConfig:
    """The configuration every process of these suites opens the store with."""
    return StoreConfig(root=root, durability=durability, io_threads=threads, io_mode="host")


def open_group(
    root: Path, durability: Durability, threads: int, *, read_only: bool = False
) -> tuple[KVStore, GroupStore]:
    """The store at ``root`` and its group of the suites' tiny identity (created if absent)."""
    store = KVStore(store_config(root, durability, threads), read_only=read_only)
    try:
        return store, store.namespace(tiny_identity(), create=not read_only).group(0)
    except BaseException:
        store.close()
        raise


# -- checks (shared with the soak suite) -----------------------------------------------------


@dataclass
class Census:
    """Every file under a store root, by kind (one ``os.walk``, no file opened)."""

    blocks: Counter[tuple[str, int, int, int]]  # (namespace, group dir, hash_hi, hash_lo) -> files
    temps: list[str]
    trash: int
    quarantine: int
    foreign: list[str]
    block_bytes: int

    def coords(self) -> set[tuple[int, int]]:
        return {(hi, lo) for _ns, _g, hi, lo in self.blocks}

    def summary(self) -> dict[str, Any]:
        return {
            "block_files": sum(self.blocks.values()),
            "namespaces": len({ns for ns, *_ in self.blocks}),
            "temps": len(self.temps),
            "trash_entries": self.trash,
            "quarantine_entries": self.quarantine,
            "foreign": self.foreign[:5],
            "block_bytes": self.block_bytes,
        }


def census(root: Path) -> Census:
    """Walk the store: published block files (a decimal name in a decimal fan-out directory
    below ``<ns>/g<k>/c/``), temporary files, trash and quarantine entries, anything else.
    A block file that vanishes between listing and ``lstat`` (gc still running) is left out."""
    blocks: Counter[tuple[str, int, int, int]] = Counter()
    temps: list[str] = []
    foreign: list[str] = []
    trash = quarantine = block_bytes = 0
    for directory, _dirs, files in os.walk(root):
        rel = Path(directory).relative_to(root).parts
        for name in files:
            path = os.path.join(directory, name)  # noqa: PTH118 - one join per file of a big walk
            if TRASH in rel:
                trash += 1
            elif QUARANTINE in rel:
                quarantine += 1
            elif name == ZARR_JSON:
                continue
            elif TMP_MARK in name:
                if parse_temp_lo(name) is not None:
                    temps.append(path)
                else:
                    foreign.append(path)  # a document being replaced, or anything else
            elif len(rel) >= 4 and rel[2] == "c" and parse_lo(name) is not None:
                hi = parse_lo(rel[-1])
                if hi is None:
                    foreign.append(path)
                    continue
                try:
                    size = os.lstat(path).st_size
                except FileNotFoundError:  # evicted since the listing (the soak's gc runs on)
                    continue
                blocks[(rel[0], int(rel[1].removeprefix("g") or -1), hi, int(name))] += 1
                block_bytes += size
            else:
                foreign.append(path)
    return Census(blocks, temps, trash, quarantine, foreign, block_bytes)


def run_verify(root: Path) -> dict[str, Any]:
    """``python -m kvstore.cli verify <root> --json`` as an operator runs it: exit status and
    the kinds of its findings."""
    proc = subprocess.run(  # noqa: S603 - this interpreter, the suite's own arguments
        [sys.executable, "-m", "kvstore.cli", "verify", str(root), "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    kinds: Counter[str] = Counter()
    blocks = None
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        kinds.update(str(f.get("kind", "?")) for f in doc.get("findings", []))
        blocks = doc.get("blocks_checked", doc.get("blocks"))
    return {
        "exit": proc.returncode,
        "findings": dict(kinds),
        "blocks": blocks,
        "stderr_tail": proc.stderr[-400:] if proc.returncode != 0 else "",
    }


def read_back(group: GroupStore, hashes: Sequence[bytes]) -> dict[str, list[bytes]]:
    """Read every block of ``hashes`` and compare it with :func:`content_of`: the hashes that
    missed (``missing``), came back with other bytes (``wrong``) or failed otherwise
    (``failed``: corrupt or an I/O error)."""
    nbytes = group.layout.block_nbytes
    outs = [aligned_buffer(nbytes) for _ in range(min(READ_BATCH, max(1, len(hashes))))]
    found: dict[str, list[bytes]] = {"missing": [], "wrong": [], "failed": []}
    for start in range(0, len(hashes), READ_BATCH):
        part = hashes[start : start + READ_BATCH]
        results = group.read_blocks([BlockRead(h, outs[j]) for j, h in enumerate(part)])
        for j, (h, r) in enumerate(zip(part, results, strict=True)):
            if r.status is ReadStatus.MISS:
                found["missing"].append(h)
            elif r.status is not ReadStatus.HIT:
                found["failed"].append(h)
            elif outs[j][:nbytes].tobytes() != content_of(h, nbytes):
                found["wrong"].append(h)
    return found


# -- the writer processes --------------------------------------------------------------------


def _write_task(task: dict[str, Any], tasks: Any, results: Any) -> dict[str, Any]:
    """One run's share of one process: open the store, build the contents, report ready, wait
    for "go", write, report the counts (the parent times from the earliest start to the
    latest end: ``time.monotonic`` is system-wide on Linux)."""
    store, group = open_group(Path(task["root"]), task["durability"], task["threads"])
    try:
        tag, first, last = task["tag"], task["first"], task["last"]
        nbytes = group.layout.block_nbytes
        indices = range(first, last)
        hashes = [key_of(tag, i) for i in indices]
        # Contents built before the start signal: the timed loop only writes.
        backing = aligned_buffer(len(hashes) * nbytes)
        for j, h in enumerate(hashes):
            backing[j * nbytes : (j + 1) * nbytes] = np.frombuffer(content_of(h, nbytes), np.uint8)
        writes = [
            BlockWrite(h, backing[j * nbytes : (j + 1) * nbytes], parent_of(tag, i))
            for j, (i, h) in enumerate(zip(indices, hashes, strict=True))
        ]
        results.put({"worker": task["worker"], "ready": True})
        if tasks.get() != "go":
            return {"worker": task["worker"], "error": "expected 'go'"}
        counts: Counter[str] = Counter()
        errors: list[str] = []
        start = time.monotonic()
        for b in range(0, len(writes), task["batch"]):
            for r in group.write_blocks(writes[b : b + task["batch"]]):
                counts[r.status.value] += 1
                if r.status is WriteStatus.FAILED and len(errors) < 3:
                    errors.append(r.error)
        end = time.monotonic()
    finally:
        store.close()
    return {
        "worker": task["worker"],
        "start": start,
        "end": end,
        "blocks": len(writes),
        "written": counts[WriteStatus.WRITTEN.value],
        "exists": counts[WriteStatus.EXISTS.value],
        "failed": counts[WriteStatus.FAILED.value],
        "errors": errors,
    }


def writer_process(worker: int, tasks: Any, results: Any) -> None:
    """A reusable writer process: runs tasks from ``tasks`` until ``None``."""
    while True:
        task = tasks.get()
        if task is None:
            return
        try:
            result = _write_task({**task, "worker": worker}, tasks, results)
        except Exception as exc:  # reported as the run's failure, the process stays usable
            result = {"worker": worker, "error": f"{type(exc).__name__}: {exc}"}
        results.put(result)


class WriterPool:
    """``size`` writer processes (spawn), each with its own task queue; one result queue."""

    def __init__(self, size: int) -> None:
        ctx = mp.get_context("spawn")
        self.results: Any = ctx.Queue()
        self.tasks: list[Any] = [ctx.Queue() for _ in range(size)]
        self.procs = [
            ctx.Process(target=writer_process, args=(w, self.tasks[w], self.results), daemon=True)
            for w in range(size)
        ]
        for p in self.procs:
            p.start()

    def _get(self) -> dict[str, Any]:
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        while True:
            try:
                message: dict[str, Any] = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.pid for p in self.procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"writer processes: no answer (dead: {dead or 'none'})"
                    ) from None
                continue
            return message

    def run(self, tasks: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Give task k to process k; start them all at once; their results by process."""
        for w, task in enumerate(tasks):
            self.tasks[w].put(task)
        out: dict[int, dict[str, Any]] = {}
        ready = 0
        while ready + len(out) < len(tasks):  # every process: ready, or failed preparing
            message = self._get()
            if message.get("ready"):
                ready += 1
            else:
                out[message["worker"]] = message
        for w in range(len(tasks)):
            if w not in out:
                self.tasks[w].put("go")
        while len(out) < len(tasks):
            message = self._get()
            out[message["worker"]] = message
        return [out[w] for w in range(len(tasks))]

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()


# -- the suite -------------------------------------------------------------------------------


def key_range(mode: str, proc: int, blocks: int) -> tuple[int, int]:
    """The key numbers ``[first, last)`` process ``proc`` writes in ``mode`` (module doc)."""
    if mode == "disjoint":
        return proc * blocks, (proc + 1) * blocks
    if mode == "half":
        return proc * (blocks // 2), proc * (blocks // 2) + blocks
    if mode == "same":
        return 0, blocks
    raise ValueError(f"writers: mode {mode!r}: expected one of {MODES}")


def run_one(  # noqa: PLR0913 - where, how many, which keys, and the store settings
    pool: WriterPool,
    root: Path,
    procs: int,
    blocks: int,
    mode: str,
    *,
    durability: Durability,
    threads: int,
    check: bool = True,
) -> dict[str, Any]:
    """One run: ``procs`` processes of ``pool`` write into a fresh store at ``root``; then
    every check of the module doc (unless not ``check``). The store is removed afterwards."""
    shutil.rmtree(root, ignore_errors=True)
    tag = f"writers-{mode}-{procs}"
    ranges = [key_range(mode, p, blocks) for p in range(procs)]
    tasks = [
        {
            "root": str(root),
            "tag": tag,
            "first": first,
            "last": last,
            "durability": durability,
            "threads": threads,
            "batch": BATCH,
        }
        for first, last in ranges
    ]
    try:
        results = pool.run(tasks)
        unique = sorted({i for first, last in ranges for i in range(first, last)})
        hashes = [key_of(tag, i) for i in unique]
        row = _measure(results, procs, mode, len(unique), suite_layout().block_nbytes)
        if check:
            row["checks"] = _check(root, results, hashes, durability)
            row["ok"] = not row["checks"]["problems"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return row


def suite_layout() -> ShardLayout:
    """The block geometry of the suites' identity (one 4 KiB inner chunk per block)."""
    identity = tiny_identity()
    return ShardLayout.for_group(
        identity.groups[0], identity.tokens_per_block, identity.dtype.itemsize
    )


def _measure(
    results: Sequence[dict[str, Any]], procs: int, mode: str, unique: int, nbytes: int
) -> dict[str, Any]:
    timed = [r for r in results if "start" in r]
    seconds = (
        max(r["end"] for r in timed) - min(r["start"] for r in timed) if timed else float("nan")
    )
    submitted = sum(r.get("blocks", 0) for r in timed)
    per_proc = [r["blocks"] / max(r["end"] - r["start"], 1e-9) for r in timed]
    return {
        "procs": procs,
        "mode": mode,
        "blocks_submitted": submitted,
        "blocks_distinct": unique,
        "seconds": round(seconds, 3),
        "blocks_per_s": round(submitted / seconds) if seconds > 0 else None,
        "published_per_s": round(unique / seconds) if seconds > 0 else None,
        "mb_per_s": round(submitted * nbytes / seconds / 1e6, 1) if seconds > 0 else None,
        "per_process_blocks_per_s": [round(x) for x in per_proc],
        "written": sum(r.get("written", 0) for r in results),
        "exists": sum(r.get("exists", 0) for r in results),
        "failed": sum(r.get("failed", 0) for r in results),
    }


def _check(
    root: Path, results: Sequence[dict[str, Any]], hashes: Sequence[bytes], durability: Durability
) -> dict[str, Any]:
    """The checks of the module doc; ``problems`` lists every one that failed, in words."""
    problems: list[str] = []
    errors = [f"process {r['worker']}: {r['error']}" for r in results if "error" in r]
    errors += [f"process {r['worker']}: {e}" for r in results for e in r.get("errors", [])]
    problems += errors[:5]
    failed = sum(r.get("failed", 0) for r in results)
    if failed:
        problems.append(f"{failed} write results FAILED")
    written = sum(r.get("written", 0) for r in results)
    if written != len(hashes):
        problems.append(f"WRITTEN {written} times for {len(hashes)} distinct keys")
    found = census(root)
    per_file = Counter(found.blocks.values())
    expected = {hash_coords(h) for h in hashes}
    extra = found.coords() - expected
    absent = expected - found.coords()
    if sum(found.blocks.values()) != len(hashes) or extra or absent or set(per_file) - {1}:
        problems.append(
            f"{sum(found.blocks.values())} block files for {len(hashes)} keys "
            f"({len(absent)} keys without a file, {len(extra)} files of no key)"
        )
    if found.temps:
        problems.append(f"{len(found.temps)} temporary files left, e.g. {found.temps[0]}")
    if found.trash or found.quarantine or found.foreign:
        problems.append(
            f"trash {found.trash}, quarantine {found.quarantine}, foreign {found.foreign[:3]}"
        )
    store, group = open_group(root, durability, 2, read_only=True)
    try:
        read = read_back(group, hashes)
    finally:
        store.close()
    for what, bad in read.items():
        if bad:
            problems.append(f"read back: {len(bad)} {what}, e.g. {bad[0].hex()}")
    verify = run_verify(root)
    if verify["exit"] != 0:
        problems.append(f"kvstore verify exit {verify['exit']}: {verify['findings']}")
    return {
        "census": found.summary(),
        "read_back": {k: len(v) for k, v in read.items()},
        "verify": verify,
        "problems": problems,
    }


def run(  # noqa: PLR0913 - where, the sizes, the modes, and the store settings keyword-only
    base: Path,
    procs: Sequence[int],
    blocks: int,
    modes: Sequence[str] = MODES,
    *,
    durability: Durability = "full",
    threads: int = 2,
) -> dict[str, Any]:
    """Every (N, mode) of ``procs`` x ``modes``, ``blocks`` blocks per process (module doc)."""
    for mode in modes:
        key_range(mode, 0, 1)  # an unknown mode fails before any process starts
    pool = WriterPool(max(procs))
    rows: list[dict[str, Any]] = []
    try:
        # Untimed: every process's first store open and first writes (lazy imports, thread
        # pools, the native library) would otherwise land in the first run's figures.
        warm = run_one(
            pool, base / "writers-store", max(procs), WARMUP_BLOCKS, "disjoint",
            durability=durability, threads=threads, check=False,
        )  # fmt: skip
        if warm["failed"] or warm["written"] != max(procs) * WARMUP_BLOCKS:
            raise RuntimeError(f"writers warm-up failed: {warm}")
        for mode in modes:
            for n in sorted(set(procs)):
                rows.append(
                    run_one(
                        pool,
                        base / "writers-store",
                        n,
                        blocks,
                        mode,
                        durability=durability,
                        threads=threads,
                    )
                )
    finally:
        pool.close()
        shutil.rmtree(base / "writers-store", ignore_errors=True)
    for row in rows:
        one = next((r for r in rows if r["mode"] == row["mode"] and r["procs"] == 1), None)
        if one and one["blocks_per_s"] and row["blocks_per_s"]:
            row["vs_1_process"] = round(row["blocks_per_s"] / one["blocks_per_s"], 2)
    return {
        "rows": rows,
        "blocks_per_process": blocks,
        "block_nbytes": suite_layout().block_nbytes,
        "durability": durability,
        "threads_per_process": threads,
        "ok": all(r["ok"] for r in rows),
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['blocks_per_process']:,} blocks of {result['block_nbytes']} B per process, "
        f"durability {result['durability']}, {result['threads_per_process']} I/O threads each",
        f"{'mode':9}{'procs':>6}{'blocks/s':>10}{'published/s':>13}{'MB/s':>8}{'vs 1':>7}"
        f"{'written':>9}{'exists':>9}  checks",
    ]
    for r in result["rows"]:
        vs = f"{r['vs_1_process']:.2f}x" if "vs_1_process" in r else "-"
        verdict = "ok" if r["ok"] else "FAILED: " + "; ".join(r["checks"]["problems"])
        lines.append(
            f"{r['mode']:9}{r['procs']:>6}{r['blocks_per_s'] or 0:>10,}"
            f"{r['published_per_s'] or 0:>13,}{r['mb_per_s'] or 0:>8.1f}{vs:>7}"
            f"{r['written']:>9,}{r['exists']:>9,}  {verdict}"
        )
    return "\n".join(lines)

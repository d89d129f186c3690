"""Soak suite: writers, readers and ``kvstore gc --watch`` on one store for minutes, checked.

For ``seconds`` (default 120), in processes of their own (multiprocessing ``spawn``):

* ``writers`` processes keep writing new blocks (chains of :data:`~kvstore.bench.writers.CHAIN`,
  contents derived from the hash: :func:`~kvstore.bench.writers.content_of`), each at most
  ``rate`` blocks/s (0: as fast as it can). A block is *acknowledged* when ``write_blocks``
  returned ``WRITTEN`` for it; each writer publishes how many of its keys are (a shared
  counter: its keys are acknowledged in order);
* ``readers`` processes keep reading random acknowledged blocks (half from each writer's most
  recent :data:`RECENT`, half from all) and compare every byte with the expected contents. A
  miss is counted and its key remembered (gc may have evicted it); a wrong byte, a corrupt
  block or an I/O error is a failure;
* ``python -m kvstore.cli gc <root> --watch --interval <interval> --max-bytes <budget> --json
  --list-victims`` keeps the store under ``budget`` (default: half of what the writers would
  write at ``rate``); its JSON line per pass names every victim.

Checked at the end (``ok`` is all of them): no wrong byte read and no read failure; no writer
failure; every acknowledged block either reads back its exact bytes or is among gc's victims
(and so is every key a reader missed): nothing acknowledged was lost; every published block was
acknowledged; no temporary file once the writers stopped; nothing quarantined; gc ran every
pass without findings and left usage within the budget after each; gc exits 0 on SIGINT;
``kvstore verify`` exits 0. Reported: reads/s, writes/s, evictions, misses, gc passes, and
the store's usage against the budget before and after gc's passes (before: what the writers
added during one interval on top).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.bench.common import BATCH
from kvstore.bench.writers import (
    census,
    content_of,
    key_of,
    open_group,
    parent_of,
    read_back,
    run_verify,
    suite_layout,
)
from kvstore.config import Durability
from kvstore.io.buffers import aligned_buffer
from kvstore.keys import hash_coords
from kvstore.store.group_store import GroupStore
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockRead, BlockWrite, ReadStatus, WriteStatus

RECENT = 2000  # readers draw half their keys from each writer's last RECENT acknowledged ones
DEFAULT_BUDGET = 256 << 20  # when the writers are not rate-limited
START_TIMEOUT_S = 300.0  # spawned children import torch (through the store): slow on 2 cores
STOP_TIMEOUT_S = 120.0


def _tag(writer: int) -> str:
    return f"soak-w{writer}"


# -- the child processes ---------------------------------------------------------------------


def _open_or_report(
    where: tuple[str, Durability, int], result: dict[str, Any], ready: Any, out: Any
) -> tuple[KVStore, GroupStore] | None:
    """The process's store and group (``where``: root, durability, I/O threads); None after
    reporting why they could not be opened (the parent must hear from every process)."""
    root, durability, threads = where
    try:
        return open_group(Path(root), durability, threads)
    except Exception as exc:
        result["errors"].append(f"open: {type(exc).__name__}: {exc}")
        ready.set()
        out.put(result)
        return None


def writer_process(  # noqa: PLR0913 - the store, the pace, and the shared signals and counter
    writer: int,
    root: str,
    durability: Durability,
    threads: int,
    rate: float,
    ready: Any,
    go: Any,
    stop: Any,
    acked: Any,
    out: Any,
) -> None:
    """Write new blocks until ``stop``; ``acked.value`` = how many are acknowledged."""
    result: dict[str, Any] = {"role": "writer", "id": writer, "written": 0, "errors": []}
    opened = _open_or_report((root, durability, threads), result, ready, out)
    if opened is None:
        return
    store, group = opened
    try:
        nbytes = group.layout.block_nbytes
        buffers = aligned_buffer(BATCH * nbytes)
        ready.set()
        go.wait()
        tag, i, start = _tag(writer), 0, time.monotonic()
        while not stop.is_set():
            hashes = [key_of(tag, k) for k in range(i, i + BATCH)]
            for j, h in enumerate(hashes):
                buffers[j * nbytes : (j + 1) * nbytes] = np.frombuffer(
                    content_of(h, nbytes), np.uint8
                )
            writes = [
                BlockWrite(h, buffers[j * nbytes : (j + 1) * nbytes], parent_of(tag, i + j))
                for j, h in enumerate(hashes)
            ]
            results = group.write_blocks(writes)
            bad = [r for r in results if r.status is not WriteStatus.WRITTEN]
            if bad:  # acknowledged keys stay a prefix: stop here, the check reports it
                result["errors"] += [f"{r.status.value}: {r.error}" for r in bad[:3]]
                break
            i += BATCH
            acked.value = i
            if rate > 0:  # hold the pace: sleep until this many blocks are due
                ahead = start + i / rate - time.monotonic()
                if ahead > 0:
                    stop.wait(ahead)
        result["written"] = i
        result["seconds"] = time.monotonic() - start
    except Exception as exc:
        result["errors"].append(f"{type(exc).__name__}: {exc}")
    finally:
        store.close()
    out.put(result)


def reader_process(  # noqa: PLR0913 - the store, the writers' counters and the shared signals
    reader: int,
    root: str,
    durability: Durability,
    threads: int,
    acked: Sequence[Any],
    ready: Any,
    go: Any,
    stop: Any,
    out: Any,
) -> None:
    """Read random acknowledged blocks until ``stop``, comparing every byte."""
    result: dict[str, Any] = {
        "role": "reader", "id": reader, "reads": 0, "hits": 0, "misses": 0,
        "wrong": 0, "failed": 0, "errors": [], "missed_keys": [],
    }  # fmt: skip
    opened = _open_or_report((root, durability, threads), result, ready, out)
    if opened is None:
        return
    store, group = opened
    rng = random.Random(reader)
    missed: set[tuple[int, int]] = set()
    try:
        nbytes = group.layout.block_nbytes
        outs = [aligned_buffer(nbytes) for _ in range(BATCH)]
        ready.set()
        go.wait()
        start = time.monotonic()
        while not stop.is_set():
            picks = _picks(rng, [a.value for a in acked])
            if not picks:
                stop.wait(0.01)
                continue
            keys = [key_of(_tag(w), i) for w, i in picks]
            results = group.read_blocks([BlockRead(h, outs[j]) for j, h in enumerate(keys)])
            result["reads"] += len(keys)
            for j, (pick, h, r) in enumerate(zip(picks, keys, results, strict=True)):
                if r.status is ReadStatus.MISS:
                    result["misses"] += 1
                    missed.add(pick)
                elif r.status is not ReadStatus.HIT:
                    result["failed"] += 1
                    if len(result["errors"]) < 3:
                        result["errors"].append(f"{h.hex()}: {r.status.value}: {r.error}")
                elif outs[j].tobytes() != content_of(h, nbytes):
                    result["wrong"] += 1
                    if len(result["errors"]) < 3:
                        result["errors"].append(f"{h.hex()}: wrong bytes")
                else:
                    result["hits"] += 1
        result["seconds"] = time.monotonic() - start
    except Exception as exc:
        result["errors"].append(f"{type(exc).__name__}: {exc}")
    finally:
        store.close()
    result["missed_keys"] = sorted(missed)
    out.put(result)


def _picks(rng: random.Random, acked: Sequence[int]) -> list[tuple[int, int]]:
    """One batch of (writer, key number) among the acknowledged keys."""
    writers = [w for w, n in enumerate(acked) if n > 0]
    picks: list[tuple[int, int]] = []
    for _ in range(BATCH if writers else 0):
        w = rng.choice(writers)
        n = acked[w]
        low = max(0, n - RECENT) if rng.random() < 0.5 else 0
        picks.append((w, rng.randrange(low, n)))
    return picks


# -- the suite -------------------------------------------------------------------------------


class _Children:
    """The writer and reader processes of one soak, with their shared signals."""

    def __init__(  # noqa: PLR0913 - the store, the counts and the pace, as run() got them
        self,
        root: Path,
        writers: int,
        readers: int,
        rate: float,
        durability: Durability,
        threads: int,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.out: Any = ctx.Queue()
        self.go, self.stop = ctx.Event(), ctx.Event()
        # Held here for the whole soak: Process.start() drops its arguments, and a semaphore
        # the parent lets go of is unlinked before a spawned child has unpickled it.
        self.acked = acked = [ctx.Value("q", 0) for _ in range(writers)]
        self.readies = [ctx.Event() for _ in range(writers + readers)]
        common = (str(root), durability, threads)
        self.procs = [
            ctx.Process(
                target=writer_process,
                args=(w, *common, rate, self.readies[w], self.go, self.stop, acked[w], self.out),
            )
            for w in range(writers)
        ] + [
            ctx.Process(
                target=reader_process,
                args=(r, *common, acked, self.readies[writers + r], self.go, self.stop, self.out),
            )
            for r in range(readers)
        ]

    def start(self) -> None:
        """Start every child and wait until all are ready; then give the start signal."""
        for p in self.procs:
            p.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(ready.is_set() for ready in self.readies):
            dead = [p.exitcode for p in self.procs if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"soak: children did not start (exit codes {dead})")
            time.sleep(0.05)
        self.go.set()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def finish(self) -> list[dict[str, Any]]:
        """Stop every child; what each reported."""
        self.stop.set()
        results: list[dict[str, Any]] = []
        # Results before joins: a child blocks on exit until its queued result is read.
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while len(results) < len(self.procs) and time.monotonic() < deadline:
            try:
                results.append(self.out.get(timeout=1.0))
            except queue.Empty:
                if not any(p.is_alive() for p in self.procs):
                    break
        for p in self.procs:
            p.join(timeout=30)
        return results

    def kill(self) -> None:
        """Whatever is still running (after a failure) goes."""
        self.stop.set()
        self.go.set()
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()


def _stop_gc(gc: subprocess.Popen[bytes], problems: list[str]) -> None:
    """SIGINT: gc finishes its pass (and prints it, victims and all), then exits 0."""
    if gc.poll() is not None:
        return
    gc.send_signal(signal.SIGINT)
    try:
        gc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        gc.kill()
        gc.wait()
        problems.append(f"gc did not stop within {STOP_TIMEOUT_S:g} s of SIGINT (killed)")


def run(  # noqa: PLR0913 - where and for how long, then the workload's knobs keyword-only
    base: Path,
    seconds: float,
    *,
    writers: int = 2,
    readers: int = 2,
    rate: float = 500.0,
    budget: int | None = None,
    interval: float = 1.0,
    durability: Durability = "full",
    threads: int = 2,
) -> dict[str, Any]:
    """The soak of the module doc; the store is removed afterwards."""
    root = base / "soak-store"
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    file_nbytes = suite_layout().file_nbytes
    if budget is None:
        budget = int(0.5 * writers * rate * seconds * file_nbytes) if rate > 0 else DEFAULT_BUDGET
    store, _group = open_group(root, durability, threads)  # gc needs a store to watch
    store.close()
    gc_out, gc_err = base / "soak-gc.jsonl", base / "soak-gc.stderr"  # outside the store
    gc_command = [
        sys.executable, "-m", "kvstore.cli", "gc", str(root), "--watch",
        "--interval", str(interval), "--max-bytes", str(budget), "--json", "--list-victims",
    ]  # fmt: skip
    children = _Children(root, writers, readers, rate, durability, threads)
    problems: list[str] = []
    try:
        with gc_out.open("w") as stdout, gc_err.open("w") as stderr:
            gc = subprocess.Popen(gc_command, stdout=stdout, stderr=stderr)  # noqa: S603 - this interpreter, the suite's own arguments
            try:
                children.start()
                started = time.monotonic()
                while time.monotonic() - started < seconds:
                    if not children.alive() or gc.poll() is not None:
                        problems.append(
                            "a child process ended before the soak did"
                            if gc.poll() is None
                            else f"gc exited early with {gc.returncode}"
                        )
                        break
                    time.sleep(min(0.5, max(0.0, seconds - (time.monotonic() - started))))
                elapsed = time.monotonic() - started
                results = children.finish()
                # The writers have stopped and gc writes no block temporaries: none may be left.
                temps_after_writers = len(census(root).temps)
            finally:
                children.kill()
                _stop_gc(gc, problems)
        report = _check(root, results, (writers, readers), gc_out, durability)
        report["gc"] |= _gc_summary(_gc_passes(gc_out), budget, gc.returncode, problems)
        report["gc"]["stderr_tail"] = gc_err.read_text()[-400:]
    finally:
        shutil.rmtree(root, ignore_errors=True)
        gc_out.unlink(missing_ok=True)
        gc_err.unlink(missing_ok=True)
    problems += report.pop("problems")
    if temps_after_writers:
        problems.append(f"{temps_after_writers} temporary files left after the writers stopped")
    if report["gc"]["exit"] != 0:
        problems.append(f"gc exit {report['gc']['exit']}: {report['gc']['stderr_tail']}")
    report.update(
        soak_seconds=round(elapsed, 1),  # "seconds" is the driver's: the suite's whole run
        writers=writers,
        readers=readers,
        rate_per_writer=rate,
        budget=budget,
        file_nbytes=file_nbytes,
        temps_after_writers=temps_after_writers,
        writes_per_s=round(report["acknowledged"] / elapsed),
        reads_per_s=round(report["reads"]["reads"] / elapsed),
        problems=problems,
        ok=not problems,
    )
    return report


def _gc_passes(path: Path) -> list[dict[str, Any]]:
    """gc's JSON lines, one per pass."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _victims(passes: Sequence[dict[str, Any]]) -> tuple[set[str], set[tuple[int, int]]]:
    """Every block gc evicted: hashes (hex), and coordinates of those whose header it could
    not read (the file's name still says which key it was)."""
    hashes: set[str] = set()
    coords: set[tuple[int, int]] = set()
    for doc in passes:
        for v in doc["evicted"].get("victims", []):
            if v.get("hash"):
                hashes.add(v["hash"])
            else:
                coords.add((v["hash_hi"], v["hash_lo"]))
    return hashes, coords


def _gc_summary(
    passes: Sequence[dict[str, Any]], budget: int, rc: int | None, problems: list[str]
) -> dict[str, Any]:
    """gc's figures; what went wrong in its passes goes to ``problems``."""
    findings = [f for doc in passes for f in doc.get("findings", [])]
    over = [(n, doc) for n, doc in enumerate(passes, 1) if doc["after"]["usage"] > budget]
    if not passes:
        problems.append("gc reported no pass")
    if findings:
        problems.append(f"gc findings: {findings[:3]}")
    if over:  # what gc said about the first such pass, for whoever looks into it
        n, doc = over[0]
        problems.append(
            f"{len(over)} gc passes left usage over the budget of {budget:,} B, first pass {n}: "
            f"usage {doc['before']['usage']:,} B (temporaries {doc['before']['temp_bytes']:,}) "
            f"-> {doc['after']['usage']:,} B, {doc['before']['blocks']} -> "
            f"{doc['after']['blocks']} blocks, evicted {doc['evicted']['blocks']}, "
            f"kept_recently_used {doc['evicted'].get('kept_recently_used')}, over_budget "
            f"{doc.get('over_budget')}, selection {doc.get('selection', '?')}"
        )
    return {
        "passes": len(passes),
        "evicted_blocks": sum(doc["evicted"]["blocks"] for doc in passes),
        "max_usage_before": max((d["before"]["usage"] for d in passes), default=0),
        "max_usage_after": max((d["after"]["usage"] for d in passes), default=0),
        "max_temp_bytes": max((d["before"]["temp_bytes"] for d in passes), default=0),
        "mean_pass_s": round(sum(d["seconds"] for d in passes) / max(1, len(passes)), 3),
        "exit": rc,
    }


def _reads(results: Sequence[dict[str, Any]], problems: list[str]) -> dict[str, int]:
    """The readers' counts added up; wrong bytes and failed reads go to ``problems``."""
    readers = [r for r in results if r["role"] == "reader"]
    reads = {k: sum(r[k] for r in readers) for k in ("reads", "hits", "misses", "wrong", "failed")}
    if reads["wrong"] or reads["failed"]:
        problems.append(f"reads: {reads['wrong']} wrong, {reads['failed']} failed")
    return reads


def _check(
    root: Path,
    results: Sequence[dict[str, Any]],
    counts: tuple[int, int],
    gc_out: Path,
    durability: Durability,
) -> dict[str, Any]:
    """The end checks of the module doc on a stopped store (gc's own in :func:`_gc_summary`);
    ``problems`` says what failed."""
    problems: list[str] = []
    got = tuple(sum(r["role"] == role for r in results) for role in ("writer", "reader"))
    if got != counts:
        problems.append(f"results from {got} of {counts} (writers, readers)")
    for r in results:
        problems += [f"{r['role']} {r['id']}: {e}" for e in r["errors"][:3]]
    reads = _reads(results, problems)
    victims, victim_coords = _victims(_gc_passes(gc_out))

    def evicted(h: bytes) -> bool:
        return h.hex() in victims or hash_coords(h) in victim_coords

    acked = {r["id"]: r["written"] for r in results if r["role"] == "writer"}
    hashes = [key_of(_tag(w), i) for w, n in acked.items() for i in range(n)]
    store, group = open_group(root, durability, 2, read_only=True)
    try:
        read = read_back(group, hashes)
    finally:
        store.close()
    lost = [h for h in read["missing"] if not evicted(h)]
    missed = {(w, i) for r in results if r["role"] == "reader" for w, i in r["missed_keys"]}
    unexplained = [wi for wi in missed if not evicted(key_of(_tag(wi[0]), wi[1]))]
    found = census(root)
    unacked = found.coords() - {hash_coords(h) for h in hashes}
    for count, what in (
        (len(lost), "acknowledged blocks missing and not among gc's victims"),
        (len(unexplained), "keys readers missed that are not among gc's victims"),
        (len(read["wrong"]), "acknowledged blocks read back wrong at the end"),
        (len(read["failed"]), "acknowledged blocks failed to read at the end"),
        (len(unacked), "published blocks never acknowledged"),
        (found.quarantine, "quarantined entries"),
        (len(found.foreign), "foreign files"),
    ):
        if count:
            problems.append(f"{count} {what}")
    verify = run_verify(root)
    if verify["exit"] != 0:
        problems.append(f"kvstore verify exit {verify['exit']}: {verify['findings']}")
    return {
        "acknowledged": len(hashes),
        "reads": reads,
        "gc": {"victims_listed": len(victims) + len(victim_coords)},
        "end": {
            "readable": len(hashes) - len(read["missing"]),
            "missing_evicted": len(read["missing"]) - len(lost),
            "lost": len(lost),
            "reader_missed_keys": len(missed),
            "unacknowledged_published": len(unacked),
            "census": found.summary(),
        },
        "verify": verify,
        "problems": problems,
    }


def table(result: dict[str, Any]) -> str:
    g, rd, end = result["gc"], result["reads"], result["end"]
    budget = result["budget"]
    lines = [
        f"{result['soak_seconds']} s: {result['writers']} writers (<= {result['rate_per_writer']:g} "
        f"blocks/s each), {result['readers']} readers, gc --watch to {budget / 1e6:.1f} MB",
        f"  writes  {result['acknowledged']:>10,} acknowledged  {result['writes_per_s'] or 0:>8,}/s",
        f"  reads   {rd['reads']:>10,} ({rd['hits']:,} hits, {rd['misses']:,} misses, "
        f"{rd['wrong']} wrong, {rd['failed']} failed)  {result['reads_per_s'] or 0:>8,}/s",
        f"  gc      {g['passes']} passes, {g['evicted_blocks']:,} blocks evicted, "
        f"{g['mean_pass_s']} s per pass; usage max {g['max_usage_before'] / budget:.2f}x budget "
        f"before a pass, {g['max_usage_after'] / budget:.2f}x after",
        f"  end     {end['readable']:,} acknowledged blocks readable, "
        f"{end['missing_evicted']:,} evicted, {end['lost']} lost; "
        f"temps after writers {result['temps_after_writers']}; verify exit "
        f"{result['verify']['exit']}",
        "  checks  " + ("ok" if result["ok"] else "FAILED: " + "; ".join(result["problems"])),
    ]
    return "\n".join(lines)

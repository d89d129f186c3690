"""Overhead suite: Python time per block of the store over the raw floor.

Tiny blocks on tmpfs (``/dev/shm``), one thread, no fsync, so that I/O time nearly vanishes and
what is left is what the store's code adds per block (checksums, header, index, temporary file
and rename on writes; header decode and checks on reads). The protocol floor
(:class:`~kvstore.bench.floor.ProtocolFloor`: the system calls and checksums the protocol
requires, leanest Python) runs beside them: store / floor is what the store's code adds to its
protocol, floor / raw what the protocol adds to plain I/O.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstore.bench.common import RawFloor, make_workload
from kvstore.bench.floor import ProtocolFloor, SyscallFloor
from kvstore.bench.lookup import tiny_identity
from kvstore.bench.systems import KvstoreSystem

# Rounds per run: each round measures every system on fresh directories, in an order rotated
# from round to round, and each figure is the median over the rounds. One round of 4,000 tiny
# blocks lasts a fraction of a second per system, so on a shared 2-core VM a single round can
# land entirely in another process's burst (single runs moved by up to 50 %).
ROUNDS = 3


def run(blocks: int, rounds: int = ROUNDS) -> dict[str, Any]:
    """Per-block time of the store and its floors on tmpfs: medians over ``rounds`` rounds."""
    if rounds < 1:
        raise ValueError(f"overhead rounds: expected at least 1, got {rounds}")
    shm = Path("/dev/shm")  # noqa: S108 - tmpfs, so that I/O time vanishes
    samples: dict[str, list[float]] = {}
    block_bytes = 0
    for r in range(rounds):
        scratch = Path(tempfile.mkdtemp(dir=shm if shm.is_dir() else None))
        try:
            timings, block_bytes = _one_round(scratch, blocks, r)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        for name, seconds in timings:
            samples.setdefault(name, []).append(seconds)

    def us(name: str) -> float:
        return statistics.median(samples[name]) / blocks * 1e6

    def per_block(phase: str) -> dict[str, float]:
        return {
            "store": round(us(f"store {phase}"), 1),
            "raw": round(us(f"raw {phase}"), 1),
            "overhead": round(us(f"store {phase}") - us(f"raw {phase}"), 1),
            "floor": round(us(f"floor {phase}"), 1),  # the protocol floor
            "raw_store_paths": round(us(f"deep {phase}"), 1),  # raw, on the store's paths
            "syscalls": round(us(f"calls {phase}"), 1),  # the protocol's calls alone
        }

    return {
        "blocks": blocks,
        "rounds": rounds,
        "block_bytes": block_bytes,
        "write_us_per_block": per_block("write"),
        "read_us_per_block": per_block("read"),
    }


def _one_round(scratch: Path, blocks: int, turn: int) -> tuple[list[tuple[str, float]], int]:
    """Seconds of every system's write, then every system's read, of ``blocks`` tiny blocks
    under ``scratch`` (the systems' order rotated by ``turn``), and the block size."""
    identity = tiny_identity()
    store = KvstoreSystem(scratch / "store", identity, 1, "none", "none", "off")
    layout = store.group.layout
    raw = RawFloor(scratch / "raw", 1, durable=False)
    floor = ProtocolFloor(scratch / "floor", layout, identity.digest, 1, durable=False)
    calls = SyscallFloor(scratch / "syscalls", store.store.config.root, store.group.path_of, layout)
    try:
        work = make_workload(layout, blocks, seed=11, tag=f"overhead-{turn}")
        outs = work.outs
        written: dict[str, list[str]] = {}

        def deep_write() -> float:
            seconds, written["deep"] = calls.raw_write(work)
            return seconds

        def calls_write() -> float:
            seconds, written["calls"] = calls.protocol_write(work)
            return seconds

        writes: list[tuple[str, Callable[[], float]]] = [
            ("store", lambda: store.write(work)),
            ("raw", lambda: raw.write(work)),
            ("floor", lambda: floor.write(work)),
            ("deep", deep_write),
            ("calls", calls_write),
        ]
        reads: list[tuple[str, Callable[[], float]]] = [
            ("store", lambda: store.read(work, outs)),
            ("raw", lambda: raw.read(work, outs)),
            ("floor", lambda: floor.read(work, outs)),
            ("deep", lambda: calls.raw_read(written["deep"], outs)),
            ("calls", lambda: calls.protocol_read(written["calls"], outs)),
        ]
        shift = turn % len(writes)
        out = []
        for phase, systems in (("write", writes), ("read", reads)):
            for name, measure in systems[shift:] + systems[:shift]:
                out.append((f"{name} {phase}", measure()))
        return out, work.block_nbytes
    finally:
        store.close()
        raw.close()
        floor.close()


# (store, raw) µs per block at e141e29 (before the small-block fast path), from the second of the
# runs that measured kvstore.bench.throughput.TMPFS_BASELINE (the first: write 108.7 / 18.2,
# read 54.2 / 8.5).
BASELINE_COMMIT = "e141e29"
BASELINE_US: dict[str, tuple[float, float]] = {"write": (60.4, 10.7), "read": (40.0, 6.4)}


def versus_baseline(result: dict[str, Any]) -> str:
    """Store time per block as a multiple of raw, this run next to :data:`BASELINE_US`, and
    (where measured) as a multiple of the protocol floor's, and the floor's of raw."""
    parts = []
    floors = []
    for phase in ("write", "read"):
        now = result[f"{phase}_us_per_block"]
        text = f"{phase} {now['store'] / now['raw']:.1f}x raw ({now['store']} / {now['raw']} µs)"
        if phase in BASELINE_US:
            store, raw = BASELINE_US[phase]
            text += f", {BASELINE_COMMIT}: {store / raw:.1f}x ({store} / {raw} µs)"
        parts.append(text)
        if now.get("floor"):
            floors.append(
                f"{phase} {now['store'] / now['floor']:.1f}x protocol floor "
                f"({now['store']} / {now['floor']} µs; floor / raw {now['floor'] / now['raw']:.1f}x)"
            )
    text = "per-block time, store / raw: " + "; ".join(parts)
    text += ("; store / protocol floor: " + "; ".join(floors)) if floors else ""
    calls = [_syscall_steps(phase, result[f"{phase}_us_per_block"]) for phase in ("write", "read")]
    if all(calls):
        text += "; system calls alone: " + "; ".join(calls)
    return text


def _syscall_steps(phase: str, now: dict[str, float]) -> str:
    """Where a block's time goes, as multiples of the raw floor: raw on the store's
    (format v1) paths, the protocol's system calls alone there, the store itself."""
    if not now.get("syscalls") or not now.get("raw_store_paths"):
        return ""
    raw = now["raw"]
    return (
        f"{phase}: raw on the store's paths {now['raw_store_paths'] / raw:.1f}x raw, "
        f"the protocol's calls there {now['syscalls'] / raw:.1f}x "
        f"({now['syscalls']} µs), store {now['store'] / now['syscalls']:.2f}x those calls"
    )


def table(result: dict[str, Any]) -> str:
    w, r = result["write_us_per_block"], result["read_us_per_block"]
    text = (
        f"python overhead per block (tmpfs, {result['block_bytes']} B blocks, median of "
        f"{result.get('rounds', 1)} rounds): write "
        f"{w['overhead']} us (store {w['store']}, raw {w['raw']}), read {r['overhead']} us "
        f"(store {r['store']}, raw {r['raw']})"
    )
    if "floor" in w and "floor" in r:
        text += (
            f"; protocol floor: write {w['floor']} us (store / floor "
            f"{w['store'] / w['floor']:.2f}x), read {r['floor']} us (store / floor "
            f"{r['store'] / r['floor']:.2f}x)"
        )
    if w.get("syscalls") and r.get("syscalls"):
        text += (
            f"; on the store's paths: raw write {w['raw_store_paths']} us, read "
            f"{r['raw_store_paths']} us; the protocol's system calls alone: write "
            f"{w['syscalls']} us, read {r['syscalls']} us"
        )
    return text


def markdown(result: dict[str, Any]) -> list[str]:
    w, r = result["write_us_per_block"], result["read_us_per_block"]
    return (
        [
            f"{result['blocks']} blocks of {result['block_bytes']} bytes on tmpfs, one thread, no "
            "fsync, so that I/O time nearly vanishes; store time minus raw time per block:",
            "",
            f"* write: store {w['store']} µs, raw {w['raw']} µs, **overhead {w['overhead']} µs**",
            f"* read: store {r['store']} µs, raw {r['raw']} µs, **overhead {r['overhead']} µs**",
        ]
        + (
            [
                f"* protocol floor (the system calls and checksums the protocol requires, leanest "
                f"Python): write {w['floor']} µs, read {r['floor']} µs; store / floor: write "
                f"**{w['store'] / w['floor']:.2f}x**, read **{r['store'] / r['floor']:.2f}x**",
            ]
            if w.get("floor") and r.get("floor")
            else []
        )
        + (
            [
                f"* on the store's own paths (format v1: a dozen components per name): raw write "
                f"{w['raw_store_paths']} µs, read {r['raw_store_paths']} µs; the protocol's system "
                f"calls alone (no header, no checksum; one native call per step): write "
                f"**{w['syscalls']} µs**, read **{r['syscalls']} µs**",
            ]
            if w.get("syscalls") and r.get("syscalls")
            else []
        )
    )

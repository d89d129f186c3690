"""Scale suite: the admin and inspection commands against the number of blocks in a store.

One store of tiny blocks (the lookup suite's :class:`~kvstore.bench.lookup.ChainStore`: one
4 KiB inner chunk per block, chains among filler, durability none) grows through the sizes
asked for (default 10^4 and 10^5; 10^6 fits on tmpfs). At each size every command runs once as
its own process, as an operator runs it, and the suite records its wall time, its peak RSS
(``ru_maxrss`` of that child, from ``wait4``) and blocks per second, plus the engine side at the
same size: a lookup of a 1k-block chain and the store's write rate, and verify's read floor
(:mod:`kvstore.bench.read_floor`: every file listed and read whole with the same native calls
and threads, nothing checked; timed in this process, without an interpreter's start, which
verify's wall time includes, ~0.5 s): verify's blocks per second over the floor's is how close
it runs to the file system.

The figure the suite exists for is each command's RSS growth: peak RSS at the largest size over
peak RSS at the smallest. A command whose memory is bounded independently of the store stays
near 1.0; one that holds the store in memory grows with it. The table extrapolates each
command linearly from its two largest sizes to 10^8 blocks: what such growth would mean there,
an upper bound for a command whose growth stops (the admin scan's window of listed entries is
full from ~8 * 10^5 blocks on, so a run that ends below that overstates it).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvstore import heap
from kvstore.bench import verify_floor
from kvstore.bench.lookup import ChainStore, measure_chain
from kvstore.bench.read_floor import read_floor
from kvstore.store.group_store import GroupStore
from kvstore.store.types import BlockRead

# (name, arguments after the program); "{root}" and "{ns}" are filled in.
COMMANDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kvstore ls --json", ("kvstore.cli", "ls", "{root}", "--json")),
    ("kvstore ls NS --json", ("kvstore.cli", "ls", "{root}", "{ns}", "--json")),
    ("kvstore du", ("kvstore.cli", "du", "{root}")),
    ("kvstore verify", ("kvstore.cli", "verify", "{root}")),
    ("kvstore gc --dry-run (evict ~10 %)", ("kvstore.cli", "gc", "{root}", "--dry-run", "--max-bytes", "{budget}")),
    ("kvstore-inspect tree", ("kvstore.inspect.cli", "tree", "{root}", "{ns}")),
    ("kvstore-inspect overview --check", ("kvstore.inspect.cli", "overview", "{root}", "--check")),
)  # fmt: skip
TARGET_BLOCKS = 10**8
FLOOR_THREADS = 4  # verify's default reader threads


# The child's peak RSS must not include this process's: Linux carries the pre-exec memory of a
# forked (or vfork'ed) child into its ru_maxrss, so a child of this process (torch loaded) starts
# at ~700 MB. A bare interpreter (-S -E) forks the command instead and reports its ru_maxrss.
_TRAMPOLINE = r"""
import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
sys.stderr.write("\nKVBENCH_MAXRSS_KB=%d\n" % usage.ru_maxrss)
sys.exit(os.waitstatus_to_exitcode(status))
"""
_MARK = "KVBENCH_MAXRSS_KB="


def run_command(argv: Sequence[str]) -> dict[str, Any]:
    """Run ``python -m argv...`` to its end; wall seconds, peak RSS (MB) and exit status."""
    with tempfile.TemporaryFile() as errors:  # a file, not a pipe: nothing can block the child
        start = time.perf_counter()
        command = [sys.executable, "-S", "-E", "-c", _TRAMPOLINE, sys.executable, "-m", *argv]
        proc = subprocess.run(  # noqa: S603 - this interpreter, the suite's own arguments
            command, stdout=subprocess.DEVNULL, stderr=errors, check=False
        )
        seconds = time.perf_counter() - start
        errors.seek(0)
        stderr = errors.read().decode(errors="replace")
    text, _, rss = stderr.rpartition(_MARK)
    return {
        "seconds": round(seconds, 2),
        "peak_rss_mb": round(int(rss.strip() or 0) / 1024, 1),  # ru_maxrss is KiB on Linux
        "exit": proc.returncode,
        # 1 is a command's "findings" status; anything else is a failure worth showing.
        "stderr_tail": text[-400:] if proc.returncode not in (0, 1) else "",
    }


def read_rate(group: GroupStore, chain: Sequence[bytes], rounds: int = 3) -> float:
    """Blocks per second reading ``chain`` in one batch (median of ``rounds``; verified)."""
    out = np.empty((len(chain), group.layout.block_nbytes), dtype=np.uint8)
    reads = [BlockRead(h, out[i]) for i, h in enumerate(chain)]
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        results = group.read_blocks(reads)
        times.append(time.perf_counter() - start)
        if not all(r.ok for r in results):
            raise RuntimeError(f"scale: a stored chain block did not read back ({results[0]})")
    return round(len(chain) / float(np.median(times)))


def _store_bytes(root: Path) -> int:
    return sum(entry.stat().st_size for entry in root.rglob("*") if entry.is_file())


def run(base: Path, sizes: Sequence[int], check_mib: int = 0) -> dict[str, Any]:
    """Grow one store through ``sizes``; at each, every command once (module doc). With
    ``check_mib``, then verify against its read floor at larger block sizes, on stores of
    about that many MiB (:mod:`kvstore.bench.verify_floor`)."""
    heap.tune_for_batch_tool()  # the read floor runs in this process: set as the tools are
    built = ChainStore(base / "scale-store")
    rows: list[dict[str, Any]] = []
    try:
        for size in sorted(set(sizes)):
            built.grow_to(size)
            assert built.group is not None and built.store is not None
            namespace = built.group.namespace
            budget = int(_store_bytes(built.root) * 0.9)
            chain = built.chains[min(built.chains)]
            lookup = measure_chain(built.group, chain, rounds=5)
            at_size: dict[str, Any] = {
                "store_blocks": built.size,
                "lookup_1k_ms": lookup["longest_prefix_ms"],
                "read_blocks_per_s": read_rate(built.group, chain),
                "commands": {},
            }
            for name, template in COMMANDS:
                argv = [a.format(root=built.root, ns=namespace, budget=budget) for a in template]
                ran = run_command(argv)
                ran["blocks_per_s"] = round(built.size / max(ran["seconds"], 1e-9))
                at_size["commands"][name] = ran
            floor = read_floor(built.root, FLOOR_THREADS)
            floor["blocks_per_s"] = round(built.size / max(floor["seconds"], 1e-9))
            at_size["read_floor"] = floor
            verify = at_size["commands"]["kvstore verify"]
            at_size["verify_vs_floor"] = round(verify["blocks_per_s"] / floor["blocks_per_s"], 2)
            rows.append(at_size)
    finally:
        built.close()
    result: dict[str, Any] = {"sizes": rows, "growth": growth(rows)}
    if check_mib > 0:
        result["verify_by_block_size"] = verify_floor.run(base, check_mib)
    return result


def growth(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per command: peak RSS at the largest size over the smallest, and the linear
    extrapolation of RSS and time to :data:`TARGET_BLOCKS` from the two largest sizes."""
    if len(rows) < 2:
        return {}
    small, big = rows[0], rows[-1]
    prev = rows[-2]
    out: dict[str, dict[str, float]] = {}
    for name in big["commands"]:
        b, p, s = big["commands"][name], prev["commands"][name], small["commands"][name]
        span = big["store_blocks"] - prev["store_blocks"]
        rss_slope = (b["peak_rss_mb"] - p["peak_rss_mb"]) / span
        time_slope = (b["seconds"] - p["seconds"]) / span
        ahead = TARGET_BLOCKS - big["store_blocks"]
        out[name] = {
            "rss_growth": round(b["peak_rss_mb"] / max(s["peak_rss_mb"], 1e-9), 2),
            "rss_mb_at_1e8": round(b["peak_rss_mb"] + max(rss_slope, 0.0) * ahead),
            "hours_at_1e8": round((b["seconds"] + max(time_slope, 0.0) * ahead) / 3600, 1),
        }
    return out


def table(result: dict[str, Any]) -> str:
    rows = result["sizes"]
    sizes = [r["store_blocks"] for r in rows]
    head = f"{'command':36}" + "".join(f"{n:>22,}" for n in sizes)
    lines = [
        "peak RSS MB, wall s per command (each its own process) by store blocks",
        head + f"{'RSS growth':>12}{'lin.@1e8':>11}{'h @1e8':>8}",
    ]
    for name in rows[-1]["commands"]:
        cells = ""
        for r in rows:
            c = r["commands"][name]
            flag = "" if c["exit"] in (0, 1) else f" rc={c['exit']}"
            cells += f"{c['peak_rss_mb']:>10.0f} MB {c['seconds']:>6.1f} s{flag}"
        g = result["growth"].get(name, {})
        extra = (
            f"{g['rss_growth']:>11.2f}x{g['rss_mb_at_1e8']:>8.0f} MB{g['hours_at_1e8']:>7.1f}"
            if g
            else ""
        )
        lines.append(f"{name:36}{cells}{extra}")
    lines.append(
        "engine side: 1k-chain lookup "
        + ", ".join(f"{r['lookup_1k_ms']:.2f} ms at {r['store_blocks']:,}" for r in rows)
    )
    lines.append(
        "engine side: 1k-chain read "
        + ", ".join(
            f"{r.get('read_blocks_per_s', 0) / 1e3:.1f}k blocks/s at {r['store_blocks']:,}"
            for r in rows
        )
    )
    lines.append(
        "verify against its read floor (list + read every file, no check): "
        + ", ".join(
            f"{r['read_floor']['blocks_per_s'] / 1e3:.0f}k files/s, verify "
            f"{r['verify_vs_floor']:.2f}x at {r['store_blocks']:,}"
            for r in rows
            if "read_floor" in r
        )
    )
    big = rows[-1]
    lines.append(
        f"commands at {big['store_blocks']:,} blocks, k blocks/s: "
        + ", ".join(f"{name} {c['blocks_per_s'] / 1e3:.0f}" for name, c in big["commands"].items())
    )
    lines += verify_floor.lines(result.get("verify_by_block_size", []))
    return "\n".join(lines)

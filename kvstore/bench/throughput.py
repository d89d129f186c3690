"""Throughput suite: the same blocks through kvstore and through what users would pick instead.

For each (model, block tokens) the same KV-like blocks are written, read cold and read hot by:

* ``kvstore``: :meth:`GroupStore.write_blocks` / :meth:`read_blocks` - per-chunk checksums,
  header and zarr index, temporary file + rename, fdatasync and directory fsync (durability
  ``full``), every read verified.
* ``raw``: the raw floor (:class:`~kvstore.bench.common.RawFloor`): plain ``pwrite``/``preadv``,
  one file per block, the same threads, write mode and durability as kvstore.
* ``floor``: the protocol floor (:class:`~kvstore.bench.floor.ProtocolFloor`): exactly the
  system calls and checksums kvstore's protocol requires (``lstat``, ``O_EXCL`` temporary file,
  header, chunks and index, ``fdatasync``, ``renameat2(RENAME_NOREPLACE)``, directory
  ``fsync``; reads: ``fstat``, header and xxh3_64 of every chunk checked) in the leanest
  Python, on the raw floor's threads, write mode and durability. kvstore / floor is what
  kvstore's code costs; floor / raw is what the protocol itself costs (the best kvstore / raw
  could be).
* ``vllm-fs``: vLLM 0.33's own filesystem tier I/O, ``batch_store_block`` /
  ``batch_load_block`` of ``vllm.v1.kv_offload.tiering.fs.io`` (its C extension where present)
  with O_DIRECT as its ``probe_o_direct`` decides, files laid out as its ``FileMapper`` names
  them (``<base>_r0/<hex[:3]>/<hex[3:5]>_g0/<hex>.bin``). Each batch is split into one job per
  thread, each job one ``batch_*`` call, as the tier's thread pool runs them. It never fsyncs
  and has no checksums (that is what it does). Only where ``vllm`` imports.
* ``safetensors``: one ``safetensors`` file per block (``<root>/<hex>/kv_cache.safetensors``,
  ``save_file`` / ``load_file`` then a copy into the read buffer), as vLLM's example connector
  stores KV, on the same threads, without fsync.

Every system runs on the same thread count and batches; the order of systems rotates between
repetitions and the median is reported. ``os.sync()`` runs untimed after each write phase, so
the deferred writeback of systems that do not sync is not charged to the next measurement.
Cold reads follow ``posix_fadvise(DONTNEED)`` of every file; hot reads repeat the read at once
(O_DIRECT readers, vLLM's tier, read the disk again).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstore.bench.common import RawFloor, Workload, drop_cache, gbs, make_workload, median
from kvstore.bench.systems import MINE, OTHERS, SYSTEMS, available_systems, make_system
from kvstore.io.host import probe_direct_io
from kvstore.models import load_model
from kvstore.store.format import ShardLayout

PHASES = ("write", "cold", "hot")


def run_config(  # noqa: PLR0913 - one configuration of the suite: its scripts/bench.py options plus the model and block size it sweeps
    base: Path,
    model: str,
    block_tokens: int,
    gib: float,
    threads: int,
    durability: str,
    repeat: int,
    systems: Sequence[str],
    compression: str = "none",
) -> dict[str, Any]:
    """Write, cold read and hot read of one workload through every system, ``repeat`` times."""
    identity = load_model(model).identity(block_tokens)
    spec = identity.groups[0]
    layout = ShardLayout.for_group(spec, block_tokens, identity.dtype.itemsize)
    count = max(8, int(gib * 2**30) // layout.block_nbytes)
    work = make_workload(layout, count, seed=block_tokens, tag=model)
    outs = work.outs
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    direct = probe_direct_io(base, "auto").enabled
    _warm_up(base / "warm-up", work, threads, durability == "full", direct)
    samples: dict[str, dict[str, list[float]]] = {s: {p: [] for p in PHASES} for s in systems}
    described: dict[str, str] = {}
    for rep in range(repeat):
        shift = rep % len(systems)
        for name in [*systems[shift:], *systems[:shift]]:
            root = base / name
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            system = make_system(name, root, identity, threads, durability, direct, compression)
            described[name] = system.describe()
            try:
                os.sync()
                samples[name]["write"].append(system.write(work))
                os.sync()  # untimed: deferred writeback of systems that do not sync
                drop_cache(root)
                samples[name]["cold"].append(system.read(work, outs))
                work.check_last_batch(outs, name)
                samples[name]["hot"].append(system.read(work, outs))
            finally:
                system.close()
                shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(base, ignore_errors=True)
    total = work.total_bytes
    results: dict[str, Any] = {}
    for name in systems:
        results[name] = {
            f"{phase}_gbs": round(gbs(total, median(samples[name][phase])), 3) for phase in PHASES
        }
        results[name]["samples_s"] = {
            phase: [round(x, 4) for x in samples[name][phase]] for phase in PHASES
        }
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for mine in MINE:
        for other in OTHERS:
            if mine in results and other in results:
                ratios.setdefault(mine, {})[other] = {
                    phase: round(results[mine][f"{phase}_gbs"] / results[other][f"{phase}_gbs"], 3)
                    for phase in PHASES
                }
    floor_to_raw = (
        {
            phase: round(results["floor"][f"{phase}_gbs"] / results["raw"][f"{phase}_gbs"], 3)
            for phase in PHASES
        }
        if "floor" in results and "raw" in results
        else None
    )
    return {
        "model": model,
        "block_tokens": block_tokens,
        "blocks": count,
        "block_bytes": work.block_nbytes,
        "total_bytes": total,
        "threads": threads,
        "batch": work.batch,
        "durability": durability,
        "systems": results,
        "kvstore_ratio_to": ratios.get("kvstore", {}),
        "ratios": ratios,
        # protocol floor / raw floor: what the protocol itself costs (absent without both)
        **({"floor_ratio_to_raw": floor_to_raw} if floor_to_raw else {}),
        "described": described,
    }


def _warm_up(root: Path, work: Workload, threads: int, durable: bool, direct: bool) -> None:
    """One untimed raw write and read of up to 1 GiB: on the measured VM the first writer after
    a pause runs up to 2x slower (host-side allocation), which would penalise whichever system
    happens to go first."""
    n = max(1, min(len(work.hashes), (1 << 30) // work.block_nbytes))
    part = Workload(
        work.hashes[:n],
        work.parents[:n],
        work.backing,
        work.distinct,
        work.block_nbytes,
        work.batch,
        work.read_backing,
    )
    raw = RawFloor(root, threads, durable, direct)
    try:
        raw.write(part)
        raw.read(part, part.outs)
    finally:
        raw.close()
        shutil.rmtree(root, ignore_errors=True)


def run(  # noqa: PLR0913 - one parameter per scripts/bench.py option of the suite (bench._run_throughput passes them)
    base: Path,
    models: Sequence[str],
    block_tokens: Sequence[int],
    gib: float,
    threads: int,
    durability: str,
    repeat: int,
    systems: Sequence[str] = SYSTEMS,
) -> dict[str, Any]:
    """The suite: every (model, block tokens) configuration."""
    ok, skipped = available_systems(systems)
    configs = [
        run_config(base / f"{m}-{t}", m, t, gib, threads, durability, repeat, ok)
        for m in models
        for t in block_tokens
    ]
    return {"configs": configs, "skipped": skipped}


# -- the fast-storage baseline (scripts/bench.py --tmpfs) -------------------------------------

# kvstore / raw floor on tmpfs at e141e29, the commit before the fast-path work
# (read path, write path, piecewise verification): write, cold read, hot read per
# (model, block tokens). Mean of two runs of ``python scripts/bench.py --suite
# throughput,overhead --root /dev/shm/... --gib 0.25 --repeat 3 --models <all> --block-tokens
# 16,256 --systems kvstore,raw`` in a worktree of e141e29 on the 2-core development VM
# (2026-12-01, shared with other jobs: single ratios drift +-0.1).
TMPFS_BASELINE_COMMIT = "e141e29"
TMPFS_BASELINE: dict[tuple[str, int], tuple[float, float, float]] = {
    ("llama-3.1-8b", 16): (0.57, 0.56, 0.51),
    ("llama-3.1-8b", 256): (0.52, 0.72, 0.62),
    ("llama-3.1-70b", 16): (0.60, 0.47, 0.50),
    ("llama-3.1-70b", 256): (0.62, 0.79, 0.71),
    ("qwen2.5-7b", 16): (0.48, 0.54, 0.49),
    ("qwen2.5-7b", 256): (0.59, 0.74, 0.87),
    ("qwen3-32b", 16): (0.58, 0.60, 0.57),
    ("qwen3-32b", 256): (0.60, 0.82, 0.85),
    ("gpt-oss-20b", 16): (0.44, 0.45, 0.44),
    ("gpt-oss-20b", 256): (0.67, 0.70, 0.73),
    ("gemma-3-1b", 16): (0.54, 0.55, 0.50),
    ("gemma-3-1b", 256): (0.73, 0.65, 0.75),
    ("deepseek-v3", 16): (0.33, 0.38, 0.35),
    ("deepseek-v3", 256): (0.69, 0.76, 0.66),
}


# The same comparison by CPU time (cpu_ab: best of 5 alternating rounds, 64 MiB or 8 blocks
# per configuration, 4 threads), run with the e141e29 tree on the same day: (write, read).
TMPFS_BASELINE_CPU: dict[tuple[str, int], tuple[float, float]] = {
    ("llama-3.1-8b", 16): (0.57, 0.69),
    ("llama-3.1-8b", 256): (0.56, 0.78),
    ("llama-3.1-70b", 16): (0.59, 0.78),
    ("llama-3.1-70b", 256): (0.66, 0.69),
    ("qwen2.5-7b", 16): (0.45, 0.60),
    ("qwen2.5-7b", 256): (0.57, 0.71),
    ("qwen3-32b", 16): (0.66, 0.79),
    ("qwen3-32b", 256): (0.61, 0.79),
    ("gpt-oss-20b", 16): (0.57, 0.56),
    ("gpt-oss-20b", 256): (0.63, 0.62),
    ("gemma-3-1b", 16): (0.57, 0.65),
    ("gemma-3-1b", 256): (0.54, 0.73),
    ("deepseek-v3", 16): (0.34, 0.40),
    ("deepseek-v3", 256): (0.54, 0.69),
}
CPU_AB_ROUNDS = 5
CPU_AB_MIB = 64


def cpu_ab(  # noqa: PLR0913 - the configurations to sweep, then the run's knobs
    base: Path,
    models: Sequence[str],
    block_tokens: Sequence[int],
    threads: int = 4,
    rounds: int = CPU_AB_ROUNDS,
    mib: float = CPU_AB_MIB,
    floor: bool = True,
) -> list[dict[str, Any]]:
    """kvstore / raw floor by CPU time: what the throughput ratio is where the CPU, not the
    storage, is the limit (tmpfs), measured so that other jobs on a shared machine barely
    move it (they take wall time, not this process's CPU seconds).

    Per configuration, ``rounds`` rounds rotate which system goes first; each writes the
    blocks (durability full) and reads them twice, the second read timed; the process's CPU
    seconds (all threads) of the best round per system and phase give the ratio
    (``cpu_ratio``: kvstore / raw). With ``floor`` the protocol floor
    (:class:`~kvstore.bench.floor.ProtocolFloor`) runs in the rotation too:
    ``cpu_ratio_to_floor`` is kvstore / floor (what kvstore's code costs beyond its
    protocol), ``floor_cpu_ratio_to_raw`` floor / raw (what the protocol itself costs).
    """
    names = ("kvstore", "raw", "floor") if floor else ("kvstore", "raw")
    out: list[dict[str, Any]] = []
    for model in models:
        for tokens in block_tokens:
            identity = load_model(model).identity(tokens)
            layout = ShardLayout.for_group(identity.groups[0], tokens, identity.dtype.itemsize)
            count = max(8, int(mib * 2**20) // layout.block_nbytes)
            work = make_workload(layout, count, seed=tokens, tag=model)
            outs = work.outs
            root = base / f"cpu-{model}-{tokens}"
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            direct = probe_direct_io(root, "auto").enabled
            cpu: dict[tuple[str, str], list[float]] = {}
            for r in range(rounds):
                shift = r % len(names)
                for name in [*names[shift:], *names[:shift]]:
                    where = root / name
                    shutil.rmtree(where, ignore_errors=True)
                    where.mkdir()
                    system = make_system(name, where, identity, threads, "full", direct, "none")
                    try:
                        start = time.process_time()
                        system.write(work)
                        cpu.setdefault((name, "write"), []).append(time.process_time() - start)
                        system.read(work, outs)
                        start = time.process_time()
                        system.read(work, outs)
                        cpu.setdefault((name, "read"), []).append(time.process_time() - start)
                    finally:
                        system.close()
            shutil.rmtree(root, ignore_errors=True)
            row: dict[str, Any] = {
                "model": model,
                "block_tokens": tokens,
                "cpu_ratio": _cpu_ratio(cpu, "kvstore", "raw"),
            }
            if floor:
                row["cpu_ratio_to_floor"] = _cpu_ratio(cpu, "kvstore", "floor")
                row["floor_cpu_ratio_to_raw"] = _cpu_ratio(cpu, "floor", "raw")
            out.append(row)
    return out


def _cpu_ratio(cpu: dict[tuple[str, str], list[float]], system: str, to: str) -> dict[str, float]:
    """``system``'s throughput over ``to``'s per phase: ``to``'s best CPU seconds over
    ``system``'s."""
    return {
        phase: round(min(cpu[to, phase]) / min(cpu[system, phase]), 3)
        for phase in ("write", "read")
    }


def cpu_versus_baseline(rows: Sequence[dict[str, Any]]) -> list[str]:
    """:func:`cpu_ab` next to :data:`TMPFS_BASELINE_CPU`, as a markdown table."""
    floor = any("cpu_ratio_to_floor" in row for row in rows)
    lines = [
        f"| model | block tokens | write / raw by CPU time ({TMPFS_BASELINE_COMMIT} -> now) | "
        "read / raw by CPU time |"
        + (
            " kvstore / protocol floor: write, read | protocol floor / raw: write, read |"
            if floor
            else ""
        ),
        "|---|---|---|---|" + ("---|---|" if floor else ""),
    ]
    for row in rows:
        old = TMPFS_BASELINE_CPU.get((row["model"], row["block_tokens"]))
        now = row["cpu_ratio"]
        cells = [
            f"{old[k]:.2f} -> **{now[phase]:.2f}**" if old else f"- -> **{now[phase]:.2f}**"
            for k, phase in enumerate(("write", "read"))
        ]
        if floor:
            cells += [
                _pair(row.get("cpu_ratio_to_floor")),
                _pair(row.get("floor_cpu_ratio_to_raw")),
            ]
        lines.append(f"| {row['model']} | {row['block_tokens']} | " + " | ".join(cells) + " |")
    return lines


def _pair(ratio: dict[str, float] | None, phases: Sequence[str] = ("write", "read")) -> str:
    """``ratio``'s phases as one table cell, or a dash."""
    return ", ".join(f"{ratio[p]:.2f}" for p in phases) if ratio else "-"


def versus_baseline(result: dict[str, Any]) -> list[str]:
    """kvstore / raw of this run next to :data:`TMPFS_BASELINE`, as a markdown table."""
    floor = any("floor" in cfg["ratios"].get("kvstore", {}) for cfg in result["configs"])
    lines = [
        f"| model | block tokens | block MiB | write / raw ({TMPFS_BASELINE_COMMIT} -> now) | "
        "cold read / raw | hot read / raw |"
        + (
            " kvstore / protocol floor: write, cold, hot | protocol floor / raw: write, cold, hot |"
            if floor
            else ""
        ),
        "|---|---|---|---|---|---|" + ("---|---|" if floor else ""),
    ]
    for cfg in result["configs"]:
        ratio = cfg["ratios"].get("kvstore", {}).get("raw")
        if ratio is None:
            continue
        old = TMPFS_BASELINE.get((cfg["model"], cfg["block_tokens"]))
        cells = [
            f"{old[k]:.2f} -> **{ratio[phase]:.2f}**" if old else f"- -> **{ratio[phase]:.2f}**"
            for k, phase in enumerate(PHASES)
        ]
        if floor:
            cells += [
                _pair(cfg["ratios"]["kvstore"].get("floor"), PHASES),
                _pair(cfg.get("floor_ratio_to_raw"), PHASES),
            ]
        lines.append(
            f"| {cfg['model']} | {cfg['block_tokens']} | {cfg['block_bytes'] / 2**20:.2f} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


# -- output ----------------------------------------------------------------------------------


def table(result: dict[str, Any]) -> str:
    lines = []
    for name, why in result["skipped"].items():
        lines.append(f"{name}: skipped ({why})")
    lines.append(
        f"{'model':<14} {'tokens':>6} {'GB':>6}  {'system':<12} {'write':>7} {'cold rd':>7} "
        f"{'hot rd':>7}  (GB/s)"
    )
    for cfg in result["configs"]:
        for name, r in cfg["systems"].items():
            lines.append(
                f"{cfg['model']:<14} {cfg['block_tokens']:>6} {cfg['total_bytes'] / 1e9:>6.2f}  "
                f"{name:<12} {r['write_gbs']:>7.2f} {r['cold_gbs']:>7.2f} {r['hot_gbs']:>7.2f}"
            )
        pairs = [
            (f"{mine}/{other}", ratio)
            for mine, by_other in cfg["ratios"].items()
            for other, ratio in by_other.items()
        ]
        if "floor_ratio_to_raw" in cfg:
            pairs.append(("floor/raw", cfg["floor_ratio_to_raw"]))
        for label, ratio in pairs:
            lines.append(
                f"{'':<14} {'':>6} {'':>6}  {label:<26} write "
                f"{ratio['write']:.2f}x, cold {ratio['cold']:.2f}x, hot {ratio['hot']:.2f}x"
            )
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> list[str]:
    configs = result["configs"]
    if not configs:
        return []
    systems = list(configs[0]["systems"])
    lines = [
        "| model | block tokens | blocks | GB | system | write GB/s | cold read GB/s | hot read GB/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cfg in configs:
        for name in systems:
            r = cfg["systems"][name]
            lines.append(
                f"| {cfg['model']} | {cfg['block_tokens']} | {cfg['blocks']} | "
                f"{cfg['total_bytes'] / 1e9:.2f} | {name} | {r['write_gbs']:.2f} | "
                f"{r['cold_gbs']:.2f} | {r['hot_gbs']:.2f} |"
            )
    mines = list(configs[0]["ratios"])
    others = [o for o in OTHERS if mines and o in configs[0]["ratios"][mines[0]]]
    if others:
        head = " | ".join(f"vs {o}: write / cold / hot" for o in others)
        lines += ["", "Ratios (kvstore GB/s / other GB/s, higher is better):", ""]
        lines += [
            f"| model | block tokens | kvstore | {head} |",
            "|---|---|---|" + "---|" * len(others),
        ]
        for cfg in configs:
            for mine in mines:
                cells = " | ".join(
                    "**{write:.2f}** / **{cold:.2f}** / {hot:.2f}".format(**cfg["ratios"][mine][o])
                    for o in others
                )
                lines.append(f"| {cfg['model']} | {cfg['block_tokens']} | {mine} | {cells} |")
    lines += ["", "Systems as measured:", ""]
    for name, text in configs[0]["described"].items():
        lines.append(f"* `{name}`: {text}")
    for name, why in result["skipped"].items():
        lines.append(f"* `{name}`: skipped, {why}")
    cfg = configs[0]
    lines += [
        "",
        f"{cfg['threads']} threads for every system; {cfg['batch']} blocks per store/load call "
        "(fewer for very large blocks, to bound memory).",
    ]
    return lines


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    configs = result["configs"]
    if not configs:
        return []
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    systems = list(configs[0]["systems"])
    labels = [f"{c['model'].replace('llama-3.1-', '')}\n{c['block_tokens']} tok" for c in configs]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), sharey=True)
    width = 0.8 / len(systems)
    for ax, phase, title in zip(axes, PHASES, ("write", "cold read", "hot read"), strict=True):
        for k, name in enumerate(systems):
            values = [c["systems"][name][f"{phase}_gbs"] for c in configs]
            xs = [i + (k - (len(systems) - 1) / 2) * width for i in range(len(configs))]
            ax.bar(xs, values, width, label=name)
        ax.set_xticks(range(len(configs)), labels)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].legend(fontsize=8)
    fig.suptitle("Same blocks through each system (median of repetitions)")
    fig.tight_layout()
    path = out_dir / "perf_throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]

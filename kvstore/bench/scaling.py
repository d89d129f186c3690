"""Scaling suite: kvstore vs the raw floor as threads and block size grow, and store size.

* **threads**: write / cold read / hot read of the same workload (llama-3.1-8b geometry,
  16-token blocks) with 1..16 I/O threads, kvstore and raw floor alternating, as in the
  throughput suite.
* **block size**: the same at a fixed thread count for 16..256-token blocks (2..32 MiB).
* **store size**: the lookup suite's store of tiny blocks grows from 10k to ``store_blocks``;
  at each checkpoint the write rate of the last blocks written and the lookup latency of every
  stored chain are measured: does either cost grow with the number of blocks?
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstore.bench import lookup, throughput


def run(  # noqa: PLR0913 - one parameter per scripts/bench.py option of the suite (bench._run_scaling passes them)
    base: Path,
    model: str,
    threads: Sequence[int],
    block_tokens: Sequence[int],
    fixed_threads: int,
    gib: float,
    durability: str,
    repeat: int,
    store_sizes: Sequence[int],
) -> dict[str, Any]:
    systems = ["kvstore", "raw"]
    by_threads = [
        throughput.run_config(
            base / f"scaling-threads-{t}", model, 16, gib, t, durability, repeat, systems
        )
        for t in threads
    ]
    by_block = [
        throughput.run_config(
            base / f"scaling-tokens-{t}", model, t, gib, fixed_threads, durability, repeat, systems
        )
        for t in block_tokens
    ]
    sizes: list[dict[str, Any]] = []
    if store_sizes:
        built = lookup.chain_store(base, max(store_sizes), store_sizes)
        sizes = [c for c in built.checkpoints if c["store_blocks"] in store_sizes]
    return {
        "model": model,
        "by_threads": [_row(c, "threads") for c in by_threads],
        "by_block": [_row(c, "block_tokens") for c in by_block],
        "fixed_threads": fixed_threads,
        "gib": gib,
        "by_store_size": sizes,
    }


def _row(cfg: dict[str, Any], key: str) -> dict[str, Any]:
    k, r = cfg["systems"]["kvstore"], cfg["systems"]["raw"]
    return {
        key: cfg[key],
        "block_bytes": cfg["block_bytes"],
        "total_bytes": cfg["total_bytes"],
        "kvstore": {p: k[f"{p}_gbs"] for p in throughput.PHASES},
        "raw": {p: r[f"{p}_gbs"] for p in throughput.PHASES},
        "ratio": cfg["kvstore_ratio_to"]["raw"],
    }


def table(result: dict[str, Any]) -> str:
    lines = [f"{'threads':>8} | kvstore write/cold/hot GB/s | raw write/cold/hot | ratio"]
    for row in result["by_threads"]:
        lines.append(_line(row, "threads"))
    lines.append(f"{'tokens':>8} | (at {result['fixed_threads']} threads)")
    for row in result["by_block"]:
        lines.append(_line(row, "block_tokens"))
    for cp in result["by_store_size"]:
        looks = ", ".join(
            f"{lk['chain_blocks']}-chain {lk['longest_prefix_ms']:.3f} ms"
            f" (per-key {lk['per_key_stat_ms']:.1f} ms)"
            for lk in cp["lookups"]
        )
        lines.append(
            f"store {cp['store_blocks']:>8} blocks: write {cp['write_blocks_per_s']:,.0f} "
            f"blocks/s; lookup {looks}"
        )
    return "\n".join(lines)


def _line(row: dict[str, Any], key: str) -> str:
    k, r, q = row["kvstore"], row["raw"], row["ratio"]
    return (
        f"{row[key]:>8} | {k['write']:>5.2f} {k['cold']:>5.2f} {k['hot']:>5.2f} | "
        f"{r['write']:>5.2f} {r['cold']:>5.2f} {r['hot']:>5.2f} | "
        f"{q['write']:.2f} {q['cold']:.2f} {q['hot']:.2f}"
    )


def markdown(result: dict[str, Any]) -> list[str]:
    lines = [
        f"Threads ({result['model']}, 16-token blocks, {result['gib']} GiB per point):",
        "",
        "| threads | kvstore write | cold read | hot read | raw write | cold read | hot read "
        "| ratio write / cold / hot |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [_md(row, "threads") for row in result["by_threads"]]
    lines += [
        "",
        f"Block size ({result['fixed_threads']} threads):",
        "",
        "| block tokens (MiB) | kvstore write | cold read | hot read | raw write | cold read "
        "| hot read | ratio write / cold / hot |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [_md(row, "block_tokens") for row in result["by_block"]]
    if result["by_store_size"]:
        chains = sorted(
            {lk["chain_blocks"] for cp in result["by_store_size"] for lk in cp["lookups"]}
        )
        head = " | ".join(f"{c:,}-block prefix ms" for c in chains)
        lines += [
            "",
            "Store size (tiny blocks; write rate of the last blocks written before each "
            "checkpoint; `longest_prefix` latency, per-key `stat` in parentheses):",
            "",
            f"| store blocks | write blocks/s | {head} |",
            "|---|---|" + "---|" * len(chains),
        ]
        for cp in result["by_store_size"]:
            found = {lk["chain_blocks"]: lk for lk in cp["lookups"]}
            cells = " | ".join(
                f"{found[c]['longest_prefix_ms']:.3f} ({found[c]['per_key_stat_ms']:.1f})"
                if c in found
                else "-"
                for c in chains
            )
            lines.append(f"| {cp['store_blocks']:,} | {cp['write_blocks_per_s']:,.0f} | {cells} |")
    return lines


def _md(row: dict[str, Any], key: str) -> str:
    k, r, q = row["kvstore"], row["raw"], row["ratio"]
    label = row[key]
    if key == "block_tokens":
        label = f"{label} ({row['block_bytes'] / 2**20:.0f})"
    return (
        f"| {label} | {k['write']:.2f} | {k['cold']:.2f} | {k['hot']:.2f} | {r['write']:.2f} | "
        f"{r['cold']:.2f} | {r['hot']:.2f} | **{q['write']:.2f}** / **{q['cold']:.2f}** / "
        f"{q['hot']:.2f} |"
    )


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    paths = []
    for key, rows, xlabel, name in (
        ("threads", result["by_threads"], "I/O threads", "perf_scaling_threads.png"),
        ("block_tokens", result["by_block"], "tokens per block", "perf_scaling_block.png"),
    ):
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(6.5, 4))
        xs = [row[key] for row in rows]
        for system, style in (("kvstore", "-"), ("raw", "--")):
            for phase, color in (("write", "C0"), ("cold", "C1"), ("hot", "C2")):
                ax.plot(
                    xs,
                    [row[system][phase] for row in rows],
                    style,
                    color=color,
                    marker="o",
                    label=f"{system} {phase}",
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("GB/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        ax.set_title(f"kvstore (solid) vs raw floor (dashed) by {xlabel}")
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    if result["by_store_size"]:
        cps = result["by_store_size"]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        sizes = [cp["store_blocks"] for cp in cps]
        a1.plot(sizes, [cp["write_blocks_per_s"] for cp in cps], marker="o")
        a1.set_xscale("log")
        a1.set_xlabel("blocks in store")
        a1.set_ylabel("write rate (blocks/s)")
        a1.set_ylim(bottom=0)
        a1.grid(alpha=0.3)
        chains = sorted({lk["chain_blocks"] for cp in cps for lk in cp["lookups"]})
        for c in chains:
            pts = [
                (cp["store_blocks"], lk["longest_prefix_ms"])
                for cp in cps
                for lk in cp["lookups"]
                if lk["chain_blocks"] == c
            ]
            a2.plot(*zip(*pts, strict=True), marker="o", label=f"{c:,}-block prefix")
        a2.set_xscale("log")
        a2.set_xlabel("blocks in store")
        a2.set_ylabel("longest_prefix latency (ms)")
        a2.set_ylim(bottom=0)
        a2.grid(alpha=0.3)
        a2.legend(fontsize=8)
        fig.suptitle("Cost vs store size")
        fig.tight_layout()
        path = out_dir / "perf_store_size.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths

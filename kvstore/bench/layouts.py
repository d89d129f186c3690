"""Cross-layout read benchmark: blocks written at one parallel layout, read at another.

For each pair (write layout W, read layout R): blocks written by every rank of W are read by
every rank of R (each rank loads its own chunks into its own KV tensors, on CPU), and compared
with blocks written by R itself, read by R, in the same run. The ratio says what reading a
foreign layout's cache costs. Reads are cold: the store is dropped from the page cache before
each pass. Ranks run one after another in this process, so the figure is aggregate bytes over
the sum of the ranks' load times.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from kvstore.bench.common import kv_like_block
from kvstore.config import StoreConfig
from kvstore.io.fileio import drop_tree_cache as drop_cache
from kvstore.layout.page import scatter_blocks
from kvstore.layout.parallel import LocalForm, ParallelLayout, RankMapping, map_rank
from kvstore.models import load_model
from kvstore.rank_io import RankIO, model_group_geometry
from kvstore.store.group_store import GroupStore
from kvstore.store.page_store import KVStore

BATCH = 32
FORM = LocalForm(family="hnd", packing="per_layer")
DEFAULT_PAIRS = ("tp=4:tp=1", "tp=4:tp=2", "tp=4:tp=8", "tp=4:pp=2", "tp=4:tp=2,pp=2")


def _hashes(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}:{i}".encode()).digest() for i in range(n)]


def _mappings(group: GroupStore, model: str, layout: str) -> list[RankMapping]:
    geometry_source = load_model(model)
    identity = geometry_source.identity(group.layout.tokens)
    geometry = model_group_geometry(geometry_source, identity, group.index)
    parsed = ParallelLayout.parse(layout)
    return [map_rank(geometry, parsed, FORM, coord) for coord in parsed.ranks()]


def write_with(
    group: GroupStore, model: str, layout: str, hashes: list[bytes], canonical: torch.Tensor
) -> None:
    """Every rank of ``layout`` writes its share of ``hashes`` (content ``canonical``); commit."""
    mappings = _mappings(group, model, layout)
    for start in range(0, len(hashes), BATCH):
        batch = hashes[start : start + BATCH]
        pendings = group.begin_blocks(batch)
        rows = canonical[[i % len(canonical) for i in range(start, start + len(batch))]]
        ids = list(range(len(batch)))
        chunks: tuple[int, ...] = ()
        range_writers = 0
        for mapping in mappings:
            tensors = [
                torch.empty(len(batch), mapping.page_bytes, dtype=torch.uint8)
                for _ in mapping.local_layers
            ]
            scatter_blocks(mapping, rows, tensors, ids)
            rio = RankIO(group, mapping)
            chunks, range_writers = rio.commit_checksum_chunks, rio.commit_range_writers
            errors = rio.store(tensors, pendings, ids)
            if any(errors):
                raise RuntimeError(f"bench: rank write failed: {next(e for e in errors if e)}")
        results = group.commit_blocks(pendings, [chunks] * len(pendings), range_writers)
        if not all(r.status.value == "written" for r in results):
            raise RuntimeError(f"bench: commit failed: {results[0]}")


def read_with(group: GroupStore, model: str, layout: str, hashes: list[bytes]) -> tuple[int, float]:
    """Every rank of ``layout`` loads all ``hashes``; returns (bytes read, seconds)."""
    total_bytes, seconds = 0, 0.0
    for mapping in _mappings(group, model, layout):
        rio = RankIO(group, mapping)
        tensors = [
            torch.empty(BATCH, mapping.page_bytes, dtype=torch.uint8) for _ in mapping.local_layers
        ]
        for start in range(0, len(hashes), BATCH):
            batch = hashes[start : start + BATCH]
            t0 = time.perf_counter()
            results = rio.load(tensors, batch, list(range(len(batch))))
            seconds += time.perf_counter() - t0
            if not all(r.ok for r in results):
                raise RuntimeError(
                    f"bench: rank read failed: {next(r for r in results if not r.ok)}"
                )
            total_bytes += len(batch) * rio.read_nbytes
    return total_bytes, seconds


def cross_layout(  # noqa: PLR0913 - one parameter per scripts/bench.py option of the suite (bench._run_layouts passes them)
    base: Path,
    model: str,
    block_tokens: int,
    gib: float,
    threads: int,
    pairs: list[str],
    repeat: int,
) -> list[dict[str, Any]]:
    """Read throughput of foreign-layout blocks as a ratio to same-layout blocks."""
    shutil.rmtree(base, ignore_errors=True)
    identity = load_model(model).identity(block_tokens)
    rows: list[dict[str, Any]] = []
    with KVStore(StoreConfig(root=base, io_threads=threads)) as store:
        group = store.namespace(identity).group(0)
        count = max(BATCH, int(gib * 2**30) // group.layout.block_nbytes)
        spec = group.spec
        canonical = torch.stack(
            [
                torch.from_numpy(
                    kv_like_block(
                        spec.num_kv_heads, spec.num_layers, block_tokens, spec.head_dim, s
                    )
                )
                for s in range(4)
            ]
        )
        written: dict[str, list[bytes]] = {}
        for layout in sorted({part for pair in pairs for part in pair.split(":")}):
            written[layout] = _hashes(layout, count)
            write_with(group, model, layout, written[layout], canonical)
        for pair in pairs:
            write_layout, read_layout = pair.split(":")
            foreign, same = [], []
            for rep in range(repeat):  # alternate which goes first: drift favours neither
                for which in ("foreign", "same") if rep % 2 == 0 else ("same", "foreign"):
                    drop_cache(base)
                    if which == "foreign":
                        foreign.append(read_with(group, model, read_layout, written[write_layout]))
                    else:
                        same.append(read_with(group, model, read_layout, written[read_layout]))
            f_gbs = sorted(b / s / 1e9 for b, s in foreign)[len(foreign) // 2]
            s_gbs = sorted(b / s / 1e9 for b, s in same)[len(same) // 2]
            rows.append(
                {
                    "written_at": write_layout,
                    "read_at": read_layout,
                    "blocks": count,
                    "bytes_per_pass": foreign[0][0],
                    "cross_gbs": round(f_gbs, 3),
                    "same_layout_gbs": round(s_gbs, 3),
                    "ratio_to_same_layout": round(f_gbs / s_gbs, 3),
                }
            )
    shutil.rmtree(base, ignore_errors=True)
    return rows


# -- output ----------------------------------------------------------------------------------


def table(rows: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"written at {row['written_at']:<10} read at {row['read_at']:<10}"
        f" {row['cross_gbs']:>6.2f} GB/s vs same-layout {row['same_layout_gbs']:>6.2f}"
        f" ({row['ratio_to_same_layout']:.2f}x)"
        for row in rows
    )


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| written at | read at | blocks | bytes read per pass (GB) | cross-layout GB/s "
        "| same-layout GB/s | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['written_at']} | {row['read_at']} | {row['blocks']} | "
            f"{row['bytes_per_pass'] / 1e9:.2f} | {row['cross_gbs']:.2f} | "
            f"{row['same_layout_gbs']:.2f} | **{row['ratio_to_same_layout']:.2f}** |"
        )
    return lines


def plot(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['written_at']}\n-> {r['read_at']}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["cross_gbs"] for r in rows], 0.4, label="cross-layout")
    ax.bar([x + 0.2 for x in xs], [r["same_layout_gbs"] for r in rows], 0.4, label="same layout")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("GB/s (aggregate over the reader's ranks)")
    ax.set_title("Cold reads of blocks written by another parallel layout")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out_dir / "perf_layouts.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]

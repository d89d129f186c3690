"""Lookup suite: longest cached prefix of a request on a big store, vs one check per key.

A store of ``store_blocks`` tiny blocks (one 4 KiB inner chunk each, so that a million files fit
on a development disk) is built once per run with ``durability="none"`` and buffered writes;
its build time is reported. It holds hash chains of 1k, 8k and (when the store is big enough)
64k blocks among unrelated filler blocks. Each lookup asks for a request of ``chain + chain/8``
blocks whose first ``chain`` blocks are stored:

* ``longest_prefix``: kvstore's binary search over existence probes, verified (O(log n) probes);
* ``per-key stat``: one ``os.stat`` per key in order until the first miss (the cheapest form of
  what vLLM's fs tier does per key);
* ``vllm batch_lookup``: vLLM's C ``batch_lookup`` (``faccessat`` over all the request's keys,
  GIL released), on kvstore's own paths, where vllm imports.

Times are medians of repeated lookups (warm dentry cache, as on a serving node); the first
lookup of each chain is reported too. The store-size part of the scaling suite reuses the same
build: it measures write rate and lookup latency at checkpoints while the store grows.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.config import StoreConfig
from kvstore.identity import GroupSpec, Identity
from kvstore.io.buffers import aligned_buffer
from kvstore.store.group_store import GroupStore
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockWrite, WriteStatus

CHAINS = (1024, 8192, 65536)
WRITE_BATCH = 512


def tiny_identity() -> Identity:
    """One head, one layer, head_dim 64, 16 tokens: a 4096-byte block (8.2 KB file)."""
    return Identity(
        model="bench/lookup-tiny",
        kv_dtype="bfloat16",
        tokens_per_block=16,
        groups=(GroupSpec(kind="full", layer_names=("l0",), num_kv_heads=1, head_dim=64),),
    )


def _hashes(tag: str, n: int, start: int = 0) -> list[bytes]:
    return [hashlib.sha256(f"{tag}:{i}".encode()).digest() for i in range(start, start + n)]


@dataclass
class ChainStore:
    """A growing store of tiny blocks holding the lookup chains (built once per run)."""

    root: Path
    threads: int = 2
    store: KVStore | None = None
    group: GroupStore | None = None
    size: int = 0
    chains: dict[int, list[bytes]] = field(default_factory=dict)
    build_seconds: float = 0.0
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    _filler: int = 0
    _data: np.ndarray | None = None

    def open(self) -> GroupStore:
        if self.group is None:
            shutil.rmtree(self.root, ignore_errors=True)
            config = StoreConfig(
                root=self.root, durability="none", io_threads=self.threads, direct_io="off"
            )
            self.store = KVStore(config)
            self.group = self.store.namespace(tiny_identity()).group(0)
            self._data = aligned_buffer(self.group.layout.block_nbytes)
            self._data[:] = np.arange(len(self._data), dtype=np.uint8)
        return self.group

    def _write(self, hashes: Sequence[bytes], chained: bool) -> float:
        group = self.open()
        assert self._data is not None
        start = time.perf_counter()
        for i in range(0, len(hashes), WRITE_BATCH):
            part = hashes[i : i + WRITE_BATCH]
            parents = [None, *part[:-1]] if chained else [None] * len(part)
            results = group.write_blocks(
                [BlockWrite(h, self._data, p) for h, p in zip(part, parents, strict=True)]
            )
            if any(r.status is not WriteStatus.WRITTEN for r in results):
                raise RuntimeError(f"lookup store: write failed: {results[0]}")
        seconds = time.perf_counter() - start
        self.size += len(hashes)
        self.build_seconds += seconds
        return seconds

    def grow_to(
        self, target: int, on_checkpoint: Callable[[ChainStore], None] | None = None
    ) -> None:
        """Write chains and filler until the store holds ``target`` blocks."""
        self.open()
        for length in CHAINS:
            if length not in self.chains and self.size + length <= target:
                self.chains[length] = _hashes(f"chain{length}", length)
                self._write(self.chains[length], chained=True)
        if self.size < target:
            # The last filler blocks are timed on their own: the write cost at this size.
            tail = min(5000, target - self.size)
            bulk = target - self.size - tail
            self._write(_hashes("filler", bulk, self._filler), False)
            self._filler += bulk
            seconds = self._write(_hashes("filler", tail, self._filler), False)
            self._filler += tail
            rate = tail / seconds
        else:
            rate = float("nan")
        if on_checkpoint is not None:
            self.checkpoints.append({"store_blocks": self.size, "write_blocks_per_s": rate})
            on_checkpoint(self)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
            self.group = None
        shutil.rmtree(self.root, ignore_errors=True)


def vllm_batch_lookup() -> Callable[[list[str]], list[bool]] | None:
    try:
        from vllm.fs_io_C import batch_lookup  # noqa: PLC0415
    except Exception:
        return None
    fn: Callable[[list[str]], list[bool]] = batch_lookup
    return fn


def measure_chain(group: GroupStore, chain: list[bytes], rounds: int = 7) -> dict[str, Any]:
    """Lookup of a request extending ``chain`` by 1/8 unseen blocks, three ways."""
    query = chain + _hashes(f"miss{len(chain)}", max(1, len(chain) // 8))
    exists = os.stat

    def per_key() -> int:
        found = 0
        for h in query:
            try:
                exists(group.path_of(h))
            except FileNotFoundError:
                break
            found += 1
        return found

    ways: dict[str, Callable[[], int]] = {
        "longest_prefix": lambda: group.longest_prefix(query),
        "per_key_stat": per_key,
    }
    batch_lookup = vllm_batch_lookup()
    if batch_lookup is not None:
        paths = [group.path_of(h) for h in query]

        def vllm() -> int:
            flags = batch_lookup(paths)
            return next((i for i, f in enumerate(flags) if not f), len(flags))

        ways["vllm_batch_lookup"] = vllm
    out: dict[str, Any] = {"chain_blocks": len(chain), "query_blocks": len(query)}
    for name, fn in ways.items():
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            found = fn()
            times.append(time.perf_counter() - t0)
            if found != len(chain):
                raise RuntimeError(f"lookup {name}: found {found}, expected {len(chain)}")
        out[f"{name}_ms"] = round(float(np.median(times)) * 1e3, 3)
        out[f"{name}_first_ms"] = round(times[0] * 1e3, 3)
    out["speedup_vs_per_key"] = round(out["per_key_stat_ms"] / out["longest_prefix_ms"], 1)
    if "vllm_batch_lookup_ms" in out:
        out["speedup_vs_vllm"] = round(out["vllm_batch_lookup_ms"] / out["longest_prefix_ms"], 1)
    return out


_BUILT: dict[Path, ChainStore] = {}


def chain_store(base: Path, store_blocks: int, sizes: Sequence[int] = ()) -> ChainStore:
    """The run's chain store grown to ``store_blocks`` (checkpoints at ``sizes``); built once
    per process and root, shared by the lookup and scaling suites."""
    root = base / "lookup-store"
    built = _BUILT.get(root)
    if built is None or built.size > store_blocks:
        if built is not None:
            built.close()
        built = _BUILT[root] = ChainStore(root)

    def checkpoint(cs: ChainStore) -> None:
        assert cs.group is not None
        cs.checkpoints[-1]["lookups"] = [
            measure_chain(cs.group, chain, rounds=5) for chain in cs.chains.values()
        ]

    for size in sorted({*sizes, store_blocks}):
        if size > built.size:
            built.grow_to(size, checkpoint if size in sizes else None)
    return built


def close_all() -> None:
    for built in _BUILT.values():
        built.close()
    _BUILT.clear()


def run(base: Path, store_blocks: int) -> dict[str, Any]:
    built = chain_store(base, store_blocks)
    assert built.group is not None
    lookups = [measure_chain(built.group, chain) for chain in built.chains.values()]
    return {
        "store_blocks": built.size,
        "build_seconds": round(built.build_seconds, 1),
        "build_note": "tiny blocks (8.2 KB files), durability none, buffered writes, 2 threads",
        "lookups": lookups,
        "vllm_batch_lookup": vllm_batch_lookup() is not None,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"store of {result['store_blocks']} blocks, built in {result['build_seconds']} s "
        f"({result['build_note']})",
        f"{'chain':>7} {'query':>7} {'longest_prefix':>15} {'per-key stat':>13} "
        f"{'vllm batch':>11} {'speedup':>8}",
    ]
    for lk in result["lookups"]:
        vllm = lk.get("vllm_batch_lookup_ms")
        lines.append(
            f"{lk['chain_blocks']:>7} {lk['query_blocks']:>7} {lk['longest_prefix_ms']:>12.3f} ms "
            f"{lk['per_key_stat_ms']:>10.2f} ms "
            f"{(f'{vllm:.2f} ms' if vllm is not None else '-'):>11} "
            f"{lk['speedup_vs_per_key']:>7.1f}x"
        )
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> list[str]:
    vllm = result["vllm_batch_lookup"]
    head = "| chain (stored) | request | `longest_prefix` ms | per-key `stat` ms | speedup |"
    rule = "|---|---|---|---|---|"
    if vllm:
        head += " vLLM `batch_lookup` ms | speedup |"
        rule += "---|---|"
    lines = [
        f"A store of {result['store_blocks']:,} blocks (built in {result['build_seconds']} s: "
        f"{result['build_note']}). Each request extends a stored chain by 1/8 unseen blocks; "
        "medians of repeated lookups (first lookup in parentheses).",
        "",
        head,
        rule,
    ]
    for lk in result["lookups"]:
        row = (
            f"| {lk['chain_blocks']:,} | {lk['query_blocks']:,} | **{lk['longest_prefix_ms']:.3f}** "
            f"({lk['longest_prefix_first_ms']:.3f}) | {lk['per_key_stat_ms']:.2f} "
            f"({lk['per_key_stat_first_ms']:.2f}) | **{lk['speedup_vs_per_key']:.0f}x** |"
        )
        if vllm:
            row += (
                f" {lk['vllm_batch_lookup_ms']:.2f} ({lk['vllm_batch_lookup_first_ms']:.2f}) | "
                f"**{lk['speedup_vs_vllm']:.0f}x** |"
            )
        lines.append(row)
    if not vllm:
        lines += ["", "vLLM's C `batch_lookup` column: vllm does not import here."]
    return lines


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    chains = [lk["chain_blocks"] for lk in result["lookups"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (
        ("longest_prefix_ms", "kvstore longest_prefix"),
        ("per_key_stat_ms", "one stat per key"),
        ("vllm_batch_lookup_ms", "vLLM C batch_lookup"),
    ):
        values = [lk.get(key) for lk in result["lookups"]]
        if all(v is not None for v in values):
            ax.plot(chains, values, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("stored prefix (blocks)")
    ax.set_ylabel("lookup latency (ms)")
    ax.set_title(f"Longest-prefix lookup, store of {result['store_blocks']:,} blocks")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    path = out_dir / "perf_lookup.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]

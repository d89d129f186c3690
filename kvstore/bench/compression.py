"""Compression suite: ratio and speed of inner-chunk codecs on KV-like values, and the store.

* **codecs**: every inner chunk (one head of one layer) of KV-like blocks
  (:data:`~kvstore.bench.common.DATA_NOTE`) compressed on its own, as the store does, one
  thread: ratio (raw / stored bytes), compression and decompression GB/s of raw bytes. The
  store's settings (blosc + bit shuffle) are measured next to byte shuffle, no shuffle and plain
  zstd, and uniform random bytes are shown as the incompressible reference.
* **store**: write, cold read and hot read through kvstore with ``compression`` none / lz4 /
  zstd-1 / zstd-3, the same workload, back to back; GB/s of logical (uncompressed) bytes, and
  the bytes the files took.
* **when it pays**: compressing costs ``1/C`` s per byte (C: compression GB/s over the cores)
  and saves ``(1 - 1/ratio)/B`` (B: storage GB/s); it pays when the storage is slower than
  ``C * (1 - 1/ratio)`` (no overlap assumed). The suite prints that threshold per codec for
  writes and reads.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
from numcodecs import blosc

from kvstore.bench import throughput
from kvstore.bench.common import DATA_NOTE, kv_like_block, median
from kvstore.models import load_model
from kvstore.store.format import ShardLayout

STORE_SETTINGS = ("none", "lz4", "zstd-1", "zstd-3")


def _blosc(cname: str, clevel: int, shuffle: int, typesize: int) -> Callable[[memoryview], bytes]:
    def fn(chunk: memoryview) -> bytes:
        out: bytes = blosc.compress(chunk, cname.encode(), clevel, shuffle, 0, typesize=typesize)
        return out

    return fn


def codec_table(typesize: int) -> dict[str, tuple[Callable[[memoryview], bytes], Any]]:
    """name -> (compress, decompress(stored, out))."""

    def blosc_dec(stored: bytes, out: memoryview) -> None:
        blosc.decompress(stored, out)

    zstd = numcodecs.Zstd(level=1)

    def zstd_dec(stored: bytes, out: memoryview) -> None:
        zstd.decode(stored, out)

    def zstd_enc(chunk: memoryview) -> bytes:
        return bytes(zstd.encode(chunk))

    return {
        "lz4 (store: blosc lz4 + bitshuffle)": (
            _blosc("lz4", 5, blosc.BITSHUFFLE, typesize),
            blosc_dec,
        ),
        "zstd-1 (store: blosc zstd 1 + bitshuffle)": (
            _blosc("zstd", 1, blosc.BITSHUFFLE, typesize),
            blosc_dec,
        ),
        "zstd-3 (store: blosc zstd 3 + bitshuffle)": (
            _blosc("zstd", 3, blosc.BITSHUFFLE, typesize),
            blosc_dec,
        ),
        "blosc lz4 + byte shuffle": (_blosc("lz4", 5, blosc.SHUFFLE, typesize), blosc_dec),
        "blosc lz4, no shuffle": (_blosc("lz4", 5, blosc.NOSHUFFLE, typesize), blosc_dec),
        "blosc zstd 1 + byte shuffle": (_blosc("zstd", 1, blosc.SHUFFLE, typesize), blosc_dec),
        "plain zstd level 1 (zarr zstd codec)": (zstd_enc, zstd_dec),
    }


def measure_codecs(
    model: str, block_tokens: int, blocks: int = 4, rounds: int = 3
) -> list[dict[str, Any]]:
    """Per-chunk ratio and single-thread speed of each codec on KV-like blocks."""
    identity = load_model(model).identity(block_tokens)
    spec = identity.groups[0]
    layout = ShardLayout.for_group(spec, block_tokens, identity.dtype.itemsize)
    size = layout.chunk_nbytes
    datasets = {
        "KV-like bf16": np.concatenate(
            [
                kv_like_block(spec.num_kv_heads, spec.num_layers, block_tokens, spec.head_dim, s)
                for s in range(blocks)
            ]
        ),
        "uniform random bytes": np.random.default_rng(0).integers(
            0, 256, blocks * layout.block_nbytes, dtype=np.uint8
        ),
    }
    rows = []
    for data_name, data in datasets.items():
        chunks = [data[i : i + size].data for i in range(0, len(data), size)]
        out = memoryview(bytearray(size))
        for name, (enc, dec) in codec_table(identity.dtype.itemsize).items():
            if data_name != "KV-like bf16" and not name.startswith(("lz4 (", "zstd-1 (")):
                continue
            enc_t, dec_t = [], []
            stored: list[bytes] = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                stored = [enc(c) for c in chunks]
                enc_t.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for s in stored:
                    dec(s, out)
                dec_t.append(time.perf_counter() - t0)
            assert bytes(out) == bytes(chunks[-1])
            rows.append(
                {
                    "data": data_name,
                    "codec": name,
                    "chunk_bytes": size,
                    "ratio": round(len(data) / sum(len(s) for s in stored), 3),
                    "compress_gbs": round(len(data) / median(enc_t) / 1e9, 3),
                    "decompress_gbs": round(len(data) / median(dec_t) / 1e9, 3),
                }
            )
    return rows


def run(  # noqa: PLR0913 - one parameter per scripts/bench.py option of the suite (bench._run_compression passes them)
    base: Path,
    model: str,
    block_tokens: Sequence[int],
    gib: float,
    threads: int,
    durability: str,
    repeat: int,
) -> dict[str, Any]:
    codecs = [row for t in block_tokens for row in _tagged(measure_codecs(model, t), t)]
    cores = os.cpu_count() or 1
    for row in codecs:
        ratio = row["ratio"]
        saved = max(0.0, 1 - 1 / ratio)
        row["pays_below_write_gbs"] = round(row["compress_gbs"] * min(cores, threads) * saved, 2)
        row["pays_below_read_gbs"] = round(row["decompress_gbs"] * min(cores, threads) * saved, 2)
    store = []
    for setting in STORE_SETTINGS:
        cfg = throughput.run_config(
            base / f"store-{setting}",
            model,
            block_tokens[0],
            gib,
            threads,
            durability,
            repeat,
            ["kvstore"],
            compression=setting,
        )
        k = cfg["systems"]["kvstore"]
        store.append(
            {
                "compression": setting,
                "block_tokens": block_tokens[0],
                "total_bytes": cfg["total_bytes"],
                **{p: k[f"{p}_gbs"] for p in throughput.PHASES},
                "stored_bytes": _stored_bytes(base, model, block_tokens[0], setting),
            }
        )
    return {
        "data": DATA_NOTE,
        "model": model,
        "cores": cores,
        "threads": threads,
        "codecs": codecs,
        "store": store,
    }


def _tagged(rows: list[dict[str, Any]], tokens: int) -> list[dict[str, Any]]:
    return [{**row, "block_tokens": tokens} for row in rows]


def _stored_bytes(base: Path, model: str, tokens: int, setting: str) -> int:
    """Bytes per block on disk for ``setting``: one block written through a fresh store."""
    from kvstore.config import StoreConfig  # noqa: PLC0415
    from kvstore.store.page_store import KVStore  # noqa: PLC0415
    from kvstore.store.types import BlockWrite  # noqa: PLC0415

    root = base / f"size-{setting}"
    identity = load_model(model).identity(tokens)
    spec = identity.groups[0]
    data = kv_like_block(spec.num_kv_heads, spec.num_layers, tokens, spec.head_dim, 99)
    with KVStore(StoreConfig(root=root, durability="none", compression=setting)) as store:
        group = store.namespace(identity).group(0)
        h = b"\x07" * 32
        group.write_blocks([BlockWrite(h, data)])
        size = Path(group.path_of(h)).stat().st_size
    import shutil  # noqa: PLC0415

    shutil.rmtree(root, ignore_errors=True)
    return size


def table(result: dict[str, Any]) -> str:
    lines = [f"data: {result['data']}"]
    lines.append(
        f"{'tokens':>6} {'data':<21} {'codec':<42} {'ratio':>6} {'comp GB/s':>9} {'dec GB/s':>9}"
    )
    for row in result["codecs"]:
        lines.append(
            f"{row['block_tokens']:>6} {row['data']:<21} {row['codec']:<42} {row['ratio']:>6.3f} "
            f"{row['compress_gbs']:>9.2f} {row['decompress_gbs']:>9.2f}"
        )
    lines.append("store (GB/s of logical bytes): compression  write  cold  hot  bytes/block")
    for row in result["store"]:
        lines.append(
            f"  {row['compression']:<10} {row['write']:>6.2f} {row['cold']:>5.2f} "
            f"{row['hot']:>5.2f}  {row['stored_bytes']:,}"
        )
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> list[str]:
    lines = [
        f"Data: {result['data']}. Each inner chunk (one head of one layer) is compressed on its "
        'own, as the store does; one thread; GB/s of raw bytes. "Pays below" is the storage '
        f"bandwidth under which compressing saves time with {min(result['cores'], result['threads'])} "
        "cores compressing: `C * (1 - 1/ratio)`.",
        "",
        "| block tokens | data | codec | ratio | compress GB/s | decompress GB/s | pays below (write / read) GB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["codecs"]:
        lines.append(
            f"| {row['block_tokens']} | {row['data']} | {row['codec']} | **{row['ratio']:.3f}** | "
            f"{row['compress_gbs']:.2f} | {row['decompress_gbs']:.2f} | "
            f"{row['pays_below_write_gbs']:.2f} / {row['pays_below_read_gbs']:.2f} |"
        )
    store = result["store"]
    base = store[0]
    lines += [
        "",
        f"Through the store ({result['model']}, {base['block_tokens']}-token blocks, "
        f"{base['total_bytes'] / 1e9:.2f} GB, {result['threads']} threads; GB/s of logical bytes; "
        "ratio to `none` in parentheses):",
        "",
        "| compression | bytes per block file | write GB/s | cold read GB/s | hot read GB/s |",
        "|---|---|---|---|---|",
    ]
    for row in store:
        lines.append(
            f"| {row['compression']} | {row['stored_bytes']:,} | {row['write']:.2f} "
            f"({row['write'] / base['write']:.2f}) | {row['cold']:.2f} "
            f"({row['cold'] / base['cold']:.2f}) | {row['hot']:.2f} ({row['hot'] / base['hot']:.2f}) |"
        )
    return lines


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for row in result["codecs"]:
        if row["data"] != "KV-like bf16":
            continue
        marker = "o" if row["block_tokens"] == result["codecs"][0]["block_tokens"] else "s"
        a1.scatter(row["compress_gbs"], row["ratio"], marker=marker)
        a1.annotate(
            f"{row['codec'].split(' (')[0]} ({row['block_tokens']} tok)",
            (row["compress_gbs"], row["ratio"]),
            fontsize=7,
        )
    a1.set_xlabel("compression GB/s (one thread)")
    a1.set_ylabel("ratio")
    a1.set_title("Codecs on KV-like bf16 inner chunks")
    a1.grid(alpha=0.3)
    store = result["store"]
    names = [row["compression"] for row in store]
    width = 0.25
    for k, phase in enumerate(("write", "cold", "hot")):
        a2.bar(
            [i + (k - 1) * width for i in range(len(store))],
            [row[phase] for row in store],
            width,
            label=phase,
        )
    a2.set_xticks(range(len(store)), names)
    a2.set_ylabel("GB/s of logical bytes")
    a2.set_title("Through the store")
    a2.grid(axis="y", alpha=0.3)
    a2.legend()
    fig.tight_layout()
    path = out_dir / "perf_compression.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]

"""What every benchmark suite shares: realistic KV data, workloads, the raw floor, timing.

**Data.** Benchmarks write *KV-like* values, not uniform random bytes (which no compressor can
touch and which flatter nothing else either): bf16 tensors shaped like a block of vLLM's HND
page, ``(kv_head, layer, token, K|V, head_dim)``, drawn the way published KV-cache statistics
describe them (KIVI, KVQuant): keys with per-channel scales (log-normal, a few outlier channels
8x larger), a per-channel bias, and rotary position embedding applied over the token axis;
values Gaussian with a per-(head, layer) scale. :data:`DATA_NOTE` says so in every report.

**Raw floor.** One file per block, plain ``pwrite``/``preadv``, the same threads, durability and
write mode as the store: what any store on this filesystem must at least pay.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.io.buffers import aligned_buffer
from kvstore.io.fileio import O_DIRECT
from kvstore.io.fileio import drop_tree_cache as drop_cache
from kvstore.keys import HASH_HI_FANOUT
from kvstore.store.format import ShardLayout

BATCH = 32  # blocks per call: one scheduler step's worth of stores or loads
DATA_NOTE = (
    "synthetic KV-like bf16 values: keys with log-normal per-channel scales, 4 outlier channels "
    "per head (8x), per-channel bias and rotary position embedding; values Gaussian with a "
    "per-(head, layer) scale"
)

__all__ = [
    "BATCH",
    "DATA_NOTE",
    "RawFloor",
    "Workload",
    "batches",
    "drop_cache",
    "gbs",
    "kv_like_block",
    "make_workload",
    "median",
    "run_pool",
]


def kv_like_block(  # noqa: PLR0913 - the block geometry (heads, layers, tokens, head_dim) plus the seed and position of its values
    heads: int, layers: int, tokens: int, head_dim: int, seed: int, position: int = 0
) -> np.ndarray:
    """One canonical block of KV-like bf16 values, as its bytes (uint8, C order of
    ``(head, layer, token, kv, head_dim)``). See the module docstring."""
    rng = np.random.default_rng(seed)
    half = head_dim // 2
    inv_freq = 500_000.0 ** (-np.arange(half) / half)
    angle = np.arange(position, position + tokens)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    scale = rng.lognormal(0.0, 0.6, (heads, layers, 1, head_dim)).astype(np.float32)
    outliers = rng.random((heads, layers, 1, head_dim)).argsort(axis=-1) < 4
    scale[outliers] *= 8.0
    bias = rng.standard_normal((heads, layers, 1, head_dim)).astype(np.float32) * 1.5
    keys = rng.standard_normal((heads, layers, tokens, head_dim), dtype=np.float32) * scale + bias
    out = np.empty((heads, layers, tokens, 2, head_dim), dtype=np.float32)
    x1, x2 = keys[..., :half], keys[..., half:]
    out[..., 0, :half] = x1 * cos - x2 * sin
    out[..., 0, half:] = x1 * sin + x2 * cos
    v_scale = rng.lognormal(-1.0, 0.5, (heads, layers, 1, 1)).astype(np.float32)
    out[..., 1, :] = rng.standard_normal((heads, layers, tokens, head_dim), dtype=np.float32)
    out[..., 1, :] *= v_scale
    bits = out.reshape(-1).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return rounded.astype(np.uint16).view(np.uint8)


@dataclass(frozen=True)
class Workload:
    """N blocks with distinct hashes whose bytes cycle through a few KV-like buffers.

    The buffers are consecutive slices of one page-aligned allocation (``backing``), like the
    connector's staging buffers and vLLM's CPU tier; ``batch`` is the blocks per store or load
    call (a scheduler step), ``outs`` one read buffer per block of a batch.
    """

    hashes: list[bytes]
    parents: list[bytes | None]
    backing: np.ndarray
    distinct: int
    block_nbytes: int
    batch: int
    read_backing: np.ndarray

    def data(self, i: int) -> np.ndarray:
        start = (i % self.distinct) * self.block_nbytes
        return self.backing[start : start + self.block_nbytes]

    @property
    def outs(self) -> list[np.ndarray]:
        n = self.block_nbytes
        return [self.read_backing[j * n : (j + 1) * n] for j in range(self.batch)]

    @property
    def total_bytes(self) -> int:
        return len(self.hashes) * self.block_nbytes

    def batches(self) -> list[range]:
        return batches(len(self.hashes), self.batch)

    def check_last_batch(self, outs: Sequence[np.ndarray], who: str) -> None:
        """The read buffers hold the last batch's blocks (a sanity check after a timed read)."""
        for i in self.batches()[-1]:
            if not np.array_equal(outs[i % len(outs)], self.data(i)):
                raise RuntimeError(f"{who}: block {i} read back different bytes")


def make_workload(  # noqa: PLR0913 - layout and count, then keyword-only knobs with defaults (seed, tag, batch, buffer budget)
    layout: ShardLayout,
    count: int,
    *,
    seed: int = 0,
    tag: str = "",
    batch: int = BATCH,
    buffer_budget: int = 256 << 20,
) -> Workload:
    """``count`` chained blocks of ``layout`` (attention geometry) with KV-like contents.

    At most ``buffer_budget`` bytes of distinct contents (2 to 8 blocks), and batches no larger
    than the same budget, so 80 MiB blocks (70B, 256 tokens) fit in memory too.
    """
    n = layout.block_nbytes
    distinct = max(1, min(8, count, max(2, buffer_budget // n)))
    batch = max(1, min(batch, count, max(2, buffer_budget // n)))
    head_dim = layout.elems_per_token // 2
    backing = aligned_buffer(distinct * n)
    for k in range(distinct):
        backing[k * n : (k + 1) * n] = kv_like_block(
            layout.num_heads, layout.num_layers, layout.tokens, head_dim, seed * 1000 + k
        )
    hashes = [hashlib.sha256(f"{tag}:{seed}:{i}".encode()).digest() for i in range(count)]
    parents: list[bytes | None] = [None, *hashes[:-1]]
    return Workload(hashes, parents, backing, distinct, n, batch, aligned_buffer(batch * n))


def batches(n: int, size: int = BATCH) -> list[range]:
    return [range(i, min(n, i + size)) for i in range(0, n, size)]


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def gbs(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def run_pool(
    pool: ThreadPoolExecutor | None, fn: Callable[[Any], None], items: Sequence[Any]
) -> None:
    """``fn`` over ``items`` on ``pool`` (inline when None), re-raising the first error."""
    if pool is None:
        for item in items:
            fn(item)
    else:
        list(pool.map(fn, items))


class RawFloor:
    """One file per block, plain pwrite/preadv, same threads and durability as the store.

    ``direct`` opens files for writing with O_DIRECT, as the store's engine does when its probe
    passed, so the comparison isolates what the store adds (checksums, header and index,
    temporary file and rename, directory fsync) from the choice of write mode.
    """

    name = "raw"

    def __init__(self, root: Path, threads: int, durable: bool, direct: bool = False) -> None:
        self.root = root
        self.durable = durable
        self.direct = direct
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads) if threads > 1 else None
        # the store's fan-out: one directory per value of a hash's first byte
        for hi in range(HASH_HI_FANOUT):
            (root / str(hi)).mkdir(parents=True, exist_ok=True)

    def describe(self) -> str:
        mode = "O_DIRECT" if self.direct else "buffered"
        sync = ", fdatasync per file" if self.durable else ""
        return f"raw floor: one file per block, {mode} pwrite{sync}, buffered preadv"

    def path(self, block_hash: bytes) -> str:
        return f"{self.root}/{block_hash[0]}/{block_hash[1:9].hex()}"

    def _write_one(self, args: tuple[bytes, np.ndarray]) -> None:
        block_hash, data = args
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (O_DIRECT if self.direct else 0)
        fd = os.open(self.path(block_hash), flags, 0o600)
        try:
            os.pwrite(fd, data.data, 0)
            if self.durable:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def _read_one(self, args: tuple[bytes, np.ndarray]) -> None:
        block_hash, out = args
        fd = os.open(self.path(block_hash), os.O_RDONLY)
        try:
            if os.preadv(fd, [out.data], 0) != len(out):
                raise RuntimeError("raw read came back short")
        finally:
            os.close(fd)

    def write(self, work: Workload) -> float:
        start = time.perf_counter()
        for batch in work.batches():
            run_pool(self.pool, self._write_one, [(work.hashes[i], work.data(i)) for i in batch])
        return time.perf_counter() - start

    def read(self, work: Workload, outs: Sequence[np.ndarray]) -> float:
        start = time.perf_counter()
        for batch in work.batches():
            run_pool(
                self.pool, self._read_one, [(work.hashes[i], outs[i % len(outs)]) for i in batch]
            )
        return time.perf_counter() - start

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()

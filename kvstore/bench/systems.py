"""The systems the throughput suite compares, one class each, behind one small protocol.

:class:`KvstoreSystem` (the store, buffered or ``direct_reads``), :class:`RawSystem` (the raw
floor), :class:`FloorSystem` (the protocol floor: kvstore's mandatory system calls and checksums
in the leanest Python, :mod:`kvstore.bench.floor`), :class:`VllmFsSystem` (vLLM 0.33's filesystem tier I/O, where ``vllm`` imports) and
:class:`SafetensorsSystem` (one safetensors file per block); what each does and pays is in
:mod:`kvstore.bench.throughput`. :func:`make_system` builds one by name.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from kvstore.bench.common import RawFloor, Workload
from kvstore.bench.floor import ProtocolFloor
from kvstore.config import StoreConfig
from kvstore.identity import Identity
from kvstore.store.format import ShardLayout
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockRead, BlockWrite, WriteStatus

SYSTEMS = ("kvstore", "kvstore-direct", "raw", "floor", "vllm-fs", "safetensors")
MINE = ("kvstore", "kvstore-direct")
OTHERS = ("raw", "floor", "vllm-fs", "safetensors")


class System(Protocol):
    name: str

    def describe(self) -> str: ...
    def write(self, work: Workload) -> float: ...
    def read(self, work: Workload, outs: Sequence[np.ndarray]) -> float: ...
    def close(self) -> None: ...


class KvstoreSystem:
    name = "kvstore"

    def __init__(  # noqa: PLR0913 - root and identity, then one per StoreConfig field a compared configuration sets
        self,
        root: Path,
        identity: Identity,
        threads: int,
        durability: str,
        compression: str,
        direct_io: str = "auto",
        direct_reads: bool = False,
    ) -> None:
        self.name = "kvstore-direct" if direct_reads else "kvstore"
        config = StoreConfig(
            root=root,
            io_threads=threads,
            durability=durability,  # type: ignore[arg-type]
            compression=compression,
            direct_io=direct_io,  # type: ignore[arg-type]
            direct_reads=direct_reads,
        )
        self.store = KVStore(config)
        self.group = self.store.namespace(identity).group(0)
        self.durability = durability
        self.compression = compression

    def describe(self) -> str:
        extra = "" if self.compression == "none" else f", compression {self.compression}"
        if self.store.config.direct_reads:
            extra += ", direct_reads (O_DIRECT reads)"
        return f"kvstore: {self.store.engine.describe()}, durability {self.durability}{extra}"

    def write(self, work: Workload) -> float:
        group = self.group
        start = time.perf_counter()
        for batch in work.batches():
            results = group.write_blocks(
                [BlockWrite(work.hashes[i], work.data(i), work.parents[i]) for i in batch]
            )
            bad = [r for r in results if r.status is not WriteStatus.WRITTEN]
            if bad:
                raise RuntimeError(f"kvstore write failed: {bad[0]}")
        return time.perf_counter() - start

    def read(self, work: Workload, outs: Sequence[np.ndarray]) -> float:
        group = self.group
        start = time.perf_counter()
        for batch in work.batches():
            results = group.read_blocks(
                [BlockRead(work.hashes[i], outs[i % len(outs)]) for i in batch]
            )
            if not all(r.ok for r in results):
                raise RuntimeError(f"kvstore read failed: {next(r for r in results if not r.ok)}")
        return time.perf_counter() - start

    def close(self) -> None:
        self.store.close()


def vllm_fs_io() -> tuple[Any, str]:
    """vLLM's fs tier io module, or (None, why not)."""
    try:
        from vllm.v1.kv_offload.tiering.fs import io as fs_io  # noqa: PLC0415
    except Exception as exc:  # vllm absent, or failing to import on this machine
        return None, f"vllm's fs tier does not import here ({type(exc).__name__}: {exc})"
    return fs_io, ""


class VllmFsSystem:
    name = "vllm-fs"

    def __init__(self, root: Path, threads: int) -> None:
        fs_io, why = vllm_fs_io()
        if fs_io is None:
            raise RuntimeError(why)
        self.io = fs_io
        self.base = root / "bench-model_000000000000"
        self.base.mkdir(parents=True, exist_ok=True)
        self.direct = bool(fs_io.probe_o_direct(str(self.base)))
        self.c_ext = bool(getattr(fs_io, "_HAS_FSIO_C", False))
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads)

    def describe(self) -> str:
        impl = "C extension" if self.c_ext else "Python"
        mode = "O_DIRECT" if self.direct else "buffered (O_DIRECT probe failed)"
        return (
            f"vLLM fs tier io ({impl}): batch_store_block/batch_load_block, {mode}, "
            f"{self.threads} threads, no fsync, no checksums"
        )

    def path(self, block_hash: bytes) -> str:
        h = block_hash.hex()
        return f"{self.base}_r0/{h[:3]}/{h[3:5]}_g0/{h}.bin"

    def _jobs(self, batch: range) -> list[range]:
        n = len(batch)
        per = -(-n // self.threads)
        return [
            range(batch.start + k, min(batch.stop, batch.start + k + per)) for k in range(0, n, per)
        ]

    def write(self, work: Workload) -> float:
        view = work.backing.data
        n = work.block_nbytes
        store = self.io.batch_store_block

        def job(block_ids: range) -> None:
            paths = [self.path(work.hashes[i]) for i in block_ids]
            offsets = [(i % work.distinct) * n for i in block_ids]
            store(paths, view, offsets, n, self.direct)

        start = time.perf_counter()
        for batch in work.batches():
            list(self.pool.map(job, self._jobs(batch)))
        return time.perf_counter() - start

    def read(self, work: Workload, outs: Sequence[np.ndarray]) -> float:
        view = work.read_backing.data
        n = work.block_nbytes
        load = self.io.batch_load_block

        def job(block_ids: range) -> None:
            paths = [self.path(work.hashes[i]) for i in block_ids]
            offsets = [(i % work.batch) * n for i in block_ids]
            load(paths, view, offsets, n, self.direct)

        start = time.perf_counter()
        for batch in work.batches():
            list(self.pool.map(job, self._jobs(batch)))
        return time.perf_counter() - start

    def close(self) -> None:
        self.pool.shutdown()


class SafetensorsSystem:
    name = "safetensors"

    def __init__(self, root: Path, threads: int) -> None:
        from safetensors import torch as st  # noqa: PLC0415

        self.st = st
        self.root = root
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads)

    def describe(self) -> str:
        return (
            "safetensors: one file per block (save_file / load_file + copy), "
            f"{self.threads} threads, no fsync"
        )

    def path(self, block_hash: bytes) -> str:
        return f"{self.root}/{block_hash.hex()}/kv_cache.safetensors"

    def write(self, work: Workload) -> float:
        def one(i: int) -> None:
            path = self.path(work.hashes[i])
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            tensor = torch.from_numpy(work.data(i)).view(torch.bfloat16)
            self.st.save_file({"kv_cache": tensor}, path)

        start = time.perf_counter()
        for batch in work.batches():
            list(self.pool.map(one, batch))
        return time.perf_counter() - start

    def read(self, work: Workload, outs: Sequence[np.ndarray]) -> float:
        def one(i: int) -> None:
            tensor = self.st.load_file(self.path(work.hashes[i]))["kv_cache"]
            target = torch.from_numpy(outs[i % len(outs)]).view(torch.bfloat16)
            target.copy_(tensor)

        start = time.perf_counter()
        for batch in work.batches():
            list(self.pool.map(one, batch))
        return time.perf_counter() - start

    def close(self) -> None:
        self.pool.shutdown()


class RawSystem(RawFloor):
    """The raw floor as a benchmark system."""


class FloorSystem(ProtocolFloor):
    """The protocol floor as a benchmark system, for the blocks of ``identity``'s first group
    (the group the throughput suite writes)."""

    def __init__(
        self, root: Path, identity: Identity, threads: int, durable: bool, direct: bool
    ) -> None:
        spec = identity.groups[0]
        layout = ShardLayout.for_group(spec, identity.tokens_per_block, identity.dtype.itemsize)
        super().__init__(root, layout, identity.digest, threads, durable, direct)


def available_systems(wanted: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The systems of ``wanted`` that can run here, and why the others cannot."""
    skipped: dict[str, str] = {}
    ok: list[str] = []
    for name in wanted:
        if name not in SYSTEMS:
            raise ValueError(f"system: expected one of {list(SYSTEMS)}, got {name!r}")
        if name == "vllm-fs":
            fs_io, why = vllm_fs_io()
            if fs_io is None:
                skipped[name] = why
                continue
        ok.append(name)
    return ok, skipped


def make_system(  # noqa: PLR0913 - the union of what the systems' constructors take; each system takes its share
    name: str,
    root: Path,
    identity: Identity,
    threads: int,
    durability: str,
    direct: bool,
    compression: str,
) -> System:
    if name in MINE:
        return KvstoreSystem(
            root, identity, threads, durability, compression, direct_reads=name != "kvstore"
        )
    if name == "raw":
        return RawSystem(root, threads, durability == "full", direct)
    if name == "floor":
        return FloorSystem(root, identity, threads, durability == "full", direct)
    if name == "vllm-fs":
        return VllmFsSystem(root, threads)
    return SafetensorsSystem(root, threads)

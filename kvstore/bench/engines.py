"""Engines benchmark: write and cold-read GB/s of each I/O engine against raw file I/O.

``python -m kvstore.bench.engines [--device cuda] [--gib 2] [--engines host,pinned,gds]
[--cases 256:32:8,2048:32:8,...]``

Blocks start (writes) and end (reads) in memory on ``--device``, as KV pages do. Per engine,
batches go through the engine's own staging and the store's public API
(:meth:`Staging.store_rows` -> :meth:`GroupStore.write_blocks`; :meth:`GroupStore.read_blocks`
-> :meth:`Staging.deliver`), the path :class:`kvstore.rank_io.RankIO` takes. Two baselines,
measured in the same run on the same files' sizes:

* ``raw_odirect``: fio-style raw file I/O, one file per block, ``pwrite``/``preadv`` with
  O_DIRECT from page-aligned host buffers on the same number of threads (no device copy at
  all): the storage floor the device engines are held to (target: >= 0.8x).
* ``torch_pwrite``: the naive device path, ``tensor.cpu()`` (pageable D2H) then ``os.pwrite``
  per block; reads ``preadv`` then ``.to(device)``.

Reads are cold: every file's pages are dropped from the page cache before reading. On a
machine without CUDA, ``--device cpu`` runs the same code with the CPU stand-ins (the pinned
and GDS engines' logic, not their speed). ``--checksum`` measures the checksums only.

``--cases`` sweeps block size, batch and threads: each ``KIB:BATCH:THREADS`` is one full run
(every system, the same data volume), and a last table lines their ratios up.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from kvstore.checksum import wsum64_rows
from kvstore.config import StoreConfig
from kvstore.identity import Identity, attention_group
from kvstore.io.buffers import aligned_buffer
from kvstore.io.cufile import PosixCuFiles
from kvstore.io.device import CpuDeviceOps
from kvstore.io.fileio import O_DIRECT, drop_tree_cache
from kvstore.io.select import Found, Probes
from kvstore.store.format import ShardLayout
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockRead, BlockWrite

ENGINES = ("host", "pinned", "gds")
BATCH = 32  # blocks per staged batch (one gather, one event)
HEADS = 8
BLOCK_KIB_PER_LAYER = 64  # 8 heads x 16 tokens x 128 dims x K,V x bf16


def bench_identity(layers: int = 32, heads: int = HEADS) -> Identity:
    """Llama-8B-like geometry: 8 KV heads x 32 layers x 16 tokens x 128 dims, bf16 = 2 MiB."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    return Identity(
        model="bench/engines",
        kv_dtype="bfloat16",
        tokens_per_block=16,
        groups=(attention_group("full", names, num_kv_heads=heads, head_dim=128),),
    )


def _hash(i: int) -> bytes:
    return i.to_bytes(8, "little") + bytes([7]) * 24


def _probes(device: torch.device) -> Probes | None:
    if device.type == "cuda":
        return None  # the real probes
    return Probes(
        cuda=lambda: Found(True, "CPU stand-in"),
        kvikio=lambda: PosixCuFiles(strict=False),
        device_ops=CpuDeviceOps,
        device=lambda: torch.device("cpu"),
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _copy_from(rows: torch.Tensor) -> Callable[[torch.Tensor], object]:
    """A staging fill that copies ``rows`` in (what a real batch's gather does)."""
    return lambda out: out.copy_(rows)


def _batches(n: int, batch: int = BATCH) -> list[range]:
    return [range(i, min(n, i + batch)) for i in range(0, n, batch)]


def run_engine(  # noqa: PLR0913 - one measured run: engine name, scratch root, the data, threads, device and the identity its store opens
    name: str,
    root: Path,
    data: torch.Tensor,
    threads: int,
    device: torch.device,
    identity: Identity,
    batch: int = BATCH,
) -> dict[str, Any]:
    """Write every row of ``data`` as a block with engine ``name``, then read them back."""
    config = StoreConfig(root=root).replace(io_mode=name, durability="none", io_threads=threads)
    with KVStore(config, probes=_probes(device)) as store:
        group = store.namespace(identity).group(0)
        staging = store.staging
        n, nbytes = data.shape

        def write() -> None:
            for part in _batches(n, batch):
                rows = data[part.start : part.stop]
                with staging.store_rows(len(part), nbytes, device, _copy_from(rows)) as st:
                    st.ready.synchronize()  # the batch's copy has run (RankIO.write_staged)
                    src: Any = st.rows if staging.on_device else st.rows.numpy()
                    results = group.write_blocks(
                        [BlockWrite(_hash(i), src[k]) for k, i in enumerate(part)]
                    )
                    if not all(r.status.value == "written" for r in results):
                        raise RuntimeError(f"{name}: write failed: {results[0]}")

        dest = torch.empty_like(data)

        def read() -> None:
            for part in _batches(n, batch):
                with staging.load_rows(len(part), nbytes, device) as st:
                    out: Any = st.rows if staging.on_device else st.rows.numpy()
                    results = group.read_blocks(
                        [BlockRead(_hash(i), out[k]) for k, i in enumerate(part)]
                    )
                    if not all(r.ok for r in results):
                        raise RuntimeError(f"{name}: read failed: {results[0]}")
                    target = dest[part.start : part.stop]
                    staging.deliver(st.rows, target.copy_, device)

        write_s = _timed(write, device)
        drop_tree_cache(root)
        read_s = _timed(read, device)
        if not torch.equal(dest, data):
            raise RuntimeError(f"{name}: blocks read back differ from those written")
        return {
            "engine": store.engine.describe(),
            "checksum": store.checksum,
            "write_gbs": n * nbytes / write_s / 1e9,
            "read_gbs": n * nbytes / read_s / 1e9,
        }


def _pool_map(threads: int, fn: Callable[[int], None], n: int) -> None:
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fn, range(n)))


def run_raw_odirect(root: Path, n: int, nbytes: int, threads: int) -> dict[str, Any]:
    """One file per block, O_DIRECT pwrite/preadv from aligned host buffers (fio-like)."""
    if not O_DIRECT:
        return {"skipped": "no O_DIRECT on this platform"}
    root.mkdir(parents=True, exist_ok=True)
    padded = -(-nbytes // 4096) * 4096
    buffers = [aligned_buffer(padded) for _ in range(threads)]
    for b in buffers:
        b[:] = np.random.default_rng(1).integers(0, 256, padded, dtype=np.uint8)
    slot: dict[int, np.ndarray] = {}

    def buf() -> np.ndarray:
        import threading  # noqa: PLC0415

        key = threading.get_ident()
        if key not in slot:
            slot[key] = buffers[len(slot) % len(buffers)]
        return slot[key]

    def write_one(i: int) -> None:
        fd = os.open(root / f"{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o600)
        try:
            os.pwrite(fd, buf().data, 0)
        finally:
            os.close(fd)

    def read_one(i: int) -> None:
        fd = os.open(root / f"{i}", os.O_RDONLY | O_DIRECT)
        try:
            os.preadv(fd, [buf().data], 0)
        finally:
            os.close(fd)

    try:
        write_s = _timed(lambda: _pool_map(threads, write_one, n), torch.device("cpu"))
        drop_tree_cache(root)
        read_s = _timed(lambda: _pool_map(threads, read_one, n), torch.device("cpu"))
    except OSError as exc:
        return {"skipped": f"O_DIRECT refused here: {exc}"}
    return {"write_gbs": n * padded / write_s / 1e9, "read_gbs": n * padded / read_s / 1e9}


def run_torch_pwrite(
    root: Path, data: torch.Tensor, threads: int, device: torch.device, batch: int = BATCH
) -> dict[str, Any]:
    """The naive path: ``.cpu()`` per batch, buffered pwrite per block; reads the reverse."""
    root.mkdir(parents=True, exist_ok=True)
    n, nbytes = data.shape
    dest = torch.empty_like(data)

    def write() -> None:
        for part in _batches(n, batch):
            host = data[part.start : part.stop].cpu().numpy()

            def one(k: int, host: np.ndarray = host, start: int = part.start) -> None:
                fd = os.open(root / f"{start + k}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    os.pwrite(fd, host[k].data, 0)
                finally:
                    os.close(fd)

            _pool_map(threads, one, len(part))

    def read() -> None:
        for part in _batches(n, batch):
            host = np.empty((len(part), nbytes), dtype=np.uint8)

            def one(k: int, host: np.ndarray = host, start: int = part.start) -> None:
                fd = os.open(root / f"{start + k}", os.O_RDONLY)
                try:
                    os.preadv(fd, [host[k].data], 0)
                finally:
                    os.close(fd)

            _pool_map(threads, one, len(part))
            dest[part.start : part.stop].copy_(torch.from_numpy(host))

    write_s = _timed(write, device)
    drop_tree_cache(root)
    read_s = _timed(read, device)
    if not torch.equal(dest, data):
        raise RuntimeError("torch_pwrite: blocks read back differ")
    return {"write_gbs": n * nbytes / write_s / 1e9, "read_gbs": n * nbytes / read_s / 1e9}


def run_checksums(device: torch.device, mib: int = 4, repeat: int = 10) -> dict[str, float]:
    """GB/s of wsum64 (torch, on ``device`` and on the CPU) and xxh3 (CPU) on one chunk."""
    data = torch.randint(0, 256, (1, mib << 20), dtype=torch.uint8)
    out: dict[str, float] = {}

    def rate(fn: Callable[[], object], dev: torch.device) -> float:
        fn()  # warm up (keys cached, kernels loaded)
        seconds = _timed(lambda: [fn() for _ in range(repeat)], dev)
        return repeat * data.numel() / seconds / 1e9

    out["wsum64_cpu_gbs"] = rate(lambda: wsum64_rows(data), torch.device("cpu"))
    host = data.numpy()[0]
    out["xxh3_cpu_gbs"] = rate(lambda: xxhash.xxh3_64_intdigest(host), torch.device("cpu"))
    if device.type == "cuda":
        on_device = data.to(device)
        out["wsum64_device_gbs"] = rate(lambda: wsum64_rows(on_device), device)
    return out


def run(  # noqa: PLR0913 - keyword-only, one per `python -m kvstore.bench.engines` option
    *,
    root: Path,
    device: torch.device,
    gib: float,
    threads: int,
    engines: Sequence[str],
    layers: int = 32,
    batch: int = BATCH,
) -> dict[str, Any]:
    """One run: every system writes and cold-reads the same ``gib`` of blocks of ``layers``
    layers (64 KiB each), ``batch`` blocks per staged batch, on ``threads`` threads."""
    identity = bench_identity(layers)
    nbytes = ShardLayout.for_group(identity.groups[0], 16, 2).block_nbytes
    n = max(batch, int(gib * (1 << 30)) // nbytes)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=gen).to(device)
    report: dict[str, Any] = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "blocks": n,
        "block_bytes": nbytes,
        "batch": batch,
        "threads": threads,
        "results": {},
    }
    results: dict[str, Any] = report["results"]
    results["raw_odirect"] = run_raw_odirect(root / "raw", n, nbytes, threads)
    shutil.rmtree(root / "raw", ignore_errors=True)
    results["torch_pwrite"] = run_torch_pwrite(root / "torch", data, threads, device, batch)
    shutil.rmtree(root / "torch", ignore_errors=True)
    for name in engines:
        try:
            results[name] = run_engine(name, root / name, data, threads, device, identity, batch)
        except Exception as exc:  # an engine this machine cannot run: say why, go on
            results[name] = {"skipped": f"{type(exc).__name__}: {exc}"}
        shutil.rmtree(root / name, ignore_errors=True)
    report["checksums"] = run_checksums(device)
    raw = results["raw_odirect"]
    for row in results.values():
        if "write_gbs" in row and "write_gbs" in raw:
            row["write_vs_raw"] = row["write_gbs"] / raw["write_gbs"]
            row["read_vs_raw"] = row["read_gbs"] / raw["read_gbs"]
    report["targets"] = {
        name: bool(row.get("write_vs_raw", 0) >= 0.8 and row.get("read_vs_raw", 0) >= 0.8)
        for name, row in results.items()
        if name in ("pinned", "gds") and "write_vs_raw" in row
    }
    return report


def table(report: dict[str, Any]) -> str:
    lines = [
        f"{report['blocks']} blocks x {report['block_bytes']} B on {report['device_name']}, "
        f"batches of {report.get('batch', BATCH)}, {report['threads']} threads, cold reads",
        f"{'system':<14}{'write GB/s':>12}{'read GB/s':>12}{'w/raw':>8}{'r/raw':>8}",
    ]
    for name, row in report["results"].items():
        if "skipped" in row:
            lines.append(f"{name:<14}  skipped: {row['skipped']}")
            continue
        ratios = (
            f"{row['write_vs_raw']:>8.2f}{row['read_vs_raw']:>8.2f}"
            if "write_vs_raw" in row
            else ""
        )
        lines.append(f"{name:<14}{row['write_gbs']:>12.2f}{row['read_gbs']:>12.2f}{ratios}")
    for name, ok in report.get("targets", {}).items():
        lines.append(f"target {name} >= 0.8x raw O_DIRECT: {'met' if ok else 'NOT met'}")
    sums = ", ".join(f"{k} {v:.1f}" for k, v in report.get("checksums", {}).items())
    lines.append(f"checksums (GB/s, 4 MiB chunk): {sums}")
    return "\n".join(lines)


def parse_cases(text: str) -> list[tuple[int, int, int]]:
    """``KIB:BATCH:THREADS,...`` -> cases; ValueError naming what is wrong. KIB is a multiple of
    the 64 KiB one layer holds."""
    cases = []
    for item in (t.strip() for t in text.split(",")):
        parts = item.split(":")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"--cases: expected KIB:BATCH:THREADS (integers), got {item!r}")
        kib, batch, threads = (int(p) for p in parts)
        if kib < BLOCK_KIB_PER_LAYER or kib % BLOCK_KIB_PER_LAYER or batch < 1 or threads < 1:
            raise ValueError(
                f"--cases {item!r}: expected a block size that is a positive multiple of "
                f"{BLOCK_KIB_PER_LAYER} KiB, batch >= 1 and threads >= 1"
            )
        cases.append((kib, batch, threads))
    return cases


def sweep_table(reports: Sequence[dict[str, Any]]) -> str:
    """One line per case: each system's write/read ratio against raw O_DIRECT."""
    names = [n for n in reports[0]["results"] if n != "raw_odirect"] if reports else []
    head = f"{'block':>8}{'batch':>6}{'thr':>5}{'raw w/r GB/s':>15}" + "".join(
        f"{n + ' w/r':>18}" for n in names
    )
    lines = ["ratio to raw O_DIRECT (write/read), same run:", head]
    for rep in reports:
        raw = rep["results"]["raw_odirect"]
        cells = []
        for name in names:
            row = rep["results"].get(name, {})
            cells.append(
                f"{row['write_vs_raw']:>9.2f}/{row['read_vs_raw']:<8.2f}"
                if "write_vs_raw" in row
                else f"{'skipped':>18}"
            )
        lines.append(
            f"{rep['block_bytes'] >> 10:>6}Ki{rep['batch']:>6}{rep['threads']:>5}"
            f"{raw['write_gbs']:>8.2f}/{raw['read_gbs']:<6.2f}" + "".join(cells)
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_engines", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--gib", type=float, default=1.0, help="data per system")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--root", type=Path, default=None, help="scratch directory")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument("--checksum", action="store_true", help="measure checksums only")
    parser.add_argument(
        "--cases",
        default=None,
        help="sweep KIB:BATCH:THREADS,... (block KiB a multiple of 64); default: one 2 MiB run "
        "with --threads",
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.checksum:
        print(json.dumps(run_checksums(device), indent=2))
        return 0
    try:
        cases = parse_cases(args.cases) if args.cases else [(2048, BATCH, args.threads)]
    except ValueError as exc:
        parser.error(str(exc))
    scratch = args.root or Path(tempfile.mkdtemp(prefix="kvstore-bench-engines-", dir="."))
    reports = []
    try:
        for kib, batch, threads in cases:
            report = run(
                root=scratch.absolute() / f"{kib}-{batch}-{threads}",
                device=device,
                gib=args.gib,
                threads=threads,
                engines=[e for e in args.engines.split(",") if e],
                layers=kib // BLOCK_KIB_PER_LAYER,
                batch=batch,
            )
            print(table(report), flush=True)
            reports.append(report)
            if args.json is not None:  # after every case: a sweep cut short keeps what it ran
                args.json.write_text(json.dumps(reports[0] if len(cases) == 1 else reports))
    finally:
        if args.root is None:
            shutil.rmtree(scratch, ignore_errors=True)
    if len(reports) > 1:
        print(sweep_table(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())

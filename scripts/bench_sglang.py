#!/usr/bin/env python3
"""kvstore against SGLang's own file backend (HiCacheFile), on the same host-pool pages.

Runs in the SGLang venv (scripts/sglang_venv.sh): SGLang 0.5.23's real host pool of a model's
geometry (models.json), its real ``HiCacheFile`` backend, and kvstore's backend loaded through
SGLang's ``dynamic`` factory. Each system moves the same pages the way SGLang's cache
controller calls it:

* ``hicache_file``: the generic interface (``batch_set`` of ``get_data_page`` copies; reads into
  ``get_dummy_flat_data_page`` buffers, then ``set_from_flat_data_page``): HiCacheFile has no
  zero-copy path. It writes with ``tofile`` and ``os.replace``: no fsync, no checksum.
* ``kvstore_generic``: kvstore behind the same generic calls.
* ``kvstore_v1``: kvstore's zero-copy interface (``batch_set_v1``/``batch_get_v1`` on host
  indices: pages gathered from and scattered into the pool), ``durability`` none and full, and
  with buffered writes (``direct_io`` off: HiCacheFile's kind of write, into the page cache).

Per directory and model: write GB/s (fresh keys, batches of SGLang's ``STORAGE_BATCH_SIZE``
pages), read GB/s (the same pages back into another pool, after dropping the page cache when
this process may), and one-page latency (one page per call, as a short prefix does; the gets
after dropping the page cache too). Ratios are
against ``hicache_file`` in the same run; every read is compared with what was written.

    PY=$(scripts/sglang_venv.sh | tail -n1)
    PYTHONPATH=$PWD $PY scripts/bench_sglang.py --dir /dev/shm/bench-sglang \
        --dir /var/tmp/bench-sglang
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

warnings.simplefilter("ignore")  # SGLang warns at import that AWQ/GGUF need a GPU

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    STORAGE_BATCH_SIZE,
    HiCacheFile,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from connector.sglang import extra_config  # noqa: E402

MODELS = Path(__file__).resolve().parents[1] / ".." / "shared" / "models.json"
GIB = 1 << 30


@dataclass
class Geometry:
    name: str
    mla: bool
    layers: int
    heads: int  # KV heads (MHA); 1 latent (MLA)
    head_dim: int  # MHA head dim; MLA: kv_lora_rank + rope dim
    dtype: torch.dtype


def load_geometry(models: Path, name: str) -> Geometry:
    spec = json.loads(models.read_text())[name]
    group = spec["groups"][0]
    dtype = getattr(torch, spec["dtype"])
    if group["kind"] == "mla":
        return Geometry(name, True, group["layers"], 1, group["latent_dim"], dtype)
    return Geometry(name, False, group["layers"], group["kv_heads"], group["head_dim"], dtype)


def host_pool(geo: Geometry, pages: int, page_tokens: int, layout: str, seed: int) -> Any:
    """A real SGLang host pool holding ``pages`` pages (plus SGLang's page 0), filled."""
    size = pages * page_tokens
    layers = {"start_layer": 0, "end_layer": geo.layers}
    if geo.mla:  # the latent: kv_lora_rank + a 64-wide rope part
        device: Any = MLATokenToKVPool(
            size, page_tokens, geo.dtype, geo.head_dim - 64, 64, geo.layers, "cpu", False, **layers
        )
        host_class: Any = MLATokenToKVPoolHost
        buffers, extra = device._mla_buffer_info(), {"target_layer_num": geo.layers}
    else:
        device = MHATokenToKVPool(
            size,
            page_tokens,
            geo.dtype,
            geo.heads,
            geo.head_dim,
            geo.layers,
            "cpu",
            False,
            **layers,
        )
        host_class, buffers, extra = MHATokenToKVPoolHost, device._mha_buffer_info(), {}
    with host_memory_budget_scope(64 * GIB):
        host = host_class(
            buffers, 1, 0, page_tokens, layout, pin_memory=False, device="cpu",
            device_capacity_tokens=size, **layers, **extra,
        )  # fmt: skip
    del device
    gen = torch.Generator().manual_seed(seed)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=gen).to(geo.dtype))
    return host


def storage_config(geo: Geometry, extra: dict[str, Any]) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=geo.mla,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name=f"bench/{geo.name}",
        extra_config=extra,
    )


class System:
    """One backend behind the calls SGLang's cache controller makes for it."""

    def __init__(self, name: str, backend: Any, host: Any, zero_copy: bool) -> None:
        self.name, self.backend, self.host, self.zero_copy = name, backend, host, zero_copy
        self.page_tokens = host.page_size

    def indices(self, pages: list[int]) -> torch.Tensor:
        t = self.page_tokens
        return torch.cat([torch.arange(p * t, (p + 1) * t) for p in pages])

    def set(self, keys: list[str], pages: list[int], prefix: list[str]) -> bool:
        if self.zero_copy:
            info = HiCacheStorageExtraInfo(prefix_keys=prefix or None)
            return all(self.backend.batch_set_v1(keys, self.indices(pages), info))
        data = [self.host.get_data_page(p * self.page_tokens) for p in pages]
        return bool(self.backend.batch_set(keys, data))

    def get(self, host: Any, keys: list[str], pages: list[int]) -> int:
        if self.zero_copy:
            return sum(self.backend.batch_get_v1(keys, self.indices(pages)))
        dummies = [host.get_dummy_flat_data_page() for _ in keys]
        got = self.backend.batch_get(keys, dummies)
        count = 0
        for page, data in zip(pages, got, strict=True):
            if data is None:
                break
            host.set_from_flat_data_page(page * self.page_tokens, data)
            count += 1
        return count


def make_system(
    kind: str, geo: Geometry, root: Path, source: Any, target: Any, **opts: Any
) -> tuple[System, System]:
    """A writer on ``source`` and a reader on ``target`` (a restarted server), same store."""
    if kind == "hicache_file":
        made = [HiCacheFile(storage_config(geo, {}), file_path=str(root)) for _ in range(2)]
        return System(kind, made[0], source, False), System(kind, made[1], target, False)
    out = []
    for host in (source, target):
        cfg = storage_config(geo, extra_config(str(root), **opts))
        backend = StorageBackendFactory.create_backend("dynamic", cfg, host)
        backend.register_mem_pool_host(host)  # as HiCacheController's attach does
        out.append(System(kind, backend, host, kind == "kvstore_v1"))
    return out[0], out[1]


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def keys_for(tag: str, count: int) -> list[str]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(count)]


@dataclass
class Case:
    """One directory and model: the pools every system moves pages between."""

    base: Path
    geo: Geometry
    source: Any  # the pool written from
    target: Any  # the pool read into (a restarted server's)
    pages: int
    layout: str


def run_once(case: Case, kind: str, tag: str, opts: dict[str, Any]) -> dict[str, float]:
    geo, base, source, target, pages = case.geo, case.base, case.source, case.target, case.pages
    root = base / tag
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    writer, reader = make_system(kind, geo, root, source, target, **opts)
    page_bytes = source.get_data_page(0).numel() * source.dtype.itemsize
    ids = list(range(1, pages + 1))  # SGLang keeps page 0 out of use
    keys = keys_for(tag, pages)
    t0 = time.perf_counter()
    for i in range(0, pages, STORAGE_BATCH_SIZE):
        batch = slice(i, i + STORAGE_BATCH_SIZE)
        if not writer.set(keys[batch], ids[batch], keys[:i]):
            raise SystemExit(f"{kind}: a set failed")
    write_s = time.perf_counter() - t0
    cold = drop_page_cache()
    target.kv_buffer.zero_()
    t0 = time.perf_counter()
    served = 0
    for i in range(0, pages, STORAGE_BATCH_SIZE):
        batch = slice(i, i + STORAGE_BATCH_SIZE)
        served += reader.get(target, keys[batch], ids[batch])
    read_s = time.perf_counter() - t0
    if served != pages:
        raise SystemExit(f"{kind}: {served} of {pages} pages read back")
    for p in ids:
        if not torch.equal(
            source.get_data_page(p * source.page_size), target.get_data_page(p * target.page_size)
        ):
            raise SystemExit(f"{kind}: page {p} read back differs from what was written")
    one = keys_for(tag + "/one", min(pages, 16))
    t0 = time.perf_counter()
    for k, p in zip(one, ids, strict=False):
        writer.set([k], [p], [])
    one_set = (time.perf_counter() - t0) / len(one)
    drop_page_cache()  # kvstore's O_DIRECT writes left nothing in it, HiCacheFile's did
    t0 = time.perf_counter()
    for k, p in zip(one, ids, strict=False):
        reader.get(target, [k], [p])
    one_get = (time.perf_counter() - t0) / len(one)
    shutil.rmtree(root, ignore_errors=True)
    total = pages * page_bytes
    return {
        "write_gbs": total / write_s / 1e9,
        "read_gbs": total / read_s / 1e9,
        "one_set_ms": one_set * 1e3,
        "one_get_ms": one_get * 1e3,
        "cold": float(cold),
        "page_mib": page_bytes / (1 << 20),
    }


SYSTEMS: list[tuple[str, str, dict[str, Any]]] = [
    ("hicache_file", "hicache_file", {}),
    ("kvstore_generic (none)", "kvstore_generic", {"durability": "none"}),
    ("kvstore_v1 (none)", "kvstore_v1", {"durability": "none"}),
    ("kvstore_v1 (full)", "kvstore_v1", {"durability": "full"}),
    ("kvstore_v1 (none, buffered)", "kvstore_v1", {"durability": "none", "direct_io": "off"}),
]


def bench(case: Case, repeat: int, emit: Callable[[str], None]) -> None:
    base, geo, pages, layout = case.base, case.geo, case.pages, case.layout
    page_tokens = case.source.page_size
    results: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in SYSTEMS}
    for r in range(repeat):  # alternating systems, so drift hits all of them alike
        for n, (label, kind, opts) in enumerate(SYSTEMS):
            results[label].append(run_once(case, kind, f"r{r}s{n}", opts))
    first = results[SYSTEMS[0][0]]
    best = {k: max(x[k] for x in first) for k in ("write_gbs", "read_gbs")}
    best.update({k: min(x[k] for x in first) for k in ("one_set_ms", "one_get_ms")})
    page_mib = first[0]["page_mib"]
    cold = "cold" if all(x["cold"] for x in first) else "page cache hot"
    emit(
        f"\n{base}  {geo.name} ({'MLA' if geo.mla else 'MHA'}, {layout}, "
        f"{page_tokens} tokens/page, {page_mib:.2f} MiB/page, {pages} pages, reads {cold}; "
        f"best of {repeat})"
    )
    emit(
        "| system | write GB/s | read GB/s | 1-page set ms | 1-page get ms "
        "| write x | read x | set x | get x |"
    )
    emit("|---|---|---|---|---|---|---|---|---|")
    for label, _, _ in SYSTEMS:
        runs = results[label]
        w, rd = max(x["write_gbs"] for x in runs), max(x["read_gbs"] for x in runs)
        s1, g1 = min(x["one_set_ms"] for x in runs), min(x["one_get_ms"] for x in runs)
        spread = statistics.pstdev(x["write_gbs"] for x in runs) if len(runs) > 1 else 0.0
        emit(
            f"| {label} | {w:.2f} (±{spread:.2f}) | {rd:.2f} | {s1:.2f} | {g1:.2f} | "
            f"{w / best['write_gbs']:.2f} | {rd / best['read_gbs']:.2f} | "
            f"{best['one_set_ms'] / s1:.2f} | {best['one_get_ms'] / g1:.2f} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dir",
        action="append",
        type=Path,
        required=True,
        help="a directory to bench in (repeatable); its contents are removed",
    )
    parser.add_argument(
        "--model", action="append", help="models.json names (default: llama-3.1-8b and deepseek-v3)"
    )
    parser.add_argument("--models-json", type=Path, default=MODELS)
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--page-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    print(
        f"sglang HiCacheFile vs kvstore; torch {torch.__version__}; ratios x: kvstore / "
        "hicache_file (GB/s) and hicache_file / kvstore (latency): above 1 is kvstore faster"
    )
    layout = "page_first"  # SGLang's usual layout with storage; the others are gathered alike
    for name in args.model or ["llama-3.1-8b", "deepseek-v3"]:
        geo = load_geometry(args.models_json, name)
        source = host_pool(geo, args.pages + 1, args.page_tokens, layout, seed=1)
        target = host_pool(geo, args.pages + 1, args.page_tokens, layout, seed=2)
        for base in args.dir:
            bench(Case(base, geo, source, target, args.pages, layout), args.repeat, print)
            sys.stdout.flush()
        del source, target
    return 0


if __name__ == "__main__":
    sys.exit(main())

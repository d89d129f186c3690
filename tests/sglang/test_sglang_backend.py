"""The kvstore backend on SGLang 0.5.23's own objects, in one process: loaded by SGLang's
``dynamic`` factory, every host layout (MHA and MLA) through the generic, v1 and v2
interfaces, the identity and configuration checks, hybrid pools through v2, SGLang's metrics
object, and failures (bad indices, a full disk) as failed calls that never raise.

Runs in the SGLang venv (scripts/sglang_venv.sh); skipped where SGLang is not installed.
"""

from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from connector.sglang import extra_config
from connector.sglang.backend import KVStoreHiCacheStorage
from kvstore import ConfigError
from tests.sglang.real_pools import fill, mha_pools, mla_pools

T, L, H, D, SIZE = 4, 3, 2, 16, 256
MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
# SGLang's keys are SHA-256 hex digests; real ones, since kvstore places a block by the first
# 70 bits of its hash (keys that share them would share a file and stand for each other).
KEYS = [hashlib.sha256(bytes([i])).hexdigest() for i in range(1, 6)]


def _mha_host(layout: str, heads: int = H, layers: int = L, seed: int = 0) -> Any:
    _, host = mha_pools(layout, SIZE, T, heads, D, layers)
    fill(host.kv_buffer, seed)
    return host


def _mla_host(layout: str, seed: int = 0) -> Any:
    _, host = mla_pools(layout, SIZE, T, 8, 4, L)
    fill(host.kv_buffer, seed)
    return host


def _config(root: Path, mla: bool = False, tp: tuple[int, int] = (0, 1), **extra: Any) -> Any:
    return HiCacheStorageConfig(
        tp_rank=tp[0],
        tp_size=tp[1],
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=True,
        is_page_first_layout=False,
        model_name="test/sglang-model",
        extra_config=extra_config(str(root), **extra),
    )


def _backend(root: Path, host: Any, mla: bool = False, **extra: Any) -> KVStoreHiCacheStorage:
    """Through SGLang's own factory, then the host pool registered, as HiCacheController's
    attach does for --hicache-storage-backend dynamic (the factory hands a dynamic backend only
    the config)."""
    backend = StorageBackendFactory.create_backend("dynamic", _config(root, mla, **extra), host)
    assert isinstance(backend, KVStoreHiCacheStorage)
    backend.register_mem_pool_host(host)
    return backend


def _indices(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * T, (p + 1) * T) for p in pages])


def _page(host: Any, page: int) -> torch.Tensor:
    data: torch.Tensor = host.get_data_page(page * T, flat=True).clone()
    return data


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "store"


@pytest.mark.parametrize(
    ("kind", "layout"), [("mha", x) for x in MHA_LAYOUTS] + [("mla", x) for x in MLA_LAYOUTS]
)
def test_every_layout_through_every_interface(root: Path, kind: str, layout: str) -> None:
    make = _mha_host if kind == "mha" else _mla_host
    source, target = make(layout, seed=1), make(layout, seed=2)
    writer = _backend(root, source, mla=kind == "mla")
    info = HiCacheStorageExtraInfo(prefix_keys=None)
    # v1 writes pages 3, 7; generic writes page 9; v2 writes page 11.
    assert writer.batch_set_v1(KEYS[:2], _indices([3, 7]), info) == [True, True]
    assert writer.batch_set(KEYS[2:3], [_page(source, 9)]) is True
    v2 = PoolTransfer(name="kv", host_indices=_indices([11]), keys=KEYS[3:4])
    assert writer.batch_set_v2([v2]) == {"kv": [True]}
    assert writer.batch_exists(KEYS) == 4 and not writer.exists(KEYS[4])

    reader = _backend(root, target, mla=kind == "mla")  # a second backend: a restarted server
    assert reader.batch_get_v1(KEYS[:3], _indices([0, 1, 2]), info) == [True, True, True]
    dummies = [target.get_dummy_flat_data_page() for _ in range(2)]
    got = reader.batch_get([KEYS[0], KEYS[3]], dummies)
    assert all(g is not None for g in got)
    back = PoolTransfer(name="kv", host_indices=_indices([5, 6]), keys=[KEYS[1], KEYS[4]])
    assert reader.batch_get_v2([back]) == {"kv": [True, False]}
    for read_page, written_page in [(0, 3), (1, 7), (2, 9), (5, 7)]:
        assert torch.equal(_page(target, read_page), _page(source, written_page))
    assert got[0] is not None and got[1] is not None
    assert torch.equal(got[0], _page(source, 3)) and torch.equal(got[1], _page(source, 11))
    stats = reader.get_stats()
    assert type(stats).__name__ == "StorageMetrics" and stats.kvstore["hits"] == 6
    assert stats.kvstore["misses"] == 1 and stats.prefetch_pgs


def test_a_miss_leaves_the_pool_untouched(root: Path) -> None:
    host = _mha_host("page_first", seed=3)
    backend = _backend(root, host)
    before = host.kv_buffer.clone()
    assert backend.batch_get_v1(KEYS[:2], _indices([1, 2])) == [False, False]
    assert backend.batch_get([KEYS[0]], [host.get_dummy_flat_data_page()]) == [None]
    assert torch.equal(host.kv_buffer, before)


def test_bad_calls_fail_without_raising(root: Path) -> None:
    host = _mha_host("page_first")
    backend = _backend(root, host)
    assert backend.batch_set_v1(KEYS[:2], torch.arange(7)) == [False, False]  # 7 slots for 2 pages
    assert backend.batch_set_v1(KEYS[:1], torch.arange(1, 5)) == [False]  # not page aligned
    assert backend.batch_set(["not-a-hash"], [_page(host, 0)]) is False
    assert backend.batch_set(KEYS[:1], [torch.zeros(3)]) is False  # not a flat page
    assert backend.batch_exists(["zz"]) == 0
    assert backend.stats.errors == 3


def test_identity_and_config_are_checked(root: Path) -> None:
    _backend(root, _mha_host("page_first"))
    with pytest.raises(ConfigError, match="unknown key"):
        _backend(root, _mha_host("page_first"), block_size=16)
    with pytest.raises(ConfigError, match="expected 'root'"):
        config = _config(root)
        config.extra_config.pop("root")
        StorageBackendFactory.create_backend("dynamic", config, _mha_host("page_first"))
    # Another head count, dtype or model is another namespace: never the same pages.
    base = _backend(root, _mha_host("page_first"))
    fewer_heads = _backend(root, _mha_host("page_first", heads=1))
    renamed = _backend(root, _mha_host("page_first"), model_name="another/model")
    names = {b._pools["kv"].namespace for b in (base, fewer_heads, renamed)}  # type: ignore[union-attr]
    assert len(names) == 3
    assert base.batch_set_v1(KEYS[:1], _indices([0])) == [True]
    assert fewer_heads.batch_exists(KEYS[:1]) == 0 and renamed.batch_exists(KEYS[:1]) == 0


def test_hybrid_pools_through_v2(root: Path) -> None:
    """A KV pool, an SWA pool and a pool kvstore cannot store (a Mamba state stand-in)."""
    kv, swa = _mha_host("page_first", seed=4), _mha_host("page_first", layers=1, seed=5)
    backend = _backend(root, kv)
    backend.register_mem_host_pool_v2(swa, "swa")
    backend.register_mem_host_pool_v2(object(), "mamba")
    kv_t = PoolTransfer(name="kv", host_indices=_indices([0, 1, 2]), keys=KEYS[:3])
    swa_t = PoolTransfer(
        name="swa",
        host_indices=_indices([2]),
        keys=KEYS[2:3],
        hit_policy=PoolHitPolicy.TRAILING_PAGES,
    )
    assert backend.batch_set_v2([kv_t, swa_t]) == {"kv": [True] * 3, "swa": [True]}
    result = backend.batch_exists_v2(KEYS[:3], [swa_t])
    assert result.kv_hit_pages == 3 and result.extra_pool_hit_pages["swa"] == 3
    mamba = PoolTransfer(name="mamba", keys=KEYS[2:3], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    blocked = backend.batch_exists_v2(KEYS[:3], [swa_t, mamba])
    assert blocked.kv_hit_pages == 0  # the state pool is a miss, so no prefix is restorable
    assert backend.batch_set_v2([mamba]) == {"mamba": [False]}
    target_swa = _mha_host("page_first", layers=1, seed=6)
    reader = _backend(root, _mha_host("page_first", seed=7))
    reader.register_mem_host_pool_v2(target_swa, "swa")
    back = PoolTransfer(name="swa", host_indices=_indices([4]), keys=KEYS[2:3])
    assert reader.batch_get_v2([back]) == {"swa": [True]}
    assert torch.equal(_page(target_swa, 4), _page(swa, 2))


@pytest.mark.skipif(
    subprocess.run(["id", "-u"], capture_output=True, text=True, check=True).stdout.strip() != "0",
    reason="mounting a small tmpfs (a full disk) needs root",
)
def test_a_full_disk_fails_the_set_and_leaves_no_temporary(tmp_path: Path) -> None:
    mount = tmp_path / "small"
    mount.mkdir()
    mount_cmd = ["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mount)]
    if subprocess.run(mount_cmd, check=False).returncode:
        pytest.skip("tmpfs mount refused")
    try:
        host = _mha_host("page_first")
        backend = _backend(mount / "store", host, durability="full")
        many = [hashlib.sha256(bytes([i])).hexdigest() for i in range(100, 140)]
        results = backend.batch_set_v1(many, _indices(list(range(40))))
        assert not all(results) and backend.stats.errors == 0
        assert backend.stats.write_failures >= 1
        assert not [p for p in mount.rglob("*") if ".tmp-" in p.name]
        # What was acknowledged reads back.
        stored = [k for k, ok in zip(many, results, strict=True) if ok]
        reader = _backend(mount / "store", _mha_host("page_first", seed=9))
        assert reader.batch_exists(stored) == len(stored)
    finally:
        subprocess.run(["umount", str(mount)], check=False)

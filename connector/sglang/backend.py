"""kvstore as SGLang's HiCache L3 storage: :class:`KVStoreHiCacheStorage`.

SGLang 0.5.23 loads it with ``--hicache-storage-backend dynamic`` and
``--hicache-storage-backend-extra-config '{"backend_name": "kvstore", "module_path":
"connector.sglang", "class_name": "KVStoreHiCacheStorage", "interface_v1": 1, "root":
"/path/to/store"}'`` (docs/sglang.md), constructs it as ``Cls(storage_config, kwargs)`` and
registers its host pool(s). It serves all three of SGLang's interfaces on the same pages:

* generic (``get/set/batch_get/batch_set/exists/batch_exists``): flat pages copied by SGLang;
* v1 zero-copy (``batch_get_v1/batch_set_v1``, with ``"interface_v1": 1``): host indices,
  gathered from and scattered into the pool's own buffers;
* v2 (``batch_exists_v2/batch_get_v2/batch_set_v2``): per-pool transfers, which SGLang's
  hybrid controller (SWA, Mamba, ...) uses exclusively.

Every pool is a namespace of canonical blocks (:mod:`connector.sglang.pool_store`); a rank
moves only its heads and layers of each block, so pages written at one TP size are read at
another. No call raises into SGLang's threads: failures are misses or failed sets, counted
(:meth:`get_stats`) and logged once per episode.

No call waits on the file system past its deadline (``lookup_deadline_s``, ``load_deadline_s``,
``store_deadline_s``; :mod:`connector.sglang.deadlines`): the store's I/O runs on the
backend's own threads; what it has not answered in time is a miss or a failed set, and while
the store is unresponsive calls fail at once but for one trial per ``unresponsive_retry_s``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

from connector.sglang.config import SGLangBackendConfig
from connector.sglang.deadlines import Call, Kind, StoreCalls
from connector.sglang.pages import PoolPages, flat_page_buffers
from connector.sglang.pool_store import PoolStore, block_hash
from connector.sglang.share import model_name
from connector.sglang.stats import BackendStats, EpisodeLog
from connector.store import open_store
from kvstore import KvstoreError

logger = logging.getLogger("kvstore.sglang")

KV_POOL = "kv"
T = TypeVar("T")
Found = TypeVar("Found", int, PoolTransferResult)  # what a lookup answers
_NO_IDS = torch.zeros(0, dtype=torch.int64)  # the generic calls' pages are views, not pool ids


class KVStoreHiCacheStorage(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` on a kvstore directory (module docstring)."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.config = SGLangBackendConfig.from_extra_config(extra)
        self.model = model_name(storage_config, self.config.model_name)
        self.store = open_store(self.config.store)
        self.stats = BackendStats()
        self._calls = StoreCalls(self.config, str(self.store.root), self.stats)
        self._log = EpisodeLog()
        self._pools: dict[str, PoolStore | None] = {}
        self._pool_objects: dict[str, Any] = {}
        logger.info(
            "kvstore HiCache backend: store %s, model %r, rank tp %s/%s pp %s/%s",
            self.store.root,
            self.model,
            storage_config.tp_rank,
            storage_config.tp_size,
            getattr(storage_config, "pp_rank", 0),
            getattr(storage_config, "pp_size", 1),
        )

    # -- pools ---------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The anchor (KV) pool: refused with a clear error when kvstore cannot store it."""
        super().register_mem_pool_host(mem_pool_host)
        self._attach(KV_POOL, mem_pool_host, required=True)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A pool of the v2 interface; one kvstore cannot store (a Mamba state pool, ...)
        is logged once and answers every lookup as a miss, so SGLang recomputes."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._attach(_pool_name(host_pool_name), host_pool, required=False)

    def _attach(self, name: str, pool: Any, *, required: bool) -> None:
        if self._pool_objects.get(name) is pool:
            return
        try:
            attached = PoolStore(
                self.store,
                name,
                pool,
                self.storage_config,
                self.model,
                (self.config.num_kv_heads, self.config.num_layers),
            )
        except KvstoreError as exc:
            if required:
                raise
            logger.warning(
                "kvstore HiCache backend: pool %r (%s) is not stored, its pages are misses: %s",
                name,
                type(pool).__name__,
                exc,
            )
            self._pools[name] = None
            self._pool_objects[name] = pool
            return
        logger.info(
            "kvstore HiCache backend: pool %r -> namespace %s (%s, %s layout, share %d "
            "bytes per page)",
            name,
            attached.namespace,
            attached.geometry.kind,
            attached.geometry.layout,
            attached.geometry.share_nbytes,
        )
        self._pools[name] = attached
        self._pool_objects[name] = pool

    def _pool(self, name: str) -> PoolStore | None:
        return self._pools.get(name)

    # -- guards --------------------------------------------------------------------------------

    def _guard(self, what: str, default: T, call: Callable[[], T]) -> T:
        """Run ``call``; on any failure count it, log it once per episode, return ``default``."""
        try:
            return call()
        except Exception as exc:  # nothing may raise into SGLang's I/O threads
            self.stats.add(errors=1)
            self._log.failure(what, f"{type(exc).__name__}: {exc}")
            return default

    # -- lookups -------------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Keys published from the start (SGLang then reads that many pages)."""
        return self._guard("lookup", 0, lambda: self._lookup(keys, self._kv_leading, 0))

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The usable prefix: the KV pages found from the start, cut by every other pool's
        hit policy (all pages, or the trailing pages each prefix needs)."""
        empty = PoolTransferResult(0, {}, [])
        transfers = pool_transfers or []
        return self._guard(
            "lookup", empty, lambda: self._lookup(keys, partial(self._exists_v2, transfers), empty)
        )

    def _lookup(self, keys: list[str], find: Callable[[list[str]], Found], missed: Found) -> Found:
        """``find(keys)`` (the lookup's store calls) on the backend's threads within
        ``lookup_deadline_s``; ``missed`` when the store did not answer in time."""
        if not keys or self._pool(KV_POOL) is None:
            return missed
        found = self._calls.begin("lookup").run(partial(find, keys))
        if found is None:
            self.stats.add(lookups=len(keys), lookup_timeouts=len(keys))
            return missed
        self.stats.add(lookups=len(keys), lookup_hits=_kv_hits(found))
        return found

    def _kv_leading(self, keys: Sequence[str]) -> int:
        pool = self._pool(KV_POOL)
        return 0 if pool is None else pool.leading([block_hash(k) for k in keys])

    def _exists_v2(self, transfers: list[PoolTransfer], keys: list[str]) -> PoolTransferResult:
        kv_pages = self._kv_leading(keys)
        hits: dict[str, int] = {KV_POOL: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for transfer in transfers:
            if not restorable:
                break
            name = _pool_name(transfer.name)
            pool = self._pool(name)
            present = (
                pool.contains([block_hash(k) for k in keys[:kv_pages]])
                if pool is not None
                else [False] * kv_pages
            )
            if transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(transfer.keys or ()) or 1)
                allowed = {n for n in restorable if all(present[max(0, n - window) : n])}
            elif transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                first_missing = present.index(False) if False in present else kv_pages
                allowed = {n for n in restorable if n <= first_missing}
            else:  # BLOCK_GROUPS: reported, never gating the KV prefix
                lead = present.index(False) if False in present else kv_pages
                hits[name] = lead
                continue
            if allowed:
                hits[name] = max(allowed)
            restorable &= allowed
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)

    # -- v1: host indices ----------------------------------------------------------------------

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        transfer = PoolTransfer(name=KV_POOL, keys=keys, host_indices=host_indices)
        return self.batch_get_v2([transfer], extra_info)[KV_POOL]

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        transfer = PoolTransfer(name=KV_POOL, keys=keys, host_indices=host_indices)
        return self.batch_set_v2([transfer], extra_info)[KV_POOL]

    # -- v2: per-pool transfers ----------------------------------------------------------------

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Each transfer's pages read into its pool; one deadline for them all."""
        call = self._transfers_call("load", transfers)
        out: dict[str, list[bool]] = {}
        for t in transfers:
            name, keys, indices = _pool_name(t.name), list(t.keys or ()), t.host_indices
            out[name] = self._guard(
                "read", [False] * len(keys), partial(self._get_indices, call, name, keys, indices)
            )
        return out

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Each transfer's pages stored from its pool; one deadline for them all."""
        call = self._transfers_call("store", transfers)
        out: dict[str, list[bool]] = {}
        for t in transfers:
            name, keys, indices = _pool_name(t.name), list(t.keys or ()), t.host_indices
            out[name] = self._guard(
                "write",
                [False] * len(keys),
                partial(self._set_indices, call, name, keys, indices, extra_info),
            )
        return out

    def _transfers_call(self, kind: Kind, transfers: list[PoolTransfer]) -> Call:
        """The call moving every transfer's pages: its deadline allows for all their bytes."""
        nbytes = 0
        for t in transfers:
            pool = self._pool(_pool_name(t.name))
            nbytes += 0 if pool is None else len(t.keys or ()) * pool.geometry.share_nbytes
        return self._calls.begin(kind, nbytes)

    def _get_indices(
        self, call: Call, name: str, keys: Sequence[str], host_indices: torch.Tensor
    ) -> list[bool]:
        pool = self._pool(name)
        if pool is None or not keys:
            self.stats.add(misses=len(keys))
            return [False] * len(keys)
        ids = pool.pages.page_ids(host_indices, len(keys))
        served = pool.read([block_hash(k) for k in keys], ids, self.stats, run=call.run)
        return self._answered("load", served)

    def _set_indices(
        self,
        call: Call,
        name: str,
        keys: Sequence[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None,
    ) -> list[bool]:
        pool = self._pool(name)
        if pool is None or not keys:
            return [False] * len(keys)
        if not call.admit():  # refused at once, before the pages are gathered
            return self._answered("store", [None] * len(keys))
        ids = pool.pages.page_ids(host_indices, len(keys))
        hashes = [block_hash(k) for k in keys]
        parents = _parents(hashes, extra_info)
        written = pool.write_pages(hashes, parents, ids, self.stats, run=call.run)
        return self._answered("store", written)

    def _answered(self, kind: Kind, results: list[bool | None]) -> list[bool]:
        """Per key, whether it was served (stored); the keys not answered in time (None) are
        counted as timed out, and as misses (failed writes)."""
        late = results.count(None)
        if late and kind == "load":
            self.stats.add(read_timeouts=late, misses=late)
        elif late:
            self.stats.add(write_timeouts=late, write_failures=late)
        return [bool(r) for r in results]

    # -- generic: flat pages -------------------------------------------------------------------

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Read into the flat pages SGLang passes (``get_dummy_flat_data_page``), in the
        host layout's flat order; None for a page not served."""
        targets = list(target_locations or [None] * len(keys))
        return self._guard("read", [None] * len(keys), lambda: self._get_flat(keys, targets))

    def _get_flat(self, keys: Sequence[str], targets: list[Any]) -> list[torch.Tensor | None]:
        pool = self._pool(KV_POOL)
        if pool is None or len(targets) != len(keys) or any(t is None for t in targets):
            raise KvstoreError(
                f"batch_get: expected {len(keys)} flat page tensors of a registered pool, got "
                f"{len(targets)}"
            )
        views = [PoolPages(pool.geometry, flat_page_buffers(pool.geometry, t)) for t in targets]
        call = self._calls.begin("load", len(keys) * pool.geometry.share_nbytes)
        hashes = [block_hash(k) for k in keys]
        served = self._answered("load", pool.read(hashes, _NO_IDS, self.stats, views, call.run))
        return [t if s else None for t, s in zip(targets, served, strict=True)]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store flat pages (``get_data_page(flat=True)``); True only if every key is stored."""
        return self._guard("write", False, lambda: all(self._set_flat(keys, list(values or []))))

    def _set_flat(self, keys: Sequence[str], values: list[Any]) -> list[bool]:
        pool = self._pool(KV_POOL)
        if pool is None or len(values) != len(keys):
            raise KvstoreError(
                f"batch_set: expected {len(keys)} flat pages of a registered pool, got "
                f"{len(values)}"
            )
        views = [PoolPages(pool.geometry, flat_page_buffers(pool.geometry, v)) for v in values]
        call = self._calls.begin("store", len(keys) * pool.geometry.share_nbytes)
        if not call.admit():  # refused at once, before the pages are gathered
            return self._answered("store", [None] * len(keys))
        hashes = [block_hash(k) for k in keys]
        parents = _parents(hashes, None)
        written = pool.write_pages(hashes, parents, _NO_IDS, self.stats, views, call.run)
        return self._answered("store", written)

    # -- service -------------------------------------------------------------------------------

    def clear(self) -> None:
        """Not done: the store is shared with other servers and restarts; ``kvstore rm`` and
        ``kvstore gc`` remove pages."""
        logger.warning(
            "kvstore HiCache backend: clear() ignored: the store at %s is shared (remove "
            "pages with 'kvstore rm' or 'kvstore gc')",
            self.store.root,
        )

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (pages and GB/s per call since the last call), with
        kvstore's counters as its ``kvstore`` attribute (hits, misses, bytes, errors, ...)."""
        reads, writes = self.stats.drain_recent()
        try:
            from sglang.srt.observability.metrics_collector import (  # noqa: PLC0415 - only when SGLang collects metrics
                StorageMetrics,
            )
        except ImportError:
            return None
        metrics = StorageMetrics(
            prefetch_pgs=[p for p, _ in reads],
            backup_pgs=[p for p, _ in writes],
            prefetch_bandwidth=[r for _, r in reads],
            backup_bandwidth=[r for _, r in writes],
        )
        metrics.kvstore = {**self.stats.snapshot(), **self._calls.snapshot()}
        return metrics

    def close(self) -> None:
        self._calls.close()
        self.store.close()


def _pool_name(name: Any) -> str:
    """A pool's name as a plain string (SGLang passes its ``PoolName`` enum or a str)."""
    return str(getattr(name, "value", name))


def _kv_hits(found: int | PoolTransferResult) -> int:
    """The KV keys a lookup found from the start (batch_exists: its count; v2: the KV pool's)."""
    if isinstance(found, int):
        return found
    hits: int = found.extra_pool_hit_pages.get(KV_POOL, 0)
    return hits


def _parents(
    hashes: Sequence[bytes | None], extra_info: HiCacheStorageExtraInfo | None
) -> list[bytes | None]:
    """Each block's parent: the key before it in the call, the last prefix key for the first."""
    prefix = getattr(extra_info, "prefix_keys", None) or []
    first = block_hash(prefix[-1]) if prefix else None
    return [first, *hashes[:-1]] if hashes else []

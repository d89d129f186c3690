"""``KVStoreSpec``: the out-of-tree ``OffloadingSpec`` vLLM's OffloadingConnector loads.

vLLM builds the spec in the scheduler process and in every worker process
(``OffloadingSpecFactory.create_spec``), so ``__init__`` only parses and checks, with no
I/O: the connector keys (:class:`connector.config.ConnectorConfig`), the engine facts handed
over by :class:`connector.offload.vllm_connector.KVStoreConnector`, the namespace identity
(:mod:`connector.identity`). Every refusal is a :class:`kvstore.ConfigError` at startup.

``get_manager`` (scheduler) and ``get_worker`` (each worker) open the store and the namespace
(creating them on first use) and build :class:`connector.offload.manager.KVStoreManager` /
:class:`connector.offload.worker.KVStoreWorker`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingMetricMetadata, OffloadingSpec

import connector.store
from connector import compat
from connector.config import ConnectorConfig
from connector.facts import current
from connector.identity import derive_identity
from connector.offload import metrics as kvstore_metrics
from connector.offload.deadlines import JobDeadlines
from connector.offload.manager import KVStoreManager
from connector.offload.worker import KVStoreWorker, build_worker
from connector.rank import rank_context
from kvstore import ConfigError, Identity, KVStore, Namespace

if TYPE_CHECKING:
    from vllm.v1.kv_offload.config import OffloadingConfig

log = logging.getLogger("kvstore.connector")


def _say_other_block_spans(store: KVStore, identity: Identity) -> None:
    """One start-up line when the store holds this model at other block spans (or hash
    lookaheads), whose blocks this server can never load: vLLM 0.34's default block size is
    64, 0.33's was 16, so an upgraded server would otherwise just see misses."""
    spans = sorted(
        {
            (other.tokens_per_block, other.hash_lookahead_tokens)
            for other in store.stored_identities().values()
            if other != identity
            and dataclasses.replace(
                other,
                tokens_per_block=identity.tokens_per_block,
                hash_lookahead_tokens=identity.hash_lookahead_tokens,
            )
            == identity
        }
    )
    if not spans:
        return
    theirs = ", ".join(f"{t}" + (f" (+{a} lookahead)" if a else "") for t, a in spans)
    ours = f"{identity.tokens_per_block}" + (
        f" (+{identity.hash_lookahead_tokens} lookahead)" if identity.hash_lookahead_tokens else ""
    )
    log.warning(
        "kvstore: %s holds this model's KV cache at %s tokens per block; this server uses %s "
        "and cannot load those blocks (serve with --block-size %d to share them)",
        store.root,
        theirs,
        ours,
        spans[0][0],
    )


class KVStoreSpec(OffloadingSpec):  # type: ignore[misc, unused-ignore]  # Any w/o vLLM
    """kvstore as vLLM's offloading medium: a persistent, shared, layout-free page store."""

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """The ``vllm:kvstore_*`` series the manager reports (docs/metrics.md)."""
        return kvstore_metrics.metric_definitions()

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """vLLM 0.33: label names of ``vllm:kv_offload_config_info`` the manager fills."""
        return kvstore_metrics.CONFIG_INFO_KEYS

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        facts = current()
        if facts is None:
            raise ConfigError(
                "KVStoreSpec must be loaded by connector.KVStoreConnector (it reports failed "
                'loads to vLLM): set "kv_connector": "KVStoreConnector" and '
                '"kv_connector_module_path": "connector" in --kv-transfer-config'
            )
        self.facts = facts
        self.options = ConnectorConfig.from_extra_config(config.extra_config)
        if facts.kv_load_failure_policy != "recompute":
            raise ConfigError(
                f"kv_load_failure_policy={facts.kv_load_failure_policy!r}: kvstore serves a "
                "missing or corrupt block as a miss that vLLM recomputes; set "
                '"kv_load_failure_policy": "recompute" in --kv-transfer-config'
            )
        sync_budget = int(config.extra_config.get("sync_load_budget_bytes", 0) or 0)
        if sync_budget > 0 and not compat.VLLM_HAS_SYNC_LOADS:
            raise ConfigError(
                f"sync_load_budget_bytes={sync_budget}: this vLLM has no synchronous loads "
                "(OffloadingWorker.submit_load takes no 'expedited'; vLLM 0.32) and would "
                "ignore the key; leave it at 0"
            )
        if sync_budget > 0 and len(config.groups) > 1:
            raise ConfigError(
                "sync_load_budget_bytes > 0 with several KV-cache groups: vLLM 0.33 cannot "
                "recompute a failed synchronous load of a multi-group model; leave it at 0"
            )
        self.identity, self.key_map = derive_identity(config, facts, self.options)
        self._layer_views: dict[str, torch.Tensor] | None = None

    def attach_layer_views(self, layer_views: Mapping[str, torch.Tensor]) -> None:
        """vLLM's typed per-layer KV views (worker side), to certify the page form."""
        self._layer_views = dict(layer_views)

    def get_manager(self) -> KVStoreManager:
        store, namespace = self._open(say_other_spans=True)
        log.info(
            "kvstore: namespace %s in %s (%d KV groups, %d tokens per block)",
            namespace.name,
            store.root,
            len(namespace.groups),
            self.identity.tokens_per_block,
        )
        return KVStoreManager(
            store=store,
            namespace=namespace,
            key_map=self.key_map,
            options=self.options,
            commit_checksum_all=self.facts.dcp > 1,
            events_enabled=self.kv_events_config.enable_kv_cache_events,
        )

    def get_worker(self, kv_caches: CanonicalKVCaches) -> KVStoreWorker:
        context = rank_context(self.facts, self.config.parallel.rank)
        store, namespace = self._open()
        try:
            return build_worker(
                kv_caches=kv_caches,
                group_ids=[g.group_id for g in self.config.groups],
                identity=self.identity,
                key_map=self.key_map,
                facts=self.facts,
                context=context,
                store=store,
                namespace=namespace,
                threads=self.options.worker_threads,
                deadlines=JobDeadlines.of(self.options),
                layer_views=self._layer_views,
            )
        except BaseException:
            store.close()
            raise

    def _open(self, say_other_spans: bool = False) -> tuple[KVStore, Namespace]:
        """The store and this server's namespace; with ``say_other_spans`` (the scheduler, once)
        one line if the store holds this model at other block spans."""
        store = connector.store.open_store(self.options.store)  # tests inject faults
        try:
            namespace = store.namespace(self.identity)
            if say_other_spans:
                _say_other_block_spans(store, self.identity)
        except BaseException:
            store.close()
            raise
        return store, namespace

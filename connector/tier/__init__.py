"""kvstore as a vLLM secondary tier: vLLM's CPU tier in front, the persistent store behind.

vLLM 0.33 loads it from ``secondary_tiers`` of ``TieringOffloadingSpec`` by
``{"type": "KVStoreTier", "module_path": "connector.tier", "root": ...}``
(:func:`tiering_transfer_config` builds the whole ``--kv-transfer-config``; docs/vllm.md says
when to use it instead of the direct connector). Modules, one job each: ``config`` (the tier's
keys), ``chunks`` (CPU-tier rows <-> canonical blocks, through :mod:`kvstore.layout`),
``lookup`` (vLLM's async existence probes against the store), ``jobs`` (load and store
threads, each job's deadline), ``transfers`` (one part of a store or promotion job, on a job
thread), ``health`` (the deadlines, the store's responsiveness on a hung mount, the
``vllm:kvstore_tier_*`` metrics), ``manager`` (the ``SecondaryTierManager``).
"""

from __future__ import annotations

from typing import Any

from connector.tier.manager import KVStoreTier

TIER_TYPE = "KVStoreTier"
TIER_MODULE_PATH = "connector.tier"

__all__ = ["TIER_MODULE_PATH", "TIER_TYPE", "KVStoreTier", "tier_entry", "tiering_transfer_config"]


def tier_entry(root: str, **options: Any) -> dict[str, Any]:
    """The ``secondary_tiers`` entry of a kvstore tier at ``root`` (more keys: ``options``)."""
    return {"type": TIER_TYPE, "module_path": TIER_MODULE_PATH, "root": str(root), **options}


def tiering_transfer_config(root: str, cpu_bytes_to_use: int, **options: Any) -> dict[str, Any]:
    """The ``--kv-transfer-config`` object of vLLM's CPU tier with kvstore behind it.

    ``options`` are further keys of the tier's entry (store keys such as ``durability``, tier
    keys such as ``load_threads``, vLLM's ``backpressure``).
    """
    return {
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": int(cpu_bytes_to_use),
            "secondary_tiers": [tier_entry(root, **options)],
        },
    }

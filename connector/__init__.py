"""vLLM connector for kvstore: persist KV pages from vLLM's KV cache into a kvstore.

vLLM 0.32.x and 0.33.x (their differences: :mod:`connector.compat`).

Entry points (loaded by vLLM by name; see docs/vllm.md):

* :class:`connector.offload.vllm_connector.KVStoreConnector` - ``"kv_connector":
  "KVStoreConnector"``, ``"kv_connector_module_path": "connector"``: vLLM's
  OffloadingConnector plus load-failure reporting; both modes load through it (it hands
  vLLM's engine facts to the spec vLLM builds);
* :class:`connector.offload.spec.KVStoreSpec` - ``"spec_name": "KVStoreSpec"``,
  ``"spec_module_path": "connector"`` in ``kv_connector_extra_config``;
* :func:`kv_transfer_config` - the ``--kv-transfer-config`` object for a store root;
* :class:`connector.tier.KVStoreTier` - ``{"type": "KVStoreTier", "module_path":
  "connector.tier", ...}`` in ``secondary_tiers`` of vLLM 0.33's ``TieringOffloadingSpec``
  (the store behind vLLM's CPU tier; :mod:`connector.tier`).

Two modes, one package each, neither importing the other (lint-imports): ``offload`` (the
direct mode: kvstore's own ``OffloadingSpec``; its modules: :mod:`connector.offload`) and
``tier`` (the secondary tier: :mod:`connector.tier`). Shared by both: ``config`` (connector
keys), ``facts`` (what is read from vLLM's configs), ``identity`` (namespace identity,
OffloadKey mapping), ``keys`` (a block's parent key in its request), ``rank`` (parallel
layout and tensor form of a worker), ``store`` (opening the store), ``compat`` (what differs
between vLLM versions). ``spec`` and ``vllm_connector`` are aliases of their
:mod:`connector.offload` modules, kept for configs naming those older module paths.

The library (``kvstore``) never imports vLLM; this package holds every vLLM import of the
project. Importing ``connector`` itself does not import vLLM (entry points resolve lazily).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from connector.offload.spec import KVStoreSpec
    from connector.offload.vllm_connector import KVStoreConnector

CONNECTOR_NAME = "KVStoreConnector"
SPEC_NAME = "KVStoreSpec"
MODULE_PATH = "connector"

__all__ = [
    "CONNECTOR_NAME",
    "MODULE_PATH",
    "SPEC_NAME",
    "KVStoreConnector",
    "KVStoreSpec",
    "kv_transfer_config",
]


def kv_transfer_config(root: str, **options: Any) -> dict[str, Any]:
    """The ``--kv-transfer-config`` object running kvstore at ``root``.

    ``options`` are further ``kv_connector_extra_config`` keys (see docs/vllm.md).
    """
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": MODULE_PATH,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": SPEC_NAME,
            "spec_module_path": MODULE_PATH,
            "root": str(root),
            **options,
        },
    }


def __getattr__(name: str) -> Any:
    if name == "KVStoreConnector":
        from connector.offload.vllm_connector import KVStoreConnector  # noqa: PLC0415 - lazy: imports vLLM

        return KVStoreConnector
    if name == "KVStoreSpec":
        from connector.offload.spec import KVStoreSpec  # noqa: PLC0415 - lazy: imports vLLM

        return KVStoreSpec
    raise AttributeError(f"module 'connector' has no attribute {name!r}")

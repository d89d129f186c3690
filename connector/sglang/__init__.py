"""kvstore as SGLang's HiCache L3 storage backend (SGLang 0.5.23; docs/sglang.md).

Loaded by SGLang by module path: ``"module_path": "connector.sglang", "class_name":
"KVStoreHiCacheStorage"`` in ``--hicache-storage-backend-extra-config`` with
``--hicache-storage-backend dynamic``. Modules: ``backend`` (the ``HiCacheStorage`` subclass:
SGLang's three interfaces), ``pool_store`` (one host pool's pages in its namespace: lookups,
share writes without a coordinator, verified share reads), ``pages`` (host layouts <->
canonical share rows), ``share`` (a rank's heads and layers; the namespace identity),
``config`` (the extra config), ``stats`` (counters, the once-per-episode log).

Importing this package does not import SGLang: the backend class resolves lazily, so the
modules below it are usable (and tested) without SGLang installed. It never imports vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from connector.sglang.backend import KVStoreHiCacheStorage

BACKEND_NAME = "kvstore"
MODULE_PATH = "connector.sglang"
CLASS_NAME = "KVStoreHiCacheStorage"

__all__ = ["BACKEND_NAME", "CLASS_NAME", "MODULE_PATH", "KVStoreHiCacheStorage", "extra_config"]


def extra_config(root: str, **options: Any) -> dict[str, Any]:
    """The ``--hicache-storage-backend-extra-config`` object running kvstore at ``root``
    through the zero-copy interface; ``options`` are further keys (docs/sglang.md)."""
    return {
        "backend_name": BACKEND_NAME,
        "module_path": MODULE_PATH,
        "class_name": CLASS_NAME,
        "interface_v1": 1,
        "root": str(root),
        **options,
    }


def __getattr__(name: str) -> Any:
    if name == CLASS_NAME:
        from connector.sglang.backend import KVStoreHiCacheStorage  # noqa: PLC0415 - lazy: imports SGLang

        return KVStoreHiCacheStorage
    raise AttributeError(f"module 'connector.sglang' has no attribute {name!r}")

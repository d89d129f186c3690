"""kvstore: a persistent, parallel-layout-agnostic KV-cache store on zarr v3.

The public API, in the order a user meets it::

    from kvstore import KVStore, StoreConfig, load_model, BlockWrite, BlockRead

    with KVStore(StoreConfig(root="kvcache")) as store:
        ns = store.namespace(load_model("llama-3.1-8b").identity(tokens_per_block=16))
        g = ns.group(0)
        g.write_blocks([BlockWrite(block_hash, data, parent_hash)])
        n = g.longest_prefix(chain_hashes)
        g.read_blocks([BlockRead(block_hash, out_buffer)])
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvstore.config import StoreConfig
from kvstore.errors import (
    BlockError,
    ConfigError,
    CorruptBlockError,
    IdentityMismatchError,
    KvstoreError,
    LayoutError,
    StoreFormatError,
    StoreIOError,
    StoreTimeoutError,
)
from kvstore.identity import GroupSpec, Identity
from kvstore.models import ModelGeometry, load_model, model_names

if TYPE_CHECKING:
    from kvstore.store.format import ShardLayout
    from kvstore.store.group_store import GroupStore
    from kvstore.store.page_store import KVStore, Namespace
    from kvstore.store.types import (
        BlockRead,
        BlockWrite,
        ChunkWrite,
        PendingBlock,
        RangeWrite,
        ReadResult,
        ReadStatus,
        WriteResult,
        WriteStatus,
    )

# The store's classes are imported on first use: the tools (``kvstore ls``, ``kvstore-inspect``)
# read a store through ``kvstore.store.view`` and never need the serving stack (its engines
# import torch, which alone costs a tool several times its own start-up).
_LAZY = {
    "ShardLayout": "kvstore.store.format",
    "GroupStore": "kvstore.store.group_store",
    "KVStore": "kvstore.store.page_store",
    "Namespace": "kvstore.store.page_store",
    **dict.fromkeys(
        (
            "BlockRead",
            "BlockWrite",
            "ChunkWrite",
            "PendingBlock",
            "RangeWrite",
            "ReadResult",
            "ReadStatus",
            "WriteResult",
            "WriteStatus",
        ),
        "kvstore.store.types",
    ),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__version__ = "0.1.0"

__all__ = [
    "BlockError",
    "BlockRead",
    "BlockWrite",
    "ChunkWrite",
    "ConfigError",
    "CorruptBlockError",
    "GroupSpec",
    "GroupStore",
    "Identity",
    "IdentityMismatchError",
    "KVStore",
    "KvstoreError",
    "LayoutError",
    "ModelGeometry",
    "Namespace",
    "PendingBlock",
    "RangeWrite",
    "ReadResult",
    "ReadStatus",
    "ShardLayout",
    "StoreConfig",
    "StoreFormatError",
    "StoreIOError",
    "StoreTimeoutError",
    "WriteResult",
    "WriteStatus",
    "__version__",
    "load_model",
    "model_names",
]

"""Kept for configs naming the old path ``"spec_module_path": "connector.spec"``."""

from __future__ import annotations

from connector.offload.spec import KVStoreSpec

__all__ = ["KVStoreSpec"]

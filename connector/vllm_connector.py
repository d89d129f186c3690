"""Kept for configs naming the old ``"kv_connector_module_path": "connector.vllm_connector"``."""

from __future__ import annotations

from connector.offload.vllm_connector import KVStoreConnector

__all__ = ["KVStoreConnector"]

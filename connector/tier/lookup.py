"""Existence probes of the tier: vLLM's async lookup path in front of the store.

vLLM's :class:`AsyncLookupManager` keeps per-request lookup state, answers RETRY while a probe
runs, posts one batch per step to its thread and serves the verdicts next step;
:class:`StoreProbe` only supplies ``batch_lookup``: which keys have a published block
(:meth:`kvstore.GroupStore.contains`, one batched probe per group array). A key of a group the
namespace does not store is absent.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager

from connector.identity import GROUP_ID_BYTES, KeyMap
from kvstore import Namespace


class StoreProbe(AsyncLookupManager):  # type: ignore[misc, unused-ignore]  # Any w/o vLLM
    """vLLM's async lookup manager probing a kvstore namespace."""

    def __init__(self, namespace: Namespace, key_map: KeyMap, tier_type: str) -> None:
        self._namespace = namespace
        # a key's last GROUP_ID_BYTES -> its array (KeyMap.split without the exceptions)
        self._arrays = {
            g.to_bytes(GROUP_ID_BYTES, "big"): a for a, g in enumerate(key_map.group_ids)
        }
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        arrays = self._arrays
        by_array: dict[int, list[int]] = defaultdict(list)  # array -> positions in keys
        for i, key in enumerate(keys):
            array = arrays.get(key[-GROUP_ID_BYTES:])
            if array is not None:
                by_array[array].append(i)
        found = [False] * len(keys)
        for array, positions in by_array.items():
            hashes = [keys[i][:-GROUP_ID_BYTES] for i in positions]
            present = self._namespace.group(array).contains(hashes)
            for i, hit in zip(positions, present, strict=True):
                found[i] = hit
        return found


def split_key(key_map: KeyMap, key: bytes) -> tuple[int, bytes] | None:
    """``(array, block hash)`` of a key, None for a group the namespace does not store."""
    try:
        return key_map.split(key)
    except ValueError:
        return None

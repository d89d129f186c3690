"""A block's parent in its request: the ``OffloadKey`` of the same vLLM group one block earlier.

Both modes write each block's parent hash into its header (prefix lookups and ``kvstore gc``
follow it): the direct connector (:mod:`connector.offload.manager`) and the secondary tier
(:mod:`connector.tier.manager`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice

from vllm.v1.kv_offload.base import OffloadKey, ReqContext


@dataclass
class _ParentIndex:
    """Per request: (vLLM group id, end token) -> key, to find a block's parent."""

    by_end: dict[tuple[int, int], bytes] = field(default_factory=dict)
    seen: int = 0  # entries of the request's key-position table already indexed


def parent_key(key: bytes, req_context: ReqContext, tokens_per_block: int) -> bytes | None:
    """The key of the same vLLM group that ends ``tokens_per_block`` tokens before ``key`` in
    the request (its parent block), None for a first block or a key the request lacks.

    Indexed once per request (a :class:`_ParentIndex` in the request's state), then only the
    new entries."""
    end = req_context.get_offload_key_position(OffloadKey(key))
    if end is None or end <= tokens_per_block:
        return None
    index = req_context.get_state(_ParentIndex)
    if index is None:
        index = _ParentIndex()
        req_context.set_state(index)
    # vLLM (0.32, 0.33) records every key's end token in this table (ReqContext has no public
    # iterator); index the entries added since the last call.
    positions: dict[OffloadKey, int] = getattr(req_context, "_offload_key_positions", {})
    if len(positions) > index.seen:  # the table only grows, in insertion order
        for k, pos in islice(positions.items(), index.seen, None):
            index.by_end[(int.from_bytes(k[-4:], "big"), pos)] = bytes(k)
        index.seen = len(positions)
    return index.by_end.get((int.from_bytes(key[-4:], "big"), end - tokens_per_block))

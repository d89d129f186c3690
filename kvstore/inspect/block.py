"""The ``block`` view: one block's header, per-chunk checksum status and parent chain.

The parent chain follows the parent hash in each header back to a block without a parent
(``chain start``), a parent that is not stored (``evicted``), a header that cannot be used
(``damaged``) or a hash seen before (``cycle``, only in a forged or damaged store).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from kvstore.checksum import NAMES
from kvstore.inspect.blockfile import check_block, quick_header
from kvstore.inspect.resolve import BlockRef
from kvstore.store.full_check import BlockCheck
from kvstore.store.view import GroupView

_ALGOS = NAMES  # header id -> algorithm name (xxh3_64, crc32c, wsum64)


def parent_chain(
    group: GroupView, start: bytes | None, limit: int = 1_000_000
) -> tuple[list[str], str]:
    """Hashes (hex) from ``start``'s parent back towards the root, and how the walk ended."""
    hashes: list[str] = []
    seen: set[bytes] = set()
    current = start
    while current is not None and len(hashes) < limit:
        if current in seen:
            return hashes, "cycle"
        seen.add(current)
        path = group.path_of(current)
        if not path.is_file():
            return hashes, "evicted"
        header, problem = quick_header(group, path)
        hashes.append(current.hex())
        if header is None:
            return hashes, f"damaged ({problem})"
        current = header.parent_hash
    return hashes, "chain start" if current is None else "limit"


def block_report(group: GroupView, ref: BlockRef) -> tuple[BlockCheck, dict[str, Any]]:
    """Verify every chunk of ``ref`` and describe it (JSON-ready)."""
    check, _ = check_block(group, ref.file.path, expect_hash=ref.block_hash)
    h = check.header
    layout = group.layout
    doc: dict[str, Any] = {
        "namespace": group.namespace,
        "group": group.index,
        "path": str(check.path),
        "file_nbytes": check.file_nbytes,
        "expected_file_nbytes": layout.file_nbytes,
        "ok": check.ok,
        "problems": list(check.problems),
        "header": None,
    }
    if h is not None:
        created = dt.datetime.fromtimestamp(h.created_ns / 1e9, tz=dt.UTC)
        doc["header"] = {
            "block_hash": h.block_hash.hex(),
            "parent_hash": h.parent_hash.hex() if h.parent_hash is not None else None,
            "namespace_digest": h.namespace_digest.hex(),
            "group": h.group,
            "checksum_algo": _ALGOS.get(h.checksum_algo, f"unknown ({h.checksum_algo})"),
            "tokens": h.tokens,
            "num_chunks": h.num_chunks,
            "chunk_nbytes": h.chunk_nbytes,
            "chunk_stride": h.chunk_stride,
            "data_offset": h.data_offset,
            "header_nbytes": h.header_nbytes,
            "file_nbytes": h.file_nbytes,
            "created_ns": h.created_ns,
            "created": created.isoformat(timespec="milliseconds"),
        }
    doc["chunks"] = [
        {
            "chunk": c.chunk,
            "head": c.head,
            "layer": c.layer,
            "state": c.state.value,
            "ok": c.state.ok,
            "stored": f"{c.stored:016x}" if c.stored is not None else None,
            "computed": f"{c.computed:016x}" if c.computed is not None else None,
        }
        for c in check.chunks
    ]
    chain, end = parent_chain(group, h.parent_hash if h is not None else None)
    doc["parent_chain"] = {"hashes": chain, "depth": len(chain) + 1, "ends": end}
    if h is None:
        doc["parent_chain"]["ends"] = "unknown (header unusable)"
    return check, doc

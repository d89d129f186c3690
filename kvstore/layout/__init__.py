"""Canonical page layout: where each byte of a rank's KV pages lives in a stored block.

:mod:`kvstore.layout.parallel` derives the mapping (with :mod:`~kvstore.layout.parallel_layout`,
:mod:`~kvstore.layout.geometry`, :mod:`~kvstore.layout.records` and
:mod:`~kvstore.layout.tiling`, the only TP/PP/DCP/PCP-aware code; it re-exports their names);
:mod:`kvstore.layout.page` moves bytes by it with torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.layout.parallel import (
    CopyRun,
    GroupGeometry,
    LayoutError,
    LocalForm,
    ParallelLayout,
    RankCoord,
    RankMapping,
    ShareSegment,
    check_tiling,
    map_all_ranks,
    map_rank,
    pp_layer_range,
    verify_tiling,
)

if TYPE_CHECKING:
    from kvstore.layout.page import gather_blocks, scatter_blocks


def __getattr__(name: str) -> Any:
    # The byte movers need torch; the mapping (and the tools that print one) do not.
    if name in ("gather_blocks", "scatter_blocks"):
        from kvstore.layout import page  # noqa: PLC0415

        return getattr(page, name)
    raise AttributeError(f"module 'kvstore.layout' has no attribute {name!r}")


__all__ = [
    "CopyRun",
    "GroupGeometry",
    "LayoutError",
    "LocalForm",
    "ParallelLayout",
    "RankCoord",
    "RankMapping",
    "ShareSegment",
    "check_tiling",
    "gather_blocks",
    "map_all_ranks",
    "map_rank",
    "pp_layer_range",
    "scatter_blocks",
    "verify_tiling",
]

"""Load a verified selection of a block and present its decoded values.

:func:`load_values` reads the selected inner chunks once (through
:func:`~kvstore.inspect.blockfile.check_block`, so damage is reported rather than raised) and
keeps them as stored elements; decoding, statistics and printing derive from that.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from kvstore.inspect.blockfile import check_block
from kvstore.inspect.decode import Selection, raw_array, to_float
from kvstore.inspect.resolve import BlockRef
from kvstore.inspect.stats import StatRow, attention_stats, mla_stats
from kvstore.store.full_check import BlockCheck
from kvstore.store.view import GroupView


@dataclass(frozen=True)
class BlockValues:
    """A selection of one block: its verification result and its stored elements."""

    group: GroupView
    ref: BlockRef
    selection: Selection
    check: BlockCheck
    raw: np.ndarray  # stored element type, shape ``selection.shape(group)``

    @cached_property
    def floats(self) -> np.ndarray:
        """The values as float32 (exact for every supported KV dtype)."""
        return to_float(self.raw, self.group.dtype.name)

    def stats(self) -> list[StatRow]:
        if self.group.is_mla:
            return mla_stats(self.floats, self.selection.layers)
        return attention_stats(self.floats, self.selection.heads, self.selection.layers)


def load_values(group: GroupView, ref: BlockRef, selection: Selection) -> BlockValues:
    """Read and verify ``selection`` of block ``ref``; the values are returned even if damaged."""
    check, data = check_block(
        group,
        ref.file.path,
        chunks=selection.chunks(group),
        expect_hash=ref.block_hash,
        want_data=True,
    )
    assert data is not None
    return BlockValues(group, ref, selection, check, raw_array(data, group, selection))


def format_values(  # noqa: PLR0913 - the values and their labels (heads, layers, rows, notes) plus the `--full` switch of the values command
    values: np.ndarray,
    group: GroupView,
    heads: Sequence[int],
    layers: Sequence[int],
    rows: range,
    full: bool,
    row_name: str = "tokens",
    notes: dict[tuple[int, int], str] | None = None,
) -> list[str]:
    """Text of decoded values: per (layer, head), K and V (MLA: the latent) as rows x dims.

    ``values`` is ``(heads, layers, rows, 2, head_dim)`` or MLA ``(layers, rows, latent)``;
    ``heads`` / ``layers`` label its first axes; ``rows`` selects along the row axis (tokens,
    or a rank's slots); ``notes[(layer, head)]`` is appended to that chunk's title line.
    """
    options: dict[str, Any] = {"precision": 4, "suppress_small": False, "max_line_width": 100}
    options.update({"threshold": sys.maxsize} if full else {"threshold": 64, "edgeitems": 3})
    lines: list[str] = []
    names = group.spec.layer_names
    for li, layer in enumerate(layers):
        heads_here = [(0, 0)] if group.is_mla else list(enumerate(heads))
        for hi, head in heads_here:
            where = f"layer {layer} ({names[layer]})" + ("" if group.is_mla else f", head {head}")
            note = (notes or {}).get((layer, head))
            parts = (
                [("latent", values[li, rows.start : rows.stop])]
                if group.is_mla
                else [
                    (p, values[hi, li, rows.start : rows.stop, k]) for k, p in enumerate(("K", "V"))
                ]
            )
            for part, matrix in parts:
                nan, inf = int(np.isnan(matrix).sum()), int(np.isinf(matrix).sum())
                odd = f"  ({nan} nan, {inf} inf)" if nan or inf else ""
                lines.append(
                    f"{where} {part}: {row_name} {rows.start}..{rows.stop - 1} x "
                    f"{matrix.shape[-1]}{odd}" + (f"  [{note}]" if note else "")
                )
                text = np.array2string(matrix, **options)
                lines.extend("  " + line for line in text.splitlines())
    return lines

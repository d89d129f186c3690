"""Text tables and JSON output shared by every view.

JSON: strict (RFC 8259) documents; floats that are not finite are written as the strings
``"nan"``, ``"inf"`` and ``"-inf"`` (``json.dumps`` would otherwise emit invalid tokens).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any


def sanitize(value: Any) -> Any:
    """``value`` with non-finite floats replaced by strings, tuples by lists, recursively."""
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {str(k): sanitize(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [sanitize(v) for v in value]
    return value


def dumps(doc: Any) -> str:
    """A strict JSON document, indented."""
    return json.dumps(sanitize(doc), indent=2, allow_nan=False)


def size(nbytes: int | float | None) -> str:
    """Human bytes: 512 B, 4.0 KiB, 2.00 MiB ..."""
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"  # pragma: no cover - loop always returns


def num(value: float) -> str:
    """A float for a table column: 4 significant digits, nan / inf spelled out."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.4g}"


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    indent: str = "  ",
    align: str | None = None,
) -> list[str]:
    """Aligned text table. ``align``: one of "l" / "r" per column; default: the first column
    left aligned, the others right aligned."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    sides = align or "l" + "r" * (len(headers) - 1)
    lines = []
    for r in cells:
        parts = [
            r[i].ljust(widths[i]) if sides[i] == "l" else r[i].rjust(widths[i])
            for i in range(len(headers))
        ]
        lines.append(indent + "  ".join(parts).rstrip())
    return lines


def short(hex_hash: str | None, digits: int = 16) -> str:
    """A hash shortened for tables (full hashes are in --json)."""
    if hex_hash is None:
        return "-"
    return hex_hash if len(hex_hash) <= digits else hex_hash[:digits] + ".."


def spans(values: Sequence[int]) -> str:
    """Integers as compact runs: ``[0, 1, 2, 5]`` -> ``0-2,5``."""
    parts: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(parts) or "none"

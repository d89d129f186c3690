"""Printing command results: aligned tables for people, one JSON document for machines."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO


def table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], *, indent: str = "  "
) -> list[str]:
    """Lines of a table: text columns left aligned, numbers (int/float) right aligned."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [
        all(isinstance(row[i], int | float) for row in rows) and bool(rows)
        for i in range(len(headers))
    ]
    lines = []
    for r in cells:
        parts = [
            c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric, strict=True)
        ]
        lines.append((indent + "  ".join(parts)).rstrip())
    return lines


def print_lines(lines: Sequence[str], out: TextIO | None = None) -> None:
    stream = out or sys.stdout
    for line in lines:
        print(line, file=stream)


def print_json(doc: Any, *, lines: bool = False) -> None:
    """``doc`` as indented JSON, or as one line (``lines=True``: JSON Lines, for --watch)."""
    if lines:
        print(json.dumps(doc, sort_keys=False), flush=True)
    else:
        print(json.dumps(doc, indent=2))


def warn(message: str) -> None:
    """One line on stderr, prefixed like every kvstore diagnostic."""
    print(f"kvstore: warning: {message}", file=sys.stderr)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return "-" if value is None else str(value)

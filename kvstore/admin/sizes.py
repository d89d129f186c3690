"""Sizes and durations as operators type them, and how the admin CLI prints them.

Sizes (:func:`parse_size`): a plain number is bytes; ``K M G T P`` and ``KiB MiB GiB TiB PiB``
are powers of 1024 (as in ``du``, ``truncate -s``, ``sort -h``); ``KB MB GB TB PB`` are powers of
1000. Case does not matter, a trailing ``B`` and spaces are allowed, fractions too:
``10G`` = ``10GiB`` = 10·2^30, ``500MB`` = 5·10^8, ``1.5T``.

Durations (:func:`parse_duration`): a plain number is seconds; otherwise one or more
``<number><unit>`` terms with units ``s m h d w`` (``7d``, ``12h``, ``1h30m``, ``0.5d``).

Both reject what no operator means and what would only fail later, after the command has
started acting (``kvstore rm --grace inf`` must not unpublish the namespace and then crash):
negative, infinite and NaN values, and values past :data:`MAX_SIZE` / :data:`MAX_DURATION_S`.
"""

from __future__ import annotations

import math
import re
import time
from datetime import UTC, datetime

_BINARY = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)
_TERM = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([smhdw])", re.IGNORECASE)
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}

# Largest accepted values. 100 years is far beyond any retention, and well inside what
# time.sleep, threading waits and nanosecond timestamps (int64 up to 2262) can take;
# 1 EiB is far beyond any store.
MAX_DURATION_S = 100 * 365 * 86400.0
MAX_SIZE = 1 << 60
_DURATION_EXPECTED = "expected a duration like 7d, 12h, 1h30m or seconds"


def parse_size(text: str) -> int:
    """Bytes of a size such as ``10G``, ``500MiB``, ``2.5TB`` or ``4096``; ValueError if bad."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"expected a size like 10G, 500MiB, 2TB or a byte count, got {text!r}")
    number, prefix, binary, b = m.group(1), m.group(2).lower(), m.group(3), m.group(4)
    if binary and not prefix:
        raise ValueError(f"expected a size like 10G, 500MiB, 2TB or a byte count, got {text!r}")
    # "10GB": decimal; "10G", "10GiB": binary; "10i" is rejected above.
    factor = _DECIMAL[prefix] if (prefix and b and not binary) else _BINARY[prefix]
    value = float(number) * factor
    if not value <= MAX_SIZE:  # also inf (a number of 400 digits)
        raise ValueError(f"expected a size of at most 1 EiB ({MAX_SIZE} bytes), got {text!r}")
    return int(value)


def parse_duration(text: str) -> float:
    """Seconds of a duration such as ``7d``, ``12h``, ``1h30m``, ``90`` (seconds).

    ValueError for anything else, including negative, infinite or NaN values (``-3``, ``inf``,
    ``nan``, ``1e400``) and durations over :data:`MAX_DURATION_S`.
    """
    stripped = text.strip()
    try:
        seconds = float(stripped)
    except ValueError:
        seconds = _sum_of_terms(stripped.replace(" ", ""), text)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{_DURATION_EXPECTED} (finite, >= 0), got {text!r}")
    if seconds > MAX_DURATION_S:
        raise ValueError(f"{_DURATION_EXPECTED}, at most 100 years, got {text!r}")
    return seconds


def _sum_of_terms(compact: str, text: str) -> float:
    """Seconds of ``<number><unit>`` terms back to back (``1h30m``); ValueError otherwise."""
    pos = 0
    total = 0.0
    for m in _TERM.finditer(compact):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _SECONDS[m.group(2).lower()]
        pos = m.end()
    if not compact or pos != len(compact):
        raise ValueError(f"{_DURATION_EXPECTED}, got {text!r}")
    return total


def format_size(n: int) -> str:
    """``n`` bytes for people: binary units, three significant digits (``1.50 GiB``)."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.2f} {unit}" if value < 10 else f"{value:.1f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def format_duration(seconds: float) -> str:
    """A short duration for people: ``45s``, ``12m``, ``1.0h``, ``2.0d``."""
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def format_time(ns: int | None) -> str:
    """Local wall-clock time of an ns timestamp, to the second ("-" for None)."""
    if ns is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


def iso_time(ns: int | None) -> str | None:
    """UTC ISO 8601 of an ns timestamp (for --json), None for None."""
    if ns is None:
        return None
    stamp = datetime.fromtimestamp(ns / 1e9, tz=UTC)
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")

"""Statistics of decoded KV values per (layer, head, part).

One row per layer, head and part: ``K`` and ``V`` for attention groups, ``latent`` for MLA.
Conventions (pinned by the tests, which recompute them from the reference tensors):

* ``count`` - elements in the row (tokens x head_dim, or tokens x latent_dim);
* ``nan`` / ``inf`` - how many of them are NaN / +-Inf;
* ``absmax``, ``mean``, ``std`` - over the *finite* elements only, computed in float64 from the
  exactly decoded values; ``std`` is the population standard deviation (ddof=0). When no
  element is finite they are NaN.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StatRow:
    layer: int  # layer index within the group
    head: int  # KV head (0 for MLA)
    part: str  # "K", "V" or "latent"
    count: int
    absmax: float
    mean: float
    std: float
    nan: int
    inf: int

    def to_json(self) -> dict[str, object]:
        return {
            "layer": self.layer,
            "head": self.head,
            "part": self.part,
            "count": self.count,
            "absmax": self.absmax,
            "mean": self.mean,
            "std": self.std,
            "nan": self.nan,
            "inf": self.inf,
        }


def row_stats(values: np.ndarray, layer: int, head: int, part: str) -> StatRow:
    """Statistics of one set of values (any shape)."""
    flat = values.reshape(-1)
    nan = int(np.isnan(flat).sum())
    inf = int(np.isinf(flat).sum())
    finite = flat[np.isfinite(flat)].astype(np.float64)
    if finite.size:
        absmax, mean, std = float(np.abs(finite).max()), float(finite.mean()), float(finite.std())
    else:
        absmax = mean = std = float("nan")
    return StatRow(layer, head, part, int(flat.size), absmax, mean, std, nan, inf)


def attention_stats(
    values: np.ndarray, heads: Sequence[int], layers: Sequence[int]
) -> list[StatRow]:
    """Rows for a ``(heads, layers, tokens, 2, head_dim)`` float array, ordered by layer, head."""
    rows: list[StatRow] = []
    for li, layer in enumerate(layers):
        for hi, head in enumerate(heads):
            rows.append(row_stats(values[hi, li, :, 0], layer, head, "K"))
            rows.append(row_stats(values[hi, li, :, 1], layer, head, "V"))
    return rows


def mla_stats(values: np.ndarray, layers: Sequence[int]) -> list[StatRow]:
    """Rows for a ``(layers, tokens, latent)`` float array."""
    return [row_stats(values[li], layer, 0, "latent") for li, layer in enumerate(layers)]


def magnitude(values: np.ndarray, metric: str) -> float:
    """One magnitude of a set of values over its finite elements: rms, absmax or meanabs."""
    finite = values[np.isfinite(values)].astype(np.float64)
    if not finite.size:
        return float("nan")
    if metric == "rms":
        return float(np.sqrt(np.mean(finite * finite)))
    if metric == "absmax":
        return float(np.abs(finite).max())
    if metric == "meanabs":
        return float(np.abs(finite).mean())
    raise ValueError(f"magnitude metric: expected rms, absmax or meanabs, got {metric!r}")


METRICS = ("rms", "absmax", "meanabs")

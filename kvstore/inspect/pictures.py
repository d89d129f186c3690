"""PNG pictures: K/V magnitude heatmaps of a block, and the shape of a prefix forest.

Drawn with matplotlib's object API on the Agg canvas (no pyplot state, no display needed).
Every picture is exactly ``width`` x ``height`` pixels (no tight bounding box), so scripts and
tests can rely on the size.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter, ScalarFormatter

from kvstore.inspect.stats import magnitude
from kvstore.inspect.tree import Forest, plot_coordinates

DPI = 100
_MAX_MARKED_NODES = 20_000  # above this, nodes are drawn as edges only


def _figure(width: int, height: int) -> Figure:
    if width < 200 or height < 150:
        raise ValueError(f"picture size: expected at least 200x150 pixels, got {width}x{height}")
    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def magnitude_grid(values: np.ndarray, is_mla: bool, metric: str) -> list[tuple[str, np.ndarray]]:
    """Per part ("K", "V" or "latent"), a (layers x heads) grid of magnitudes.

    ``values``: float array ``(heads, layers, tokens, 2, head_dim)`` or MLA ``(layers, tokens,
    latent)``.
    """
    if is_mla:
        grid = np.array([[magnitude(values[li], metric)] for li in range(values.shape[0])])
        return [("latent", grid)]
    heads, layers = values.shape[0], values.shape[1]
    out = []
    for k, part in enumerate(("K", "V")):
        grid = np.array(
            [[magnitude(values[h, li, :, k], metric) for h in range(heads)] for li in range(layers)]
        )
        out.append((part, grid))
    return out


def heatmap_png(  # noqa: PLR0913 - keyword-only plot options of `kvstore-inspect heatmap` (selection, metric, title, size), each documented
    path: Path,
    values: np.ndarray,
    *,
    is_mla: bool,
    heads: range,
    layers: range,
    metric: str,
    title: str,
    width: int = 1200,
    height: int = 600,
) -> list[tuple[str, np.ndarray]]:
    """Write the heatmap PNG; returns the plotted grids (for JSON output and tests)."""
    grids = magnitude_grid(values, is_mla, metric)
    fig = _figure(width, height)
    axes = fig.subplots(1, len(grids), squeeze=False)[0]
    nonfinite = int((~np.isfinite(values)).sum())
    for ax, (part, grid) in zip(axes, grids, strict=True):
        # imshow paints NaN with the colormap's "bad" colour; Inf is folded into NaN first.
        masked = np.where(np.isfinite(grid), grid, np.nan)
        cmap = colormaps["viridis"].with_extremes(bad="#d62728")
        image = ax.imshow(masked, aspect="auto", interpolation="nearest", cmap=cmap)
        ax.set_title(f"{part} {metric}")
        ax.set_xlabel("KV head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(grid.shape[1]), [str(h) for h in (range(1) if is_mla else heads)])
        step = max(1, math.ceil(len(layers) / 16))
        ax.set_yticks(
            range(0, len(layers), step), [str(layers[i]) for i in range(0, len(layers), step)]
        )
        if grid.size <= 64:
            for (li, h), v in np.ndenumerate(grid):
                ax.text(h, li, f"{v:.3g}", ha="center", va="center", color="white", fontsize=8)
        fig.colorbar(image, ax=ax)
    suffix = (
        f"  ({nonfinite} non-finite values, cells in red have none finite)" if nonfinite else ""
    )
    fig.suptitle(title + suffix, fontsize=10)
    fig.savefig(path, dpi=DPI, format="png")
    return grids


def tree_png(path: Path, forest: Forest, title: str, width: int = 1200, height: int = 800) -> None:
    """Write the forest picture: chains drawn root (left) to leaf (right), and a histogram of
    chain lengths. Edge colour and node colour grow with the number of chains through a block."""
    fig = _figure(width, height)
    ax_tree, ax_hist = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 1]})
    coords = plot_coordinates(forest)
    segments = []
    weights = []
    for node, parent in forest.parent.items():
        if node in coords and parent is not None and parent in coords:
            segments.append([coords[parent], coords[node]])
            weights.append(forest.leaves_under[node])
    top = max(forest.leaves_under.values(), default=1)
    norm = LogNorm(vmin=1, vmax=max(2, top))
    if segments:
        lines = LineCollection(segments, cmap="plasma", norm=norm, linewidths=0.8)
        lines.set_array(np.asarray(weights, dtype=float))
        ax_tree.add_collection(lines)
        bar = fig.colorbar(lines, ax=ax_tree, label="chains through block")
        bar.ax.yaxis.set_major_formatter(ScalarFormatter())
        bar.ax.yaxis.set_minor_formatter(NullFormatter())
    if coords and len(coords) <= _MAX_MARKED_NODES:
        xs, ys = zip(*coords.values(), strict=True)
        cs = [forest.leaves_under[n] for n in coords]
        ax_tree.scatter(xs, ys, c=cs, cmap="plasma", norm=norm, s=6, zorder=3)
    ax_tree.set_xlabel("depth (blocks from root)")
    ax_tree.set_ylabel("chains (one row per leaf)")
    ax_tree.set_xlim(0.5, max((d for d, _ in coords.values()), default=1) + 0.5)
    ax_tree.set_ylim(-0.5, max(1, len(forest.leaves)) - 0.5)
    ax_tree.invert_yaxis()
    ax_tree.set_title(
        f"{len(forest.order)} blocks, {len(forest.roots)} trees, {len(forest.leaves)} chains"
    )
    lengths = [forest.depth[n] for n in forest.leaves]
    if lengths:
        lo, hi = min(lengths), max(lengths)
        step = max(1, math.ceil((hi - lo + 1) / 50))
        ax_hist.hist(lengths, bins=np.arange(lo - 0.5, hi + step + 0.5, step), color="#4c72b0")
    ax_hist.set_xlabel("chain length (blocks)")
    ax_hist.set_ylabel("chains")
    ax_hist.set_title("chain lengths")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=DPI, format="png")

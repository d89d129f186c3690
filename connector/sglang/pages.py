"""SGLang host-pool pages as a rank's share of canonical blocks, for every host layout.

A host pool holds this rank's KV heads and layers of each page in one of SGLang's layouts
(``--hicache-mem-layout``). :class:`PoolPages` sees the pool's buffers through strided views
whose axes are the canonical order of a rank's share (:mod:`kvstore.layout.parallel`):

* MHA: ``[page][head][layer][token][K|V][dim]``: the share's inner chunks ``(h, l)`` back to
  back, heads outer, layers inner, each chunk token-major with K then V per token;
* MLA: ``[page][layer][token][latent]``: one chunk per layer.

The views are built from the layout's buffer shape (SGLang 0.5.23
``srt/mem_cache/pool_host/mha.py`` / ``mla.py`` ``init_kv_buffer``), so a gather is one strided
``index_select`` per buffer and a scatter one ``index_put_``: no per-layout copy loops, and the
same code serves a whole pool (host indices, the zero-copy and v2 interfaces) and a single flat
page (``get_data_page(flat=True)``, the generic interface), which is one page of the same
layout.

Layouts (H = this rank's heads, L = its layers, T = tokens per page, D = head dim, C = latent):

=================== ============================== ===========================
layout              MHA buffer                     MLA buffer
=================== ============================== ===========================
layer_first         ``(2, L, P*T, H, D)``          ``(L, P*T, 1, C)``
page_first          ``(2, P*T, L, H, D)``          ``(P*T, L, 1, C)``
page_first_direct   ``(2, P, L, T, H, D)``         ``(P, L, T, 1, C)``
page_head           ``(2, P, H, T, L, D)``         (not an MLA layout)
page_first_kv_split (not an MHA layout)            ``(P, L, T, 1, Ck)`` + ``(P, L, T, 1, Cr)``
=================== ============================== ===========================

Views, never copies: a buffer that cannot be viewed so (not contiguous) is refused, since a
scatter into a silent copy would load nothing. Nothing here imports SGLang: a pool is read
through the attributes named above, which makes the mapping testable against plain tensors
as well as SGLang's own pools.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvstore import ConfigError

PoolKind = Literal["mha", "mla"]
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_first_kv_split")
# Layouts whose flat page (get_data_page(flat=True)) SGLang defines: the generic interface.
FLAT_PAGE_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


@dataclass(frozen=True)
class PoolGeometry:
    """What one rank's host pool holds per page (never the model's totals)."""

    kind: PoolKind
    layout: str
    dtype: torch.dtype
    page_size: int  # tokens per page
    num_layers: int  # layers in this pool (this pipeline stage's, draft layers included)
    num_heads: int = 1  # MHA: this rank's KV heads; MLA: 1
    head_dim: int = 0  # MHA: elements per head (K and V alike)
    latent_dims: tuple[int, ...] = ()  # MLA: the latent's parts (one, or the kv_split pair)

    @property
    def row_elems(self) -> int:
        """Elements of one token row of one (head, layer): 2*D, or the latent."""
        return 2 * self.head_dim if self.kind == "mha" else sum(self.latent_dims)

    @property
    def chunk_elems(self) -> int:
        """Elements of one inner chunk (one head and layer, all tokens of the page)."""
        return self.page_size * self.row_elems

    @property
    def share_nbytes(self) -> int:
        """Bytes of this rank's share of one block."""
        return self.num_heads * self.num_layers * self.chunk_elems * self.dtype.itemsize

    @property
    def page_shape(self) -> tuple[int, ...]:
        """Shape of one page in canonical share order (without the page axis)."""
        if self.kind == "mha":
            return (self.num_heads, self.num_layers, self.page_size, 2, self.head_dim)
        return (self.num_layers, self.page_size, sum(self.latent_dims))


def pool_geometry(pool: Any) -> PoolGeometry:
    """The :class:`PoolGeometry` of an SGLang host pool (MHA or MLA); :class:`ConfigError`
    naming what does not fit (an unknown layout, K and V of different widths, ...)."""
    layout = getattr(pool, "layout", None)
    dtype = getattr(pool, "dtype", None)
    page_size = getattr(pool, "page_size", None)
    num_layers = getattr(pool, "layer_num", None)
    name = type(pool).__name__
    if not isinstance(dtype, torch.dtype) or not isinstance(page_size, int):
        raise ConfigError(f"host pool {name}: expected a dtype and a page_size, got {pool!r}")
    if not isinstance(num_layers, int) or num_layers <= 0 or page_size <= 0:
        raise ConfigError(
            f"host pool {name}: expected layer_num > 0 and page_size > 0, got "
            f"{num_layers!r} and {page_size!r}"
        )
    if hasattr(pool, "kv_lora_rank"):  # an MLA pool
        if layout not in MLA_LAYOUTS:
            raise ConfigError(
                f"host pool {name}: layout {layout!r} is not supported for MLA; expected one "
                f"of {list(MLA_LAYOUTS)}"
            )
        if layout == "page_first_kv_split":
            latent: tuple[int, ...] = (
                int(pool.k_buffer.shape[-1]),
                int(pool.v_buffer.shape[-1]),
            )
        else:
            latent = (int(pool.kv_cache_dim),)
        return PoolGeometry("mla", layout, dtype, page_size, num_layers, latent_dims=latent)
    head_num, head_dim = getattr(pool, "head_num", None), getattr(pool, "head_dim", None)
    if not isinstance(head_num, int) or not isinstance(head_dim, int):
        raise ConfigError(
            f"host pool {name}: expected an MHA pool (head_num, head_dim) or an MLA pool "
            "(kv_lora_rank), got neither"
        )
    v_head_dim = getattr(pool, "v_head_dim", head_dim)
    if v_head_dim != head_dim:
        raise ConfigError(
            f"host pool {name}: canonical pages need K and V of one width; got head_dim "
            f"{head_dim} and v_head_dim {v_head_dim}"
        )
    if layout not in MHA_LAYOUTS:
        raise ConfigError(
            f"host pool {name}: layout {layout!r} is not supported; expected one of "
            f"{list(MHA_LAYOUTS)}"
        )
    return PoolGeometry("mha", layout, dtype, page_size, num_layers, head_num, head_dim)


def canonical_views(geometry: PoolGeometry, buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``buffers`` (the layout's buffers, holding P pages) with shape
    ``(P, *page_shape)`` in canonical order; MLA kv_split gives two views whose last axes
    are concatenated. :class:`ConfigError` when a buffer does not have the layout's shape."""
    g = geometry
    if g.kind == "mha":
        (kv,) = buffers
        t, layers, heads, dim = g.page_size, g.num_layers, g.num_heads, g.head_dim
        if g.layout == "layer_first":  # (2, L, P*T, H, D)
            pages = _pages(kv, 2, t, (2, layers, -1, heads, dim), "(2, L, P*T, H, D)", g)
            v = kv.view(2, layers, pages, t, heads, dim).permute(2, 4, 1, 3, 0, 5)
        elif g.layout == "page_first":  # (2, P*T, L, H, D)
            pages = _pages(kv, 1, t, (2, -1, layers, heads, dim), "(2, P*T, L, H, D)", g)
            v = kv.view(2, pages, t, layers, heads, dim).permute(1, 4, 3, 2, 0, 5)
        elif g.layout == "page_first_direct":  # (2, P, L, T, H, D)
            _pages(kv, 1, 1, (2, -1, layers, t, heads, dim), "(2, P, L, T, H, D)", g)
            v = kv.permute(1, 4, 2, 3, 0, 5)
        else:  # page_head: (2, P, H, T, L, D)
            _pages(kv, 1, 1, (2, -1, heads, t, layers, dim), "(2, P, H, T, L, D)", g)
            v = kv.permute(1, 2, 4, 3, 0, 5)
        return [v]
    t, layers = g.page_size, g.num_layers
    if g.layout == "page_first_kv_split":  # (P, L, T, 1, Ck) and (P, L, T, 1, Cr)
        views = []
        for buffer, width in zip(buffers, g.latent_dims, strict=True):
            _pages(buffer, 0, 1, (-1, layers, t, 1, width), "(P, L, T, 1, C)", g)
            views.append(buffer.squeeze(3))
        return views
    (kv,) = buffers
    (c,) = g.latent_dims
    if g.layout == "layer_first":  # (L, P*T, 1, C)
        pages = _pages(kv, 1, t, (layers, -1, 1, c), "(L, P*T, 1, C)", g)
        return [kv.view(layers, pages, t, c).permute(1, 0, 2, 3)]
    if g.layout == "page_first":  # (P*T, L, 1, C)
        pages = _pages(kv, 0, t, (-1, layers, 1, c), "(P*T, L, 1, C)", g)
        return [kv.view(pages, t, layers, c).permute(0, 2, 1, 3)]
    _pages(kv, 0, 1, (-1, layers, t, 1, c), "(P, L, T, 1, C)", g)  # page_first_direct
    return [kv.squeeze(3)]


def _pages(  # noqa: PLR0913 - the buffer, where its pages lie, and what to say if they do not
    buffer: torch.Tensor,
    axis: int,
    per_page: int,
    expected: tuple[int, ...],
    text: str,
    geometry: PoolGeometry,
) -> int:
    """Pages held along ``axis`` (``per_page`` entries each), after checking the shape."""
    shape = tuple(buffer.shape)
    fits = len(shape) == len(expected) and all(
        e in (-1, s) for e, s in zip(expected, shape, strict=True)
    )
    if fits and not buffer.is_contiguous():
        raise ConfigError(
            f"{geometry.layout} {geometry.kind} buffer of shape {shape}: expected a "
            "contiguous tensor (the pool's own buffer), got a strided view"
        )
    if not fits or buffer.dtype != geometry.dtype or shape[axis] % per_page:
        raise ConfigError(
            f"{geometry.layout} {geometry.kind} buffer: expected shape {text} = "
            f"{tuple('*' if e == -1 else e for e in expected)} of {geometry.dtype}, got "
            f"{shape} of {buffer.dtype}"
        )
    return shape[axis] // per_page


def pool_buffers(pool: Any, geometry: PoolGeometry) -> list[torch.Tensor]:
    """The buffers of a host pool that :func:`canonical_views` reads."""
    if geometry.layout == "page_first_kv_split":
        return [pool.k_buffer, pool.v_buffer]
    return [pool.kv_buffer]


def flat_page_buffers(geometry: PoolGeometry, flat: torch.Tensor) -> list[torch.Tensor]:
    """One flat page (``get_data_page(flat=True)``) as a one-page buffer of its layout."""
    if geometry.layout not in FLAT_PAGE_LAYOUTS:
        raise ConfigError(f"layout {geometry.layout!r} has no flat page in SGLang")
    expected = geometry.share_nbytes // geometry.dtype.itemsize
    if flat.dtype != geometry.dtype or flat.numel() != expected or not flat.is_contiguous():
        raise ConfigError(
            f"flat page: expected {expected} contiguous elements of {geometry.dtype}, got "
            f"{flat.numel()} of {flat.dtype}"
            f"{'' if flat.is_contiguous() else ' (not contiguous)'}"
        )
    g = geometry
    t, layers, heads, dim = g.page_size, g.num_layers, g.num_heads, g.head_dim
    if g.kind == "mla":
        (c,) = g.latent_dims
        shapes = {
            "layer_first": (layers, t, 1, c),
            "page_first": (t, layers, 1, c),
            "page_first_direct": (1, layers, t, 1, c),
        }
    else:
        shapes = {
            "layer_first": (2, layers, t, heads, dim),
            "page_first": (2, t, layers, heads, dim),
            "page_first_direct": (2, 1, layers, t, heads, dim),
            "page_head": (2, 1, heads, t, layers, dim),
        }
    return [flat.view(shapes[g.layout])]


class PoolPages:
    """Gathers and scatters a rank's shares between canonical rows and an SGLang pool."""

    def __init__(self, geometry: PoolGeometry, buffers: Sequence[torch.Tensor]) -> None:
        self.geometry = geometry
        self.views = canonical_views(geometry, buffers)
        self.num_pages = int(self.views[0].shape[0])

    def page_ids(self, host_indices: torch.Tensor, num_keys: int) -> torch.Tensor:
        """The pool pages that ``host_indices`` (``num_keys * page_size`` token slots, page
        by page, as SGLang passes them) cover; :class:`ConfigError` for anything else."""
        t = self.geometry.page_size
        flat = host_indices.reshape(-1)
        if flat.numel() != num_keys * t:
            raise ConfigError(
                f"host indices: expected {num_keys} keys x {t} token slots = {num_keys * t}, "
                f"got {flat.numel()}"
            )
        slots = flat.to(device="cpu", dtype=torch.int64).reshape(num_keys, t)
        starts = slots[:, 0]
        if num_keys and (
            bool((starts % t != 0).any())
            or not torch.equal(slots, starts[:, None] + torch.arange(t))
        ):
            raise ConfigError(
                "host indices: expected whole pages (page_size consecutive slots from a "
                "page-aligned start)"
            )
        ids = starts // t
        if num_keys and (int(ids.min()) < 0 or int(ids.max()) >= self.num_pages):
            raise ConfigError(
                f"host indices: pages {int(ids.min())}..{int(ids.max())} outside the pool's "
                f"{self.num_pages} pages"
            )
        return ids

    def gather(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The shares of pages ``ids`` as contiguous uint8 rows ``(len(ids), share_nbytes)``:
        into ``out`` (such rows, on the CPU) when given, else into new ones."""
        g = self.geometry
        count = len(ids)
        if out is None:
            out = torch.empty((count, g.share_nbytes), dtype=torch.uint8)
        if tuple(out.shape) != (count, g.share_nbytes) or not out.is_contiguous():
            raise ConfigError(
                f"gather: expected contiguous rows ({count}, {g.share_nbytes}), got "
                f"{tuple(out.shape)}"
            )
        pages = out.view(g.dtype).reshape(count, *g.page_shape)
        # One strided copy per page into the rows: index_select on the permuted views made a
        # permuted result that .contiguous() then copied again (2.5x slower, measured).
        for view, part in self._parts(pages):
            for row, page in enumerate(ids.tolist()):
                part[row].copy_(view[page])
        return out

    def scatter(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Write share rows (uint8, ``(len(ids), share_nbytes)``) into pages ``ids``."""
        g = self.geometry
        pages = rows.reshape(len(ids), -1).view(g.dtype).reshape(len(ids), *g.page_shape)
        # Per page a strided copy: index_put_ on the permuted views was 5x slower (measured).
        for view, part in self._parts(pages):
            source = part.to(view.device)
            for row, page in enumerate(ids.tolist()):
                view[page].copy_(source[row])

    def _parts(self, pages: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each canonical view with its slice of ``pages`` (MLA kv_split: the K and the rope
        part of the last axis; otherwise the whole)."""
        if len(self.views) == 1:
            return [(self.views[0], pages)]
        parts, offset = [], 0
        for view in self.views:
            width = int(view.shape[-1])
            parts.append((view, pages[..., offset : offset + width]))
            offset += width
        return parts

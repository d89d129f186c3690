"""A block as one rank of a parallel layout would hold it in its KV cache.

The mapping comes from :mod:`kvstore.layout.parallel` (the only TP/PP/DCP/PCP-aware code) and
the bytes move with :func:`kvstore.layout.page.scatter_blocks`, exactly as a server loading the
block would: this view shows what the load would put into the rank's pages.

Geometry: the layout needs each group layer's global model layer id (for the PP split). It is
read from the layer names (the first integer, as in ``model.layers.12.self_attn.attn``) when
every name of the identity has a distinct one; otherwise layers are numbered in the order the
identity lists them over all groups (``layer_ids_source`` says which). ``num_hidden_layers`` is
the largest id + 1.

Slot provenance: which canonical token each local slot holds is found by scattering a marker
block (each canonical token row tagged with its chunk and token) through the same mapping, so
it reflects what the layout code does, not a re-derivation of it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.errors import InspectError
from kvstore.identity import Identity
from kvstore.inspect.decode import raw_numpy_dtype
from kvstore.inspect.render import spans
from kvstore.keys import writer_election_key
from kvstore.layout.parallel import (
    GroupGeometry,
    LayoutError,
    LocalForm,
    ParallelLayout,
    RankMapping,
    map_rank,
)
from kvstore.store.view import GroupView

_FIRST_INT = re.compile(r"\d+")


@dataclass(frozen=True)
class RankView:
    """What one rank holds of one block."""

    layout: ParallelLayout
    global_rank: int
    mapping: RankMapping
    layer_ids_source: str  # "names" or "order" (see the module docstring)
    writer: bool  # whether this rank is the elected writer of this block
    slots: np.ndarray | None  # (local layers, local heads, bs) canonical token per slot, if known
    raw: np.ndarray  # stored elements: (local layers, local heads, bs, 2, D) or MLA (l, bs, C)

    @property
    def layers(self) -> tuple[int, ...]:
        """Group layer positions held, in local order."""
        return self.mapping.local_layers

    @property
    def heads(self) -> tuple[int, ...]:
        return self.mapping.heads

    def describe(self) -> dict[str, object]:
        m = self.mapping
        coord = m.rank
        return {
            "layout": str(self.layout),
            "rank": self.global_rank,
            "coord": {
                "tp_rank": coord.tp_rank,
                "pp_rank": coord.pp_rank,
                "pcp_rank": coord.pcp_rank,
            },
            "form": {"family": m.form.family, "packing": m.form.packing},
            "layers": list(m.local_layers),
            "model_layer_ids": [m.geometry.layer_ids[i] for i in m.local_layers],
            "layer_ids_source": self.layer_ids_source,
            "heads": list(m.heads),
            "local_block_size": m.local_block_size,
            "page_bytes": m.page_bytes,
            "share_bytes": m.share_bytes,
            "full_chunks": list(m.full_chunks),
            "partial_chunks": list(m.partial_chunks),
            "num_writers": m.num_writers,
            "writer_index": m.writer_index,
            "writes_this_block": self.writer,
        }


def group_geometry(identity: Identity, group_index: int) -> tuple[GroupGeometry, str]:
    """The :class:`GroupGeometry` of a group, and where its layer ids came from."""
    all_names = [n for g in identity.groups for n in g.layer_names]
    parsed = [_FIRST_INT.search(n) for n in all_names]
    if all(parsed) and len({int(m.group()) for m in parsed if m}) == len(all_names):
        ids = {n: int(m.group()) for n, m in zip(all_names, parsed, strict=True) if m}
        source = "names"
    else:
        ids = {n: i for i, n in enumerate(all_names)}
        source = "order"
    spec = identity.groups[group_index]
    geometry = GroupGeometry(
        kind=spec.kind,
        layer_ids=tuple(ids[n] for n in spec.layer_names),
        num_hidden_layers=max(ids.values()) + 1,
        tokens_per_block=identity.tokens_per_block,
        elem_size=identity.dtype.itemsize,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        latent_dim=spec.latent_dim,
    )
    return geometry, source


def rank_view(  # noqa: PLR0913 - the block and its identity plus the rank query of `kvstore-inspect rank` (layout text, rank, family)
    group: GroupView,
    identity: Identity,
    block: np.ndarray,
    block_hash: bytes | None,
    layout_text: str,
    rank: int,
    family: str = "hnd",
) -> RankView:
    """What global rank ``rank`` of layout ``layout_text`` holds of canonical ``block`` (uint8)."""
    try:
        layout = ParallelLayout.parse(layout_text)
        coord = layout.coord_of(rank)
        geometry, source = group_geometry(identity, group.index)
        form = LocalForm(family=family)  # type: ignore[arg-type]
        mapping = map_rank(geometry, layout, form, coord)
    except LayoutError as exc:
        raise InspectError(str(exc)) from None
    pages = _scatter(mapping, block)
    raw = _typed_pages(group, mapping, pages)
    slots = _slot_tokens(group, mapping)
    writer = block_hash is not None and mapping.is_writer(writer_election_key(block_hash))
    return RankView(layout, rank, mapping, source, writer, slots, raw)


def _scatter(mapping: RankMapping, block: np.ndarray) -> list[np.ndarray]:
    """The rank's local page of each local layer (uint8, ``page_bytes``) after loading ``block``."""
    import torch  # noqa: PLC0415 - lazy: only the rank view moves pages (with torch)

    from kvstore.layout.page import scatter_blocks  # noqa: PLC0415

    src = torch.from_numpy(np.ascontiguousarray(block, dtype=np.uint8)).reshape(1, -1)
    pages = [torch.zeros((1, mapping.page_bytes), dtype=torch.uint8) for _ in mapping.local_layers]
    scatter_blocks(mapping, src, pages, [0])
    return [p[0].numpy() for p in pages]


def _typed_pages(group: GroupView, mapping: RankMapping, pages: list[np.ndarray]) -> np.ndarray:
    """Local pages as stored elements in logical order (local layer, head, slot, ...)."""
    dtype = raw_numpy_dtype(group.dtype.name)
    h, bs = len(mapping.heads), mapping.local_block_size
    out: list[np.ndarray] = []
    for page in pages:
        elems = page.view(dtype)
        if group.is_mla:
            out.append(elems.reshape(bs, group.spec.latent_dim))
            continue
        d = group.spec.head_dim
        if mapping.form.family == "hnd":
            out.append(elems.reshape(h, bs, 2, d))
        else:
            out.append(elems.reshape(bs, h, 2, d).transpose(1, 0, 2, 3))
    shape = (0, bs, group.spec.latent_dim) if group.is_mla else (0, h, bs, 2, group.spec.head_dim)
    return np.stack(out) if out else np.zeros(shape, dtype=dtype)


def _slot_tokens(group: GroupView, mapping: RankMapping) -> np.ndarray | None:
    """Canonical token held by each local (layer, head, slot), from a marker block."""
    layout = group.layout
    row = mapping.geometry.token_row_bytes
    if row % 4:
        return None
    marker = np.zeros((layout.num_chunks, layout.tokens, row // 4), dtype="<i4")
    marker[:, :, 0] = np.arange(layout.num_chunks * layout.tokens).reshape(layout.num_chunks, -1)
    pages = _scatter(mapping, marker.view(np.uint8).reshape(-1))
    h, bs = len(mapping.heads), mapping.local_block_size
    out = np.empty((len(pages), h, bs), dtype=np.int64)
    for li, page in enumerate(pages):
        rows = page.view("<i4").reshape(-1, row // 4)[:, 0]
        tags = rows.reshape(h, bs) if mapping.form.family == "hnd" else rows.reshape(bs, h).T
        out[li] = tags % layout.tokens
    return out


def format_slots(slots: Sequence[int] | np.ndarray) -> str:
    """Slot -> canonical token, compactly: ``0..15``, ``1,3,..,15 (every 2)``, ``4-7,12-15``."""
    tokens = [int(t) for t in slots]
    if tokens == list(range(tokens[0], tokens[0] + len(tokens))):
        return f"{tokens[0]}..{tokens[-1]}"
    if len(tokens) > 2:
        step = tokens[1] - tokens[0]
        if step > 0 and tokens == list(range(tokens[0], tokens[0] + step * len(tokens), step)):
            return f"{tokens[0]},{tokens[1]},..,{tokens[-1]} (every {step})"
    return spans(tokens)

"""The parallel-layout roles of a scale-out node (see :mod:`tests.scaleout.node`).

``tp_write`` writes blocks with every rank of a layout, one process per rank (the multi-writer
protocol), then commits them as the scheduler would; ``tp_read`` reads them back with every rank
of other layouts and counts pages and wrong pages. Kept apart so that only these roles import
torch.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import time
from pathlib import Path
from typing import Any

import torch

from kvstore.identity import Identity
from kvstore.layout import LocalForm, ParallelLayout, RankCoord, map_rank
from kvstore.rank_io import RankIO, group_geometry
from kvstore.store.types import WriteStatus
from tests.layout.layout_reference import (
    _expected_pages,
    build_cache,
    cache_pages,
    full_kv,
    page_bytes,
    rank_view,
)
from tests.scaleout.node import Spec, bhash, open_store


def _tp_setup(spec: Spec) -> tuple[Any, Any, Any, list[bytes]]:
    identity = Identity.from_json(spec["identity"])
    layers = len(identity.groups[0].layer_names)
    geometry = group_geometry(identity, 0, range(layers), layers)
    kv = full_kv(geometry, spec["n"], seed=spec["seed"])
    hashes = [bhash(spec["salt"], i) for i in range(spec["n"])]
    return identity, geometry, kv, hashes


def _rank_writer(spec: Spec, coord: tuple[int, int, int], pendings: list[Any]) -> str | None:
    """One rank of the writing layout, in its own process (spawned by ``tp_write``)."""
    _identity, geometry, kv, _hashes = _tp_setup(spec)
    store, group = open_store(spec, create=False)
    try:
        layout = ParallelLayout.parse(spec["layout"])
        form = LocalForm(family=spec.get("family", "hnd"))
        rank = RankCoord(*coord)
        view = rank_view(geometry, layout, rank)
        pages = _expected_pages(kv, geometry, view, form.family)
        num_blocks = spec["n"] + 3
        gen = torch.Generator().manual_seed(sum(coord))
        block_ids = torch.randperm(num_blocks, generator=gen)[: spec["n"]]
        cache = build_cache(pages, form, num_blocks, block_ids, sum(coord))
        rio = RankIO(group, map_rank(geometry, layout, form, rank))
        errors = rio.store(cache.tensors, pendings, block_ids.tolist())
        bad = [repr(e) for e in errors if e is not None]
        return f"rank {coord}: {bad[:3]}" if bad else None
    finally:
        store.close()


def tp_write(spec: Spec) -> dict[str, Any]:
    """Write with the ranks ``spec["coords"]`` of the layout (default: all of them), then
    commit (unless ``commit`` is false). With ``pendings_file``, the pending-block descriptors
    are saved there (first node) or loaded from there (a node writing the other ranks)."""
    _identity, geometry, _kv, hashes = _tp_setup(spec)
    store, group = open_store(spec)
    started = time.perf_counter()
    saved = Path(spec["pendings_file"]) if spec.get("pendings_file") else None
    try:
        layout = ParallelLayout.parse(spec["layout"])
        if saved is not None and saved.exists():
            pendings = pickle.loads(saved.read_bytes())
        else:
            pendings = group.begin_blocks(hashes)
            if saved is not None:
                saved.write_bytes(pickle.dumps(pendings))
        every = [(c.tp_rank, c.pp_rank, c.pcp_rank) for c in layout.ranks()]
        coords = [tuple(c) for c in spec.get("coords", every)]
        with mp.get_context("spawn").Pool(len(coords)) as pool:
            errors = pool.starmap(_rank_writer, [(spec, c, pendings) for c in coords])
        if any(errors):
            raise SystemExit(f"rank writers failed: {errors}")
        visible_before_commit = sum(group.contains(hashes))
        written = 0
        if spec.get("commit", True):
            last = layout.ranks()[-1]
            rio = RankIO(group, map_rank(geometry, layout, LocalForm(), last))
            results = group.commit_blocks(
                pendings, [rio.commit_checksum_chunks] * len(pendings), rio.commit_range_writers
            )
            written = sum(r.status is WriteStatus.WRITTEN for r in results)
    finally:
        store.close()
    return {
        "ranks": len(coords),
        "blocks": len(hashes),
        "written": written,
        "visible_before_commit": visible_before_commit,
        "seconds": round(time.perf_counter() - started, 3),
    }


def tp_read(spec: Spec) -> dict[str, Any]:
    _identity, geometry, kv, hashes = _tp_setup(spec)
    store, group = open_store(spec, create=False)
    out: dict[str, Any] = {}
    try:
        for text in spec["layouts"]:
            layout = ParallelLayout.parse(text)
            for packing in ("per_layer", "packed"):
                form = LocalForm(family=spec.get("family", "hnd"), packing=packing)
                counts = {"ranks": 0, "blocks": 0, "hits": 0, "pages": 0, "wrong_pages": 0}
                for r, coord in enumerate(layout.ranks()):
                    mapping = map_rank(geometry, layout, form, coord)
                    view = rank_view(geometry, layout, coord)
                    pages = _expected_pages(kv, geometry, view, form.family)
                    expected = page_bytes(pages)
                    noise = torch.randint_like(pages.view(torch.uint8), 0, 256).view(pages.dtype)
                    num_blocks = len(hashes) + 3
                    gen = torch.Generator().manual_seed(50 + r)
                    block_ids = torch.randperm(num_blocks, generator=gen)[: len(hashes)]
                    cache = build_cache(noise, form, num_blocks, block_ids, 77 + r)
                    results = RankIO(group, mapping).load(cache.tensors, hashes, block_ids.tolist())
                    got = cache_pages(cache, mapping, block_ids)
                    counts["ranks"] += 1
                    for i, result in enumerate(results):
                        counts["blocks"] += 1
                        counts["pages"] += expected.shape[1]
                        if result.ok:
                            counts["hits"] += 1
                            for layer in range(expected.shape[1]):
                                if not torch.equal(got[i, layer], expected[i, layer]):
                                    counts["wrong_pages"] += 1
                out[f"{text}/{packing}"] = counts
    finally:
        store.close()
    return out

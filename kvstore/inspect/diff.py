"""The ``diff`` views: two blocks, or two whole stores, compared byte for byte.

Blocks are compared per inner chunk, i.e. per (head, layer): a differing chunk is reported
with how many elements differ, the first differing token and the largest absolute difference
of the decoded values. Stores are compared per namespace (present on one side only, or on
both), per group, and per block (keyed by its file: the hash coordinates): blocks only on one
side, blocks damaged on either side, and blocks whose headers (hash, parent) or chunk bytes
differ. The creation time in the header is not compared: the same block written twice
differs only there.

Stores of any size: the two sides are compared one fan-out directory at a time (a block's
directory is fixed by its hash), so memory holds one directory's listing of each side, and each
list of differences keeps its first :data:`kvstore.inspect.bounded.LISTED` entries in full and
counts the rest (``*_count``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.inspect import bounded
from kvstore.inspect.blockfile import check_block, quick_header
from kvstore.inspect.bounded import BoundedList
from kvstore.inspect.decode import Selection, raw_array, to_float
from kvstore.store.full_check import BlockCheck
from kvstore.store.paths import FANOUT, BlockFile
from kvstore.store.view import GroupView, StoreView


def compare_chunks(group: GroupView, left: np.ndarray, right: np.ndarray) -> list[dict[str, Any]]:
    """Differing (head, layer) chunks of two whole canonical blocks (uint8) of ``group``."""
    selection = Selection.all_of(group)
    a = raw_array(left, group, selection)
    b = raw_array(right, group, selection)
    out: list[dict[str, Any]] = []
    for c in range(group.layout.num_chunks):
        head, layer = divmod(c, group.num_layers)
        ca = a[layer] if group.is_mla else a[head, layer]
        cb = b[layer] if group.is_mla else b[head, layer]
        if ca.tobytes() == cb.tobytes():
            continue
        bits = f"u{ca.dtype.itemsize}"
        elements = ca.view(bits) != cb.view(bits)  # byte-wise: -0.0 != 0.0, NaN == same NaN
        per_token = elements.reshape(elements.shape[0], -1).any(axis=1)
        fa, fb = to_float(ca, group.dtype.name), to_float(cb, group.dtype.name)
        both = np.isfinite(fa) & np.isfinite(fb)
        delta = float(np.abs(fa[both] - fb[both]).max()) if both.any() else float("nan")
        out.append(
            {
                "chunk": c,
                "head": head,
                "layer": layer,
                "elements_differing": int(np.count_nonzero(elements)),
                "first_token": int(np.flatnonzero(per_token)[0]),
                "max_abs_diff": delta,
            }
        )
    return out


def _header_diff(a: BlockCheck, b: BlockCheck) -> list[str]:
    ha, hb = a.header, b.header
    if ha is None or hb is None:
        return []
    out = []
    if ha.block_hash != hb.block_hash:
        out.append(f"block hash: {ha.block_hash.hex()} vs {hb.block_hash.hex()}")
    pa = ha.parent_hash.hex() if ha.parent_hash else None
    pb = hb.parent_hash.hex() if hb.parent_hash else None
    if pa != pb:
        out.append(f"parent hash: {pa} vs {pb}")
    return out


def diff_block_files(
    left_group: GroupView, left: BlockFile, right_group: GroupView, right: BlockFile
) -> dict[str, Any]:
    """Compare two block files of groups with the same geometry (JSON-ready)."""
    ca, da = check_block(left_group, left.path, want_data=True)
    cb, db = check_block(right_group, right.path, want_data=True)
    assert da is not None and db is not None
    return {
        "left": {"path": str(left.path), "ok": ca.ok, "problem": None if ca.ok else ca.summary()},
        "right": {"path": str(right.path), "ok": cb.ok, "problem": None if cb.ok else cb.summary()},
        "header_differences": _header_diff(ca, cb),
        "num_chunks": left_group.layout.num_chunks,
        "chunks": compare_chunks(left_group, da, db),
    }


def same_geometry(a: GroupView, b: GroupView) -> bool:
    return a.layout == b.layout and a.dtype == b.dtype and a.spec.kind == b.spec.kind


def block_differs(doc: dict[str, Any]) -> bool:
    return bool(
        doc["chunks"]
        or doc["header_differences"]
        or not doc["left"]["ok"]
        or not doc["right"]["ok"]
    )


def _hash_label(group: GroupView, f: BlockFile) -> str:
    header, _ = quick_header(group, f.path)
    return header.block_hash.hex() if header is not None else f.path_hex + "..."


def diff_stores(left: StoreView, right: StoreView) -> dict[str, Any]:
    """Compare every namespace, group and block of two stores (JSON-ready)."""
    names_a, names_b = set(left.namespace_names()), set(right.namespace_names())
    namespaces = []
    for name in sorted(names_a & names_b):
        na, nb = left.namespace(name), right.namespace(name)
        groups = [
            _diff_groups(ga, gb)
            for ga, gb in zip(na.groups, nb.groups, strict=True)  # same name => same identity
        ]
        namespaces.append({"name": name, "groups": groups})
    return {
        "left": str(left.root),
        "right": str(right.root),
        "only_left_namespaces": sorted(names_a - names_b),
        "only_right_namespaces": sorted(names_b - names_a),
        "namespaces": namespaces,
    }


def _diff_groups(ga: GroupView, gb: GroupView) -> dict[str, Any]:
    """One group of both stores, fan-out directory by fan-out directory (module doc)."""
    only_left: BoundedList[str] = BoundedList(bounded.LISTED)
    only_right: BoundedList[str] = BoundedList(bounded.LISTED)
    differing: BoundedList[dict[str, Any]] = BoundedList(bounded.LISTED)
    left_blocks = right_blocks = common = 0
    for hi in FANOUT:
        fa = {f.hash_lo: f for f in ga.iter_files([hi])}
        fb = {f.hash_lo: f for f in gb.iter_files([hi])}
        left_blocks += len(fa)
        right_blocks += len(fb)
        for lo in sorted(fa.keys() & fb.keys()):
            common += 1
            doc = diff_block_files(ga, fa[lo], gb, fb[lo])
            if block_differs(doc):
                doc["block"] = _hash_label(ga, fa[lo])
                differing.add(doc)
        for lo in sorted(fa.keys() - fb.keys()):
            only_left.add(_hash_label(ga, fa[lo]))
        for lo in sorted(fb.keys() - fa.keys()):
            only_right.add(_hash_label(gb, fb[lo]))
    return {
        "group": ga.index,
        "left_blocks": left_blocks,
        "right_blocks": right_blocks,
        "common": common,
        "only_left": only_left.items,
        "only_left_count": only_left.total,
        "only_right": only_right.items,
        "only_right_count": only_right.total,
        "differing": differing.items,
        "differing_count": differing.total,
    }


def store_difference_count(doc: dict[str, Any]) -> int:
    """Number of differences found by :func:`diff_stores` (0 = identical contents)."""
    count = len(doc["only_left_namespaces"]) + len(doc["only_right_namespaces"])
    for ns in doc["namespaces"]:
        for g in ns["groups"]:
            count += g["only_left_count"] + g["only_right_count"] + g["differing_count"]
    return count

"""The ``overview`` view: namespaces -> identity -> per group geometry, block counts and bytes.

Without ``check`` it only lists directories and stats files (fast on any store size): a file
whose size lies outside what its group's geometry and compression allow is counted as
``bad_size`` (a raw block has exactly ``file_nbytes``; a compressed one lies within
:attr:`~kvstore.store.check.ShardSpec.size_bounds`, and may be larger than the raw file). With
``check`` every block is read and verified like a server would (header and every inner chunk),
and damaged ones are counted as ``damaged`` and listed.

Findings (what makes the CLI exit 1): bad-size or damaged blocks, and namespace / array
documents that are not what format v1 prescribes.
"""

from __future__ import annotations

from typing import Any

from kvstore.inspect.blockfile import check_block
from kvstore.store.view import GroupView, NamespaceView, StoreView


def group_summary(group: GroupView, check: bool) -> dict[str, Any]:
    files = group.files()
    layout = group.layout
    spec = group.spec
    low, high = group.shard.size_bounds
    doc: dict[str, Any] = {
        "group": group.index,
        "kind": spec.kind,
        "layers": spec.num_layers,
        "kv_heads": group.num_heads,
        "head_dim": spec.head_dim,
        "latent_dim": spec.latent_dim,
        "sliding_window": spec.sliding_window,
        "block_nbytes": layout.block_nbytes,
        "file_nbytes": layout.file_nbytes,
        "blocks": len(files),
        "bytes_on_disk": sum(f.nbytes for f in files),
        "kv_bytes": len(files) * layout.block_nbytes,
        "bad_size": sum(not low <= f.nbytes <= high for f in files),
        "temp_files": len(group.temp_files()),
        "oldest_mtime_ns": min((f.mtime_ns for f in files), default=None),
        "newest_mtime_ns": max((f.mtime_ns for f in files), default=None),
        "problems": [*group.problems, *group.listing_problems.values()],
        "damaged": None,
    }
    if check:
        damaged = []
        for f in files:
            result, _ = check_block(group, f.path)
            if not result.ok:
                damaged.append({"path": str(f.path), "problem": result.summary()})
        doc["damaged"] = damaged
    return doc


def namespace_summary(ns: NamespaceView, check: bool) -> dict[str, Any]:
    return {
        "name": ns.name,
        "identity": ns.identity.to_json(),
        "engine": ns.identity.engine,
        "groups": [group_summary(g, check) for g in ns.groups],
        "quarantined": len(ns.quarantined()),
        "problems": list(ns.problems),
    }


def store_summary(store: StoreView, check: bool = False) -> dict[str, Any]:
    """The ``overview`` document of a whole store (JSON-ready). A namespace that cannot be
    read is listed under ``problems`` and the others are shown."""
    names = store.namespace_names()
    namespaces = [namespace_summary(store.namespace(n), check) for n in names]
    # Namespace-like directories that cannot be read (a renamed one is shown, with its problem).
    unreadable = [p.detail for p in store.problems if p.path.name not in names]
    groups = [g for ns in namespaces for g in ns["groups"]]
    return {
        "root": str(store.root),
        "checked": check,
        "problems": unreadable,
        "namespaces": namespaces,
        "totals": {
            "namespaces": len(namespaces),
            "blocks": sum(g["blocks"] for g in groups),
            "bytes_on_disk": sum(g["bytes_on_disk"] for g in groups),
            "bad_size": sum(g["bad_size"] for g in groups),
            "damaged": sum(len(g["damaged"]) for g in groups) if check else None,
        },
    }


def findings(summary: dict[str, Any]) -> int:
    """How many things in an overview deserve attention (0 = clean)."""
    count = len(summary.get("problems", []))
    for ns in summary["namespaces"]:
        count += len(ns["problems"])
        for g in ns["groups"]:
            count += g["bad_size"] + len(g["problems"]) + len(g["damaged"] or [])
    return count

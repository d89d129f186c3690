"""The ``overview`` view: namespaces -> identity -> per group geometry, block counts and bytes.

Without ``check`` it only lists directories and stats files (fast on any store size): a file
whose size lies outside what its group's geometry and compression allow is counted as
``bad_size`` (a raw block has exactly ``file_nbytes``; a compressed one lies within
:attr:`~kvstore.store.check.ShardSpec.size_bounds`, and may be larger than the raw file). With
``check`` every block is read and verified like a server would (header and every inner chunk),
and damaged ones are counted (``damaged_count``) and listed (``damaged``, the first
:data:`~kvstore.inspect.bounded.LISTED`). Either way the blocks are streamed, never held: the
memory is the same for 10^4 blocks as for 10^8.

Findings (what makes the CLI exit 1): bad-size or damaged blocks, and namespace / array
documents that are not what format v1 prescribes.
"""

from __future__ import annotations

from typing import Any

from kvstore.inspect import bounded
from kvstore.inspect.blockfile import check_block
from kvstore.inspect.bounded import BoundedList, BoundedProblems
from kvstore.store.paths import BlockFile
from kvstore.store.view import GroupView, NamespaceView, StoreView


def group_summary(group: GroupView, check: bool) -> dict[str, Any]:
    """One group's line of the overview, streamed: its block files are listed one fan-out
    directory at a time and only tallied (with ``check``, each is verified as it is listed),
    so the memory does not depend on the number of blocks. Damaged blocks and listing
    problems are kept in full up to :data:`~kvstore.inspect.bounded.LISTED` each and counted
    in all (``damaged_count``, ``problems_count``)."""
    layout = group.layout
    spec = group.spec
    low, high = group.shard.size_bounds
    # The limit is read at each call (not bound at import) so tests can make it small.
    problems = BoundedProblems(bounded.LISTED)
    damaged: BoundedList[dict[str, str]] = BoundedList(bounded.LISTED)
    blocks = on_disk = bad_size = temps = 0
    oldest: int | None = None
    newest: int | None = None
    # One listing of each fan-out directory for blocks and temporaries alike (on a network
    # file system every listing is round trips per entry).
    for f in group.paths.list_blocks_and_temps(root=group.store_root, problems=problems):
        if not isinstance(f, BlockFile):
            temps += 1
            continue
        blocks += 1
        on_disk += f.nbytes
        bad_size += not low <= f.nbytes <= high
        oldest = f.mtime_ns if oldest is None else min(oldest, f.mtime_ns)
        newest = f.mtime_ns if newest is None else max(newest, f.mtime_ns)
        if check:
            result, _ = check_block(group, f.path)
            if not result.ok:
                damaged.add({"path": str(f.path), "problem": result.summary()})
    return {
        "group": group.index,
        "kind": spec.kind,
        "layers": spec.num_layers,
        "kv_heads": group.num_heads,
        "head_dim": spec.head_dim,
        "latent_dim": spec.latent_dim,
        "sliding_window": spec.sliding_window,
        "block_nbytes": layout.block_nbytes,
        "file_nbytes": layout.file_nbytes,
        "blocks": blocks,
        "bytes_on_disk": on_disk,
        "kv_bytes": blocks * layout.block_nbytes,
        "bad_size": bad_size,
        "temp_files": temps,
        "oldest_mtime_ns": oldest,
        "newest_mtime_ns": newest,
        "problems": [*group.problems, *problems.values()],
        "problems_count": len(group.problems) + problems.total,
        "damaged": damaged.items if check else None,
        "damaged_count": damaged.total if check else None,
        "listed_max": bounded.LISTED,
    }


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
            "damaged": sum(g["damaged_count"] for g in groups) if check else None,
        },
    }


def findings(summary: dict[str, Any]) -> int:
    """How many things in an overview deserve attention (0 = clean)."""
    count = len(summary.get("problems", []))
    for ns in summary["namespaces"]:
        count += len(ns["problems"])
        for g in ns["groups"]:
            count += g["bad_size"] + g["problems_count"] + (g["damaged_count"] or 0)
    return count

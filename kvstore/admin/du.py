"""``kvstore du``: where a store's bytes are.

Per namespace: published block bytes per group, temporary files (writes in flight or left by a
crash), quarantined files, trash (evicted blocks waiting out the grace period) and foreign
files; in the root: namespaces being removed, temporary and foreign entries. ``bytes`` are
``st_size`` sums of the files, ``allocated_bytes`` what they hold on the disk (``st_blocks``,
see :mod:`kvstore.admin.scan`); ``gc_usage`` is what ``kvstore gc --max-bytes`` compares with
its budget: the allocated bytes of everything but trash and removed namespaces (already on
their way out), including what can be listed of namespaces whose ``zarr.json`` cannot be read.

What cannot be read (a directory that cannot be listed, a namespace whose ``zarr.json`` is
unreadable) is reported on stderr and under ``problems`` and the rest is counted; the figures
are then lower bounds (``complete: false``) and the exit code is 1.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvstore.admin.progress import Progress
from kvstore.admin.report import print_json, print_lines, table, warn
from kvstore.admin.scan import Entry, HeldFile, StoreScan, fanout_dirs, open_root, scan_store
from kvstore.admin.sizes import format_size


def _count(items: Iterable[Entry | HeldFile]) -> dict[str, int]:
    files = nbytes = 0
    for item in items:
        files += item.files if isinstance(item, HeldFile) else 1
        nbytes += item.size
    return {"files": files, "bytes": nbytes}


def _held(items: Iterable[Entry | HeldFile]) -> int:
    return sum(item.allocated for item in items)


def usage(scan: StoreScan) -> dict[str, Any]:
    """The JSON document of ``kvstore du`` for a finished scan."""
    namespaces = []
    for ns in scan.store.namespaces:

        def mine(items: Iterable[Entry | HeldFile], name: str = ns.name) -> list[Any]:
            return [i for i in items if i.namespace == name]

        groups = [
            {"group": g.index, "blocks": tally.blocks, "bytes": tally.bytes}
            for g in ns.groups
            for tally in [scan.tally(ns.name, g.index)]
        ]
        temp, quarantine, trash = (
            _count(mine(scan.temps)),
            _count(mine(scan.quarantine)),
            _count(mine(scan.trash)),
        )
        foreign = _count(mine(scan.foreign))
        block_bytes = sum(g["bytes"] for g in groups)
        held = scan.tally(ns.name).allocated + sum(
            _held(mine(items)) for items in (scan.temps, scan.quarantine, scan.trash, scan.foreign)
        )
        namespaces.append(
            {
                "name": ns.name,
                "blocks": sum(g["blocks"] for g in groups),
                "block_bytes": block_bytes,
                "groups": groups,
                "temp": temp,
                "quarantine": quarantine,
                "trash": trash,
                "foreign": foreign,
                "bytes": block_bytes
                + temp["bytes"]
                + quarantine["bytes"]
                + trash["bytes"]
                + foreign["bytes"],
                "allocated_bytes": held,
            }
        )
    root_temp = _count(t for t in scan.temps if t.namespace is None)
    root_foreign = _count(f for f in scan.foreign if f.namespace is None)
    removed = _count(scan.removed)
    counted = gc_usage(scan)
    everything = scan.tally()
    total = {
        "blocks": everything.blocks,
        "block_bytes": everything.bytes,
        "temp": _count(scan.temps),
        "quarantine": _count(scan.quarantine),
        "trash": _count(scan.trash),
        "foreign": _count(scan.foreign),
        "removed_namespaces": removed,
        "gc_usage": counted,
        "bytes": everything.bytes
        + sum(_count(items)["bytes"] for items in (scan.temps, scan.quarantine, scan.foreign))
        + sum(u.size for u in scan.unusable)
        + _count(scan.trash)["bytes"]
        + removed["bytes"],
        "allocated_bytes": counted + _held(scan.trash) + _held(scan.removed),
    }
    return {
        "root": str(scan.store.root),
        "namespaces": namespaces,
        "root_entries": {"temp": root_temp, "foreign": root_foreign, "removed_namespaces": removed},
        "total": total,
        "complete": scan.complete,
        "problems": problems(scan),
    }


def problems(scan: StoreScan, *, namespaces: bool = True) -> list[dict[str, str]]:
    """What the scan could not read: unreadable namespaces (unless ``namespaces`` is False: a
    scan of chosen namespaces), then directories that could not be listed."""
    bad = list(scan.store.problems) if namespaces else []
    return [{"path": str(p.path), "detail": p.detail} for p in [*bad, *scan.unreadable]]


def gc_usage(scan: StoreScan) -> int:
    """Bytes ``kvstore gc`` counts against ``--max-bytes``: what everything but trash and
    removed namespaces holds on the disk (allocated, not apparent, bytes)."""
    return (
        scan.tally().allocated
        + _held(scan.temps)
        + _held(scan.quarantine)
        + _held(scan.foreign)
        + _held(scan.unusable)
    )


def render(doc: dict[str, Any]) -> list[str]:
    lines = [f"store {doc['root']}"]
    rows: list[list[object]] = []
    for ns in doc["namespaces"]:
        rows.append(
            [
                ns["name"],
                ns["blocks"],
                format_size(ns["block_bytes"]),
                format_size(ns["temp"]["bytes"]),
                format_size(ns["quarantine"]["bytes"]),
                format_size(ns["trash"]["bytes"]),
                format_size(ns["foreign"]["bytes"]),
                format_size(ns["bytes"]),
            ]
        )
        if len(ns["groups"]) > 1:
            rows.extend(
                [f"  g{g['group']}", g["blocks"], format_size(g["bytes"]), "", "", "", "", ""]
                for g in ns["groups"]
            )
    root = doc["root_entries"]
    if root["temp"]["files"] or root["foreign"]["files"] or root["removed_namespaces"]["files"]:
        rows.append(
            [
                "(root)",
                "",
                "",
                format_size(root["temp"]["bytes"]),
                "",
                format_size(root["removed_namespaces"]["bytes"]) + " removed",
                format_size(root["foreign"]["bytes"]),
                format_size(
                    root["temp"]["bytes"]
                    + root["foreign"]["bytes"]
                    + root["removed_namespaces"]["bytes"]
                ),
            ]
        )
    t = doc["total"]
    rows.append(
        [
            "total",
            t["blocks"],
            format_size(t["block_bytes"]),
            format_size(t["temp"]["bytes"]),
            format_size(t["quarantine"]["bytes"]),
            format_size(t["trash"]["bytes"] + t["removed_namespaces"]["bytes"]),
            format_size(t["foreign"]["bytes"]),
            format_size(t["bytes"]),
        ]
    )
    headers = [
        "namespace",
        "blocks",
        "blocks size",
        "temp",
        "quarantine",
        "trash",
        "foreign",
        "total",
    ]
    lines += table(headers, rows)
    lines.append(
        f"  on the disk {format_size(t['allocated_bytes'])}; counted by gc --max-bytes: "
        f"{format_size(t['gc_usage'])} ({t['gc_usage']} bytes allocated)"
    )
    return lines


def run(root: Path, *, as_json: bool) -> int:
    """``kvstore du``: exit 0, or 1 when something could not be read (figures incomplete)."""
    store = open_root(root)
    with Progress(fanout_dirs(store.namespaces), "scanning") as bar:
        scan = scan_store(store, on_dir=bar.update, keep_blocks=False)
    doc = usage(scan)
    for problem in doc["problems"]:
        warn(f"cannot read {problem['path']}: {problem['detail']}")
    if as_json:
        print_json(doc)
    else:
        print_lines(render(doc))
    return 0 if not doc["problems"] else 1

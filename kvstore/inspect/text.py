"""Human-readable renderings of the views' JSON documents (one function per view).

Each function takes the same document ``--json`` prints, so the two outputs cannot drift.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from kvstore.inspect.render import num, short, size, table
from kvstore.inspect.stats import StatRow

DAMAGED_SHOWN = 10  # damaged blocks named per group in text (--json lists more)


def _when(ns: int | None) -> str:
    if ns is None:
        return "-"
    return dt.datetime.fromtimestamp(ns / 1e9, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def overview_text(doc: dict[str, Any]) -> list[str]:
    totals = doc["totals"]
    lines = [
        f"store {doc['root']}: {totals['namespaces']} namespace(s), {totals['blocks']} blocks, "
        f"{size(totals['bytes_on_disk'])} on disk"
    ]
    lines += [f"  CANNOT READ: {p}" for p in doc.get("problems", [])]
    for ns in doc["namespaces"]:
        ident = ns["identity"]
        rev = f"@{ident['revision']}" if ident["revision"] else ""
        lines.append("")
        engine = f" (written by {ns['engine']})" if ns.get("engine") else ""
        lines.append(f"namespace {ns['name']}{engine}")
        lines.append(
            f"  model {ident['model']}{rev}, kv dtype {ident['kv_dtype']}, "
            f"{ident['tokens_per_block']} tokens/block, hash {ident['hash_algo']}"
            + (f" seed {ident['hash_seed']!r}" if ident["hash_seed"] else "")
            + f", format v{ident['format_version']}"
        )
        rows = []
        for g in ns["groups"]:
            geometry = (
                f"{g['layers']}L x latent {g['latent_dim']}"
                if g["kind"] == "mla"
                else f"{g['layers']}L x {g['kv_heads']}H x {g['head_dim']}"
            )
            if g["sliding_window"]:
                geometry += f" (window {g['sliding_window']})"
            rows.append(
                [
                    f"g{g['group']}",
                    g["kind"],
                    geometry,
                    size(g["block_nbytes"]),
                    g["blocks"],
                    size(g["bytes_on_disk"]),
                    g["bad_size"],
                    "-" if g["damaged_count"] is None else g["damaged_count"],
                    g["temp_files"],
                    _when(g["newest_mtime_ns"]),
                ]
            )
        lines += table(
            [
                "group",
                "kind",
                "geometry",
                "block",
                "blocks",
                "on disk",
                "bad size",
                "damaged",
                "tmp",
                "newest",
            ],
            rows,
            align="lllrrrrrrl",
        )
        if ns["quarantined"]:
            lines.append(f"  quarantined by servers: {ns['quarantined']} file(s)")
        lines += [f"  PROBLEM: {problem}" for problem in ns["problems"]]
        for g in ns["groups"]:
            lines += [f"  PROBLEM: {problem}" for problem in g["problems"]]
            if g["problems_count"] > len(g["problems"]):
                lines.append(
                    f"  ... g{g['group']}: {g['problems_count'] - len(g['problems'])} more "
                    f"problem(s) counted, not listed (the first {g['listed_max']} are)"
                )
        for g in ns["groups"]:
            shown = (g["damaged"] or [])[:DAMAGED_SHOWN]
            for d in shown:
                lines.append(f"  DAMAGED g{g['group']}: {d['path']}: {d['problem']}")
            if (g["damaged_count"] or 0) > len(shown):
                lines.append(
                    f"  ... g{g['group']}: {g['damaged_count'] - len(shown)} more damaged "
                    f"block(s) (--json lists the first {len(g['damaged'])})"
                )
    if not doc["checked"]:
        lines.append("")
        lines.append("(headers and checksums not read; --check verifies every block)")
    return lines


def tree_text(doc: dict[str, Any]) -> list[str]:
    lines = _sampled_tree_text(doc) if doc.get("sampled") else _exact_tree_text(doc)
    s = doc["summary"]
    damaged = s["damaged"][:DAMAGED_SHOWN]
    for d in damaged:
        lines.append(f"  DAMAGED (left out): {d['path']}: {d['problem']}")
    if s["damaged_count"] > len(damaged):
        lines.append(
            f"  ... {s['damaged_count'] - len(damaged)} more damaged header(s) "
            f"(--json lists the first {len(s['damaged'])})"
        )
    problems = doc.get("problems", [])
    lines += [f"  PROBLEM: {p}" for p in problems[:DAMAGED_SHOWN]]
    if doc.get("problems_count", 0) > len(problems[:DAMAGED_SHOWN]):
        lines.append(
            f"  ... {doc['problems_count'] - len(problems[:DAMAGED_SHOWN])} more listing "
            "problem(s) (--json lists the first ones)"
        )
    if doc.get("png"):
        lines.append(f"  picture: {doc['png']}")
    return lines


def _sampled_tree_text(doc: dict[str, Any]) -> list[str]:
    """The tree view of a group above --max-blocks: exact totals, then what the sample shows,
    every estimate marked with ``~``."""
    smp, est, s = doc["sampled"], doc["estimates"], doc["summary"]
    d = est["depth"]
    lines = [
        f"prefix forest of {doc['namespace']}/g{doc['group']}: SAMPLED: {smp['blocks']} of "
        f"{doc['blocks']} blocks (more than --max-blocks {smp['max_blocks']}); numbers marked "
        "~ are estimates from the sample",
        f"  blocks                 {doc['blocks']} ({size(doc['bytes_on_disk'])} on disk; exact)",
        f"  sampled forest         {smp['nodes']} nodes: {smp['usable']} sampled blocks and "
        f"{smp['ancestors']} ancestors ({smp['headers_read']} headers read)",
        f"  ~ trees                {est['trees']} ({est['chain_starts']} chain starts, "
        f"{est['orphan_roots']} orphans whose parent was evicted)",
        f"  ~ block depth          min {d['min']}, mean {d['mean']:.2f}, max {d['max']}"
        " (of the sampled blocks)",
        "  depth histogram        "
        + ", ".join(f"{k}: {v}" for k, v in d["histogram"].items())
        + " (sampled blocks)",
    ]
    if smp["cut_walks"] or est["depth_lower_bounds"]:
        lines.append(
            f"  CUT                    {smp['cut_walks']} ancestor walk(s) stopped at "
            f"{smp['max_blocks']} nodes: {est['depth_lower_bounds']} sampled depth(s) are lower "
            "bounds"
        )
    if s["unreachable"]:
        lines.append(
            f"  UNREACHABLE            {s['unreachable']} sampled nodes (parent links form a cycle)"
        )
    if est["largest_trees"]:
        lines.append("  largest trees in the sample:")
        lines += table(
            ["root", "kind", "sampled", "~blocks", "depth seen"],
            [
                [
                    short(t["root"]),
                    t["root_kind"],
                    t["sampled_blocks"],
                    t["blocks"],
                    t["depth_seen"],
                ]
                for t in est["largest_trees"]
            ],
            indent="    ",
        )
    lines.append(
        "  (chains, sharing and branch points need every block: --max-blocks "
        f"{doc['blocks']} gives them exactly, at under 1 KB of memory a block)"
    )
    return lines


def _exact_tree_text(doc: dict[str, Any]) -> list[str]:
    s = doc["summary"]
    cl = s["chain_length"]
    lines = [
        f"prefix forest of {doc['namespace']}/g{doc['group']}: {s['blocks']} blocks in "
        f"{s['trees']} tree(s) ({s['chain_starts']} chain starts, {s['orphan_roots']} orphans "
        f"whose parent was evicted)",
        f"  chains (root-to-leaf)  {s['chains']}: length min {cl['min']}, mean {cl['mean']:.2f}, "
        f"max {cl['max']}",
        f"  shared prefix blocks   {s['shared_blocks']} (on 2+ chains)",
        f"  reuse                  {s['reuse']:.2f}x: chains span {s['chain_blocks']} blocks, "
        f"{s['blocks']} stored ({s['saved_blocks']} saved by sharing)",
        f"  branch points          {s['branch_points']} (max fan-out {s['max_fanout']})",
        f"  blocks per depth       {_compact(s['blocks_per_depth'])}",
        "  chain length histogram "
        + ", ".join(f"{k}: {v}" for k, v in s["chain_length"]["histogram"].items()),
    ]
    if s["unreachable"]:
        lines.append(
            f"  UNREACHABLE            {s['unreachable']} blocks (parent links form a cycle)"
        )
    if s["largest_trees"]:
        lines.append("  largest trees:")
        lines += table(
            ["root", "kind", "blocks", "chains", "depth", "shared"],
            [
                [
                    short(t["root"]),
                    t["root_kind"],
                    t["blocks"],
                    t["chains"],
                    t["depth"],
                    t["shared_blocks"],
                ]
                for t in s["largest_trees"]
            ],
            indent="    ",
        )
    if s["top_branch_points"]:
        lines.append("  most shared branch points:")
        lines += table(
            ["block", "depth", "children", "chains", "subtree"],
            [
                [short(b["block"]), b["depth"], b["children"], b["chains"], b["subtree_blocks"]]
                for b in s["top_branch_points"]
            ],
            indent="    ",
        )
    return lines


def _compact(values: Sequence[int], limit: int = 24) -> str:
    shown = " ".join(str(v) for v in values[:limit])
    return shown + (f" ... ({len(values)} depths)" if len(values) > limit else "")


def block_text(doc: dict[str, Any]) -> list[str]:
    status = "ok" if doc["ok"] else "DAMAGED"
    lines = [f"block {doc['path']}", f"  status {status}"]
    lines += [f"  PROBLEM: {p}" for p in doc["problems"]]
    h = doc["header"]
    if h is not None:
        lines += table(
            ["field", "value"],
            [
                ["block hash", h["block_hash"]],
                ["parent hash", h["parent_hash"] or "(none: first block of a chain)"],
                ["namespace digest", h["namespace_digest"]],
                ["group", h["group"]],
                ["tokens", h["tokens"]],
                [
                    "inner chunks",
                    f"{h['num_chunks']} x {h['chunk_nbytes']} B (stride {h['chunk_stride']})",
                ],
                ["data offset", h["data_offset"]],
                ["file bytes", f"{h['file_nbytes']} (on disk {doc['file_nbytes']})"],
                ["checksum", h["checksum_algo"]],
                ["created", h["created"]],
            ],
            align="ll",
        )
    bad = [c for c in doc["chunks"] if not c["ok"]]
    lines.append(
        f"  inner chunks: {len(doc['chunks']) - len(bad)} of {len(doc['chunks'])} verified ok"
    )
    if bad:
        lines += table(
            ["chunk", "head", "layer", "stored", "computed", "state"],
            [
                [
                    c["chunk"],
                    c["head"],
                    c["layer"],
                    c["stored"] or "-",
                    c["computed"] or "-",
                    c["state"],
                ]
                for c in bad
            ],
            indent="    ",
        )
    chain = doc["parent_chain"]
    lines.append(f"  parent chain: depth {chain['depth']}, ends: {chain['ends']}")
    for i, parent in enumerate(chain["hashes"][:8], start=1):
        lines.append(f"    -{i}  {parent}")
    if len(chain["hashes"]) > 8:
        lines.append(f"    ... {len(chain['hashes']) - 8} more (see --json)")
    return lines


def stats_text(rows: Sequence[StatRow]) -> list[str]:
    return table(
        ["layer", "head", "part", "absmax", "mean", "std", "nan", "inf"],
        [
            [r.layer, r.head, r.part, num(r.absmax), num(r.mean), num(r.std), r.nan, r.inf]
            for r in rows
        ],
    )


def damage_text(label: str, check: dict[str, Any]) -> list[str]:
    return [
        f"block {label} is DAMAGED: {check['summary']}",
        "  (`kvstore-inspect block` shows details; --force decodes the bytes anyway)",
    ]


def block_diff_text(doc: dict[str, Any], limit: int) -> list[str]:
    lines = [f"left  {doc['left']['path']}", f"right {doc['right']['path']}"]
    lines += [
        f"  {side} block DAMAGED: {doc[side]['problem']}"
        for side in ("left", "right")
        if not doc[side]["ok"]
    ]
    lines += [f"  header: {d}" for d in doc["header_differences"]]
    if not doc["chunks"]:
        lines.append("  all inner chunks byte-identical")
        return lines
    lines.append(f"  {len(doc['chunks'])} of {doc['num_chunks']} inner chunks differ:")
    lines += table(
        ["head", "layer", "elements", "first token", "max |diff|"],
        [
            [
                c["head"],
                c["layer"],
                c["elements_differing"],
                c["first_token"],
                num(c["max_abs_diff"]),
            ]
            for c in doc["chunks"][:limit]
        ],
        indent="    ",
    )
    if len(doc["chunks"]) > limit:
        lines.append(f"    ... {len(doc['chunks']) - limit} more (--limit, or --json for all)")
    return lines


def store_diff_text(doc: dict[str, Any], limit: int) -> list[str]:
    lines = [f"left  {doc['left']}", f"right {doc['right']}"]
    lines += [
        f"  namespace only on the {side}: {name}"
        for side in ("left", "right")
        for name in doc[f"only_{side}_namespaces"]
    ]
    for ns in doc["namespaces"]:
        for g in ns["groups"]:
            lines.append(
                f"  {ns['name']}/g{g['group']}: {g['left_blocks']} vs {g['right_blocks']} blocks, "
                f"{g['common']} common, {g['only_left_count']} only left, "
                f"{g['only_right_count']} only right, {g['differing_count']} differ"
            )
            lines += [
                f"    only {side}: {h}"
                for side in ("left", "right")
                for h in g[f"only_{side}"][:limit]
            ]
            for d in g["differing"][:limit]:
                where = ", ".join(f"(h{c['head']},l{c['layer']})" for c in d["chunks"][:8])
                extra = "; ".join(d["header_differences"])
                damage = "; ".join(
                    f"{s} damaged: {d[s]['problem']}" for s in ("left", "right") if not d[s]["ok"]
                )
                what = "; ".join(
                    x for x in (f"chunks {where}" if where else "", extra, damage) if x
                )
                lines.append(f"    differs: {d['block']}: {what}")
    return lines

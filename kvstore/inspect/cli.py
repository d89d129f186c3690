"""The ``kvstore-inspect`` command: look inside a store directory cold, read only.

Views (each also as one JSON document with ``--json``):

* ``overview ROOT [--check]`` - namespaces, identities, per group geometry, blocks and bytes;
* ``tree ROOT NS [--group K] [--png F] [--max-blocks N] [--sample S]`` - prefix forests
  rebuilt from parent hashes (exact up to N blocks, sampled above: it says so);
* ``block ROOT NS HASH`` - header fields, checksum of every inner chunk, parent chain;
* ``values ROOT NS HASH [--heads A:B] [--layers A:B] [--tokens A:B] [--layout L --rank N]`` -
  decoded values, canonically or as a rank of a parallel layout holds them;
* ``stats ROOT NS HASH [...]`` - abs-max, mean, std, NaN / Inf counts per layer, head, K / V;
* ``heatmap ROOT NS HASH --png F`` - per (layer, head) K and V magnitudes as a picture;
* ``export ROOT NS HASH --out F.npy|F.safetensors`` - a block or part of it, byte-exact;
* ``diff ROOT NS HASH HASH2`` (two blocks) and ``diff ROOT ROOT2`` (two stores).

NS is a namespace directory name or a unique prefix of it (or of its digest); HASH is a full
block hash in hex or a unique prefix. Nothing is ever written to a store.

Exit codes: 0 nothing to report, 1 findings (damaged blocks, documents not as format v1
prescribes, differences found by ``diff``), 2 error (bad arguments, not a store, unknown
namespace or block). Errors print one line naming what was expected and what arrived.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvstore import heap
from kvstore.cli_args import OneLineParser, positive_int, store_root
from kvstore.errors import InspectError, KvstoreError
from kvstore.inspect import block as block_view
from kvstore.inspect import diff as diff_view
from kvstore.inspect import overview as overview_view
from kvstore.inspect import text
from kvstore.inspect import tree as tree_view
from kvstore.inspect.decode import Selection, to_float
from kvstore.inspect.export import export_block
from kvstore.inspect.rank import RankView, format_slots, rank_view
from kvstore.inspect.render import dumps, spans
from kvstore.inspect.resolve import BlockRef, find_block, find_namespace, parse_range
from kvstore.inspect.stats import METRICS, StatRow, attention_stats, mla_stats
from kvstore.inspect.values import BlockValues, format_values, load_values
from kvstore.io import stall, supervise
from kvstore.store.view import GroupView, NamespaceView, StoreView

PROG = "kvstore-inspect"


# -- arguments -------------------------------------------------------------------------------


MAX_PIXELS = 16384  # per side: the canvas of a larger picture would not fit in memory


def _pixels(text: str) -> tuple[int, int]:
    """argparse type: ``WIDTHxHEIGHT``, each side at most MAX_PIXELS (the drawing module
    enforces its own minimum)."""
    expected = f"expected WIDTHxHEIGHT in pixels, each at most {MAX_PIXELS}, got {text!r}"
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(expected) from None
    if not (0 < w <= MAX_PIXELS and 0 < h <= MAX_PIXELS):
        raise argparse.ArgumentTypeError(expected)
    return w, h


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="Look inside a kvstore directory (read only; no engine, no GPU needed).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def command(
        name: str, help_text: str, block: bool = False, ns: bool = False
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("root", type=store_root, help="store directory")
        if ns or block:
            p.add_argument("namespace", help="namespace directory name, or a unique prefix")
        if block:
            p.add_argument("hash", help="block hash in hex, or a unique prefix")
        if ns or block:
            p.add_argument("--group", type=int, default=0, help="KV-cache group (default 0)")
        p.add_argument("--json", action="store_true", help="print one JSON document")
        return p

    o = command("overview", "namespaces, identities, block counts and bytes")
    o.add_argument("--check", action="store_true", help="read and verify every block")

    t = command("tree", "prefix trees rebuilt from parent hashes", ns=True)
    t.add_argument("--png", type=Path, help="also draw the forest into this PNG file")
    t.add_argument("--size", type=_pixels, default=(1200, 800), help="PNG size (default 1200x800)")
    t.add_argument("--top", type=positive_int, default=5, help="largest trees listed (default 5)")
    t.add_argument(
        "--max-blocks",
        type=positive_int,
        default=tree_view.MAX_BLOCKS,
        help="largest group whose exact forest is built (under 1 KB of memory a block); above "
        f"it the forest is sampled (default {tree_view.MAX_BLOCKS})",
    )
    t.add_argument(
        "--sample",
        type=positive_int,
        help="blocks sampled above --max-blocks, at most --max-blocks (default "
        f"{tree_view.SAMPLE_BLOCKS}, or --max-blocks if smaller)",
    )

    command("block", "header, checksum of every inner chunk, parent chain", block=True)

    def selection_args(p: argparse.ArgumentParser, rank: bool) -> None:
        p.add_argument("--heads", help="KV heads N or A:B (default all)")
        p.add_argument("--layers", help="group layers N or A:B (default all)")
        p.add_argument("--force", action="store_true", help="decode a damaged block anyway")
        if rank:
            p.add_argument("--layout", help="parallel layout, e.g. tp=2,pp=2 (with --rank)")
            p.add_argument("--rank", type=int, help="global rank of --layout")
            p.add_argument(
                "--family",
                choices=("hnd", "nhd"),
                default="hnd",
                help="the rank's page order (default hnd)",
            )

    v = command("values", "decoded values of a block (or of one rank's share)", block=True)
    selection_args(v, rank=True)
    v.add_argument("--tokens", help="tokens (rank view: slots) N or A:B (default all)")
    v.add_argument("--full", action="store_true", help="print every value, no summarizing")

    s = command("stats", "abs-max, mean, std, NaN/Inf per layer, head, K/V", block=True)
    selection_args(s, rank=True)

    h = command("heatmap", "PNG of per-(layer, head) K and V magnitudes", block=True)
    selection_args(h, rank=False)
    h.add_argument("--png", type=Path, required=True, help="output PNG file")
    h.add_argument("--metric", choices=METRICS, default="rms", help="magnitude (default rms)")
    h.add_argument("--size", type=_pixels, default=(1200, 600), help="PNG size (default 1200x600)")

    e = command("export", "write a block or part of it to .npy or .safetensors", block=True)
    selection_args(e, rank=False)
    e.add_argument("--out", type=Path, required=True, help="F.npy or F.safetensors")
    e.add_argument("--decoded", action="store_true", help="float32 values instead of stored bits")

    d = sub.add_parser(
        "diff",
        help="compare two blocks (ROOT NS HASH HASH2) or two stores (ROOT ROOT2)",
        description="compare two blocks (ROOT NS HASH HASH2) or two stores (ROOT ROOT2)",
    )
    d.add_argument("operands", nargs="+", metavar="ARG", help="ROOT NS HASH HASH2 | ROOT ROOT2")
    d.add_argument("--group", type=int, default=0, help="KV-cache group of the blocks (default 0)")
    d.add_argument("--limit", type=positive_int, default=20, help="entries listed per kind (text)")
    d.add_argument("--json", action="store_true", help="print one JSON document")
    return parser


# -- helpers ---------------------------------------------------------------------------------


def _emit(args: argparse.Namespace, doc: Any, lines: list[str]) -> None:
    print(dumps(doc) if args.json else "\n".join(lines))


def _open_group(args: argparse.Namespace) -> tuple[NamespaceView, GroupView]:
    ns = find_namespace(StoreView.open(args.root), args.namespace)
    return ns, ns.group(args.group)


def _selection(args: argparse.Namespace, group: GroupView) -> Selection:
    heads = parse_range(args.heads, group.num_heads, "--heads")
    layers = parse_range(args.layers, group.num_layers, "--layers")
    return Selection(heads, layers)


def _load(args: argparse.Namespace) -> tuple[NamespaceView, GroupView, BlockRef, BlockValues]:
    rank = getattr(args, "layout", None) is not None or getattr(args, "rank", None) is not None
    if rank and (args.layout is None or args.rank is None):
        raise InspectError("rank view: expected both --layout and --rank")
    if rank and (args.heads is not None or args.layers is not None):
        raise InspectError(
            "rank view: expected no --heads / --layers (a rank holds its own heads and layers)"
        )
    ns, group = _open_group(args)
    ref = find_block(group, args.hash)
    selection = Selection.all_of(group) if rank else _selection(args, group)
    return ns, group, ref, load_values(group, ref, selection)


def _check_doc(values: BlockValues) -> dict[str, Any]:
    check = values.check
    return {
        "ok": check.ok,
        "summary": check.summary(),
        "problems": list(check.problems),
        "bad_chunks": [
            {"head": c.head, "layer": c.layer, "state": c.state.value} for c in check.bad_chunks
        ],
    }


def _block_head(group: GroupView, ref: BlockRef, values: BlockValues) -> dict[str, Any]:
    return {
        "namespace": group.namespace,
        "group": group.index,
        "block": ref.label,
        "kv_dtype": group.dtype.name,
        "selection": values.selection.to_json(),
        "check": _check_doc(values),
    }


def _refuse_damaged(args: argparse.Namespace, doc: dict[str, Any], values: BlockValues) -> bool:
    """Report a damaged selection; True when the view must stop there (no --force)."""
    if values.check.ok or args.force:
        return False
    _emit(args, doc, text.damage_text(values.ref.label, doc["check"]))
    return True


def _rank(
    args: argparse.Namespace, ns: NamespaceView, group: GroupView, values: BlockValues
) -> RankView:
    block = values.raw.reshape(-1).view(np.uint8)
    return rank_view(
        group, ns.identity, block, values.ref.block_hash, args.layout, args.rank, args.family
    )


def _rank_floats(group: GroupView, view: RankView) -> np.ndarray:
    """A rank's values as (heads, layers, slots, 2, D) floats (MLA: (layers, slots, C))."""
    floats = to_float(view.raw, group.dtype.name)
    return floats if group.is_mla else floats.transpose(1, 0, 2, 3, 4)


# -- commands --------------------------------------------------------------------------------


def cmd_overview(args: argparse.Namespace) -> int:
    doc = overview_view.store_summary(StoreView.open(args.root), check=args.check)
    _emit(args, doc, text.overview_text(doc))
    return 1 if overview_view.findings(doc) else 0


def cmd_tree(args: argparse.Namespace) -> int:
    _, group = _open_group(args)
    # A small --max-blocks alone is no error: the default sample shrinks to fit it.
    sample = args.sample or min(tree_view.SAMPLE_BLOCKS, args.max_blocks)
    scan = tree_view.scan_group(group, max_blocks=args.max_blocks, sample=sample)
    forest = scan.forest
    doc: dict[str, Any] = {
        "namespace": group.namespace,
        "group": group.index,
        "blocks": scan.blocks,
        "bytes_on_disk": scan.bytes_on_disk,
        "sampled": scan.sample,
        "summary": tree_view.summarize(forest, top=args.top),
        "estimates": scan.estimates,
        "problems": list(scan.problems.values()),
        "problems_count": scan.problems.total,
        "png": None,
    }
    if args.png is not None:
        w, h = args.size
        title = f"{group.label}: prefix forest"
        if scan.sample is not None:
            title += f" (sampled: {scan.sample['blocks']} of {scan.blocks} blocks + ancestors)"
        from kvstore.inspect.pictures import tree_png  # noqa: PLC0415 - lazy: matplotlib

        tree_png(args.png, forest, title, width=w, height=h)
        doc["png"] = str(args.png)
    _emit(args, doc, text.tree_text(doc))
    return 1 if doc["summary"]["damaged_count"] or doc["summary"]["unreachable"] else 0


def cmd_block(args: argparse.Namespace) -> int:
    _, group = _open_group(args)
    check, doc = block_view.block_report(group, find_block(group, args.hash))
    _emit(args, doc, text.block_text(doc))
    return 0 if check.ok else 1


def cmd_values(args: argparse.Namespace) -> int:
    ns, group, ref, values = _load(args)
    doc = _block_head(group, ref, values)
    if _refuse_damaged(args, doc, values):
        return 1
    if args.layout is not None or args.rank is not None:
        view = _rank(args, ns, group, values)
        floats = _rank_floats(group, view)
        rows = parse_range(args.tokens, view.mapping.local_block_size, "--tokens")
        heads, layers = list(view.heads), list(view.layers)
        notes: dict[tuple[int, int], str] = {}
        if view.slots is not None:
            for li, layer in enumerate(layers):
                for hi, head in enumerate(heads):
                    notes[(layer, head)] = "slots hold canonical tokens " + format_slots(
                        view.slots[li, hi]
                    )
        doc["rank"] = view.describe()
        doc["slots"] = view.slots.tolist() if view.slots is not None else None
        doc["axes"] = (
            ["layer", "slot", "latent"]
            if group.is_mla
            else ["kv_head", "layer", "slot", "kv", "head_dim"]
        )
        lines = [_rank_line(doc["rank"], view.writer)]
        row_name = "slots"
    else:
        floats = values.floats
        rows = parse_range(args.tokens, group.tokens, "--tokens")
        heads, layers = list(values.selection.heads), list(values.selection.layers)
        notes, lines, row_name = {}, [], "tokens"
        doc["axes"] = (
            ["layer", "token", "latent"]
            if group.is_mla
            else ["kv_head", "layer", "token", "kv", "head_dim"]
        )
    cut = (
        floats[:, rows.start : rows.stop] if group.is_mla else floats[:, :, rows.start : rows.stop]
    )
    doc["rows"] = [rows.start, rows.stop]
    doc["values"] = cut.tolist()
    lines = [
        f"block {ref.label} of {group.label} ({group.dtype.name}); {values.check.summary()}",
        *lines,
    ]
    lines += format_values(floats, group, heads, layers, rows, args.full, row_name, notes)
    _emit(args, doc, lines)
    return 0 if values.check.ok else 1


def _rank_line(desc: dict[str, Any], writer: bool) -> str:
    coord, form = desc["coord"], desc["form"]["family"]
    return (
        f"rank {desc['rank']} of {desc['layout']} (tp_rank {coord['tp_rank']}, pp_rank "
        f"{coord['pp_rank']}, pcp_rank {coord['pcp_rank']}): heads {spans(desc['heads'])}, "
        f"layers {spans(desc['layers'])} (model layers {spans(desc['model_layer_ids'])}), "
        f"{desc['local_block_size']} slots/block, {desc['page_bytes']} B/page ({form}); "
        f"writer {desc['writer_index'] + 1} of {desc['num_writers']}"
        + (", elected for this block" if writer else "")
    )


def cmd_stats(args: argparse.Namespace) -> int:
    ns, group, ref, values = _load(args)
    doc = _block_head(group, ref, values)
    if _refuse_damaged(args, doc, values):
        return 1
    lines = [f"block {ref.label} of {group.label} ({group.dtype.name}); {values.check.summary()}"]
    rows: list[StatRow]
    if args.layout is not None or args.rank is not None:
        view = _rank(args, ns, group, values)
        floats = _rank_floats(group, view)
        rows = (
            mla_stats(floats, view.layers)
            if group.is_mla
            else attention_stats(floats, view.heads, view.layers)
        )
        doc["rank"] = view.describe()
        lines.append(_rank_line(doc["rank"], view.writer))
    else:
        rows = values.stats()
    doc["rows"] = [r.to_json() for r in rows]
    _emit(args, doc, lines + text.stats_text(rows))
    return 0 if values.check.ok else 1


def cmd_heatmap(args: argparse.Namespace) -> int:
    _, group, ref, values = _load(args)
    doc = _block_head(group, ref, values)
    if _refuse_damaged(args, doc, values):
        return 1
    w, h = args.size
    from kvstore.inspect.pictures import heatmap_png  # noqa: PLC0415 - lazy: matplotlib

    grids = heatmap_png(
        args.png,
        values.floats,
        is_mla=group.is_mla,
        heads=values.selection.heads,
        layers=values.selection.layers,
        metric=args.metric,
        title=f"{group.label} block {ref.label[:16]} ({group.dtype.name})",
        width=w,
        height=h,
    )
    doc.update(
        png=str(args.png),
        size=[w, h],
        metric=args.metric,
        grids={part: grid.tolist() for part, grid in grids},
    )
    _emit(args, doc, [f"wrote {args.png} ({w}x{h}, {args.metric} per layer x head)"])
    return 0 if values.check.ok else 1


def cmd_export(args: argparse.Namespace) -> int:
    _, group, ref, values = _load(args)
    doc = _block_head(group, ref, values)
    if _refuse_damaged(args, doc, values):
        return 1
    doc["export"] = info = export_block(values, args.out, decoded=args.decoded)
    _emit(
        args,
        doc,
        [f"wrote {info['path']}: {info['format']} {info['dtype']} {info['shape']} {info['axes']}"],
    )
    return 0 if values.check.ok else 1


def cmd_diff(args: argparse.Namespace) -> int:
    ops = args.operands
    if len(ops) == 2:
        doc = diff_view.diff_stores(StoreView.open(ops[0]), StoreView.open(ops[1]))
        _emit(args, doc, text.store_diff_text(doc, args.limit))
        return 1 if diff_view.store_difference_count(doc) else 0
    if len(ops) != 4:
        raise InspectError(
            f"diff: expected ROOT NS HASH HASH2 or ROOT ROOT2, got {len(ops)} arguments"
        )
    root, ns_text, first, second = ops
    group = find_namespace(StoreView.open(root), ns_text).group(args.group)
    a, b = find_block(group, first), find_block(group, second)
    doc = diff_view.diff_block_files(group, a.file, group, b.file)
    doc.update(left_block=a.label, right_block=b.label)
    _emit(args, doc, text.block_diff_text(doc, args.limit))
    return 1 if diff_view.block_differs(doc) else 0


COMMANDS = {
    "overview": cmd_overview,
    "tree": cmd_tree,
    "block": cmd_block,
    "values": cmd_values,
    "stats": cmd_stats,
    "heatmap": cmd_heatmap,
    "export": cmd_export,
    "diff": cmd_diff,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv``; returns the exit code (0 / 1 findings / 2 error)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else 2
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        with stall.watching(f"{PROG} {args.command}", getattr(args, "root", "the store")):
            return COMMANDS[args.command](args)
    except BrokenPipeError:  # output piped into `head` and closed: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 2
    except (KvstoreError, OSError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # read-only: nothing to undo, one line instead of a traceback
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The console script (and ``python -m kvstore.inspect.cli``): :func:`main` in a worker
    process that a hung mount cannot keep from exiting (kvstore.io.supervise), with the
    collector set for walks of millions of entries (kvstore/heap.py; the worker is forked: it
    inherits them). Not in :func:`main`, which tests call in their own process."""
    heap.tune_for_batch_tool()
    sys.exit(supervise.run(main))


if __name__ == "__main__":
    entry()

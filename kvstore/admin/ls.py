"""``kvstore ls``: what is in a store.

``kvstore ls ROOT`` lists namespaces (model, dtype, groups, block count, bytes, oldest and newest
last use); ``kvstore ls ROOT NS`` lists the blocks of one namespace (group, hash from the
header, parent, tokens, size, last use), most recently used first. Last use is the block file's
mtime (see ``docs/admin.md``). Read-only; listing a namespace reads each block's 176-byte header.
What cannot be read (a namespace whose ``zarr.json`` is unreadable, a directory that cannot be
listed) is reported on stderr and under ``problems``; the rest is listed and the exit code is 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.admin.blockfile import read_header
from kvstore.admin.du import problems
from kvstore.admin.progress import Progress
from kvstore.admin.report import print_json, print_lines, table, warn
from kvstore.admin.scan import (
    BlockTally,
    Entry,
    fanout_dirs,
    open_root,
    scan_store,
)
from kvstore.admin.sizes import format_size, format_time, iso_time
from kvstore.errors import CorruptBlockError
from kvstore.store.view import NamespaceView


@dataclass(frozen=True)
class NamespaceSummary:
    """One row of ``kvstore ls ROOT``."""

    name: str
    model: str
    engine: str  # whose keys: "vllm" or "sglang" (Identity.engine)
    dtype: str
    tokens_per_block: int
    groups: int
    blocks: int
    hash_lookahead_tokens: int
    bytes: int
    oldest_ns: int | None
    newest_ns: int | None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": self.model,
            "engine": self.engine,
            "dtype": self.dtype,
            "tokens_per_block": self.tokens_per_block,
            "hash_lookahead_tokens": self.hash_lookahead_tokens,
            "groups": self.groups,
            "blocks": self.blocks,
            "bytes": self.bytes,
            "oldest_ns": self.oldest_ns,
            "newest_ns": self.newest_ns,
            "oldest": iso_time(self.oldest_ns),
            "newest": iso_time(self.newest_ns),
        }


def summarize(ns: NamespaceView, tally: BlockTally) -> NamespaceSummary:
    """A namespace's row from its identity and the tally of its blocks."""
    return NamespaceSummary(
        name=ns.name,
        model=ns.identity.model,
        engine=ns.identity.engine,
        dtype=ns.identity.kv_dtype,
        tokens_per_block=ns.identity.tokens_per_block,
        groups=len(ns.groups),
        blocks=tally.blocks,
        hash_lookahead_tokens=ns.identity.hash_lookahead_tokens,
        bytes=tally.bytes,
        oldest_ns=tally.oldest_ns,
        newest_ns=tally.newest_ns,
    )


def list_namespaces(root: Path, *, progress: bool = True) -> dict[str, Any]:
    """The JSON document of ``kvstore ls ROOT``."""
    store = open_root(root)
    with Progress(fanout_dirs(store.namespaces), "scanning", enabled=progress) as bar:
        scan = scan_store(store, on_dir=bar.update, keep_blocks=False)
    rows = [summarize(ns, scan.tally(ns.name)) for ns in store.namespaces]
    return {
        "root": str(store.root),
        "namespaces": [r.to_json() for r in rows],
        "total": {"blocks": sum(r.blocks for r in rows), "bytes": sum(r.bytes for r in rows)},
        "problems": problems(scan),
    }


def list_blocks(root: Path, name: str, *, progress: bool = True) -> dict[str, Any]:
    """The JSON document of ``kvstore ls ROOT NS``."""
    store = open_root(root)
    ns = store.namespace(name)
    with Progress(fanout_dirs([ns]), "scanning", enabled=progress) as bar:
        scan = scan_store(store, [ns], on_dir=bar.update)
    rows: list[dict[str, Any]] = []
    with Progress(len(scan.blocks), "headers", unit="block", enabled=progress) as bar:
        for block in scan.blocks:
            rows.append(_block_row(block, store.root))
            bar.update()
    rows.sort(key=lambda r: (-r["last_access_ns"], r["group"], r["hash_hi"], r["hash_lo"]))
    return {
        "root": str(store.root),
        "namespace": summarize(ns, scan.tally(ns.name)).to_json(),
        "blocks": rows,
        "problems": problems(scan, namespaces=False),
    }


def _block_row(block: Entry, root: Path) -> dict[str, Any]:
    row: dict[str, Any] = {
        "group": block.group,
        "hash_hi": block.hash_hi,
        "hash_lo": block.hash_lo,
        "hash": None,
        "parent": None,
        "tokens": None,
        "bytes": block.size,
        "last_access_ns": block.mtime_ns,
        "last_access": iso_time(block.mtime_ns),
        "path": str(Path(block.path).relative_to(root)),
        "error": None,
    }
    try:
        header = read_header(block.path)
    except FileNotFoundError:
        row["error"] = "vanished while listing"
    except (CorruptBlockError, OSError) as exc:
        row["error"] = str(exc)
    else:
        row["hash"] = header.block_hash.hex()
        row["parent"] = header.parent_hash.hex() if header.parent_hash else None
        row["tokens"] = header.tokens
    return row


def render_namespaces(doc: dict[str, Any]) -> list[str]:
    lines = [f"store {doc['root']}"]
    if not doc["namespaces"]:
        return [*lines, "  no namespaces"]
    rows = [
        [
            n["name"],
            n["model"],
            n.get("engine", ""),
            n["dtype"],
            _block_tokens(n),
            n["groups"],
            n["blocks"],
            format_size(n["bytes"]),
            format_time(n["oldest_ns"]),
            format_time(n["newest_ns"]),
        ]
        for n in doc["namespaces"]
    ]
    total = doc["total"]
    rows.append(["total", "", "", "", "", "", total["blocks"], format_size(total["bytes"]), "", ""])
    headers = [
        *("namespace", "model", "engine", "dtype", "tokens/block", "groups"),
        *("blocks", "size", "oldest", "newest"),
    ]
    return lines + table(headers, rows)


def _block_tokens(summary: dict[str, Any]) -> str:
    """Tokens per block, and the hash lookahead where the engine hashed one in (``16+2``)."""
    lookahead = summary.get("hash_lookahead_tokens", 0)
    return (
        f"{summary['tokens_per_block']}+{lookahead}"
        if lookahead
        else str(summary["tokens_per_block"])
    )


def render_blocks(doc: dict[str, Any]) -> list[str]:
    ns = doc["namespace"]
    lines = [
        f"namespace {ns['name']}: {ns['model']} ({ns.get('engine', '?')}), {ns['dtype']}, "
        f"{ns['tokens_per_block']} tokens "
        f"per block, {ns['blocks']} blocks, {format_size(ns['bytes'])}"
    ]
    rows = [
        [
            f"g{b['group']}",
            (b["hash"][:16] if b["hash"] else f"? {b['error']}"),
            (b["parent"][:16] if b["parent"] else "-"),
            b["tokens"],
            format_size(b["bytes"]),
            format_time(b["last_access_ns"]),
        ]
        for b in doc["blocks"]
    ]
    if not rows:
        return [*lines, "  no blocks"]
    return lines + table(["group", "hash", "parent", "tokens", "size", "last access"], rows)


def run(root: Path, namespace: str | None, *, as_json: bool) -> int:
    """``kvstore ls``: exit 0, or 1 when something could not be read (listing incomplete)."""
    doc = list_namespaces(root) if namespace is None else list_blocks(root, namespace)
    for problem in doc["problems"]:
        warn(f"cannot read {problem['path']}: {problem['detail']}")
    if as_json:
        print_json(doc)
    else:
        print_lines(render_namespaces(doc) if namespace is None else render_blocks(doc))
    return 1 if doc["problems"] else 0

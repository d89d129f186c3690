"""``kvstore ls``: what is in a store.

``kvstore ls ROOT`` lists namespaces (model, dtype, groups, block count, bytes, oldest and newest
last use); ``kvstore ls ROOT NS`` lists the blocks of one namespace (group, hash from the
header, parent, tokens, size, last use). Last use is the block file's mtime (see
``docs/admin.md``). Read-only; listing a namespace reads each block's 176-byte header.
What cannot be read (a namespace whose ``zarr.json`` is unreadable, a directory that cannot be
listed) is reported on stderr and under ``problems``; the rest is listed and the exit code is 1.

**Streaming.** A namespace may hold 10^8 blocks: ``kvstore ls ROOT NS`` prints each block as
it is read, in scan order (group, fan-out directory, directory order; not sorted, which would
mean holding them all), in memory bounded whatever the namespace's size (:func:`stream_blocks`).
With ``--json`` the output is JSON Lines: one ``{"type": "block", …}`` object per block, then
one ``{"type": "summary", …}`` object (root, namespace totals, problems). The namespace
totals come last in the text form too.
"""

from __future__ import annotations

import json
import os
import sys
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

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
from kvstore.store.view import NamespaceView, StoreView

# Threads reading block headers (one small read each: on a shared file system a round trip).
HEADER_THREADS = 8
# Blocks per header-reading task, and tasks queued or running per thread: the window of
# blocks in flight is HEADER_THREADS * TASKS_AHEAD * TASK_BLOCKS, whatever the namespace holds.
TASK_BLOCKS = 64
TASKS_AHEAD = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for `kvstore ls ... | head`


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


def stream_blocks(
    store: StoreView,
    ns: NamespaceView,
    emit: Callable[[str], object],
    line: Callable[[dict[str, Any]], str],
    *,
    progress: bool = True,
) -> dict[str, Any]:
    """List the blocks of ``ns`` as they are found: ``emit`` gets the text of each batch of
    blocks, one ``line(row)`` per block, in scan order (group, fan-out directory, directory
    order); the summary object of ``kvstore ls ROOT NS --json`` is returned at the end.

    Headers are read on :data:`HEADER_THREADS` threads, at most ``HEADER_THREADS *
    TASKS_AHEAD`` tasks of :data:`TASK_BLOCKS` at a time, and emitted in submission order:
    memory is bounded whatever the size of the namespace. An exception raised by ``emit`` (a
    closed pipe, a Ctrl-C) stops the scan and propagates."""
    window: deque[Future[str]] = deque()

    def read(blocks: Sequence[Entry]) -> str:
        return "".join(line(_block_row(block, store.root)) for block in blocks)

    def take_oldest() -> None:
        text = window[0].result()
        window.popleft()
        emit(text)

    def feed(batch: Sequence[Entry]) -> None:
        for i in range(0, len(batch), TASK_BLOCKS):
            while len(window) >= HEADER_THREADS * TASKS_AHEAD:
                take_oldest()
            window.append(pool.submit(read, batch[i : i + TASK_BLOCKS]))

    with (
        Progress(fanout_dirs([ns]), "scanning", enabled=progress) as bar,
        ThreadPoolExecutor(HEADER_THREADS, thread_name_prefix="kvstore-ls") as pool,
    ):
        try:
            scan = scan_store(store, [ns], on_dir=bar.update, on_blocks=feed)
            while window:
                take_oldest()
        finally:
            for task in window:
                task.cancel()  # stopped early: the headers not begun are never read
    return {
        "type": "summary",
        "root": str(store.root),
        "namespace": summarize(ns, scan.tally(ns.name)).to_json(),
        "problems": problems(scan, namespaces=False),
    }


def json_line(row: dict[str, Any]) -> str:
    """One block of ``kvstore ls ROOT NS --json``: a JSON Lines object, ``"type": "block"``."""
    return json.dumps({"type": "block", **row}) + "\n"


def text_line(row: dict[str, Any]) -> str:
    """One block of the ``kvstore ls ROOT NS`` table: fixed-width columns (rows are printed as
    they are read, before the widest value is known), a read error last."""
    hash_ = row["hash"][:16] if row["hash"] else "?"
    parent = row["parent"][:16] if row["parent"] else "-"
    tokens = "-" if row["tokens"] is None else row["tokens"]
    text = (
        f"  {'g' + str(row['group']):<5}  {hash_:<16}  {parent:<16}  {tokens:>6}  "
        f"{format_size(row['bytes']):<10}  {format_time(row['last_access_ns'])}"
    )
    return text + (f"  error: {row['error']}" if row["error"] else "") + "\n"


TEXT_HEADER = (
    f"  {'group':<5}  {'hash':<16}  {'parent':<16}  {'tokens':>6}  {'size':<10}  last access"
)


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


def render_namespace_head(ns: NamespaceView) -> str:
    """The first line of ``kvstore ls ROOT NS`` (counts come last: known once all is listed)."""
    ident = ns.identity
    return (
        f"namespace {ns.name}: {ident.model} ({ident.engine}), {ident.kv_dtype}, "
        f"{ident.tokens_per_block} tokens per block"
    )


def render_namespace_tail(summary: dict[str, Any]) -> str:
    ns = summary["namespace"]
    if not ns["blocks"]:
        return "  no blocks"
    return (
        f"  {ns['blocks']} blocks, {format_size(ns['bytes'])} (in scan order: group, fan-out "
        "directory)"
    )


def run(root: Path, namespace: str | None, *, as_json: bool) -> int:
    """``kvstore ls``: exit 0, or 1 when something could not be read (listing incomplete); a
    namespace's listing streams to stdout (141 when its reader closed the pipe, 130 Ctrl-C)."""
    if namespace is None:
        doc = list_namespaces(root)
        _warn_problems(doc["problems"])
        if as_json:
            print_json(doc)
        else:
            print_lines(render_namespaces(doc))
        return 1 if doc["problems"] else 0
    store = open_root(root)
    ns = store.namespace(namespace)
    out = sys.stdout
    # Rows on a terminal are their own progress; a bar redrawn among them would garble them.
    progress = not _is_tty(out)
    try:
        if not as_json:
            out.write(render_namespace_head(ns) + "\n" + TEXT_HEADER + "\n")
        summary = stream_blocks(
            store, ns, out.write, json_line if as_json else text_line, progress=progress
        )
        out.write(json_line_summary(summary) if as_json else render_namespace_tail(summary) + "\n")
        out.flush()
    except BrokenPipeError:
        _drop_stdout()  # `| head`: the reader has what it wanted
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        out.flush()
        warn("ls interrupted: the listing above is incomplete")
        return EXIT_INTERRUPTED
    _warn_problems(summary["problems"])
    return 1 if summary["problems"] else 0


def json_line_summary(summary: dict[str, Any]) -> str:
    return json.dumps(summary) + "\n"


def _warn_problems(found: Sequence[dict[str, str]]) -> None:
    for problem in found:
        warn(f"cannot read {problem['path']}: {problem['detail']}")


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _drop_stdout() -> None:
    """After EPIPE: point stdout at /dev/null, so the interpreter's flush at exit does not
    fail a second time (and print a traceback)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a real file (a test's capture): nothing is flushed to a descriptor
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)

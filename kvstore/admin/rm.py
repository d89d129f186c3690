"""``kvstore rm``: remove a namespace.

The namespace directory is renamed to ``<root>/.trash-<ns>-<ns time>`` (atomic: from then on the
namespace no longer exists for anyone opening the store, and block reads of servers still using
it miss), then deleted once the grace period has passed (``--grace``, default 60 s; ``rm`` waits
for it), or at once with ``--now``. Servers that still have the namespace open fail their writes
with a logged error (the write path never recreates a removed namespace's directories) and miss
on reads; reopening the store recreates the namespace empty. If ``rm`` is interrupted while it
waits, the renamed directory stays and the next ``gc`` or ``rm`` deletes it once expired.
Expired removed namespaces and trash of earlier runs are deleted as well.

Without ``--yes`` it asks for confirmation on a terminal and refuses otherwise.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstore.admin.report import print_json, print_lines, warn
from kvstore.admin.scan import HeldFile, open_root, scan_store
from kvstore.admin.sizes import format_size
from kvstore.admin.trash import DEFAULT_GRACE_S, delete_held, expired, remove_namespace_dir
from kvstore.admin.usage import tree_usage
from kvstore.errors import KvstoreError
from kvstore.io import stall


def remove_namespace(
    root: Path,
    name: str,
    *,
    grace_s: float = DEFAULT_GRACE_S,
    now: bool = False,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Remove namespace ``name``; the JSON document of ``kvstore rm``."""
    store = open_root(root)
    store.namespace(name)  # a clear error naming the namespaces present
    renamed = remove_namespace_dir(store.root, name)
    files, nbytes, _held = tree_usage(str(renamed))
    if not now and grace_s > 0:
        print(
            f"kvstore: namespace {name} unpublished as {renamed.name}; waiting {grace_s:g} s for "
            "reads in flight before deleting it (--now skips the wait)",
            file=sys.stderr,
        )
        sleep(grace_s)
    deleted = delete_held([HeldFile(str(renamed), None, nbytes, files, 0)])
    for failure in deleted.failed:  # e.g. an unreadable directory inside: gc retries later
        warn(f"rm {name}: unpublished, but {failure}; kvstore gc deletes it once it can")
    # Earlier removals and gc trash whose grace period is over.
    later = scan_store(open_root(root), arrays=False)
    swept = delete_held(expired([*later.removed, *later.trash], grace_s))
    for failure in swept.failed:
        warn(f"rm: expired trash not deleted: {failure}")
    return {
        "root": str(store.root),
        "namespace": name,
        "files": files,
        "bytes": nbytes,
        "deleted": deleted.entries == 1,
        "renamed_to": str(renamed),
        "expired_trash_deleted": {"entries": swept.entries, "bytes": swept.bytes},
    }


def confirm(name: str, nbytes: int) -> bool:
    """Ask on the terminal; the operator types the namespace name to confirm."""
    if not sys.stdin.isatty():
        raise KvstoreError(f"rm {name}: expected --yes (stdin is not a terminal), got no --yes")
    sys.stderr.write(f"remove namespace {name} ({format_size(nbytes)})? type its name to confirm: ")
    sys.stderr.flush()
    with stall.paused():  # a person thinking is not the mount hanging
        return sys.stdin.readline().strip() == name


def run(root: Path, name: str, *, yes: bool, grace_s: float, now: bool, as_json: bool) -> int:  # noqa: PLR0913 - keyword-only flags of the `kvstore rm` command, one per CLI option
    """``kvstore rm``: exit 0 removed, 1 not confirmed or not wholly deleted (unpublished all
    the same; the rest is reported and deleted by a later gc), 2 error (no such namespace …)."""
    store = open_root(root)
    ns = store.namespace(name)
    if not yes:
        _files, nbytes, _held = tree_usage(str(ns.path))
        if not confirm(name, nbytes):
            print(f"kvstore: rm: {name} not removed (confirmation did not match)", file=sys.stderr)
            return 1
    doc = remove_namespace(root, name, grace_s=grace_s, now=now)
    if as_json:
        print_json(doc)
    else:
        state = "deleted" if doc["deleted"] else f"renamed to {doc['renamed_to']}"
        print_lines(
            [f"namespace {name}: {doc['files']} files, {format_size(doc['bytes'])} {state}"]
        )
    return 0 if doc["deleted"] else 1

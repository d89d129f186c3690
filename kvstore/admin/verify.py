"""``kvstore verify``: is the store intact?

Checks, per namespace:

* every block file (or a random ``--sample`` fraction of them): size, header (magic, version,
  crc), hash coordinates in the header = the path's ``<hi>/<lo>`` (else **mis-keyed**: a shard
  copied under another hash's name), namespace digest and group = where it lies (else
  **misplaced**), geometry = the array's, the sharding index, every inner chunk's checksum and
  zero padding (else **corrupt**); a short file is **truncated**, a long one **oversized**;
* temporary files: older than ``--tmp-age`` (default 1 h) they are **orphan-temp** (a writer
  that crashed); younger ones may be writes in flight and are only listed, never touched;
* **foreign** entries: anything in a fan-out directory that is neither a block name nor a
  temporary file, any unknown entry of a namespace, array or ``c/`` tree, and of the root;
* the array documents (``g<k>/zarr.json``) against format v1 for the namespace's identity
  (**metadata**), and namespaces whose ``zarr.json`` cannot be read (**bad-namespace**).

Hostile entries (docs/reliability.md) are findings of their own: **symlink** (a symbolic link
anywhere in the store, with where it points and whether that is outside the root; never
followed; ``--fix`` unlinks the link itself, never its target), **special-file** (a FIFO,
socket or device where a file or directory belongs; never opened; ``--fix`` moves it to
quarantine, a rename that opens nothing), **unreadable** (a directory that cannot be listed:
reported, left alone, the rest is checked), and ``trash`` / ``quarantine`` entries that are not
real directories (nothing is moved into them; ``--fix`` removes a link, quarantines a file;
a ``quarantine`` that is not a directory is left for a person).

The temp, foreign and metadata checks always cover the whole store; ``--sample`` only thins
the block checks. Read-only unless ``--fix``: then bad blocks and foreign entries of a
namespace move to ``<ns>/quarantine/`` and orphan temporary files are deleted; entries of the
root and metadata problems are reported, never changed. Exit code 1 when anything was found,
fixed or not (0: clean; young temporary files are not findings).
"""

from __future__ import annotations

import json
import math
import os
import random
import stat
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.admin.blockfile import BlockFault, judge_block_file
from kvstore.admin.progress import Progress
from kvstore.admin.report import print_json, print_lines, table
from kvstore.admin.scan import Entry, fanout_dirs, open_root, scan_store
from kvstore.admin.sizes import format_duration, format_size
from kvstore.admin.trash import HeldDirectoryError, ReplacedError, quarantine_file
from kvstore.errors import StoreFormatError
from kvstore.io.entries import FileId, kind_noun, remove_if_same
from kvstore.io.native_fileio import DEFAULT_FILEIO
from kvstore.store import metadata
from kvstore.store.check import ShardSpec
from kvstore.store.codec import Codec
from kvstore.store.paths import QUARANTINE, TRASH, ZARR_JSON
from kvstore.store.view import NamespaceView, read_document

DEFAULT_TMP_AGE_S = 3600.0
ORPHAN_TEMP = "orphan-temp"
FOREIGN = "foreign"
METADATA = "metadata"
BAD_NAMESPACE = "bad-namespace"
SYMLINK = "symlink"
SPECIAL_FILE = "special-file"
UNREADABLE = "unreadable"


@dataclass(frozen=True)
class Finding:
    """One problem found: its kind, where, why, and what ``--fix`` did about it."""

    kind: str
    path: str
    namespace: str | None
    group: int | None
    detail: str
    action: str | None = None  # None: read-only run; else "quarantined as …", "deleted", "left …"

    def to_json(self, root: Path) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "path": _rel(self.path, root),
            "namespace": self.namespace,
            "group": self.group,
            "detail": self.detail,
            "action": self.action,
        }


@dataclass(frozen=True)
class VerifyOptions:
    fix: bool = False
    sample: float = 1.0  # fraction of blocks whose contents are checked, 0 < sample <= 1
    tmp_age_s: float = DEFAULT_TMP_AGE_S
    threads: int = 4
    seed: int | None = None  # of the sample; None: a different sample each run
    progress: bool = True


def verify_store(root: Path, options: VerifyOptions) -> dict[str, Any]:
    """Run every check (and the fixes); the JSON document of ``kvstore verify``."""
    if not 0 < options.sample <= 1:
        raise ValueError(f"--sample: expected a fraction in (0, 1], got {options.sample}")
    store = open_root(root)
    with Progress(fanout_dirs(store.namespaces), "scanning", enabled=options.progress) as bar:
        scan = scan_store(store, on_dir=bar.update)
    by_name = {ns.name: ns for ns in store.namespaces}
    findings: list[Finding] = [
        Finding(BAD_NAMESPACE, str(p.path), p.path.name, None, p.detail, _left(options))
        for p in store.problems
    ]
    findings += _check_metadata(store.namespaces, options)
    chosen = _sample(scan.blocks, options)
    checked, vanished, block_findings = _check_blocks(chosen, by_name, options)
    findings += block_findings
    now = time.time_ns()
    orphan_limit = now - int(options.tmp_age_s * 1e9)
    in_flight = [t for t in scan.temps if t.mtime_ns > orphan_limit]
    for temp in scan.temps:
        if temp.mtime_ns <= orphan_limit:
            age = (now - temp.mtime_ns) / 1e9
            detail = (
                f"temporary file {format_duration(age)} old, expected none older than "
                f"{format_duration(options.tmp_age_s)} (a writer crashed)"
            )
            findings.append(_fix_temp(temp, detail, options))
    for entry in scan.foreign:
        findings.append(_fix_foreign(entry, by_name, store.root, options))
    findings += [
        Finding(UNREADABLE, str(p.path), None, None, p.detail, _left(options))
        for p in scan.unreadable
    ]
    findings.sort(key=lambda f: (f.kind, f.path))
    counts: dict[str, int] = {}
    for f in findings:
        counts[f.kind] = counts.get(f.kind, 0) + 1
    return {
        "root": str(store.root),
        "fix": options.fix,
        "sample": options.sample,
        "blocks": {
            "found": len(scan.blocks),
            "checked": checked,
            "checked_bytes": sum(b.size for b in chosen),
            "vanished": vanished,
        },
        "in_flight_temps": [
            {"path": _rel(t.path, store.root), "bytes": t.size, "age_s": (now - t.mtime_ns) / 1e9}
            for t in in_flight
        ],
        "counts": counts,
        "findings": [f.to_json(store.root) for f in findings],
    }


def _sample(blocks: Sequence[Entry], options: VerifyOptions) -> list[Entry]:
    if options.sample >= 1:
        return list(blocks)
    rng = random.Random(options.seed)
    k = min(len(blocks), math.ceil(options.sample * len(blocks)))
    return rng.sample(list(blocks), k)


def _check_blocks(
    blocks: Sequence[Entry], namespaces: dict[str, NamespaceView], options: VerifyOptions
) -> tuple[int, int, list[Finding]]:
    """(blocks checked, blocks that vanished meanwhile, findings)."""

    def check(block: Entry) -> tuple[BlockFault | None, FileId | None] | FileNotFoundError:
        """The verdict on ``block`` and the identity of the file judged (the one a fix may
        move: a copy re-published under the name after this check is never touched)."""
        ns = namespaces[block.namespace or ""]
        assert block.group is not None
        group = ns.groups[block.group]
        codec = Codec.for_name(group.compression, group.layout.itemsize)
        spec = ShardSpec(group.layout, ns.digest, group.index, codec)
        try:
            return judge_block_file(block.path, spec, block.hash_hi, block.hash_lo)
        except FileNotFoundError as exc:
            return exc
        except OSError as exc:
            return BlockFault("unreadable", f"{type(exc).__name__}: {exc}"), None

    findings: list[Finding] = []
    checked = vanished = 0
    total = sum(b.size for b in blocks)
    with (
        Progress(total, "verifying", unit="B", enabled=options.progress) as bar,
        ThreadPoolExecutor(max(1, options.threads)) as pool,
    ):
        for block, outcome in zip(blocks, pool.map(check, blocks), strict=True):
            bar.update(block.size)
            if isinstance(outcome, FileNotFoundError):
                vanished += 1  # evicted or quarantined while we looked: not a finding
                continue
            checked += 1
            fault, identity = outcome
            if fault is None:
                continue
            action = None
            if options.fix:
                ns = namespaces[block.namespace or ""]
                name = f"g{block.group}-{block.hash_hi}-{block.hash_lo}"
                action = _quarantine(ns, name, block.path, identity)
            findings.append(
                Finding(fault.kind, block.path, block.namespace, block.group, fault.detail, action)
            )
    return checked, vanished, findings


def _check_metadata(namespaces: Sequence[NamespaceView], options: VerifyOptions) -> list[Finding]:
    findings = []
    for ns in namespaces:
        for group in ns.groups:
            expected = json.loads(
                metadata.array_document(ns.identity, group.index, group.compression)
            )
            try:
                got = read_document(group.path)
            except StoreFormatError as exc:
                detail = str(exc)
            else:
                if got == expected:
                    continue
                detail = (
                    f"{group.path}/{ZARR_JSON}: expected the format v1 array document "
                    f"of this identity, got {'none' if got is None else 'a different one'}"
                )
            findings.append(
                Finding(
                    METADATA,
                    str(group.path / ZARR_JSON),
                    ns.name,
                    group.index,
                    detail,
                    _left(options),
                )
            )
    return findings


def _fix_temp(temp: Entry, detail: str, options: VerifyOptions) -> Finding:
    action = None
    if options.fix:
        # The file judged old, never one that took its name since (a by-name unlink would).
        try:
            outcome = remove_if_same(DEFAULT_FILEIO, None, temp.path, (temp.dev, temp.ino))
        except OSError as exc:
            action = f"left in place (cannot delete: {exc.strerror or exc})"
        else:
            action = {
                "removed": "deleted",
                "gone": "vanished before the fix",
                "replaced": "left in place (the name holds another file since the check)",
            }[outcome]
    return Finding(ORPHAN_TEMP, temp.path, temp.namespace, temp.group, detail, action)


def _fix_foreign(
    entry: Entry, namespaces: dict[str, NamespaceView], root: Path, options: VerifyOptions
) -> Finding:
    kind, detail = _describe_foreign(entry, root)
    action = None
    if options.fix:
        name = Path(entry.path).name
        held_dir = entry.namespace is not None and entry.group is None
        if kind == SYMLINK:
            action = _unlink_link(entry.path)  # inside the root: the link, never its target
        elif entry.namespace is None:
            action = "left in place (outside any namespace)"
        elif held_dir and name == QUARANTINE:
            action = "left in place (fix by hand: quarantine/ must be a directory)"
        else:
            ns = namespaces[entry.namespace]
            quarantined = "foreign-" + os.path.relpath(entry.path, ns.path).replace(os.sep, "-")
            action = _quarantine(ns, quarantined, entry.path, (entry.dev, entry.ino))
    return Finding(kind, entry.path, entry.namespace, entry.group, detail, action)


def _describe_foreign(entry: Entry, root: Path) -> tuple[str, str]:
    """(kind, detail) of a foreign entry: symlink, special-file or foreign."""
    what = kind_noun(entry.mode) if entry.mode else ("directory" if entry.is_dir else "file")
    held_dir = entry.namespace is not None and entry.group is None
    name = Path(entry.path).name
    role = ""
    if held_dir and name in (TRASH, QUARANTINE):
        role = (
            f"{name}/ must be a real directory; nothing is moved into this one"
            + ("; gc deletes evicted blocks directly meanwhile" if name == TRASH else "")
            + ". "
        )
    if stat.S_ISLNK(entry.mode):
        try:
            target = str(Path(entry.path).readlink())
        except OSError:
            target = "?"
        # realpath only lstats and readlinks along the way: nothing is opened.
        resolved = os.path.realpath(Path(entry.path).parent / target)
        where = "inside" if _inside(resolved, root) else "OUTSIDE"
        return SYMLINK, (
            f"{role}symbolic link to {target!r} ({where} the root): never followed, not part of "
            "format v1"
        )
    if entry.mode and not (stat.S_ISREG(entry.mode) or stat.S_ISDIR(entry.mode)):
        return SPECIAL_FILE, f"{role}unexpected {what}: never opened, not part of format v1"
    return FOREIGN, f"{role}unexpected {what} ({format_size(entry.size)}): not part of format v1"


def _inside(path: str, root: Path) -> bool:
    real_root = os.path.realpath(root)
    return path == real_root or path.startswith(real_root + os.sep)


def _unlink_link(path: str) -> str:
    try:
        Path(path).unlink()  # unlink never follows a link: the target is untouched
    except FileNotFoundError:
        return "vanished before the fix"
    except OSError as exc:
        return f"left in place (cannot unlink: {exc.strerror})"
    return "unlinked (the link only)"


def _quarantine(ns: NamespaceView, name: str, path: str, identity: FileId | None) -> str:
    """Move the file judged (``identity``; None: a non-regular entry, moved by name) into
    quarantine; the action taken, in words."""
    try:
        moved = quarantine_file(ns.path, name, path, identity)
    except ReplacedError:
        return "left in place (the name holds another file since the check: re-published)"
    except HeldDirectoryError as exc:
        return f"left in place ({exc})"
    except OSError as exc:
        return f"left in place (cannot move: {exc.strerror or exc})"
    return _quarantined(moved, ns)


def _quarantined(moved: str | None, ns: NamespaceView) -> str:
    if moved is None:
        return "vanished before the fix"
    return f"quarantined as {os.path.relpath(moved, ns.path.parent)}"


def _left(options: VerifyOptions) -> str | None:
    return "left in place (fix by hand)" if options.fix else None


def _rel(path: str, root: Path) -> str:
    try:
        return os.path.relpath(path, root)
    except ValueError:
        return path


def render(doc: dict[str, Any]) -> list[str]:
    b = doc["blocks"]
    sample = "" if doc["sample"] >= 1 else f" (sample {doc['sample']:g})"
    lines = [
        f"store {doc['root']}: checked {b['checked']} of {b['found']} blocks{sample}, "
        f"{format_size(b['checked_bytes'])}"
        + (f"; {b['vanished']} vanished while checking" if b["vanished"] else "")
    ]
    if doc["in_flight_temps"]:
        lines.append(
            f"  {len(doc['in_flight_temps'])} temporary file(s) younger than --tmp-age "
            "(writes in flight; left alone)"
        )
    findings = doc["findings"]
    if not findings:
        lines.append("  no findings")
        return lines
    summary = ", ".join(f"{n} {kind}" for kind, n in sorted(doc["counts"].items()))
    lines.append(f"  {len(findings)} finding(s): {summary}")
    rows = [
        [f["kind"], f["path"], f["detail"]] + ([f["action"] or "-"] if doc["fix"] else [])
        for f in findings
    ]
    headers = ["kind", "path", "detail"] + (["action"] if doc["fix"] else [])
    return lines + table(headers, rows)


def run(root: Path, options: VerifyOptions, *, as_json: bool) -> int:
    """``kvstore verify``: exit 0 clean, 1 findings (fixed or not)."""
    doc = verify_store(root, options)
    if as_json:
        print_json(doc)
    else:
        print_lines(render(doc))
    return 1 if doc["findings"] else 0

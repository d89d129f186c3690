"""``kvstore verify`` as a command: the run's exit status and what it prints.

:func:`run` calls :func:`kvstore.admin.verify.verify_store` (the checks and fixes, and the
JSON document of ``--json``) and prints the table of :func:`render`; a Ctrl-C prints
:func:`render_partial` on stderr and exits 130 (nothing on stdout: a document would claim a
whole run).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from kvstore.admin.report import print_json, print_lines, table
from kvstore.admin.sizes import format_size
from kvstore.admin.verify import (
    MAX_LISTED_BLOCK_FINDINGS,
    VerifyInterrupted,
    VerifyOptions,
    verify_store,
)

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C


def render(doc: dict[str, Any]) -> list[str]:
    b = doc["blocks"]
    sample = "" if doc["sample"] >= 1 else f" (sample {doc['sample']:g}: {b['chosen']} chosen)"
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
    if not doc["counts"]:
        lines.append("  no findings")
        return lines
    lines.append(f"  {sum(doc['counts'].values())} finding(s): {_summary(doc['counts'])}")
    if doc["findings_omitted"]:
        lines.append(
            f"  listing the first {MAX_LISTED_BLOCK_FINDINGS} bad blocks (scan order) and every "
            f"other finding; {doc['findings_omitted']} more bad block(s) not listed"
            + (" (all fixed like those listed)" if doc["fix"] else "")
        )
    rows = [
        [f["kind"], f["path"], f["detail"]] + ([f["action"] or "-"] if doc["fix"] else [])
        for f in findings
    ]
    headers = ["kind", "path", "detail"] + (["action"] if doc["fix"] else [])
    return lines + table(headers, rows)


def render_partial(partial: dict[str, Any]) -> list[str]:
    """The lines ``kvstore verify`` prints on stderr when a Ctrl-C stopped it."""
    b, dirs = partial["blocks"], partial["fanout_dirs"]
    counts = partial["counts"]
    found = f"findings so far: {_summary(counts)}" if counts else "no findings so far"
    if partial["fix"]:
        found += f" ({partial['fixed']} quarantined)"
    return [
        "kvstore: verify interrupted; every check and fix in flight finished (nothing is "
        "half-done)",
        f"  scanned {dirs['scanned']} of {dirs['total']} fan-out directories: "
        f"{b['found']} blocks listed, {b['checked']} checked "
        f"({format_size(b['checked_bytes'])}), {b['vanished']} vanished",
        f"  {found}",
        "  every block was checked; the sweep of temporary, foreign and unreadable entries "
        "was cut short (run verify again)"
        if partial["blocks_done"]
        else "  not checked: the remaining blocks, temporary files, foreign and unreadable "
        "entries (run verify again)",
    ]


def _summary(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))


def run(root: Path, options: VerifyOptions, *, as_json: bool) -> int:
    """``kvstore verify``: exit 0 clean, 1 findings (fixed or not), 130 stopped by Ctrl-C
    (a partial summary on stderr, nothing on stdout: a document would claim a whole run)."""
    try:
        doc = verify_store(root, options)
    except VerifyInterrupted as stopped:
        print_lines(render_partial(stopped.partial), sys.stderr)
        return EXIT_INTERRUPTED
    if as_json:
        print_json(doc)
    else:
        print_lines(render(doc))
    return 1 if doc["counts"] else 0

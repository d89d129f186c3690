"""The admin subcommands of ``kvstore`` (ls, du, verify, gc, rm): arguments and dispatch.

:func:`add_parsers` registers them on :mod:`kvstore.cli`'s parser and :func:`dispatch` runs
one; the work is done by the module of each command. Exit codes follow the CLI: 0 ok,
1 findings (verify found something, gc could not reach the budget, rm not confirmed), 2 error.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvstore.admin import du, gc, ls, rm, verify, verify_cli
from kvstore.admin.sizes import parse_duration, parse_size
from kvstore.admin.trash import DEFAULT_GRACE_S
from kvstore.cli_args import OneLineParser, positive_int, store_root

COMMANDS = ("ls", "du", "verify", "gc", "rm")
JSON_HELP = "print JSON for machines instead of the table"


def add_parsers(sub: argparse._SubParsersAction[OneLineParser]) -> None:
    """Register ls, du, verify, gc, rm on the ``kvstore`` command's subparsers."""
    root_help = "store directory"
    p_ls = sub.add_parser(
        "ls",
        help="list namespaces, or the blocks of one namespace",
        description="Namespaces (model, dtype, groups, blocks, bytes, oldest/newest last use); "
        "with NS, its blocks (hash, parent, tokens, size, last use) in scan order, streamed.",
    )
    p_ls.add_argument("root", type=store_root, help=root_help)
    p_ls.add_argument("namespace", nargs="?", help="namespace directory name")
    p_ls.add_argument("--json", action="store_true", help=JSON_HELP)
    p_du = sub.add_parser(
        "du",
        help="bytes per namespace and group, temp, quarantine, trash",
        description="Bytes per namespace and group, temporary files, quarantined files, trash.",
    )
    p_du.add_argument("root", type=store_root, help=root_help)
    p_du.add_argument("--json", action="store_true", help=JSON_HELP)
    v = sub.add_parser(
        "verify",
        help="check every block, find orphan temps and foreign files (--fix repairs)",
        description="Re-check every block file (size, header, key, identity, checksums) and find "
        "orphan temporary files and foreign files. Read-only unless --fix. Exit 1 on findings.",
    )
    v.add_argument("root", type=store_root, help=root_help)
    v.add_argument(
        "--fix",
        action="store_true",
        help="quarantine bad blocks and foreign entries, delete orphan temporary files",
    )
    v.add_argument(
        "--sample",
        type=_fraction,
        default=1.0,
        help="check this random fraction of blocks, 0<F<=1 (default: 1, all)",
    )
    v.add_argument("--seed", type=int, default=None, help="seed of --sample (default: random)")
    v.add_argument(
        "--tmp-age",
        type=_duration,
        default=verify.DEFAULT_TMP_AGE_S,
        help="temporary files older than this are orphans (default: 1h)",
    )
    v.add_argument("--threads", type=positive_int, default=4, help="reader threads (default: 4)")
    v.add_argument("--json", action="store_true", help=JSON_HELP)
    g = sub.add_parser(
        "gc",
        help="evict least recently used blocks (leaves of prefix chains first) to a budget",
        description="Evict least recently used blocks, leaves of prefix chains first, until the "
        "store is within --max-bytes and/or no block is older than --max-age. Evicted blocks are "
        "renamed into <ns>/trash/ and unlinked after --grace.",
    )
    g.add_argument("root", type=store_root, help=root_help)
    g.add_argument("--max-bytes", type=_size, help="size budget, e.g. 10G, 500MiB, 2TB")
    g.add_argument("--max-age", type=_duration, help="evict blocks unused for longer, e.g. 7d, 12h")
    g.add_argument("--dry-run", action="store_true", help="report what would go, change nothing")
    g.add_argument(
        "--grace",
        type=_duration,
        default=DEFAULT_GRACE_S,
        help="unlink trash entries older than this (default: 60s)",
    )
    g.add_argument(
        "--tmp-age",
        type=_duration,
        default=verify.DEFAULT_TMP_AGE_S,
        help="delete temporary files older than this (default: 1h)",
    )
    g.add_argument(
        "--watch", action="store_true", help="keep the store within budget until SIGINT/SIGTERM"
    )
    g.add_argument(
        "--interval",
        type=_duration,
        default=10.0,
        help="time between --watch passes (default: 10s)",
    )
    g.add_argument("--max-passes", type=positive_int, help="stop --watch after this many passes")
    g.add_argument(
        "--no-evict-ahead",
        dest="evict_ahead",
        action="store_false",
        help="--watch: evict only down to --max-bytes (by default a pass evicts ahead of what "
        "writers add until the next pass, up to half the budget: docs/operating.md)",
    )
    g.add_argument(
        "--metrics",
        type=_file_path,
        metavar="FILE",
        help="after every pass write Prometheus metrics to FILE, atomically (node-exporter "
        "textfile collector: name it *.prom); see docs/operating.md",
    )
    g.add_argument("--json", action="store_true", help=JSON_HELP)
    g.add_argument(
        "--list-victims",
        action="store_true",
        help="with --json: list every evicted block (by default a summary: counts, bytes, "
        "per namespace, last-use range)",
    )
    r = sub.add_parser(
        "rm",
        help="remove a namespace",
        description="Remove a namespace: rename it out of the store at once, delete it after "
        "--grace (or at once with --now).",
    )
    r.add_argument("root", type=store_root, help=root_help)
    r.add_argument("namespace", help="namespace directory name")
    r.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    r.add_argument(
        "--grace",
        type=_duration,
        default=DEFAULT_GRACE_S,
        help="wait this long for reads in flight before deleting (default: 60s)",
    )
    r.add_argument(
        "--now", action="store_true", help="delete at once (no server uses the namespace)"
    )
    r.add_argument("--json", action="store_true", help=JSON_HELP)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _file_path(text: str) -> Path:
    """argparse type: a file path, not empty (an unset shell variable must not mean '.')."""
    if not text:
        raise argparse.ArgumentTypeError("expected a file path, got '' (an empty path)")
    return Path(text)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


def dispatch(args: argparse.Namespace) -> int:
    """Run the admin command named by ``args.command``; its exit code."""
    if args.command == "ls":
        return ls.run(args.root, args.namespace, as_json=args.json)
    if args.command == "du":
        return du.run(args.root, as_json=args.json)
    if args.command == "verify":
        options = verify.VerifyOptions(
            fix=args.fix,
            sample=args.sample,
            tmp_age_s=args.tmp_age,
            threads=args.threads,
            seed=args.seed,
        )
        return verify_cli.run(args.root, options, as_json=args.json)
    if args.command == "gc":
        policy = gc.Policy(
            max_bytes=args.max_bytes,
            max_age_s=args.max_age,
            grace_s=args.grace,
            tmp_age_s=args.tmp_age,
            dry_run=args.dry_run,
            list_victims=args.list_victims,
            evict_ahead=args.evict_ahead,
        )
        return gc.run(
            args.root,
            policy,
            as_json=args.json,
            watch_interval_s=args.interval if args.watch else None,
            max_passes=args.max_passes,
            metrics_path=args.metrics,
        )
    if args.command == "rm":
        return rm.run(
            args.root,
            args.namespace,
            yes=args.yes,
            grace_s=args.grace,
            now=args.now,
            as_json=args.json,
        )
    raise AssertionError(f"not an admin command: {args.command}")  # pragma: no cover

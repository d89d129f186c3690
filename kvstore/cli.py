"""The ``kvstore`` command: ``kvstore demo`` (the main job) and the storage admin commands
``ls``, ``du``, ``verify``, ``gc``, ``rm`` (logic in :mod:`kvstore.admin`, docs in docs/admin.md).

Exit codes: 0 success, 1 findings (a demo byte that did not verify), 2 error (bad arguments,
unreadable store, identity mismatch); errors print one line naming what was expected and what
arrived.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

from kvstore import checksum, heap
from kvstore.admin import commands as admin_commands
from kvstore.cli_args import OneLineParser, positive_int, store_root
from kvstore.errors import KvstoreError
from kvstore.io import fileproto, stall, supervise
from kvstore.layout.parallel import ParallelLayout
from kvstore.models import model_names
from kvstore.native import native_report

# Both bindings register with kvstore.native on import; --version reports each.
_BINDINGS = (checksum.NATIVE_BATCH, fileproto.NATIVE_FILEPROTO)
# The first line of kvstore.demo's docstring (the demo is imported only to run it).
DEMO_SUMMARY = (
    "The main job: write a realistic prefix-cache workload, then read it back as a restarted "
    "server."
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="kvstore",
        description="Persistent KV-cache store for LLM inference (zarr v3 on a filesystem).",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log engine choices and warnings"
    )
    parser.add_argument(
        "--version",
        action=_VersionAction,
        help="print the version and which native calls run (KVSTORE_NATIVE), then exit",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "demo",
        help="write a prefix-cache workload, read it back from a new process, verify every byte",
        description=DEMO_SUMMARY,
    )
    d.add_argument(
        "--root",
        type=store_root,
        default=Path("kvcache"),
        help="store directory (default: ./kvcache)",
    )
    d.add_argument(
        "--model",
        default="llama-3.1-8b",
        choices=model_names(),
        help="KV geometry (default: llama-3.1-8b)",
    )
    d.add_argument(
        "--blocks", type=positive_int, default=256, help="unique blocks to write (default: 256)"
    )
    d.add_argument(
        "--block-tokens", type=positive_int, default=16, help="tokens per block (default: 16)"
    )
    d.add_argument(
        "--requests", type=positive_int, default=8, help="requests sharing prefixes (default: 8)"
    )
    d.add_argument("--threads", type=positive_int, default=4, help="I/O threads (default: 4)")
    d.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    d.add_argument(
        "--write-layout",
        default="",
        metavar="LAYOUT",
        help="write with every rank of a parallel layout, one process each "
        "(e.g. tp=2, tp=4,pp=2, tp=2,dcp=2)",
    )
    d.add_argument(
        "--read-layout",
        default="",
        metavar="LAYOUT",
        help="read back with every rank of another layout (e.g. tp=4 or tp=1)",
    )
    d.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    admin_commands.add_parsers(sub)
    return parser


class _VersionAction(argparse.Action):
    """``--version``: kvstore's version, then one line for the ``KVSTORE_NATIVE`` switch and
    one per C extension (native from which file, or the Python reference and why)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        logging.disable(logging.WARNING)  # the report says why; no second line per extension
        try:
            lines, satisfied = native_report()
        except KvstoreError as exc:
            parser.exit(2, f"kvstore: error: {exc}\n")
        print("\n".join([f"kvstore {version('kvstore')}", *lines]))
        # 2: KVSTORE_NATIVE=require and an extension cannot be used (the report says which)
        parser.exit(0 if satisfied else 2)


def _layout(text: str) -> str:
    """Validate a layout string early (a clear error before any work); "" means none."""
    return str(ParallelLayout.parse(text)) if text else ""


EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s"
    )
    try:
        if args.command == "demo":
            # Imported here: the demo needs torch, the admin commands do not.
            from kvstore import demo  # noqa: PLC0415

            spec = demo.DemoSpec(
                root=args.root,
                model=args.model,
                blocks=args.blocks,
                tokens=args.block_tokens,
                requests=args.requests,
                threads=args.threads,
                seed=args.seed,
                write_layout=_layout(args.write_layout),
                read_layout=_layout(args.read_layout),
            )
            return demo.run(spec, args.json)
        if args.command in admin_commands.COMMANDS:
            with stall.watching(f"kvstore {args.command}", args.root):  # a hung mount: exit
                return admin_commands.dispatch(args)
    except (KvstoreError, OSError, ValueError) as exc:
        print(f"kvstore: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Every change the tools make is one rename or unlink: a Ctrl-C between two leaves
        # nothing half-done (gc's victims so far are in trash, the rest still published).
        print(f"kvstore {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 2  # pragma: no cover - argparse rejects unknown commands


def entry() -> None:
    """The console script (and ``python -m kvstore.cli``): :func:`main` in a worker process
    that a hung mount cannot keep from exiting (kvstore.io.supervise), with the collector
    set for walks of millions of entries (kvstore/heap.py; the worker is forked: it inherits
    them). Not in :func:`main`, which tests call in their own process."""
    heap.tune_for_batch_tool()
    sys.exit(supervise.run(main))


if __name__ == "__main__":
    entry()

"""kvstore benchmarks: every claim measured next to what users would pick instead, same run.

Suites (``--suite NAME[,NAME]``; all by default), one module each:

* ``throughput`` (:mod:`kvstore.bench.throughput`): write, cold read and hot read of the same
  blocks through kvstore, the raw floor, vLLM 0.33's filesystem tier I/O and per-block
  safetensors files; ratios of kvstore to each.
* ``lookup`` (:mod:`kvstore.bench.lookup`): longest-prefix lookup on a big store vs one
  existence check per key (and vLLM's C batch lookup).
* ``layouts`` (:mod:`kvstore.bench.layouts`): blocks written at one parallel layout read at
  another, vs same-layout reads.
* ``scaling`` (:mod:`kvstore.bench.scaling`): kvstore vs raw floor by threads and block size;
  write and lookup cost as the store grows.
* ``compression`` (:mod:`kvstore.bench.compression`): codec ratio and speed on KV-like values,
  and the store with each compression setting.
* ``overhead`` (:mod:`kvstore.bench.overhead`): Python time per block over the raw floor.
* ``tier`` (:mod:`kvstore.bench.tier`): kvstore as vLLM's secondary tier vs vLLM's ``fs`` tier,
  behind the same tiering manager (needs vLLM 0.33).
* ``scale`` (:mod:`kvstore.bench.scale`): every admin and inspection command's wall time and
  peak RSS as the store grows (``--scale-sizes``), with each one's RSS growth.

Run only when named (multi-process stress runs of minutes, not part of ``all`` or ``--full``):

* ``writers`` (:mod:`kvstore.bench.writers`): 1, 2, 4, 8 writer processes into one store
  (``--writers-procs``), disjoint and overlapping keys; aggregate blocks/s and MB/s, and every
  key published once, no temporaries left, every block's bytes, ``kvstore verify`` clean.
* ``soak`` (:mod:`kvstore.bench.soak`): writers, readers and ``kvstore gc --watch`` together
  for ``--soak-seconds``; nothing wrong read, no acknowledged block lost (every missing one is
  among gc's victims), ``kvstore verify`` clean.

The report (machine, targets, the markdown page) is :mod:`kvstore.bench.report`; the systems
the throughput suite compares are :mod:`kvstore.bench.systems`.

``--tmpfs`` is the fast-storage run: throughput and overhead on tmpfs
(``/dev/shm``, a stand-in for storage faster than the code), kvstore against the raw floor for
every model of ``models.json`` at 16- and 256-token blocks, with the ratios measured at the
commit before the fast-path work printed next to this run's
(:data:`kvstore.bench.throughput.TMPFS_BASELINE`), then the same comparison by CPU time
(:func:`kvstore.bench.throughput.cpu_ab`, which other jobs on a shared machine barely move).
Both tables also give kvstore / the protocol floor (:mod:`kvstore.bench.floor`: the system
calls and checksums kvstore's protocol requires, in the leanest Python) and floor / raw, so
what kvstore's code costs and what its protocol costs are told apart. Any other ``--root`` on any file system works the same way; ``--tmpfs`` only picks the
defaults.

The default run takes about two minutes on a 2-core VM (small data); ``--full`` runs the
figures of docs/performance.md (>= 4 GiB per throughput configuration, two models, a store of
a million blocks). Absolute figures on shared VMs drift by 20-30 % minutes apart, so every
figure is paired with its baseline measured right next to it, and ratios are what count.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvstore.bench import (
    compression,
    layouts,
    lookup,
    overhead,
    scale,
    scaling,
    soak,
    throughput,
    tier,
    writers,
)
from kvstore.bench.common import DATA_NOTE
from kvstore.bench.report import legacy_keys, machine, markdown_report, targets
from kvstore.bench.systems import SYSTEMS
from kvstore.io.fileio import filesystem_type
from kvstore.models import model_names

SUITES = ("throughput", "lookup", "layouts", "scaling", "compression", "overhead", "tier", "scale")
# Suites run only when --suite names them: multi-process stress runs with checks, minutes each.
ON_REQUEST_SUITES = ("writers", "soak")
# The default run: the store against the raw floor, lookup and per-block overhead, in about a
# minute on the 2-core reference machine; the other suites with --suite or --full.
QUICK_SUITES = ("throughput", "lookup", "overhead")

# Parameters: (default run, --full run). An explicit flag overrides both.
PRESETS: dict[str, tuple[Any, Any]] = {
    "models": ("llama-3.1-8b", "llama-3.1-8b,llama-3.1-70b"),
    "block_tokens": ("16,256", "16,256"),
    "gib": (0.25, 4.0),
    "repeat": (2, 3),
    "store_blocks": (20_000, 1_000_000),
    "store_sizes": ("10000,20000", "10000,100000,1000000"),
    "scale_sizes": ("10000,100000", "10000,100000,1000000"),
    "scale_check_mib": ("128", "512"),
    "scaling_threads": ("1,4,16", "1,2,4,8,16"),
    "scaling_tokens": ("16,64,256", "16,32,64,128,256"),
    "scaling_gib": (0.125, 1.0),
    "layout_gib": (0.125, 1.0),
    "compression_gib": (0.125, 1.0),
    "overhead_blocks": (4000, 20000),
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _pairs(text: str) -> list[str]:
    """'a:b,c:d' or 'a,x:b;c:d' (layouts that contain commas) into ['a:b', 'c:d']."""
    if not text:
        return []
    if ";" in text:
        return [p.strip() for p in text.split(";") if p.strip()]
    pairs: list[str] = []
    for part in text.split(","):
        if ":" in part:
            pairs.append(part)
        elif pairs:  # a layout continued after a comma, e.g. "tp=2,pp=2"
            pairs[-1] += "," + part
    return pairs


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench", description=(__doc__ or "").split("\n\n")[0], allow_abbrev=False
    )
    parser.add_argument(
        "--suite",
        default=None,
        help=(
            f"comma list of {SUITES + ON_REQUEST_SUITES} or 'all' (default: "
            f"{','.join(QUICK_SUITES)}; --full and 'all': {','.join(SUITES)})"
        ),
    )
    parser.add_argument("--full", action="store_true", help="the big runs of docs/performance.md")
    parser.add_argument(
        "--root", type=Path, default=None, help="scratch directory (default ./bench-scratch)"
    )
    parser.add_argument("--models", "--model", dest="models", default=None)
    parser.add_argument("--block-tokens", default=None, help="comma-separated list")
    parser.add_argument("--gib", type=float, default=None, help="data per throughput config")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--durability", choices=["full", "none"], default="full")
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument(
        "--systems", default=None, help=f"throughput systems (default: {','.join(SYSTEMS)})"
    )
    parser.add_argument(
        "--tmpfs",
        action="store_true",
        help=(
            "fast-storage run: throughput and overhead under /dev/shm, every model at 16 and "
            "256 tokens, kvstore vs raw and the protocol floor; prints the ratios next to the "
            "old ones"
        ),
    )
    parser.add_argument("--store-blocks", type=int, default=None, help="lookup store size")
    parser.add_argument("--store-sizes", default=None, help="scaling store-size checkpoints")
    parser.add_argument(
        "--scale-sizes", default=None, help="scale suite: store sizes the commands run at"
    )
    parser.add_argument(
        "--scale-check-mib",
        default=None,
        help="scale suite: MiB of each larger-block store verify runs on against its read "
        "floor (0: none)",
    )
    parser.add_argument("--scaling-threads", default=None)
    parser.add_argument("--scaling-tokens", default=None)
    parser.add_argument("--scaling-gib", type=float, default=None)
    parser.add_argument(
        "--layouts",
        default=",".join(layouts.DEFAULT_PAIRS),
        help="cross-layout pairs WRITE:READ, comma-separated (layouts with commas: use ';')",
    )
    parser.add_argument("--layout-gib", type=float, default=None)
    parser.add_argument("--compression-gib", type=float, default=None)
    parser.add_argument("--overhead-blocks", type=int, default=None)
    parser.add_argument(
        "--tier-lookup-blocks",
        default="1000,64000",
        help="tier suite: stored-block counts at which lookups are timed (comma list)",
    )
    parser.add_argument(
        "--tier-slice",
        type=int,
        default=None,
        help="tier suite: the systems take turns every N blocks (default: one after the other)",
    )
    _add_stress_args(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--markdown", type=Path, default=None, help="write a markdown page (and PNGs next to it)"
    )
    parser.add_argument("--plots", type=Path, default=None, help="directory for PNG plots")
    parser.add_argument("--save-json", type=Path, default=None, help="also save the report here")
    parser.add_argument(
        "--render",
        type=Path,
        default=None,
        help="run nothing: write --markdown (and plots) from a report saved with --save-json",
    )
    args = parser.parse_args(argv)
    if args.tmpfs:
        _tmpfs_defaults(args)
    if args.systems is None:
        args.systems = ",".join(SYSTEMS)
    for name, (small, full) in PRESETS.items():
        if getattr(args, name) is None:
            setattr(args, name, full if args.full else small)
    if args.suite is None:
        args.suite = ",".join(SUITES if args.full else QUICK_SUITES)
    suites = list(SUITES) if args.suite == "all" else _names(args.suite)
    unknown = [s for s in suites if s not in SUITES + ON_REQUEST_SUITES]
    if unknown:
        parser.error(
            f"--suite: unknown {unknown}; expected names from {list(SUITES + ON_REQUEST_SUITES)}"
        )
    args.suites = suites
    return args


def _add_stress_args(parser: argparse.ArgumentParser) -> None:
    """The options of the suites run only on request (:data:`ON_REQUEST_SUITES`)."""
    parser.add_argument(
        "--writers-procs", default="1,2,4,8", help="writers suite: process counts (comma list)"
    )
    parser.add_argument(
        "--writers-blocks", type=int, default=20_000, help="writers suite: blocks per process"
    )
    parser.add_argument(
        "--writers-modes",
        default=",".join(writers.MODES),
        help=f"writers suite: key modes, comma list of {writers.MODES}",
    )
    parser.add_argument("--soak-seconds", type=float, default=120.0, help="soak suite: duration")
    parser.add_argument("--soak-writers", type=int, default=2, help="soak suite: writer processes")
    parser.add_argument("--soak-readers", type=int, default=2, help="soak suite: reader processes")
    parser.add_argument(
        "--soak-rate",
        type=float,
        default=500.0,
        help="soak suite: blocks/s per writer at most (0: unpaced)",
    )
    parser.add_argument(
        "--soak-budget",
        type=int,
        default=None,
        help="soak suite: gc --max-bytes in bytes (default: half of what the writers write)",
    )
    parser.add_argument(
        "--soak-interval", type=float, default=1.0, help="soak suite: gc --watch --interval"
    )


# The fast-storage run's scratch directory (tmpfs on Linux).
TMPFS_ROOT = Path("/dev/shm/kvstore-bench")  # noqa: S108 - tmpfs on purpose: I/O at memory speed


def _tmpfs_defaults(args: argparse.Namespace) -> None:
    """``--tmpfs``: the fast-storage run's defaults for every option not given."""
    if args.root is None:
        args.root = TMPFS_ROOT
    if args.suite is None:
        args.suite = "throughput,overhead"
    if args.models is None:
        args.models = ",".join(model_names())
    if args.block_tokens is None:
        args.block_tokens = "16,256"
    if args.systems is None:
        args.systems = "kvstore,raw,floor"
    if args.repeat is None:
        args.repeat = 3


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render is not None:
        saved: dict[str, Any] = json.loads(args.render.read_text())
        saved["targets"] = targets(saved)
        _write_outputs(args, saved)
        return 0
    base = (args.root or Path("bench-scratch")).absolute()
    base.mkdir(parents=True, exist_ok=True)
    if args.tmpfs and filesystem_type(base) != "tmpfs":
        print(f"note: {base} is on {filesystem_type(base) or 'an unknown file system'}, not tmpfs")
    report: dict[str, Any] = {
        "command": _command(argv),
        "machine": machine(base),
        "data": DATA_NOTE,
        "suites": {},
    }
    started = time.perf_counter()
    try:
        for name in args.suites:
            t0 = time.perf_counter()
            report["suites"][name] = RUNNERS[name](args, base)
            report["suites"][name]["seconds"] = round(time.perf_counter() - t0, 1)
            if not args.json:
                print(f"== {name} ({report['suites'][name]['seconds']} s)", flush=True)
                print(TABLES[name](report["suites"][name]), flush=True)
        if args.tmpfs and "throughput" in report["suites"]:
            # The same comparison by CPU time: on a shared machine the wall-clock ratios
            # move by tenths between runs, these much less (throughput.cpu_ab).
            report["suites"]["throughput"]["cpu_ab"] = throughput.cpu_ab(
                base / "cpu-ab", _names(args.models), _ints(args.block_tokens), args.threads
            )
    finally:
        lookup.close_all()
        if args.root is None or (args.tmpfs and args.root == TMPFS_ROOT):
            shutil.rmtree(base, ignore_errors=True)
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["targets"] = targets(report)
    legacy_keys(report)
    if args.save_json:
        args.save_json.write_text(json.dumps(report, indent=2, default=str))
    _write_outputs(args, report)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print("== targets")
        for row in report["targets"]:
            print(f"  {row['what']:<36} {row['target']:>6}  got {row['got']:<22} {row['verdict']}")
        print(f"total {report['seconds']} s")
        if args.tmpfs:
            print("\n".join(_tmpfs_tables(report["suites"])))
    return _exit_status(report)


def _exit_status(report: dict[str, Any]) -> int:
    """1 when a suite's own checks failed (writers, soak: ``"ok": false``), else 0."""
    failed = [name for name, suite in report["suites"].items() if suite.get("ok") is False]
    if failed:
        print(f"FAILED checks in suite(s): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _tmpfs_tables(suites: dict[str, Any]) -> list[str]:
    """``--tmpfs``'s tables: kvstore / raw of this run next to the baseline's, wall clock and
    CPU time, and the per-block overhead."""
    lines: list[str] = []
    if "throughput" in suites:
        lines.append("== fast storage: kvstore / raw floor, this run next to the baseline")
        lines += throughput.versus_baseline(suites["throughput"])
        if "cpu_ab" in suites["throughput"]:
            lines.append("== fast storage by CPU time: kvstore / raw floor, next to the baseline")
            lines += throughput.cpu_versus_baseline(suites["throughput"]["cpu_ab"])
    if "overhead" in suites:
        lines.append(overhead.versus_baseline(suites["overhead"]))
    return lines


def _write_outputs(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """PNG plots (next to --markdown, or in --plots) and the markdown page."""
    plots: list[Path] = []
    plot_dir = args.plots or (args.markdown.parent if args.markdown else None)
    if plot_dir is not None:
        plot_dir.mkdir(parents=True, exist_ok=True)
        for name, result in report["suites"].items():
            if name in PLOTS:
                plots += PLOTS[name](result, plot_dir)
    if args.markdown:
        previous = args.markdown.read_text() if args.markdown.is_file() else ""
        args.markdown.write_text(
            markdown_report(report, plots, args.markdown.parent, previous=previous)
        )


# -- suite runners ---------------------------------------------------------------------------


def _run_throughput(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    return throughput.run(
        base / "throughput",
        _names(args.models),
        _ints(args.block_tokens),
        args.gib,
        args.threads,
        args.durability,
        args.repeat,
        _names(args.systems),
    )


def _run_lookup(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    sizes = _ints(args.store_sizes) if "scaling" in args.suites else []
    lookup.chain_store(base, max([args.store_blocks, *sizes]), sizes)  # built once
    return lookup.run(base, max([args.store_blocks, *sizes]))


def _run_layouts(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    rows = layouts.cross_layout(
        base / "layouts",
        _names(args.models)[0],
        16,
        args.layout_gib,
        args.threads,
        _pairs(args.layouts),
        repeat=args.repeat,
    )
    return {"rows": rows, "gib": args.layout_gib, "threads": args.threads}


def _run_scaling(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    return scaling.run(
        base,
        _names(args.models)[0],
        _ints(args.scaling_threads),
        _ints(args.scaling_tokens),
        args.threads,
        args.scaling_gib,
        args.durability,
        args.repeat,
        _ints(args.store_sizes),
    )


def _run_compression(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    return compression.run(
        base / "compression",
        _names(args.models)[0],
        _ints(args.block_tokens),
        args.compression_gib,
        args.threads,
        args.durability,
        args.repeat,
    )


def _run_overhead(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    return overhead.run(args.overhead_blocks)


RUNNERS: dict[str, Callable[[argparse.Namespace, Path], dict[str, Any]]] = {
    "throughput": _run_throughput,
    "lookup": _run_lookup,
    "layouts": _run_layouts,
    "scaling": _run_scaling,
    "compression": _run_compression,
    "overhead": _run_overhead,
    "scale": lambda args, base: scale.run(base, _ints(args.scale_sizes), int(args.scale_check_mib)),
    "writers": lambda args, base: writers.run(
        base,
        _ints(args.writers_procs),
        args.writers_blocks,
        _names(args.writers_modes),
        durability=args.durability,
        threads=args.threads,
    ),
    "soak": lambda args, base: soak.run(
        base,
        args.soak_seconds,
        writers=args.soak_writers,
        readers=args.soak_readers,
        rate=args.soak_rate,
        budget=args.soak_budget,
        interval=args.soak_interval,
        durability=args.durability,
        threads=args.threads,
    ),
    "tier": lambda args, base: tier.run(
        base / "tier",
        _names(args.models)[0],
        args.gib,
        _ints(args.tier_lookup_blocks),
        slice_blocks=args.tier_slice,
    ),
}
TABLES: dict[str, Callable[[dict[str, Any]], str]] = {
    "throughput": throughput.table,
    "lookup": lookup.table,
    "layouts": lambda r: layouts.table(r["rows"]),
    "scaling": scaling.table,
    "compression": compression.table,
    "overhead": overhead.table,
    "tier": tier.table,
    "scale": scale.table,
    "writers": writers.table,
    "soak": soak.table,
}
PLOTS: dict[str, Callable[[dict[str, Any], Path], list[Path]]] = {
    "throughput": throughput.plot,
    "lookup": lookup.plot,
    "layouts": lambda r, d: layouts.plot(r["rows"], d),
    "scaling": scaling.plot,
    "compression": compression.plot,
}


def _command(argv: Sequence[str] | None) -> str:
    args = list(argv if argv is not None else sys.argv[1:])
    return " ".join(["python scripts/bench.py", *args])

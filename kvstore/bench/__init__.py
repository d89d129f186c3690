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

The default run takes about two minutes on a 2-core VM (small data); ``--full`` runs the
figures of docs/performance.md (>= 4 GiB per throughput configuration, two models, a store of
a million blocks). Absolute figures on shared VMs drift by 20-30 % minutes apart, so every
figure is paired with its baseline measured right next to it, and ratios are what count.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
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
    scaling,
    throughput,
)
from kvstore.bench.common import DATA_NOTE

SUITES = ("throughput", "lookup", "layouts", "scaling", "compression", "overhead")
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
        help=f"comma list of {SUITES} or 'all' (default: {','.join(QUICK_SUITES)}; --full: all)",
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
        "--systems", default=",".join(throughput.SYSTEMS), help="throughput systems"
    )
    parser.add_argument("--store-blocks", type=int, default=None, help="lookup store size")
    parser.add_argument("--store-sizes", default=None, help="scaling store-size checkpoints")
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
    for name, (small, full) in PRESETS.items():
        if getattr(args, name) is None:
            setattr(args, name, full if args.full else small)
    if args.suite is None:
        args.suite = ",".join(SUITES if args.full else QUICK_SUITES)
    suites = list(SUITES) if args.suite == "all" else _names(args.suite)
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        parser.error(f"--suite: unknown {unknown}; expected names from {list(SUITES)}")
    args.suites = suites
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render is not None:
        saved: dict[str, Any] = json.loads(args.render.read_text())
        saved["targets"] = targets(saved)
        _write_outputs(args, saved)
        return 0
    base = (args.root or Path("bench-scratch")).absolute()
    base.mkdir(parents=True, exist_ok=True)
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
    finally:
        lookup.close_all()
        if args.root is None:
            shutil.rmtree(base, ignore_errors=True)
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["targets"] = targets(report)
    _legacy_keys(report)
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
    return 0


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
        args.markdown.write_text(markdown_report(report, plots, args.markdown.parent))


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
}
TABLES: dict[str, Callable[[dict[str, Any]], str]] = {
    "throughput": throughput.table,
    "lookup": lookup.table,
    "layouts": lambda r: layouts.table(r["rows"]),
    "scaling": scaling.table,
    "compression": compression.table,
    "overhead": overhead.table,
}
PLOTS: dict[str, Callable[[dict[str, Any], Path], list[Path]]] = {
    "throughput": throughput.plot,
    "lookup": lookup.plot,
    "layouts": lambda r, d: layouts.plot(r["rows"], d),
    "scaling": scaling.plot,
    "compression": compression.plot,
}


# -- report ----------------------------------------------------------------------------------


def machine(base: Path) -> dict[str, Any]:
    """What the figures were measured on."""
    fs = "?"
    try:
        best = ""
        for line in Path("/proc/mounts").read_text().splitlines():
            _dev, mount, kind, *_ = line.split()
            if str(base).startswith(mount) and len(mount) >= len(best):
                best, fs = mount, kind
    except OSError:
        pass
    mem = 0
    with contextlib.suppress(ValueError, OSError):
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(mem / 2**30, 1),
        "filesystem": fs,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }


def targets(report: dict[str, Any]) -> list[dict[str, str]]:
    """The issue's targets with the worst figure of this run against each."""
    suites = report["suites"]
    rows: list[dict[str, str]] = []

    def add(what: str, target: str, values: list[tuple[float, str]]) -> None:
        if not values:
            rows.append({"what": what, "target": target, "got": "not measured", "verdict": "-"})
            return
        worst, where = min(values)
        bound = float(target.rsplit(maxsplit=1)[-1])
        verdict = "met" if worst >= bound else "MISSED"
        rows.append(
            {"what": what, "target": target, "got": f"{worst:.2f} ({where})", "verdict": verdict}
        )

    configs = suites.get("throughput", {}).get("configs", [])
    for mine in throughput.MINE:
        for other, label, target in (
            ("raw", "raw floor", ">= 0.9"),
            ("vllm-fs", "vLLM fs tier", ">= 1.0"),
        ):
            for phase, pname in (("write", "write"), ("cold", "cold read")):
                values = [
                    (c["ratios"][mine][other][phase], f"{c['model']}/{c['block_tokens']}")
                    for c in configs
                    if other in c["ratios"].get(mine, {})
                ]
                if mine == "kvstore" or (values and other != "raw"):
                    # kvstore-direct reads with O_DIRECT: its peer is vLLM's tier (O_DIRECT too),
                    # not the raw floor's buffered reads.
                    add(f"{mine} / {label}, {pname}", target, values)
    lookups = suites.get("lookup", {}).get("lookups", [])
    add(
        "lookup speedup at 8k blocks",
        ">= 10",
        [
            (lk["speedup_vs_per_key"], "vs per-key stat")
            for lk in lookups
            if lk["chain_blocks"] == 8192
        ],
    )
    layout_rows = suites.get("layouts", {}).get("rows", [])
    add(
        "cross-layout / same-layout read",
        ">= 0.9",
        [(r["ratio_to_same_layout"], f"{r['written_at']}->{r['read_at']}") for r in layout_rows],
    )
    return rows


def _legacy_keys(report: dict[str, Any]) -> None:
    """Top-level write/read of the first throughput configuration (earlier JSON contract)."""
    configs = report["suites"].get("throughput", {}).get("configs", [])
    if configs and "raw" in configs[0]["systems"]:
        cfg = configs[0]
        for phase, key in (("write", "write"), ("cold", "read")):
            store = cfg["systems"]["kvstore"][f"{phase}_gbs"]
            raw = cfg["systems"]["raw"][f"{phase}_gbs"]
            report[key] = {
                "store_gbs": store,
                "raw_gbs": raw,
                "ratio_to_raw": round(store / raw, 3),
            }


def _command(argv: Sequence[str] | None) -> str:
    args = list(argv if argv is not None else sys.argv[1:])
    return " ".join(["python scripts/bench.py", *args])


SECTIONS = (
    ("throughput", "Throughput: kvstore vs raw floor, vLLM's fs tier, safetensors"),
    ("lookup", "Lookup"),
    ("layouts", "Cross-layout reads"),
    ("scaling", "Scaling"),
    ("compression", "Compression"),
    ("overhead", "Python overhead per block"),
)
PLOT_FILES = {
    "throughput": ["perf_throughput.png"],
    "lookup": ["perf_lookup.png"],
    "layouts": ["perf_layouts.png"],
    "scaling": ["perf_scaling_threads.png", "perf_scaling_block.png", "perf_store_size.png"],
    "compression": ["perf_compression.png"],
}


def markdown_report(report: dict[str, Any], plots: Sequence[Path], page_dir: Path) -> str:
    """The figures as a markdown page (docs/performance.md), with the command that made them."""
    m = report["machine"]
    suites = report["suites"]
    lines = [
        "# kvstore performance",
        "",
        "Produced by the benchmark script; reproduce with:",
        "",
        f"    {report['command']}",
        "",
        f"Measured {m['date_utc']} UTC on {m['cpus']} CPUs, {m['memory_gib']} GiB memory, "
        f"{m['filesystem']} (kernel {m['kernel']}, Python {m['python']}); the whole run took "
        f"{report['seconds']:.0f} s. Absolute figures drift 20-30 % between runs on a shared "
        "host; every ratio compares measurements taken back to back in the same run.",
        "",
        f"Data written: {report['data']}.",
        "",
        "## Targets",
        "",
        "| what | target | worst in this run | |",
        "|---|---|---|---|",
    ]
    for row in report["targets"]:
        lines.append(f"| {row['what']} | {row['target']} | {row['got']} | {row['verdict']} |")
    names = {p.name for p in plots}
    for key, title in SECTIONS:
        if key not in suites:
            continue
        result = suites[key]
        body = {
            "throughput": throughput.markdown,
            "lookup": lookup.markdown,
            "layouts": lambda r: layouts.markdown(r["rows"]),
            "scaling": scaling.markdown,
            "compression": compression.markdown,
            "overhead": overhead.markdown,
        }[key](result)
        lines += ["", f"## {title}", "", *body]
        for png in PLOT_FILES.get(key, []):
            if png in names:
                lines += ["", f"![{png}]({png})"]
    lines += _scaleout_section(page_dir)
    lines += ["", *_notes(report)]
    return "\n".join(lines) + "\n"


def _scaleout_section(page_dir: Path) -> list[str]:
    """The scale-out figures (``scaleout.md`` beside the page, written by
    ``scripts/bench_scaleout.sh``, which needs root and GlusterFS), embedded as they are, so
    that the page holds every figure: its title replaced by this section's heading, its other
    headings below it."""
    source = page_dir / "scaleout.md"
    if not source.is_file():
        return []
    body = source.read_text(encoding="utf-8").splitlines()
    shift = 1  # an untitled page: its headings sit below this section's
    if body and body[0].startswith("#"):
        # Its title is replaced by the section heading below; its headings keep their depth
        # relative to it.
        shift = 2 - (len(body[0]) - len(body[0].lstrip("#")))
        body = body[1:]
    demoted = ["#" * max(0, shift) + line if line.startswith("#") else line for line in body]
    return [
        "",
        "## Scale-out: GlusterFS (FUSE) vs the local disk under it",
        "",
        "Copied from [scaleout.md](scaleout.md) when this page was written; that page is "
        "produced by `scripts/bench_scaleout.sh` (root and GlusterFS needed), not by the run "
        "above.",
        *demoted,
    ]


def _notes(report: dict[str, Any]) -> list[str]:
    """Fixed explanations that go with the figures (how to read them, what is not measured)."""
    return [
        "## Notes",
        "",
        "* **What kvstore pays that others do not.** kvstore computes an xxh3_64 checksum per "
        "inner chunk, writes a header and the zarr index, creates the file with `O_EXCL` under "
        "a temporary name, publishes it by rename, `fdatasync`s every file and `fsync`s the "
        "fan-out directories it renamed into (durability `full`), and verifies header and "
        "checksums on every read. vLLM's fs tier and the safetensors files never fsync; the raw "
        "floor pays the same `fdatasync` per file but nothing else.",
        "* **How the write gap to the raw floor was closed** (it was 0.69-0.94 before): a "
        "per-call profile (4 threads, 2 MiB blocks) showed the `ftruncate` that cut the "
        "O_DIRECT-padded tail costing 1.0-1.4 ms of ~6.7 ms of thread time per block (a "
        "contended metadata update), and every file paying its own journal commit. Now the "
        "unaligned last page is written buffered on the same descriptor (no truncate), and a "
        "batch is written first, then synced, then renamed, then its directories synced: the "
        "same ordering per file, but one journal commit covers many files.",
        "* **vLLM's fs tier never fsyncs.** Where its writes beat kvstore's, they beat the raw "
        "floor (which fsyncs like kvstore) by the same margin: the difference is the "
        "`fdatasync`, i.e. power-loss durability, not kvstore's checksums, header or publish. "
        "Run with `--suite throughput --durability none` to compare without it.",
        "* **Reads.** kvstore reads buffered by default, so repeated reads come from the page "
        "cache (the *hot* column). `kvstore-direct` is the same store with "
        "`direct_reads=true`: O_DIRECT reads like vLLM's tier, which on this VM matched vLLM's "
        "cold reads but gives up the page cache. Hot reads stay below the raw floor because "
        "kvstore verifies every read (header decode, one xxh3 call per inner chunk: 256 per "
        "8B block, 640 per 70B block) while the raw floor's hot read is a bare memcpy.",
        "* **Noise.** `kvstore` and `kvstore-direct` write with identical code; their write "
        "figures show how far two measurements of the same thing drift on this shared host "
        "(often 10-20 %). Read the ratios across configurations, not a single cell.",
        "* **Cross-layout reads**: files are canonical, so a reader's I/O does not depend on the "
        "layout that wrote a block; the ratio is 1 within noise. Absolute figures of that suite "
        "include each rank's scatter into its per-layer KV tensors on CPU, one rank after the "
        "other.",
        "* **Compression** is off by default: see the compression section and docs/format.md "
        "(addendum) for when it pays.",
    ]

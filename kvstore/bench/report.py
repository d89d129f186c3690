"""The benchmark report: what the figures were measured on, the performance targets against
the worst figure of a run, and the markdown page (docs/performance.md) with every suite's section.

:func:`kvstore.bench.main` runs the suites and calls these; ``--render`` re-renders a saved
JSON report through them without measuring anything.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstore.bench import compression, layouts, lookup, overhead, scaling, throughput
from kvstore.bench.systems import MINE


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
    """The performance targets, with the worst figure of this run against each."""
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
    for mine in MINE:
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


def legacy_keys(report: dict[str, Any]) -> None:
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


# Sections of the page that no suite of this script writes, kept word for word from the
# previous page when the page is rewritten, so that regenerating the page never drops them; in
# this order, after the generated sections and before the Notes.
HAND_SECTIONS = (
    # written by scripts/bench_ttft.py --markdown: a vLLM engine run, not a suite of this script
    "## Time to first token with a real engine",
    # `--suite tier` prints its tables; which of its runs are the current figures is picked by hand
    "## Secondary tier vs vLLM fs tier",
    # `--tmpfs` prints its tables to the terminal, not into the page
    "## Fast storage (tmpfs): what kvstore adds to the raw floor",
    # `--suite scale` (and soak, writers) print their tables; the section reads them by hand
    "## Store size: admin and inspection at 10^4-10^6 blocks",
    # what the figures above still miss: read from them by hand
    "## Known gaps",
)
# The page's last line: the dated investigation rounds live in docs/notes/, not on the page.
HISTORY = (
    "How these figures were reached (dated investigation rounds, profiles and A/B runs; not "
    "current figures): [notes/tier-rounds.md](notes/tier-rounds.md), "
    "[notes/tmpfs-rounds.md](notes/tmpfs-rounds.md)."
)


def markdown_report(
    report: dict[str, Any], plots: Sequence[Path], page_dir: Path, previous: str = ""
) -> str:
    """The figures as a markdown page (docs/performance.md), with the command that made them;
    the :data:`HAND_SECTIONS` of the ``previous`` page are kept."""
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
    lines += page_tail(previous)
    return "\n".join(lines) + "\n"


def page_tail(previous: str) -> list[str]:
    """What follows the generated sections: the hand sections of ``previous``, the Notes and
    the line that points to the history."""
    return [*hand_sections(previous), "", *_notes(), "", HISTORY]


def hand_sections(previous: str) -> list[str]:
    """The :data:`HAND_SECTIONS` of a previous page, each up to the next ``## `` heading."""
    lines = previous.splitlines()
    out: list[str] = []
    for heading in HAND_SECTIONS:
        start = next((i for i, line in enumerate(lines) if line.rstrip() == heading), None)
        if start is None:
            continue
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
        body = lines[start:end]
        while body and not body[-1].strip():
            body.pop()
        out += ["", *body]
    return out


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


def _notes() -> list[str]:
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

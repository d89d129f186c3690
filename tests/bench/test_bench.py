"""The benchmark front-end runs every suite end to end on tiny data (a smoke test: figures are
not checked, only that each suite measures, renders a table, a markdown page and its plots)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore import bench
from kvstore.bench import report as bench_report
from kvstore.bench.common import kv_like_block

TINY = [
    "--block-tokens", "16", "--gib", "0.01", "--repeat", "1", "--threads", "2",
    "--systems", "kvstore,kvstore-direct,raw,safetensors",
    "--store-blocks", "1500", "--store-sizes", "1200,1500",
    "--layouts", "tp=2:tp=1", "--layout-gib", "0.01",
    "--scaling-threads", "1,2", "--scaling-tokens", "16", "--scaling-gib", "0.01",
    "--compression-gib", "0.01", "--overhead-blocks", "50", "--durability", "none",
    "--tier-lookup-blocks", "16", "--scale-sizes", "1100,1300", "--scale-check-mib", "2",
]  # fmt: skip


def test_every_suite_runs_and_renders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "docs" / "performance.md"
    saved = tmp_path / "report.json"
    argv = [
        *TINY,
        "--suite",
        "all",
        "--root",
        str(tmp_path / "scratch"),
        "--json",
        "--markdown",
        str(page),
    ]
    assert bench.main([*argv, "--save-json", str(saved)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["suites"]) == set(bench.SUITES)
    throughput = report["suites"]["throughput"]["configs"][0]
    assert set(throughput["systems"]) == {"kvstore", "kvstore-direct", "raw", "safetensors"}
    assert throughput["ratios"]["kvstore"]["raw"]["write"] > 0
    lookups = report["suites"]["lookup"]["lookups"]
    assert [lk["chain_blocks"] for lk in lookups] == [1024]
    assert [c["store_blocks"] for c in report["suites"]["scaling"]["by_store_size"]] == [
        1200,
        1500,
    ]
    assert {row["compression"] for row in report["suites"]["compression"]["store"]} == {
        "none",
        "lz4",
        "zstd-1",
        "zstd-3",
    }
    scale = report["suites"]["scale"]
    assert [r["store_blocks"] for r in scale["sizes"]] == [1100, 1300]
    for row in scale["sizes"]:
        for name, command in row["commands"].items():
            assert command["exit"] in (0, 1), (name, command["stderr_tail"])
            assert 10 < command["peak_rss_mb"] < 600, (name, command)
    assert set(scale["growth"]) == {name for name, _ in bench.scale.COMMANDS}
    by_size = scale["verify_by_block_size"]  # a clean verify of each store, against its floor
    assert [r["file_nbytes"] > 30_000 for r in by_size] == [True] * len(bench.verify_floor.LAYERS)
    assert all(r["blocks"] >= 1 and r["verify_vs_floor"] > 0 for r in by_size)
    assert any(t["what"].startswith("lookup") for t in report["targets"])
    text = page.read_text()
    assert "python scripts/bench.py" in text and "## Compression" in text
    for png in ("perf_throughput.png", "perf_lookup.png", "perf_compression.png"):
        assert (page.parent / png).stat().st_size > 1000
        assert f"]({png})" in text
    # The page can be re-rendered from the saved report without running anything.
    page.unlink()
    assert bench.main(["--render", str(saved), "--markdown", str(page)]) == 0
    assert "## Lookup" in page.read_text()
    assert not (tmp_path / "scratch" / "lookup-store").exists()  # scratch cleaned up
    # The hand sections (bench_ttft.py's, the tier's, the gaps) survive a rewrite, in their
    # order and before the Notes; the rest of the old page does not.
    ttft = "## Time to first token with a real engine\n\n**Recomputed / loaded: 9.9x**\n"
    tier = "## Secondary tier vs vLLM fs tier\n\n| run | store |\n|---|---|\n| a | 1.01 |\n"
    gaps = "## Known gaps\n\n* **Never measured**: a GPU.\n"
    old_round = "### Second round (2026-12-01, evening)\n\nold round\n"
    page.write_text(
        f"# old page\n\nstale figures\n\n{gaps}\n{ttft}\n## Old rounds\n\n{old_round}\n"
        f"{tier}\n## Notes\n\nold notes\n"
    )
    assert bench.main(["--render", str(saved), "--markdown", str(page)]) == 0
    text = page.read_text()
    assert ttft.strip() in text and tier.strip() in text and gaps.strip() in text
    assert text.index("## Time to first") < text.index("## Secondary tier") < text.index("## Known")
    assert text.index("## Known gaps") < text.index("## Notes") < text.index(bench_report.HISTORY)
    assert text.rstrip().endswith(bench_report.HISTORY) and "## Lookup" in text
    assert "stale figures" not in text and "old notes" not in text and "old round" not in text


def test_unknown_suite_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--suite", "throughput,nonsense"])
    assert "nonsense" in capsys.readouterr().err


def test_layout_pairs_with_commas() -> None:
    assert bench._pairs("tp=4:tp=2,pp=2,tp=1:tp=8") == ["tp=4:tp=2,pp=2", "tp=1:tp=8"]
    assert bench._pairs("tp=4:tp=2,pp=2;tp=1:pp=2") == ["tp=4:tp=2,pp=2", "tp=1:pp=2"]


def test_kv_like_values_are_bf16_with_structure() -> None:
    data = kv_like_block(2, 3, 16, 64, seed=1).view("<u2")
    assert data.size == 2 * 3 * 16 * 2 * 64
    exponents = (data >> 7) & 0xFF
    assert 4 < len(set(exponents.tolist())) < 64  # realistic magnitudes, not uniform bits


def test_scaleout_figures_are_embedded_when_present(tmp_path: Path) -> None:
    assert bench_report._scaleout_section(tmp_path) == []
    (tmp_path / "scaleout.md").write_text(
        "## kvstore scale-out\n\nIntro.\n\n### Throughput\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    )
    lines = bench_report._scaleout_section(tmp_path)
    assert lines[1] == "## Scale-out: GlusterFS (FUSE) vs the local disk under it"
    assert not any("kvstore scale-out" in line for line in lines)  # its title is replaced
    assert "### Throughput" in lines and "| 1 | 2 |" in lines  # headings under the section


PAGE = Path(__file__).resolve().parents[2] / "docs" / "performance.md"


def test_the_page_regenerates_its_hand_sections_as_they_are() -> None:
    """docs/performance.md from its first hand section on is what a rewrite produces from it:
    every hand section is there and kept word for word, nothing else after the generated part
    survives, and no dated investigation round is on the page (they live in docs/notes/)."""
    text = PAGE.read_text(encoding="utf-8")
    headings = [line for line in text.splitlines() if line.startswith("#")]
    assert all(heading in headings for heading in bench_report.HAND_SECTIONS)
    assert not [h for h in headings if " round" in h.lower() or "2026-" in h]
    start = text.index(bench_report.HAND_SECTIONS[0])
    assert text[start:] == "\n".join(bench_report.page_tail(text)[1:]) + "\n"
    for link in ("notes/tier-rounds.md", "notes/tmpfs-rounds.md"):
        assert f"]({link})" in bench_report.HISTORY and (PAGE.parent / link).is_file()


def test_scale_measures_the_command_not_this_process() -> None:
    """A child's peak RSS is its own: this process's memory (here 300 MB more) never counts."""
    ballast = bytearray(300 << 20)
    ballast[::4096] = b"x" * len(ballast[::4096])  # resident, not just reserved
    result = bench.scale.run_command(["kvstore.cli", "--version"])
    assert result["exit"] == 0
    assert 5 < result["peak_rss_mb"] < 200, result
    del ballast


def test_scale_growth_extrapolates_from_the_two_largest_sizes() -> None:
    def row(blocks: int, rss: float, seconds: float) -> dict[str, object]:
        return {"store_blocks": blocks, "commands": {"c": {"peak_rss_mb": rss, "seconds": seconds}}}

    rows = [row(10_000, 50.0, 1.0), row(100_000, 50.0, 10.0), row(1_000_000, 500.0, 100.0)]
    g = bench.scale.growth(rows)["c"]
    assert g["rss_growth"] == 10.0
    # 450 MB per 900k blocks: 0.5 KB per block, ~50 GB more at 10^8.
    assert g["rss_mb_at_1e8"] == round(500 + 450 / 900_000 * (10**8 - 1_000_000))
    assert g["hours_at_1e8"] == round((100 + 90 / 900_000 * (10**8 - 1_000_000)) / 3600, 1)
    assert bench.scale.growth(rows[:1]) == {}

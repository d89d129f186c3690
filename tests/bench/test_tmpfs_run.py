"""scripts/bench.py --tmpfs: the fast-storage run's defaults and its old-vs-new ratio table."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.bench import TMPFS_ROOT, overhead, parse_args, report, throughput
from kvstore.models import model_names


def test_tmpfs_picks_the_fast_storage_defaults() -> None:
    args = parse_args(["--tmpfs"])
    assert args.root == TMPFS_ROOT
    assert args.suites == ["throughput", "overhead"]
    assert args.models.split(",") == model_names() and len(model_names()) >= 7
    assert args.block_tokens == "16,256"
    assert args.systems == "kvstore,raw,floor"


def test_explicit_options_override_tmpfs_defaults(tmp_path: Path) -> None:
    args = parse_args(["--tmpfs", "--root", str(tmp_path), "--models", "gemma-3-1b"])
    assert args.root == tmp_path and args.models == "gemma-3-1b"
    assert parse_args([]).systems.split(",")[0] == "kvstore"  # without --tmpfs: every system


def config(model: str, tokens: int, write: float, cold: float, hot: float) -> dict[str, object]:
    ratio = {"write": write, "cold": cold, "hot": hot}
    return {
        "model": model,
        "block_tokens": tokens,
        "block_bytes": 2 << 20,
        "ratios": {"kvstore": {"raw": ratio}},
    }


def test_versus_baseline_puts_old_and_new_ratios_side_by_side() -> None:
    old = throughput.TMPFS_BASELINE[("llama-3.1-8b", 16)]
    result = {"configs": [config("llama-3.1-8b", 16, 0.91, 0.92, 0.93), config("x", 16, 1, 1, 1)]}
    lines = throughput.versus_baseline(result)
    assert len(lines) == 4
    assert lines[2] == (
        f"| llama-3.1-8b | 16 | 2.00 | {old[0]:.2f} -> **0.91** | {old[1]:.2f} -> **0.92** | "
        f"{old[2]:.2f} -> **0.93** |"
    )
    assert lines[3].startswith("| x | 16 | 2.00 | - -> **1.00** |")  # no baseline: a dash


def test_versus_baseline_adds_the_protocol_floor_when_measured() -> None:
    cfg = config("llama-3.1-8b", 16, 0.6, 0.7, 0.8)
    cfg["ratios"]["kvstore"]["floor"] = {"write": 0.81, "cold": 0.82, "hot": 0.83}  # type: ignore[index]
    cfg["floor_ratio_to_raw"] = {"write": 0.5, "cold": 0.6, "hot": 0.7}
    lines = throughput.versus_baseline({"configs": [cfg, config("x", 16, 1, 1, 1)]})
    assert "kvstore / protocol floor" in lines[0] and lines[1].count("|") == 9
    assert lines[2].endswith("| 0.81, 0.82, 0.83 | 0.50, 0.60, 0.70 |")
    assert lines[3].endswith("| - | - |")  # a configuration without the floor: dashes


def test_every_model_has_a_baseline_at_both_block_sizes() -> None:
    assert {(m, t) for m in model_names() for t in (16, 256)} <= set(throughput.TMPFS_BASELINE)


def test_overhead_versus_baseline() -> None:
    result = {
        "write_us_per_block": {"store": 30.0, "raw": 10.0, "overhead": 20.0},
        "read_us_per_block": {"store": 14.0, "raw": 7.0, "overhead": 7.0},
    }
    text = overhead.versus_baseline(result)
    assert "write 3.0x raw (30.0 / 10.0 µs)" in text
    assert "read 2.0x raw (14.0 / 7.0 µs)" in text
    assert f"{overhead.BASELINE_COMMIT}: " in text
    assert "protocol floor" not in text  # not measured: not printed
    result["write_us_per_block"]["floor"] = 20.0
    result["read_us_per_block"]["floor"] = 10.0
    text = overhead.versus_baseline(result)
    assert "write 3.0x raw (30.0 / 10.0 µs)" in text
    assert "write 1.5x protocol floor (30.0 / 20.0 µs; floor / raw 2.0x)" in text
    assert "read 1.4x protocol floor (14.0 / 10.0 µs; floor / raw 1.4x)" in text
    assert "system calls alone" not in text  # not measured: not printed
    result["write_us_per_block"] |= {"raw_store_paths": 12.0, "syscalls": 25.0}
    result["read_us_per_block"] |= {"raw_store_paths": 7.7, "syscalls": 10.5}
    text = overhead.versus_baseline(result)
    assert (
        "write: raw on the store's paths 1.2x raw, the protocol's calls there 2.5x (25.0 µs), "
        "store 1.20x those calls" in text
    )
    assert "read: raw on the store's paths 1.1x raw, the protocol's calls there 1.5x" in text


def test_the_fast_storage_section_survives_a_rewrite_of_the_page() -> None:
    section = (
        "## Fast storage (tmpfs): what kvstore adds to the raw floor\n\n| a | b |\n|---|---|\n"
    )
    previous = "# page\n\n## Lookup\n\nold\n\n" + section + "\n## Notes\n\nold notes\n"
    kept = "\n".join(report.hand_sections(previous))
    assert section.strip() in kept and "old notes" not in kept


def test_cpu_ab_measures_both_phases(tmp_path: Path) -> None:
    rows = throughput.cpu_ab(tmp_path, ["gemma-3-1b"], [16], threads=2, rounds=2, mib=1)
    assert [(r["model"], r["block_tokens"]) for r in rows] == [("gemma-3-1b", 16)]
    for key in ("cpu_ratio", "cpu_ratio_to_floor", "floor_cpu_ratio_to_raw"):
        assert all(0 < rows[0][key][phase] < 10 for phase in ("write", "read"))
    assert list(tmp_path.iterdir()) == []  # scratch removed
    lines = throughput.cpu_versus_baseline(rows)
    old = throughput.TMPFS_BASELINE_CPU[("gemma-3-1b", 16)]
    assert lines[2].startswith(f"| gemma-3-1b | 16 | {old[0]:.2f} -> **")
    assert {(m, t) for m in model_names() for t in (16, 256)} <= set(throughput.TMPFS_BASELINE_CPU)


def test_overhead_takes_the_median_of_rounds_with_every_system_in_each() -> None:
    result = overhead.run(20, rounds=2)
    assert result["rounds"] == 2 and result["blocks"] == 20
    for phase in ("write", "read"):
        figures = result[f"{phase}_us_per_block"]
        assert set(figures) == {"store", "raw", "overhead", "floor", "raw_store_paths", "syscalls"}
        assert all(figures[k] > 0 for k in figures if k != "overhead")
    assert "median of 2 rounds" in overhead.table(result)
    with pytest.raises(ValueError, match="at least 1"):
        overhead.run(20, rounds=0)

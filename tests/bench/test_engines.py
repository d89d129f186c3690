"""The engines benchmark runs end to end on the CPU stand-ins and checks what it read back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvstore.bench import engines


def test_engines_bench_runs_every_system_on_cpu(tmp_path: Path) -> None:
    report = engines.run(
        root=tmp_path,
        device=torch.device("cpu"),
        gib=0,
        threads=2,
        engines=engines.ENGINES,
        layers=2,
    )
    results = report["results"]
    assert set(results) == {"raw_odirect", "torch_pwrite", "host", "pinned", "gds"}
    for name in ("torch_pwrite", "host", "pinned", "gds"):
        assert results[name]["write_gbs"] > 0, (name, results[name])
        assert results[name]["read_gbs"] > 0, (name, results[name])
    assert results["gds"]["checksum"] == "wsum64"
    assert results["pinned"]["checksum"] == "xxh3_64"
    text = engines.table(report)
    assert "gds" in text
    assert "checksums (GB/s, 4 MiB chunk)" in text


def test_checksum_mode_prints_rates(capsys: object) -> None:
    assert engines.main(["--checksum", "--device", "cpu"]) == 0


def test_cases_sweep_runs_each_case_and_lines_up_the_ratios(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report_path = tmp_path / "report.json"
    argv = ["--device", "cpu", "--gib", "0", "--cases", "64:4:1,128:8:2"]
    assert engines.main([*argv, "--root", str(tmp_path / "s"), "--json", str(report_path)]) == 0
    reports = json.loads(report_path.read_text())
    assert [(r["block_bytes"], r["batch"], r["threads"]) for r in reports] == [
        (64 << 10, 4, 1),
        (128 << 10, 8, 2),
    ]
    for report in reports:
        assert report["results"]["gds"]["read_gbs"] > 0
    out = capsys.readouterr().out
    assert "ratio to raw O_DIRECT (write/read), same run:" in out
    assert "batches of 8, 2 threads" in out


@pytest.mark.parametrize("bad", ["100:4:1", "64:0:1", "64:4", "64:x:1", "0:1:1"])
def test_malformed_cases_are_refused_naming_the_item(bad: str) -> None:
    with pytest.raises(ValueError, match=f"{bad!r}"):
        engines.parse_cases(f"64:1:1,{bad}")

"""The engines benchmark runs end to end on the CPU stand-ins and checks what it read back."""

from __future__ import annotations

from pathlib import Path

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

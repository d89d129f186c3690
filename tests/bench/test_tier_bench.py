"""The ``tier`` bench suite on tiny data (a smoke test: figures are not checked, only that every
system is measured, that each ratio is the quotient of figures of the same run, and that the
table shows them)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from kvstore.bench import tier  # imports vLLM only when run

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="the tier suite needs vLLM 0.33")


@pytest.mark.parametrize("slice_blocks", [None, 3])  # one after the other; turns of 3 blocks
def test_tier_suite_measures_every_system_against_the_fs_tier_of_the_same_run(
    tmp_path: Path, slice_blocks: int | None
) -> None:
    result = tier.run(
        tmp_path / "tier", "gemma-3-1b", gib=0, sizes=(16,), rounds=2, slice_blocks=slice_blocks
    )

    assert result["model"] == "gemma-3-1b"
    assert result["blocks"] == 8  # the suite's floor: gib=0 still stores a few blocks
    rows = {r["system"]: r for r in result["rows"]}
    assert set(rows) == set(tier.SYSTEMS)
    for r in rows.values():
        for figure in ("store_gbs", "promote_gbs", "first_hit_ms"):
            assert math.isfinite(r[figure]) and r[figure] > 0, (r["system"], figure, r[figure])
    fs = rows["vllm fs"]
    for r in rows.values():  # medians of the ratios to the fs tier of the same round
        assert len(r["rounds"]) == 2
        pairs = list(zip(r["rounds"], fs["rounds"], strict=True))
        for mine, theirs in pairs:
            assert mine["store_x"] == pytest.approx(mine["store_gbs"] / theirs["store_gbs"])
        for ratio, mine_over_fs in (
            ("store_x", [m["store_gbs"] / t["store_gbs"] for m, t in pairs]),
            ("promote_x", [m["promote_gbs"] / t["promote_gbs"] for m, t in pairs]),
            ("first_hit_x", [t["first_hit_ms"] / m["first_hit_ms"] for m, t in pairs]),
        ):
            assert r[ratio] == pytest.approx(sum(mine_over_fs) / 2), (r["system"], ratio)
        assert r["store_gbs"] == pytest.approx(sum(x["store_gbs"] for x in r["rounds"]) / 2)
    assert fs["store_x"] == fs["promote_x"] == fs["first_hit_x"] == 1.0

    lookups = {(r["system"], r["stored"]): r for r in result["lookups"]}
    assert set(lookups) == {(s, 16) for s in tier.LOOKUP_SYSTEMS}
    ref = lookups[("vllm fs", 16)]
    for r in lookups.values():
        for figure in ("hit_ms", "miss_ms", "call_us"):
            assert math.isfinite(r[figure]) and r[figure] > 0, (r["system"], figure, r[figure])
        assert r["hit_x"] == pytest.approx(ref["hit_ms"] / r["hit_ms"])
        assert r["miss_x"] == pytest.approx(ref["miss_ms"] / r["miss_ms"])
    assert ref["hit_x"] == ref["miss_x"] == 1.0

    text = tier.table(result).splitlines()
    assert text[0] == f"gemma-3-1b: 8 blocks of {result['block_bytes'] >> 10} KiB"
    # Two sections, each under its own header line: throughput rows, then lookup rows (a
    # system's name starts a line in both, so each figure is looked for in its own section).
    second = next(i for i in range(2, len(text)) if text[i].startswith("system"))
    throughput, lookup_lines = text[2:second], text[second + 1 :]
    for system in tier.SYSTEMS:
        r = rows[system]
        (line,) = [t for t in throughput if t.startswith(system)]
        for figure in (r["store_gbs"], r["store_x"], r["promote_x"]):
            assert f"{figure:.2f}" in line, (system, figure, line)
    for (system, _), r in lookups.items():
        (line,) = [t for t in lookup_lines if t.startswith(system)]
        assert f"{r['hit_ms']:.1f}" in line, (system, line)
        assert f"{r['hit_x']:.2f}" in line and f"{r['miss_x']:.2f}" in line


def test_turns_of_no_blocks_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="slice_blocks: expected at least 1 block, got 0"):
        tier.run(tmp_path, "gemma-3-1b", gib=0, sizes=(), rounds=1, slice_blocks=0)


def test_the_suite_leaves_no_region_file_in_dev_shm(tmp_path: Path) -> None:
    """vLLM's shared CPU-tier region loses its name once the manager has mapped it, so a
    bench killed mid-run (a timeout) leaves nothing in /dev/shm; the tier still works."""
    before = set(tier.SHM.glob("vllm_offload_kvstore-bench-*"))
    with tier._tiering("gemma-3-1b", 1, 2, 64, tmp_path, "kvstore none", 16) as manager:
        assert set(tier.SHM.glob("vllm_offload_kvstore-bench-*")) - before == set()
        rows = np.asarray(manager.primary_tier.get_kv_memoryview()).view(np.uint8)
        rows[3, :8] = 7  # the mapping outlives the name
        assert rows[3, :8].tolist() == [7] * 8
        del rows
    assert set(tier.SHM.glob("vllm_offload_kvstore-bench-*")) - before == set()

"""The main job end to end through the CLI, as a new user runs it (small sizes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.cli import main
from kvstore.demo.data import make_plan


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_demo_writes_then_a_new_process_verifies_every_byte(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "kv"
    code, out, _ = _run(capsys, "demo", "--root", str(root), "--blocks", "24", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["ok"] is True
    assert report["write"]["written"] == 24
    assert report["write"]["bytes"] == 24 * 2 * 2**20  # llama-3.1-8b, 16 tokens: 2 MiB blocks
    read = report["read"]
    plan = make_plan(24, 8)
    assert read["mismatched"] == 0
    # Every written prefix is found; only the never-written turn of the last request misses.
    assert read["asked_blocks"] - read["hit_blocks"] == plan.segments["unseen"]
    # A second run finds everything already stored and rewrites nothing.
    code, out, _ = _run(capsys, "demo", "--root", str(root), "--blocks", "24", "--json")
    assert code == 0
    again = json.loads(out)["write"]
    assert (again["written"], again["already_present"]) == (0, 24)


def test_demo_table_for_people(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        capsys, "demo", "--root", str(tmp_path), "--blocks", "8", "--model", "gemma-3-1b"
    )
    assert code == 0
    assert "every byte verified" in out
    assert "2 KV group(s)" in out


def test_demo_across_layouts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        capsys,
        "demo",
        "--root",
        str(tmp_path),
        "--blocks",
        "8",
        "--model",
        "gemma-3-1b",
        "--write-layout",
        "tp=2",
        "--read-layout",
        "tp=2,dcp=2",
        "--json",
    )
    assert code == 0, out
    report = json.loads(out)
    assert report["ok"] is True
    assert report["write"]["layout"] == "tp=2"
    assert report["read"]["layout"] == "tp=2,dcp=2"
    assert report["read"]["mismatched"] == 0
    assert report["read"]["hit_blocks"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--write-layout", "tp=2,xp=3"], "xp"),
        (["--write-layout", "tp=3"], "not"),  # 8 KV heads cannot be split over 3 ranks
        (["--read-layout", "tp=2,dcp=2"], "not certifiable"),  # dcp needs replicated heads
        (["--blocks", "4"], "--blocks >= 8"),
    ],
)
def test_demo_bad_input_is_one_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, _, err = _run(capsys, "demo", "--root", str(tmp_path), *argv)
    assert code == 2
    assert err.startswith("kvstore: error: ")
    assert message in err
    assert len(err.strip().splitlines()) == 1

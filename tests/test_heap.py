"""The tools' collector settings (kvstore/heap.py): applied by both console scripts before
their worker starts, never by ``main`` (which tests call in their own process)."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore import heap
from kvstore.cli import main

_PROBE = """
import gc, sys
from {module} import entry
from kvstore.io import supervise
supervise.run = lambda main: print(gc.get_threshold(), gc.get_freeze_count() > 0) or 0
sys.argv = ["tool", "--help"]
entry()
"""


@pytest.mark.parametrize("module", ["kvstore.cli", "kvstore.inspect.cli"])
def test_each_tool_sets_the_collector_before_its_worker(module: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(module=module)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    expected = (heap.YOUNG_THRESHOLD, *heap.OLDER_THRESHOLDS)
    assert out[-1] == "True"  # what was imported is frozen
    assert " ".join(out[:-1]) == str(expected)


def test_main_leaves_this_process_alone(tmp_path: Path) -> None:
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    assert main(["du", str(tmp_path / "no-store")]) == 2  # a command ran (and failed)
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == frozen

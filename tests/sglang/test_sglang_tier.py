"""The SGLang tier from the main suite: where this interpreter has no SGLang and the SGLang venv
is built (``scripts/sglang_venv.sh``, as the README's test command does first), run
``tests/sglang`` in that venv and fail with its output when it fails.

Skipped inside the SGLang venv (the tests run there directly), without the venv (the reason
says how to build it), and with ``KVTEST_SGLANG=0`` (``.ci/run`` sets it for its main suite,
having run the tier on its own).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SEPARATE_ENV = "KVTEST_SGLANG"
TIER_TIMEOUT_S = 1200  # ~2 min on 2 idle cores


def _sglang_python() -> str | None:
    probe = subprocess.run(
        [str(REPO / "scripts" / "sglang_venv.sh"), "--if-built"],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,  # waits while another process builds it
    )
    lines = probe.stdout.strip().splitlines()
    return lines[-1] if probe.returncode == 0 and lines else None


def test_the_sglang_tier_passes_in_its_venv() -> None:
    if os.environ.get(SEPARATE_ENV) == "0":
        pytest.skip(f"{SEPARATE_ENV}=0: the SGLang tier runs on its own (.ci/run runs it first)")
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here: tests/sglang run in this interpreter")
    python = _sglang_python()
    if python is None:
        pytest.skip("the SGLang venv is not built: run scripts/sglang_venv.sh")
    env = {**os.environ, "PYTHONPATH": str(REPO), "KVTEST_SGLANG_REQUIRED": "1"}
    run = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/sglang"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=TIER_TIMEOUT_S,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-8000:]
    assert " passed" in run.stdout, run.stdout[-2000:]

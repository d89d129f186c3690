"""The test-only ``KVTEST_PERTURB_LOADS=1`` hook zeroes exactly the loaded pages.

The e2e tier's negative control (tests/e2e) relies on it; here the harness checks what it does
to per-layer and packed KV tensors: the loaded prefix is wrong (zeros), the store is untouched.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the connector tests need vllm==0.33.0 (a separate venv)")

from connector.offload.worker import PERTURB_LOADS_ENV

from .harness import BLOCK, Engine, EngineOptions
from .test_roundtrip import PROMPT


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"], ids=["per-layer", "packed"])
def test_perturbed_loads_are_zeroed_after_verification(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    first = Engine(EngineOptions(root=tmp_path, layout=layout))
    first.serve("writer", PROMPT)
    first.shutdown()
    monkeypatch.setenv(PERTURB_LOADS_ENV, "1")
    second = Engine(EngineOptions(root=tmp_path, layout=layout))
    second.serve("reader", [*PROMPT, 999], max_tokens=1)
    assert second.first_start["reader"] == 5 * BLOCK  # loaded (verified) ...
    assert not second.prefix_ok["reader"]  # ... then zeroed: the prefix KV is wrong
    second.shutdown()
    monkeypatch.delenv(PERTURB_LOADS_ENV)
    third = Engine(EngineOptions(root=tmp_path, layout=layout))  # the store was not touched
    third.serve("reader", [*PROMPT, 999], max_tokens=1)
    assert third.first_start["reader"] == 5 * BLOCK
    assert third.prefix_ok["reader"]
    third.shutdown()

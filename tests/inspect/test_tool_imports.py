"""The tools start like tools: listing, checking and summarising a store imports neither torch
nor vLLM (nor matplotlib): the layers below them read a store without either.

Each command runs in a fresh interpreter (the test process itself has torch loaded), on the
reference store. Only decoding bfloat16 / float8 values, moving a rank's pages, exporting
safetensors and drawing pictures load torch or matplotlib, when they run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import Reference

HEAVY = ("torch", "vllm", "matplotlib")

_PROBE = """
import json, sys
from {module} import main
try:
    code = main({argv!r})
except SystemExit as exc:
    code = exc.code
print(json.dumps({{"code": code, "loaded": sorted(m for m in {heavy!r} if m in sys.modules)}}))
"""


def _loaded(module: str, argv: list[str]) -> tuple[int, list[str]]:
    probe = _PROBE.format(module=module, argv=argv, heavy=HEAVY)
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    last = done.stdout.strip().splitlines()[-1]
    doc = json.loads(last)
    return int(doc["code"]), list(doc["loaded"])


def _commands(reference: Reference, copy: Path) -> list[tuple[str, list[str]]]:
    root, f16 = str(reference.root), reference.f16
    ns, block = f16.ns, next(iter(f16.tensors)).hex()
    return [
        ("kvstore.cli", ["ls", root]),
        ("kvstore.cli", ["ls", root, ns, "--json"]),
        ("kvstore.cli", ["du", root]),
        ("kvstore.cli", ["verify", root]),
        ("kvstore.cli", ["gc", str(copy), "--max-bytes", "1T", "--dry-run"]),
        ("kvstore.inspect.cli", ["overview", root]),
        ("kvstore.inspect.cli", ["overview", root, "--check"]),
        ("kvstore.inspect.cli", ["tree", root, reference.bf16.ns]),
        ("kvstore.inspect.cli", ["block", root, ns, block]),
        ("kvstore.inspect.cli", ["stats", root, ns, block]),  # float16: numpy decodes it
    ]


def test_admin_and_inspect_commands_import_neither_torch_nor_vllm(
    reference: Reference, store_copy: Path
) -> None:
    for module, argv in _commands(reference, store_copy):
        code, loaded = _loaded(module, argv)
        assert code == 0, (argv, code)
        assert loaded == [], f"{module} {' '.join(argv)} imported {loaded}"


@pytest.mark.parametrize("module", ["kvstore", "kvstore.cli", "kvstore.inspect.cli"])
def test_importing_the_package_and_the_tools_is_light(module: str) -> None:
    probe = f"import sys, {module}; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"

"""The launch lines are SGLang 0.5.23's own: docs/sglang.md's and scripts/sglang_gpu_check.py's
arguments parsed by SGLang's ServerArgs parser, with the kvstore backend loaded from what
they name. Runs in the SGLang venv; skipped where SGLang is not installed."""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.server_args")

from sglang.srt.server_args import ServerArgs

REPO = Path(__file__).resolve().parents[2]


def _parse(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return vars(parser.parse_args(argv))


def _backend_class(extra: dict[str, Any]) -> Any:
    return getattr(importlib.import_module(extra["module_path"]), extra["class_name"])


def test_the_documented_launch_line_parses() -> None:
    doc = (REPO / "docs" / "sglang.md").read_text()
    block = re.search(r"```bash\n(python -m sglang\.launch_server.*?)```", doc, re.S)
    assert block, "docs/sglang.md: no launch line"
    argv = shlex.split(block.group(1).replace("\\\n", " "))[3:]
    args = _parse(argv)
    assert args["enable_hierarchical_cache"] and args["hicache_storage_backend"] == "dynamic"
    extra = json.loads(args["hicache_storage_backend_extra_config"])
    assert _backend_class(extra).__name__ == "KVStoreHiCacheStorage"
    assert extra["interface_v1"] == 1 and extra["root"]


def test_the_gpu_check_launch_line_parses(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import sglang_gpu_check  # noqa: PLC0415
    finally:
        sys.path.pop(0)
    argv = sglang_gpu_check.launch_args(tmp_path / "model", tmp_path / "store", 2, 30000)
    args = _parse(argv)
    assert args["tp_size"] == 2 and args["page_size"] == sglang_gpu_check.PAGE
    assert args["skip_tokenizer_init"] and args["hicache_write_policy"] == "write_through"
    extra = json.loads(args["hicache_storage_backend_extra_config"])
    assert extra["root"] == str(tmp_path / "store")
    assert _backend_class(extra).__name__ == "KVStoreHiCacheStorage"

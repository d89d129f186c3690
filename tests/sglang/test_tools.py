"""The admin CLI and the inspection tool on SGLang-written namespaces: they list, verify and
describe them like vLLM's, and say which engine wrote them. Runs without SGLang."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.inspect.cli import main as inspect_main
from tests.admin.util import cli, cli_json
from tests.sglang.test_pool_store import KEYS, _full, _pool_store, _slice, _write


def _sglang_store(root: Path) -> None:
    """Three pages written by two TP ranks (one block each, two shares)."""
    full = _full("page_first")
    for r in range(2):
        ps = _pool_store(root, _slice(full, slice(r, r + 1), slice(None)), (r, 2))
        assert _write(ps, [0, 1, 2], KEYS[:3]) == [True, True, True]


def test_ls_verify_du_gc_on_an_sglang_namespace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _sglang_store(tmp_path)
    rc, doc = cli_json(capsys, "ls", tmp_path)
    assert rc == 0
    (ns,) = doc["namespaces"]
    assert ns["engine"] == "sglang" and ns["blocks"] == 3 and ns["model"] == "test/model"
    rc, out, _ = cli(capsys, "ls", tmp_path)
    assert rc == 0 and "sglang" in out
    rc, report = cli_json(capsys, "verify", tmp_path)
    assert rc == 0, report
    rc, out, err = cli(capsys, "du", tmp_path)
    assert rc == 0, err
    rc, out, err = cli(capsys, "gc", tmp_path, "--max-bytes", "0")
    assert rc == 0, err
    rc, doc = cli_json(capsys, "ls", tmp_path)
    assert doc["namespaces"][0]["blocks"] == 0


def test_inspect_overview_names_the_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _sglang_store(tmp_path)
    assert inspect_main(["overview", str(tmp_path), "--check"]) == 0
    out = capsys.readouterr().out
    assert "written by sglang" in out and "3 blocks" in out
    assert inspect_main(["overview", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["namespaces"][0]["engine"] == "sglang"

"""The reliability and security suite (issue 8): every test here carries the ``reliability``
marker. ``KVSTORE_RELIABILITY_FULL=1`` selects the bigger tier (more kills, cases, operations);
the default PR tier is sized to run in CI. Each test prints one line of figures (``-s``)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.reliability)

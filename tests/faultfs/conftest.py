"""The faultfs tests: the fault-injecting FUSE file system itself, and kvstore on it. Every
test here carries the ``reliability`` marker (fault tests)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faultfs.fixture import mounted
from tests.faultfs.handle import FaultFS

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.reliability)


@pytest.fixture
def faultfs(tmp_path: Path) -> Iterator[FaultFS]:
    """A mounted faultfs (see tests/faultfs/fixture.py); skipped where FUSE is unavailable."""
    with mounted(tmp_path) as fs:
        yield fs

"""Shared fixtures of the CPU test suite: store roots, small identities, store factory.

The plain helpers (identities, hashes, deterministic block bytes) are in ``tests/helpers.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.config import StoreConfig
from kvstore.identity import Identity
from kvstore.io.fileio import FileIO
from kvstore.store import pending, publish, quarantine
from kvstore.store.page_store import KVStore
from kvstore.store.reads import context as read_context
from kvstore.store.writes import batch as batch_write
from kvstore.store.writes import hashed as hashed_write
from kvstore.store.writes import headers
from tests.helpers import (
    FROZEN_NS,
    StoreFactory,
    make_mla_identity,
    make_odd_identity,
    make_small_identity,
)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A store root that does not exist yet."""
    return tmp_path / "store"


@pytest.fixture
def small_identity() -> Identity:
    return make_small_identity()


@pytest.fixture
def odd_identity() -> Identity:
    return make_odd_identity()


@pytest.fixture
def mla_identity() -> Identity:
    return make_mla_identity()


@pytest.fixture(params=["small", "odd", "mla"])
def any_identity(request: pytest.FixtureRequest) -> Identity:
    """Each layout path in turn: dense attention, non-dense attention, MLA."""
    makers = {"small": make_small_identity, "odd": make_odd_identity, "mla": make_mla_identity}
    return makers[request.param]()


@pytest.fixture
def make_store(root: Path) -> Iterator[StoreFactory]:
    """Open ``KVStore`` objects on ``root`` (or another root); all closed at teardown.

    Keyword arguments are config overrides; ``fio=`` passes a FileIO. Defaults favour speed:
    ``durability="none"`` and two I/O threads (durability has its own tests).
    """
    opened: list[KVStore] = []

    def factory(
        store_root: Path | None = None, *, fio: FileIO | None = None, **overrides: Any
    ) -> KVStore:
        values: dict[str, Any] = {"durability": "none", "io_threads": 2}
        values.update(overrides)
        config = StoreConfig(root=store_root or root).replace(**values)
        store = KVStore(config) if fio is None else KVStore(config, fio=fio)
        opened.append(store)
        return store

    yield factory
    for store in opened:
        store.close()


@pytest.fixture
def frozen_time(monkeypatch: pytest.MonkeyPatch) -> int:
    """Fix the ``created_ns`` kvstore writes into block headers; returns the value."""

    class _Clock:
        @staticmethod
        def time_ns() -> int:
            return FROZEN_NS

    # where blocks get their times
    for module in (publish, pending, headers, hashed_write, batch_write, read_context, quarantine):
        monkeypatch.setattr(module, "time", _Clock)
    return FROZEN_NS

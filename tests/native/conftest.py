"""Fixtures of tests/native."""

from __future__ import annotations

import pytest

from kvstore.checksum import native_xxh3_capsule
from kvstore.io.fileproto import native_fileproto


@pytest.fixture
def both_extensions_bound() -> None:
    """Skip where either extension is not bound (KVSTORE_NATIVE=off, not built): the
    differential tests compare the two."""
    if native_fileproto() is None or native_xxh3_capsule() is None:
        pytest.skip("the native file protocol or the native xxh3 batch is not bound")

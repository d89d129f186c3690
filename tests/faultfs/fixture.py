"""The ``faultfs`` fixture's body, shared by every folder that needs a faultfs mount.

A conftest (or test module) defines the fixture in three lines::

    @pytest.fixture
    def faultfs(tmp_path: Path) -> Iterator[FaultFS]:
        with mounted(tmp_path) as fs:
            yield fs

and a test then takes ``faultfs``: ``faultfs.mount`` (the mount point, a Path),
``faultfs.backing`` (the directory behind it: the test may look there while the mount is
frozen), ``freeze(ops, path_glob=None)``, ``thaw()``, ``delay(ops, seconds, path_glob=None)``,
``clear()``, ``stats()``, ``wait_blocked(ops, count)`` and the ``frozen(ops)`` context.

Where FUSE cannot be used the test is skipped with the reason; ``KVTEST_FAULTFS_REQUIRED=1``
turns that skip into a failure (a machine that is meant to run these tests).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faultfs.handle import FaultFS, FuseUnavailableError, unavailable_reason

REQUIRED_ENV = "KVTEST_FAULTFS_REQUIRED"


def skip_unavailable(reason: str) -> None:
    """Skip the test (or fail it, where ``KVTEST_FAULTFS_REQUIRED=1``) with ``reason``."""
    if os.environ.get(REQUIRED_ENV, "") not in ("", "0"):
        pytest.fail(f"{reason} ({REQUIRED_ENV} is set)")
    pytest.skip(reason)


@contextlib.contextmanager
def mounted(tmp_path: Path) -> Iterator[FaultFS]:
    """A faultfs mount of ``tmp_path/faultfs-backing`` at ``tmp_path/faultfs-mount`` for the
    block; thawed, unmounted and its daemon ended however the block ends."""
    reason = unavailable_reason()
    if reason is not None:
        skip_unavailable(reason)
    try:
        fs = FaultFS.start(tmp_path / "faultfs-backing", tmp_path / "faultfs-mount")
    except FuseUnavailableError as exc:
        skip_unavailable(str(exc))
        raise  # not reached: skip raises
    try:
        yield fs
    finally:
        fs.close()

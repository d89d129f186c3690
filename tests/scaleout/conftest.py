"""The scale-out suite (issue 10): kvstore on a real distributed file system.

Every test here carries the ``scaleout`` marker and uses the session-scoped :func:`gluster`
fixture, which starts the GlusterFS environment of :mod:`tests.scaleout.gluster` once (or
reuses one already running, e.g. from ``scripts/gluster_env.sh``) and tears down what it
started. The tests skip, with the reason, where GlusterFS is not installed, where FUSE, mounts
or network namespaces are not permitted (not root, no /dev/fuse, a restricted container), or
where the environment does not start. ``KVSTORE_GLUSTER_KEEP=1`` leaves a started environment
running after the session. Each test prints one line of figures (``-s``).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.scaleout import gluster as gl
from tests.scaleout.harness import SharedRoot

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.scaleout)


@pytest.fixture(scope="session")
def gluster() -> Iterator[gl.GlusterEnv]:
    """The running environment (started once per session), or a skip saying why not."""
    reason = gl.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    env = gl.environment()
    reused = gl.healthy(env)
    if reused:
        gl.ensure_volume_options(env)  # started before kvstore's volume options were added
    else:
        try:
            env = gl.start()
        except gl.GlusterError as exc:
            pytest.skip(f"GlusterFS test environment did not start: {exc}")
    yield env
    if not reused and os.environ.get("KVSTORE_GLUSTER_KEEP", "") in ("", "0"):
        gl.stop()


@pytest.fixture
def shared(gluster: gl.GlusterEnv, tmp_path: Path) -> Iterator[SharedRoot]:
    """A fresh store directory on the volume, as each node sees it; removed afterwards."""
    name = f"store-{uuid.uuid4().hex[:12]}"
    root = SharedRoot(gluster, name, tmp_path)
    yield root
    root.close()
    shutil.rmtree(gluster.a.mount / name, ignore_errors=True)

"""The kvikio adapter (:class:`~kvstore.io.cufile.KvikioCuFiles`) over a fake kvikio package.

The fake mirrors what kvikio 26.10 does where the adapter depends on it (checked against the
installed package): ``import kvikio`` does not import ``kvikio.defaults``; settings are read
with ``defaults.get(name)`` and ``compat_mode`` is a ``CompatMode`` enum (OFF, ON, AUTO);
``num_threads`` defaults to 1; ``CuFile(path, flags)`` takes host memory only through the
buffer protocol (a torch CPU tensor is a ``TypeError``) and fails with ``RuntimeError``;
``pread``/``pwrite`` return futures whose ``get()`` is the number of bytes moved.
"""

from __future__ import annotations

import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.errors import StoreIOError
from kvstore.io.cufile import KvikioCuFiles, PosixCuFiles, kvikio_compat_mode
from kvstore.io.gds import _wait_all
from kvstore.io.select import PROBE_MAX, probe_nbytes

FAKE_INIT = """
import os


class _Future:
    def __init__(self, n):
        self._n = n

    def get(self):
        if isinstance(self._n, Exception):
            raise self._n
        return self._n

    def done(self):
        return True


class CuFile:
    fail_io = None  # a RuntimeError that get() raises

    def __init__(self, file, flags="r"):
        mode = {"r": os.O_RDONLY, "r+": os.O_RDWR}[flags]
        try:
            self._fd = os.open(file, mode)
        except OSError as exc:
            raise RuntimeError(f"Unable to open file: {exc}") from None

    def fileno(self):
        return self._fd

    def close(self):
        os.close(self._fd)

    def pwrite(self, buf, size=None, file_offset=0, task_size=None):
        view = memoryview(buf).cast("B")  # TypeError for a torch tensor, as in kvikio
        if size > len(view):
            raise ValueError("Size is greater than the size of the buffer")
        if CuFile.fail_io is not None:
            return _Future(CuFile.fail_io)
        return _Future(os.pwrite(self._fd, view[:size], file_offset))

    def pread(self, buf, size=None, file_offset=0, task_size=None):
        view = memoryview(buf).cast("B")
        if size > len(view):
            raise ValueError("Size is greater than the size of the buffer")
        return _Future(os.preadv(self._fd, [view[:size]], file_offset))
"""

FAKE_DEFAULTS = """
import enum


class CompatMode(enum.Enum):
    OFF = 0
    ON = 1
    AUTO = 2


SETTINGS = {"compat_mode": CompatMode.AUTO, "num_threads": 1, "gds_threshold": 16384}
PREFERRED = [False]


def get(name):
    return SETTINGS[name]


def set(*config):
    key, value = config
    SETTINGS[key] = value


def is_compat_mode_preferred():
    return PREFERRED[0]
"""


@pytest.fixture
def fake_kvikio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """A package ``fakekvikio`` whose ``defaults`` submodule is not imported by its
    ``__init__`` (as in kvikio 26.10)."""
    package = tmp_path / "fake_site" / "fakekvikio"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(FAKE_INIT))
    (package / "defaults.py").write_text(textwrap.dedent(FAKE_DEFAULTS))
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.delenv("KVIKIO_NTHREADS", raising=False)
    import fakekvikio  # type: ignore[import-not-found]  # noqa: PLC0415

    assert not hasattr(fakekvikio, "defaults")  # the trap the adapter must not fall into
    yield fakekvikio
    for name in [m for m in sys.modules if m.startswith("fakekvikio")]:
        del sys.modules[name]


def _defaults(module: types.ModuleType) -> Any:
    return sys.modules[f"{module.__name__}.defaults"]


def test_adapter_imports_kvikio_defaults_itself(fake_kvikio: types.ModuleType) -> None:
    files = KvikioCuFiles(fake_kvikio)
    assert files.compat_mode == "auto"
    assert files.gds_threshold == 16384


@pytest.mark.parametrize(
    ("mode", "preferred", "expected"),
    [("OFF", False, "off"), ("ON", True, "on"), ("AUTO", False, "auto"), ("AUTO", True, "on")],
)
def test_compat_mode_resolves_auto_like_kvikio(
    fake_kvikio: types.ModuleType, mode: str, preferred: bool, expected: str
) -> None:
    KvikioCuFiles(fake_kvikio)  # imports the defaults submodule
    defaults = _defaults(fake_kvikio)
    defaults.SETTINGS["compat_mode"] = defaults.CompatMode[mode]
    defaults.PREFERRED[0] = preferred
    assert kvikio_compat_mode(fake_kvikio) == expected


def test_compat_mode_of_an_old_kvikio_is_a_bool() -> None:
    class OldDefaults:
        @staticmethod
        def compat_mode() -> bool:
            return True

    assert kvikio_compat_mode(types.SimpleNamespace(defaults=OldDefaults())) == "on"


def test_want_threads_grows_kvikio_pool_unless_the_user_sized_it(
    fake_kvikio: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = KvikioCuFiles(fake_kvikio)
    settings = _defaults(fake_kvikio).SETTINGS
    files.want_threads(8)
    assert settings["num_threads"] == 8
    files.want_threads(2)  # never shrunk
    assert settings["num_threads"] == 8
    settings["num_threads"] = 1
    monkeypatch.setenv("KVIKIO_NTHREADS", "1")
    files.want_threads(8)
    assert settings["num_threads"] == 1


def test_handles_move_cpu_tensors_as_numpy(fake_kvikio: types.ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(8192))
    files = KvikioCuFiles(fake_kvikio)
    handle = files.open(str(path), "r+")
    out = torch.arange(4096, dtype=torch.int64).remainder(251).to(torch.uint8)
    back = torch.zeros(4096, dtype=torch.uint8)
    try:
        assert handle.pwrite(out, 4096, 4096).get() == 4096
        assert handle.pread(back, 4096, 4096).get() == 4096
        assert handle.fileno() >= 0
    finally:
        handle.close()
    assert torch.equal(out, back)
    assert path.read_bytes()[4096:] == bytes(out.tolist())


def test_kvikio_runtime_errors_become_store_io_errors(
    fake_kvikio: types.ModuleType, tmp_path: Path
) -> None:
    files = KvikioCuFiles(fake_kvikio)
    with pytest.raises(StoreIOError, match="Unable to open file"):
        files.open(str(tmp_path / "missing"), "r")
    path = tmp_path / "f"
    path.write_bytes(bytes(4096))
    handle = files.open(str(path), "r+")
    fake_kvikio.CuFile.fail_io = RuntimeError("cuFileWrite failed")
    try:
        future = handle.pwrite(torch.zeros(4096, dtype=torch.uint8), 4096, 0)
        with pytest.raises(StoreIOError, match="cuFileWrite failed"):
            future.get()
    finally:
        fake_kvikio.CuFile.fail_io = None
        handle.close()


def test_the_fake_refuses_what_kvikio_refuses(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(8192))
    files = PosixCuFiles()
    handle = files.open(str(path), "r+")
    try:
        with pytest.raises(ValueError, match="greater than the size"):
            handle.pwrite(torch.zeros(4096, dtype=torch.uint8), 8192, 0)
        strided = torch.zeros(2, 8192, dtype=torch.uint8)[:, :4096]
        with pytest.raises(ValueError, match="contiguous"):
            handle.pread(strided, 4096, 0)
    finally:
        handle.close()


def test_probe_moves_at_least_kvikio_gds_threshold() -> None:
    assert probe_nbytes(PosixCuFiles()) == 4096
    assert probe_nbytes(PosixCuFiles(gds_threshold=16384)) == 16384
    assert probe_nbytes(PosixCuFiles(gds_threshold=5000)) == 8192
    assert probe_nbytes(PosixCuFiles(gds_threshold=1 << 30)) == PROBE_MAX


class _Future:
    def __init__(self, result: int | Exception, log: list[str], name: str) -> None:
        self.result, self.log, self.name = result, log, name

    def get(self) -> int:
        self.log.append(self.name)
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def test_wait_all_waits_for_every_future_before_raising() -> None:
    log: list[str] = []
    futures = [
        (_Future(StoreIOError("first"), log, "a"), 0, 4096),
        (_Future(4096, log, "b"), 4096, 4096),
        (_Future(10, log, "c"), 8192, 4096),
    ]
    with pytest.raises(StoreIOError, match="first"):
        _wait_all(futures, "write")
    assert log == ["a", "b", "c"]
    log.clear()
    with pytest.raises(StoreIOError, match="at 8192: expected 4096 bytes, moved 10"):
        _wait_all(futures[1:], "write")
    assert log == ["b", "c"]


def test_gds_engine_asks_cufile_for_its_io_threads(tmp_path: Path) -> None:
    from tests.io.engines import EngineKind  # noqa: PLC0415

    files = PosixCuFiles()
    store = EngineKind("gds", "gds").open(tmp_path, cufiles=files, io_threads=3)
    try:
        assert files.threads == 3
    finally:
        store.close()

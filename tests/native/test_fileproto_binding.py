"""Binding the native file protocol (kvstore._native._fileproto): required where CI says so, one
warning and the Python reference where it is missing, and a self-test that refuses a build
whose flag values are not this platform's."""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.io import fileproto
from kvstore.io.fileio import NEW_FILE_FLAGS as NEW
from kvstore.io.fileio import O_DIRECT
from kvstore.io.native_fileio import NativeFileIO
from kvstore.native import native_mode


def test_native_required() -> None:
    """CI sets KVSTORE_NATIVE=require: there the extension must build and bind, or every
    block silently pays the Python file calls again."""
    if native_mode() != "require":
        pytest.skip("KVSTORE_NATIVE is not require")
    assert fileproto.native_fileproto_unavailable() is None


@pytest.fixture
def unbound(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The binding undone, so that the next use binds again (under the test's patches, and
    the real extension once they are undone)."""
    monkeypatch.delenv("KVSTORE_NATIVE", raising=False)
    monkeypatch.delenv("KVSTORE_NATIVE_DIR", raising=False)
    fileproto.NATIVE_FILEPROTO.reset()
    yield
    monkeypatch.undo()
    fileproto.NATIVE_FILEPROTO.reset()


def test_missing_extension_falls_back_with_one_warning(
    unbound: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    real_import = importlib.import_module

    def no_extension(name: str, package: str | None = None) -> Any:
        if name == "kvstore._native._fileproto":
            raise ImportError("No module named 'kvstore._native._fileproto'")
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", no_extension)
    fio = NativeFileIO()
    with caplog.at_level(logging.WARNING, logger="kvstore.native"):
        for i in range(3):
            path = str(tmp_path / f"f{i}")
            os.close(fio.write_new(path, NEW, 0o600, [(0, memoryview(b"abc"))], 3))
            out = memoryview(bytearray(3))
            fio.read_regular(path, os.O_RDONLY, [(0, out)], 3)
            assert bytes(out) == b"abc"
            fio.sync_and_rename(None, path, path + ".published")
    warnings = [r for r in caplog.records if "kvstore._native._fileproto unavailable" in r.message]
    assert len(warnings) == 1
    assert "extension kvstore._native._fileproto not built" in warnings[0].message
    assert fileproto.native_fileproto() is None


def test_self_test_refuses_other_flag_values() -> None:
    constants = {
        "O_DIRECT": O_DIRECT,
        "O_NOFOLLOW": os.O_NOFOLLOW,
        "O_NONBLOCK": os.O_NONBLOCK,
        "O_CLOEXEC": os.O_CLOEXEC,
    }
    assert fileproto.self_test(constants) is None
    wrong = fileproto.self_test({**constants, "O_NOFOLLOW": 0})
    assert wrong is not None
    assert wrong.startswith("O_NOFOLLOW: expected")


def test_a_build_from_older_sources_is_not_used() -> None:
    """An extension that lacks one of the protocol's functions (built before it was added) is
    refused as a whole, naming what it lacks, instead of failing at that function's first
    call; one with every function is bound."""
    module: Any = fileproto.native_fileproto()  # the module itself, from wherever it loaded
    if module is None:
        pytest.skip("the native file protocol is not bound here")

    class Older:
        def __getattr__(self, name: str) -> Any:
            if name == "check_rows":
                raise AttributeError(name)
            return getattr(module, name)

    native, why = fileproto._bind(Older())  # type: ignore[arg-type]
    assert native is None
    assert why is not None and "lacks check_rows" in why and "reinstall" in why
    assert set(fileproto.REQUIRED_FUNCTIONS) >= {"check_rows", "read_files", "list_dir_step"}
    bound, why = fileproto._bind(module)
    assert bound is module and why is None

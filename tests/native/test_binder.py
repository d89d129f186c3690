"""The one binder of both extensions (kvstore/native.py): the ``KVSTORE_NATIVE`` switch
(auto, off, require), ``KVSTORE_NATIVE_DIR`` (another build, e.g. the sanitizer's), and what
``kvstore --version`` reports. Bindings are per process, so each case runs in a new one."""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.errors import ConfigError
from kvstore.io import fileproto
from kvstore.native import native_mode

EXTENSIONS = ("kvstore._native._fileproto", "kvstore._native._xxh3batch")
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def _version(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``kvstore --version`` in a new process with ``env`` over this one's switch."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_NATIVE")}
    return subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "--version"],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _built() -> Path:
    """The directory of the extensions the package loads (skips where they are not built)."""
    why = fileproto.native_fileproto_unavailable()
    if why is not None:
        pytest.skip(f"native file protocol not active: {why}")
    module = sys.modules["kvstore._native._fileproto"]
    assert module.__file__ is not None
    return Path(module.__file__).parent


@pytest.mark.parametrize(
    ("value", "mode"), [("", "auto"), ("auto", "auto"), (" OFF ", "off"), ("require", "require")]
)
def test_the_switch_reads_its_modes(monkeypatch: pytest.MonkeyPatch, value: str, mode: str) -> None:
    monkeypatch.setenv("KVSTORE_NATIVE", value)
    assert native_mode() == mode


def test_an_unknown_mode_names_the_ones_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_NATIVE", "fast")
    with pytest.raises(ConfigError, match=r"expected one of auto, off, require, got 'fast'"):
        native_mode()
    done = _version({"KVSTORE_NATIVE": "fast"})
    assert done.returncode == 2
    assert "KVSTORE_NATIVE: expected one of auto, off, require" in done.stderr


def test_off_runs_the_reference_for_both() -> None:
    done = _version({"KVSTORE_NATIVE": "off"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("kvstore ")
    assert lines[1] == "KVSTORE_NATIVE=off"
    for name in EXTENSIONS:
        assert f"{name}: Python reference (KVSTORE_NATIVE=off)" in lines


def test_auto_and_require_report_the_files_bound() -> None:
    built = _built()
    directory = os.environ.get("KVSTORE_NATIVE_DIR")  # the sanitizer run's build, if any
    same_build = {"KVSTORE_NATIVE_DIR": directory} if directory else {}
    for mode in ("auto", "require"):
        done = _version({"KVSTORE_NATIVE": mode, **same_build})
        assert done.returncode == 0, done.stderr
        for name in EXTENSIONS:
            leaf = name.rpartition(".")[2]
            assert f"{name}: native ({built / (leaf + SUFFIX)})" in done.stdout.splitlines()


def test_a_build_directory_is_loaded_instead(tmp_path: Path) -> None:
    """KVSTORE_NATIVE_DIR: the extensions come from there (how CI loads its sanitizer build)."""
    built = _built()
    for name in EXTENSIONS:
        leaf = name.rpartition(".")[2] + SUFFIX
        shutil.copy(built / leaf, tmp_path / leaf)
    done = _version({"KVSTORE_NATIVE": "require", "KVSTORE_NATIVE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    for name in EXTENSIONS:
        leaf = name.rpartition(".")[2] + SUFFIX
        assert f"{name}: native ({tmp_path / leaf})" in done.stdout.splitlines()


def test_require_fails_where_an_extension_is_missing(tmp_path: Path) -> None:
    """An empty build directory: ``require`` is an error naming what is missing (exit 2);
    ``auto`` falls back to the reference with the reason."""
    done = _version({"KVSTORE_NATIVE": "require", "KVSTORE_NATIVE_DIR": str(tmp_path)})
    assert done.returncode == 2
    assert (
        "kvstore._native._fileproto: KVSTORE_NATIVE=require: expected "
        "kvstore._native._fileproto, but extension kvstore._native._fileproto not built "
        f"(KVSTORE_NATIVE_DIR={tmp_path}: no _fileproto{SUFFIX} there)"
    ) in done.stdout
    fallback = _version({"KVSTORE_NATIVE": "auto", "KVSTORE_NATIVE_DIR": str(tmp_path)})
    assert fallback.returncode == 0
    words = "kvstore._native._xxh3batch: Python reference (extension kvstore._native._xxh3batch"
    assert f"{words} not built" in (fallback.stdout)


def test_require_raises_at_first_use(tmp_path: Path) -> None:
    """Not only the report: the store's first native call raises NativeRequiredError."""
    code = (
        "from kvstore.errors import NativeRequiredError\n"
        "from kvstore.io.native_fileio import NativeFileIO\n"
        "try:\n"
        "    NativeFileIO().exists_many(['/nonexistent'])\n"
        "except NativeRequiredError as exc:\n"
        "    print('refused:', exc)\n"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_NATIVE")}
    env = {**base, "KVSTORE_NATIVE": "require", "KVSTORE_NATIVE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "refused: KVSTORE_NATIVE=require: expected kvstore._native._fileproto" in done.stdout

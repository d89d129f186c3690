"""The one binder of kvstore's C extensions, and the switch that chooses them.

kvstore has two optional extensions, both in :mod:`kvstore._native`: ``_xxh3batch`` (a block's
xxh3 checksums in one call without the GIL, :mod:`kvstore.checksum`) and ``_fileproto`` (a
block file's whole protocol in one call without the GIL, :mod:`kvstore.io.fileproto`). Each
has a Python reference that gives the same result for every input; the extensions are only
faster. This module decides, once per process and per extension, which one runs:

``KVSTORE_NATIVE`` (environment):

* ``auto`` (the default): the extension where it is built and passes its self-test; otherwise
  one WARNING and the Python reference.
* ``off``: the Python reference everywhere (what a machine without a compiler runs; CI runs the
  store and I/O tests this way too).
* ``require``: the extension or :class:`~kvstore.errors.NativeRequiredError` at first use
  (CI, so that a build that silently fell back cannot pass as native).

``KVSTORE_NATIVE_DIR`` (environment, optional): a directory holding the extensions' shared
objects (``_fileproto<EXT_SUFFIX>``, ``_xxh3batch<EXT_SUFFIX>``) to load instead of the ones
installed in the package: CI's sanitizer build (``scripts/sanitize.sh``) is loaded this way.

``kvstore --version`` prints :func:`native_report`.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Generic, TypeVar

from kvstore.errors import ConfigError, NativeRequiredError

log = logging.getLogger("kvstore.native")

MODE_ENV = "KVSTORE_NATIVE"
DIR_ENV = "KVSTORE_NATIVE_DIR"
MODES = ("auto", "off", "require")
# The process-wide variables above: StoreConfig.from_env, which owns the rest of KVSTORE_*,
# passes over these.
PROCESS_VARIABLES = frozenset({MODE_ENV, DIR_ENV})

T = TypeVar("T")


def native_mode() -> str:
    """The mode ``KVSTORE_NATIVE`` asks for (``auto`` when unset); ConfigError for any other
    value, naming the ones allowed."""
    mode = os.environ.get(MODE_ENV, "").strip().lower() or "auto"
    if mode not in MODES:
        raise ConfigError(
            f"{MODE_ENV}: expected one of {', '.join(MODES)}, got {os.environ.get(MODE_ENV)!r}"
        )
    return mode


def import_extension(name: str) -> ModuleType:
    """Import extension ``name`` (``kvstore._native._fileproto``): from ``KVSTORE_NATIVE_DIR``
    when it is set, else from the package. ImportError says what was looked for."""
    directory = os.environ.get(DIR_ENV)
    if not directory:
        # By name: import-linter sees no .py file for a C module and would count a plain
        # import as one of the whole kvstore package (every layer included).
        return importlib.import_module(name)
    filename = name.rpartition(".")[2] + importlib.machinery.EXTENSION_SUFFIXES[0]
    path = str(Path(directory).resolve() / filename)
    if not Path(path).is_file():
        raise ImportError(f"{DIR_ENV}={directory}: no {filename} there")
    if name in sys.modules:  # one module object per process, whichever file it came from
        module = sys.modules[name]
        if getattr(module, "__file__", None) == path:
            return module
        raise ImportError(f"{name} is already loaded from {getattr(module, '__file__', '?')}")
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None:
        raise ImportError(f"{path}: not loadable as {name}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[name] = module
    return module


@dataclass(frozen=True)
class BindingState(Generic[T]):
    """What a binding found: the bound value (None: the reference runs), why not, the file."""

    value: T | None
    why: str | None
    path: str | None


class NativeBinding(Generic[T]):
    """One extension's once-per-process binding under the switch.

    ``bind(module)`` turns the imported module into what its users call (the module itself,
    or a function of it) after its self-test: ``(value, None)``, or ``(None, why)`` when it
    must not be used. ``fallback``: the words of the WARNING that says what runs instead.
    """

    def __init__(
        self, name: str, bind: Callable[[ModuleType], tuple[T | None, str | None]], fallback: str
    ) -> None:
        self.name = name
        self._bind = bind
        self._fallback = fallback
        self._lock = threading.Lock()
        self._state: BindingState[T] | None = None
        _REGISTRY[name] = self

    def get(self) -> T | None:
        """The bound value, or None (the Python reference runs); binds on first call."""
        state = self._state
        if state is None:
            state = self.state()
        return state.value

    def unavailable(self) -> str | None:
        """Why the extension is not used (binding it on first call), None when it is."""
        return self.state().why

    def state(self) -> BindingState[T]:
        """The binding, made on first call: NativeRequiredError under ``require`` when the
        extension cannot be used; one WARNING under ``auto``."""
        with self._lock:
            if self._state is None:
                self._state = self._make()
            return self._state

    def reset(self) -> None:
        """Forget the binding (tests: the next use binds again under the current switch)."""
        with self._lock:
            self._state = None

    def _make(self) -> BindingState[T]:
        mode = native_mode()
        if mode == "off":
            return BindingState(None, f"{MODE_ENV}=off", None)
        path: str | None = None
        value: T | None = None
        why: str | None
        try:
            module = import_extension(self.name)
        except ImportError as exc:
            why = f"extension {self.name} not built ({exc})"
        else:
            path = getattr(module, "__file__", None)
            value, why = self._bind(module)
        if why is not None:
            if mode == "require":
                raise NativeRequiredError(f"{MODE_ENV}=require: expected {self.name}, but {why}")
            log.warning("%s unavailable: %s; %s", self.name, why, self._fallback)
            return BindingState(None, why, path)
        return BindingState(value, None, path)


_REGISTRY: dict[str, NativeBinding[Any]] = {}


def native_report() -> tuple[list[str], bool]:
    """One line for the switch and one per extension: bound from which file, or why not
    (binds each extension that was not bound yet); and whether the switch is satisfied
    (False: ``require`` and an extension cannot be used)."""
    directory = os.environ.get(DIR_ENV)
    lines = [f"{MODE_ENV}={native_mode()}" + (f" {DIR_ENV}={directory}" if directory else "")]
    satisfied = True
    for name, binding in sorted(_REGISTRY.items()):
        try:
            state = binding.state()
        except NativeRequiredError as exc:
            lines.append(f"{name}: {exc}")
            satisfied = False
            continue
        if state.why is None:
            lines.append(f"{name}: native ({state.path})")
        else:
            lines.append(f"{name}: Python reference ({state.why})")
    return lines, satisfied

"""cuFile (GPUDirect Storage) behind a small replaceable object.

:class:`CuFiles` opens file handles whose ``pwrite``/``pread`` move bytes between a uint8
tensor and a file at an offset, returning a future (``.get()`` -> bytes moved). The GDS engine
is written against it, so its offset, alignment, handle-reuse and bounce logic runs in the CPU
tests with :class:`PosixCuFiles` (``os.pwrite``/``os.preadv`` from CPU tensors, recording every
call and refusing unaligned ones, as GDS proper would do them through a bounce buffer).
:class:`KvikioCuFiles` is the real one, over ``kvikio.CuFile`` (kvikio 24.x-26.x): it opens the
path itself (kvikio keeps a buffered and an O_DIRECT descriptor), so the engine creates the
file first with the store's rules and checks that kvikio opened that same file.

kvikio's compatibility mode: "on" means kvikio does POSIX I/O through host bounce buffers (no
GPUDirect, still correct); "auto" tries cuFile and falls back per file; "off" insists on
cuFile. It is read once at start-up and reported in the engine's one-line description.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvstore.store.format import ALIGN


class IOFuture(Protocol):
    def get(self) -> int: ...


class CuFileHandle(Protocol):
    """One open file (kvikio.CuFile's shape)."""

    def pwrite(self, buf: torch.Tensor, size: int, file_offset: int) -> IOFuture: ...

    def pread(self, buf: torch.Tensor, size: int, file_offset: int) -> IOFuture: ...

    def fileno(self) -> int: ...

    def close(self) -> None: ...


class CuFiles(Protocol):
    """Opens :class:`CuFileHandle` objects; knows kvikio's compatibility mode."""

    compat_mode: str  # "on", "off", "auto" (kvikio's setting), or "posix" for the fake

    def open(self, path: str, flags: str) -> CuFileHandle:
        """``flags``: "r" (read) or "r+" (read and write an existing file; never creates)."""
        ...


@dataclass(frozen=True)
class _Done:
    nbytes: int

    def get(self) -> int:
        return self.nbytes


@dataclass
class PosixCuFiles:
    """The CPU tests' cuFile: POSIX I/O from CPU tensors, every call recorded.

    ``strict``: an offset or size that is not 4 KiB aligned raises ``ValueError`` (the GDS
    engine promises aligned cuFile calls; this catches it breaking the promise).
    """

    strict: bool = True
    compat_mode: str = "posix"
    calls: list[tuple[str, str, int, int]] = field(default_factory=list)  # (op, path, off, n)
    opened: list[tuple[str, str]] = field(default_factory=list)

    def open(self, path: str, flags: str) -> CuFileHandle:
        self.opened.append((path, flags))
        mode = os.O_RDWR if flags == "r+" else os.O_RDONLY
        fd = os.open(path, mode | os.O_CLOEXEC | os.O_NOFOLLOW)
        return _PosixHandle(self, path, fd)


class _PosixHandle:
    def __init__(self, owner: PosixCuFiles, path: str, fd: int) -> None:
        self._owner = owner
        self._path = path
        self._fd = fd

    def _check(self, op: str, size: int, offset: int) -> None:
        self._owner.calls.append((op, self._path, offset, size))
        if self._owner.strict and (offset % ALIGN or size % ALIGN):
            raise ValueError(f"cuFile {op}: unaligned offset {offset} or size {size}")

    def pwrite(self, buf: torch.Tensor, size: int, file_offset: int) -> IOFuture:
        self._check("pwrite", size, file_offset)
        view = buf.numpy().data.cast("B")[:size]
        done = 0
        while done < size:
            n = os.pwrite(self._fd, view[done:], file_offset + done)
            if n <= 0:
                break
            done += n
        return _Done(done)

    def pread(self, buf: torch.Tensor, size: int, file_offset: int) -> IOFuture:
        self._check("pread", size, file_offset)
        view = buf.numpy().data.cast("B")[:size]
        done = 0
        while done < size:
            n = os.preadv(self._fd, [view[done:]], file_offset + done)
            if n <= 0:
                break
            done += n
        return _Done(done)

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        os.close(self._fd)


class KvikioCuFiles:  # pragma: no cover - needs kvikio and CUDA; exercised by the gpu tests
    """kvikio.CuFile handles; ``compat_mode`` read from kvikio's settings once."""

    def __init__(self, kvikio_module: Any | None = None) -> None:
        if kvikio_module is None:
            import kvikio  # noqa: PLC0415 - optional dependency, imported only when selected

            kvikio_module = kvikio
        self._kvikio = kvikio_module
        self.compat_mode = kvikio_compat_mode(kvikio_module)

    def open(self, path: str, flags: str) -> CuFileHandle:
        handle: CuFileHandle = self._kvikio.CuFile(path, flags)
        return handle


def kvikio_compat_mode(kvikio_module: Any) -> str:  # pragma: no cover - needs kvikio
    """kvikio's compatibility mode as "on" / "off" / "auto" (the API moved across versions)."""
    defaults = kvikio_module.defaults
    try:
        value = defaults.get("compat_mode")  # kvikio >= 25.x
    except (AttributeError, KeyError, TypeError):
        value = defaults.compat_mode()  # kvikio 24.x: a bool
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(getattr(value, "name", value)).lower()

"""cuFile (GPUDirect Storage) behind a small replaceable object.

:class:`CuFiles` opens file handles whose ``pwrite``/``pread`` move bytes between a uint8
tensor and a file at an offset, returning a future (``.get()`` -> bytes moved, called once).
The GDS engine is written against it, so its offset, alignment, handle-reuse and bounce logic
runs in the CPU tests with :class:`PosixCuFiles` (``os.pwrite``/``os.preadv`` from CPU tensors,
recording every call and refusing unaligned ones, as GDS proper would do them through a bounce
buffer; like kvikio it refuses a size larger than the buffer and a non-contiguous buffer with
``ValueError``). :class:`KvikioCuFiles` is the real one, over ``kvikio.CuFile`` (checked
against kvikio 26.10): it opens the path itself (kvikio keeps a buffered and an O_DIRECT
descriptor; ``fileno()`` is the buffered one), so the engine creates the file first with the
store's rules and checks that kvikio opened that same file. kvikio takes device memory through
``__cuda_array_interface__`` (torch CUDA tensors have it) and host memory through the buffer
protocol, which torch CPU tensors lack: the adapter hands those over as numpy arrays. kvikio
reports failures as ``RuntimeError``; the adapter raises :class:`~kvstore.errors.StoreIOError`.

kvikio's compatibility mode: "on" means kvikio does POSIX I/O through host bounce buffers (no
GPUDirect, still correct); "auto" tries cuFile and falls back per file; "off" insists on
cuFile. It is read once at start-up (``auto`` that kvikio already resolves to POSIX, e.g.
without ``libcufile`` or ``/run/udev``, is reported as "on") and named in the engine's
one-line description. Two other kvikio settings matter here: ``pread``/``pwrite`` smaller than
``gds_threshold`` (16 KiB by default) bypass cuFile and use POSIX, so the selection probe moves
at least that much; and kvikio's thread pool has 1 thread unless ``KVIKIO_NTHREADS`` says
otherwise, so the GDS engine asks for as many as it has I/O threads (:meth:`want_threads`).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvstore.errors import StoreIOError
from kvstore.io.align import ALIGN


class IOFuture(Protocol):
    def get(self) -> int:
        """Wait for the operation; bytes moved. Call it once (kvikio's is a C++ future)."""
        ...


class CuFileHandle(Protocol):
    """One open file (kvikio.CuFile's shape)."""

    def pwrite(self, buf: torch.Tensor, size: int, file_offset: int) -> IOFuture: ...

    def pread(self, buf: torch.Tensor, size: int, file_offset: int) -> IOFuture: ...

    def fileno(self) -> int: ...

    def close(self) -> None: ...


class CuFiles(Protocol):
    """Opens :class:`CuFileHandle` objects; knows kvikio's compatibility mode."""

    compat_mode: str  # "on", "off", "auto" (kvikio's setting), or "posix" for the fake
    gds_threshold: int  # pread/pwrite smaller than this bypass cuFile (kvikio's POSIX path)

    def open(self, path: str, flags: str) -> CuFileHandle:
        """``flags``: "r" (read) or "r+" (read and write an existing file; never creates)."""
        ...

    def want_threads(self, n: int) -> None:
        """Let at least ``n`` cuFile operations run at once (kvikio's thread pool)."""
        ...


@dataclass(frozen=True)
class _Done:
    nbytes: int

    def get(self) -> int:
        return self.nbytes

    def done(self) -> bool:
        return True


@dataclass
class PosixCuFiles:
    """The CPU tests' cuFile: POSIX I/O from CPU tensors, every call recorded.

    ``strict``: an offset or size that is not 4 KiB aligned raises ``ValueError`` (the GDS
    engine promises aligned cuFile calls; this catches it breaking the promise).
    """

    strict: bool = True
    compat_mode: str = "posix"
    gds_threshold: int = 0
    threads: int = 1  # the most want_threads asked for
    calls: list[tuple[str, str, int, int]] = field(default_factory=list)  # (op, path, off, n)
    opened: list[tuple[str, str]] = field(default_factory=list)

    def want_threads(self, n: int) -> None:
        self.threads = max(self.threads, n)

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

    def _view(self, buf: torch.Tensor, size: int) -> memoryview:
        # kvikio's own checks (kvikio._lib.file_handle): both are ValueError there too.
        if not buf.is_contiguous():
            raise ValueError("Array must be contiguous")
        if size > buf.numel() * buf.element_size():
            raise ValueError("Size is greater than the size of the buffer")
        return buf.numpy().data.cast("B")[:size]

    def pwrite(self, buf: torch.Tensor, size: int, file_offset: int) -> IOFuture:
        self._check("pwrite", size, file_offset)
        view = self._view(buf, size)
        done = 0
        while done < size:
            n = os.pwrite(self._fd, view[done:], file_offset + done)
            if n <= 0:
                break
            done += n
        return _Done(done)

    def pread(self, buf: torch.Tensor, size: int, file_offset: int) -> IOFuture:
        self._check("pread", size, file_offset)
        view = self._view(buf, size)
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


class KvikioCuFiles:
    """kvikio.CuFile handles; ``compat_mode`` and ``gds_threshold`` read from kvikio once.

    Its logic runs in the CPU tests over a fake kvikio module; real I/O in the gpu tests.
    """

    def __init__(self, kvikio_module: Any | None = None) -> None:
        if kvikio_module is None:
            import kvikio  # noqa: PLC0415 - optional dependency, imported only when selected

            kvikio_module = kvikio
        self._kvikio = kvikio_module
        self._defaults = _kvikio_defaults(kvikio_module)
        self.compat_mode = kvikio_compat_mode(kvikio_module)
        self.gds_threshold = int(self._defaults.get("gds_threshold"))

    def open(self, path: str, flags: str) -> CuFileHandle:
        try:
            return _KvikioHandle(self._kvikio.CuFile(path, flags))
        except RuntimeError as exc:  # kvikio's C++ errors (open(2) failures included)
            raise StoreIOError(f"cuFile open {path}: {exc}") from exc

    def want_threads(self, n: int) -> None:
        """Grow kvikio's thread pool (default 1 thread) to ``n``, unless the user chose its
        size with ``KVIKIO_NTHREADS``; a process-wide setting, never shrunk here."""
        if "KVIKIO_NTHREADS" in os.environ:
            return
        if int(self._defaults.get("num_threads")) < n:
            self._defaults.set("num_threads", n)


class _KvikioHandle:
    """One kvikio.CuFile: CPU tensors go over as numpy arrays (kvikio reads host memory
    through the buffer protocol, which torch tensors lack); kvikio's RuntimeErrors become
    StoreIOError."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def pwrite(self, buf: torch.Tensor, size: int, file_offset: int) -> IOFuture:
        try:
            return _KvikioFuture(self._handle.pwrite(_kvikio_buffer(buf), size, file_offset))
        except RuntimeError as exc:
            raise StoreIOError(f"cuFile pwrite at {file_offset}: {exc}") from exc

    def pread(self, buf: torch.Tensor, size: int, file_offset: int) -> IOFuture:
        try:
            return _KvikioFuture(self._handle.pread(_kvikio_buffer(buf), size, file_offset))
        except RuntimeError as exc:
            raise StoreIOError(f"cuFile pread at {file_offset}: {exc}") from exc

    def fileno(self) -> int:
        return int(self._handle.fileno())

    def close(self) -> None:
        try:
            self._handle.close()
        except RuntimeError as exc:
            raise StoreIOError(f"cuFile close: {exc}") from exc


@dataclass(frozen=True)
class _KvikioFuture:
    future: Any

    def get(self) -> int:
        try:
            return int(self.future.get())
        except RuntimeError as exc:
            raise StoreIOError(f"cuFile I/O: {exc}") from exc

    def done(self) -> bool:
        return bool(self.future.done())


def _kvikio_buffer(buf: torch.Tensor) -> Any:
    """What kvikio accepts for ``buf``: the tensor itself on CUDA (``__cuda_array_interface__``),
    a numpy view of it on the CPU (buffer protocol)."""
    return buf if buf.is_cuda else buf.numpy()


def _kvikio_defaults(kvikio_module: Any) -> Any:
    """``kvikio.defaults``: ``import kvikio`` does not import that submodule (kvikio 26.10)."""
    defaults = getattr(kvikio_module, "defaults", None)
    if defaults is None:
        defaults = importlib.import_module(f"{kvikio_module.__name__}.defaults")
    return defaults


def kvikio_compat_mode(kvikio_module: Any) -> str:
    """kvikio's compatibility mode as "on" / "off" / "auto"; an "auto" that kvikio resolves to
    POSIX I/O for every file (``is_compat_mode_preferred()``) is "on"."""
    defaults = _kvikio_defaults(kvikio_module)
    try:
        value = defaults.get("compat_mode")  # kvikio 26.10: a kvikio.CompatMode
    except (AttributeError, KeyError, TypeError):
        value = defaults.compat_mode()  # older kvikio (no defaults.get): a bool
    if isinstance(value, bool):
        return "on" if value else "off"
    mode = str(getattr(value, "name", value)).lower()
    preferred = getattr(defaults, "is_compat_mode_preferred", None)
    if mode == "auto" and preferred is not None and preferred():
        return "on"
    return mode

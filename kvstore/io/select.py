"""Choosing the I/O engine of a store, once, at open.

``io_mode`` (:class:`~kvstore.config.StoreConfig`) is ``auto``, ``gds``, ``pinned`` or ``host``.
``auto`` probes, in this order, stopping where an answer settles it:

1. **CUDA present** (``torch.cuda.is_available()``): without it only the host engine applies.
2. **kvikio importable**: without it, the pinned engine.
3. **cuFile usable on the store's filesystem**: a write and read-back of a probe file in the
   store root from a device buffer (removed afterwards), 4 KiB or kvikio's ``gds_threshold``
   if larger (16 KiB by default; kvikio moves smaller transfers by POSIX, not cuFile), at most
   1 MiB; kvikio's compatibility mode is read too. ``compat_mode=on`` means kvikio would do
   POSIX I/O through its own host bounce buffers, no better than the pinned engine, so
   ``auto`` then picks pinned.
4. **O_DIRECT** (:func:`kvstore.io.host.probe_direct_io`, per ``direct_io``): how the host
   and pinned engines write whole files.

Then it logs exactly one line (logger ``kvstore.select``) naming the chosen engine and why
each other one was not chosen. A forced mode that cannot work is a
:class:`~kvstore.errors.ConfigError` naming what it expected and what it found. A store
opened read-only (tools) gets the host engine without probes (probes write files).

Every probe is injectable (:class:`Probes`), which is how the CPU tests simulate missing CUDA,
kvikio, cuFile or O_DIRECT.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.io.align import ALIGN, align_up
from kvstore.io.cufile import CuFiles
from kvstore.io.device import CudaDeviceOps, DeviceOps
from kvstore.io.engine import Engine
from kvstore.io.fileio import PROBE_PREFIX, FileIO
from kvstore.io.gds import GdsEngine
from kvstore.io.host import HostEngine, probe_direct_io
from kvstore.io.native_fileio import DEFAULT_FILEIO
from kvstore.io.pinned import PinnedEngine
from kvstore.io.staging import HostStaging, Staging
from kvstore.io.types import DirectIOProbe

log = logging.getLogger("kvstore.select")


@dataclass(frozen=True)
class Found:
    """One probe's answer: usable or not, and the words for the log line."""

    ok: bool
    detail: str


def _probe_cuda() -> Found:
    if torch.cuda.is_available():
        return Found(True, f"CUDA device {torch.cuda.get_device_name()}")
    return Found(False, "no CUDA (torch.cuda.is_available() is False)")


def _probe_kvikio() -> CuFiles | Found:
    from kvstore.io.cufile import KvikioCuFiles  # noqa: PLC0415 - only with CUDA

    try:
        return KvikioCuFiles()
    except ImportError as exc:
        return Found(False, f"kvikio not importable ({exc})")
    except Exception as exc:  # e.g. libkvikio's loader: libcufile not found (a RuntimeError)
        return Found(False, f"kvikio not usable ({type(exc).__name__}: {exc})")


PROBE_MAX = 1 << 20  # the cuFile probe moves at most this much


def probe_nbytes(cufiles: CuFiles) -> int:
    """Bytes the cuFile probe moves: 4 KiB, or kvikio's ``gds_threshold`` (smaller transfers
    bypass cuFile, so a smaller probe would only test POSIX I/O), at most :data:`PROBE_MAX`."""
    return min(PROBE_MAX, align_up(max(ALIGN, cufiles.gds_threshold)))


def probe_cufile(root: Path, cufiles: CuFiles, ops: DeviceOps, device: torch.device) -> Found:
    """Write :func:`probe_nbytes` from device memory with cuFile into a probe file in
    ``root``, read it back, compare; the file is removed whatever happens."""
    path = str(root / f"{PROBE_PREFIX}gds-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    size = probe_nbytes(cufiles)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
        os.close(fd)
        out = ops.device_empty(size, device)
        out.copy_(torch.arange(size, dtype=torch.int64).remainder(251).to(torch.uint8))
        back = ops.device_empty(size, device)
        back.zero_()
        ops.synchronize(device)
        handle = cufiles.open(path, "r+")
        try:
            written = handle.pwrite(out, size, 0).get()
            read = handle.pread(back, size, 0).get()
        finally:
            handle.close()
        if written != size or read != size or not torch.equal(out, back):
            return Found(False, f"cuFile probe in {root} moved {written}/{read} of {size} bytes")
        return Found(
            True, f"cuFile probe passed in {root}, kvikio compat mode {cufiles.compat_mode}"
        )
    except Exception as exc:  # any failure of the stack (driver, filesystem) means "not usable"
        return Found(False, f"cuFile probe failed in {root}: {exc}")
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


@dataclass(frozen=True)
class Probes:
    """The probes selection runs; tests replace any of them."""

    cuda: Callable[[], Found] = _probe_cuda
    kvikio: Callable[[], CuFiles | Found] = _probe_kvikio
    cufile: Callable[[Path, CuFiles, DeviceOps, torch.device], Found] = probe_cufile
    direct: Callable[[Path, str, FileIO], DirectIOProbe] = probe_direct_io
    device_ops: Callable[[], DeviceOps] = CudaDeviceOps
    device: Callable[[], torch.device] = field(
        default=lambda: torch.device("cuda", torch.cuda.current_device())
    )


@dataclass(frozen=True)
class Selection:
    """The engine of a store, its staging, and the checksum new blocks get."""

    engine: Engine
    staging: Staging
    checksum: str
    line: str  # the one log line ("" for read-only stores)


def select_engine(  # noqa: PLR0912, PLR0915 - one decision table (io_mode x probe outcome x staging), read top to bottom as the module docstring lists it
    config: StoreConfig,
    fio: FileIO = DEFAULT_FILEIO,
    *,
    read_only: bool = False,
    probes: Probes | None = None,
) -> Selection:
    """Probe once and build the engine ``config.io_mode`` asks for (module docstring)."""
    if read_only:
        plain = HostEngine(config, fio, probe=False)
        return Selection(plain, HostStaging(), config.resolved_checksum("host"), "")
    p = probes or Probes()
    mode = config.io_mode
    why_not: dict[str, str] = {}
    chosen: str
    reason: str
    cuda = Found(False, "not probed (io_mode=host)") if mode == "host" else p.cuda()
    cufiles: CuFiles | None = None
    ops: DeviceOps | None = None
    device = torch.device("cpu")
    gds_found = Found(False, "not probed")
    if cuda.ok:
        ops, device = p.device_ops(), p.device()
        if mode in ("auto", "gds"):
            kvikio = p.kvikio()
            if isinstance(kvikio, Found):
                gds_found = kvikio
            else:
                cufiles = kvikio
                gds_found = p.cufile(config.root, kvikio, ops, device)
    if mode == "host":
        chosen, reason = "host", "io_mode=host"
        why_not = {"gds": "io_mode=host", "pinned": "io_mode=host"}
    elif mode == "pinned":
        if not cuda.ok:
            raise ConfigError(f"io_mode=pinned: expected a CUDA device, found {cuda.detail}")
        chosen, reason = "pinned", f"io_mode=pinned, {cuda.detail}"
        why_not = {"gds": "io_mode=pinned", "host": "io_mode=pinned"}
    elif mode == "gds":
        if not cuda.ok:
            raise ConfigError(f"io_mode=gds: expected a CUDA device, found {cuda.detail}")
        if not gds_found.ok:
            raise ConfigError(
                f"io_mode=gds: expected kvikio with a working cuFile, found {gds_found.detail}"
            )
        chosen, reason = "gds", f"io_mode=gds, {gds_found.detail}"
        why_not = {"pinned": "io_mode=gds", "host": "io_mode=gds"}
    elif not cuda.ok:
        chosen, reason = "host", cuda.detail
        why_not = {"gds": cuda.detail, "pinned": cuda.detail}
    else:
        host_checksum = config.checksum not in ("auto", "wsum64")
        compat_on = cufiles is not None and cufiles.compat_mode == "on"
        if gds_found.ok and not compat_on and not host_checksum:
            chosen, reason = "gds", gds_found.detail
            why_not["pinned"] = "gds is usable and avoids the host copy"
        else:
            chosen, reason = "pinned", cuda.detail
            if not gds_found.ok:
                why_not["gds"] = gds_found.detail
            elif compat_on:
                why_not["gds"] = (
                    "kvikio compat mode is on (POSIX through bounce buffers, no GPUDirect)"
                )
            else:
                why_not["gds"] = f"checksum={config.checksum} is computed on the host"
        why_not["host"] = "device pages need staging (CUDA present)"
    direct = p.direct(config.root, config.direct_io, fio)
    engine: HostEngine
    staging: Staging
    if chosen == "gds":
        assert ops is not None and cufiles is not None
        gds = GdsEngine(config, ops, cufiles, device, fio, probe=False)
        engine, staging = gds, gds.staging
    elif chosen == "pinned":
        assert ops is not None
        pinned = PinnedEngine(config, ops, fio, probe=False)
        engine, staging = pinned, pinned.staging
    else:
        engine, staging = HostEngine(config, fio, probe=False), HostStaging()
    engine.direct = direct
    checksum = config.resolved_checksum(chosen)
    others = "; ".join(f"not {name}: {why}" for name, why in why_not.items())
    line = (
        f"kvstore: {chosen} engine ({reason}); {others}; O_DIRECT "
        f"{'on' if direct.enabled else 'off'} ({direct.reason}); checksum {checksum}"
    )
    log.info("%s", line)
    return Selection(engine, staging, checksum, line)

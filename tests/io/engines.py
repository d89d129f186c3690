"""The engines the conformance suite runs, each built through the real selection code.

On the CPU: the host engine, and the pinned and GDS engines with their CPU stand-ins
(:class:`~kvstore.io.device.CpuDeviceOps`: host memory plays the device;
:class:`~kvstore.io.cufile.PosixCuFiles`: cuFile calls become ``os.pwrite``/``preadv`` and an
unaligned cuFile call is an error). With CUDA (tests marked ``gpu``): the pinned and GDS
engines with real CUDA and kvikio, data in device memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.config import StoreConfig
from kvstore.io.cufile import CuFiles, PosixCuFiles
from kvstore.io.device import CpuDeviceOps
from kvstore.io.select import Found, Probes
from kvstore.store.page_store import KVStore


@dataclass(frozen=True)
class EngineKind:
    """How to open a store on one engine, and where its "device" data lives."""

    name: str  # host | pinned | gds | pinned-cuda | gds-cuda
    io_mode: str
    gpu: bool = False

    @property
    def device(self) -> torch.device:
        return torch.device("cuda") if self.gpu else torch.device("cpu")

    @property
    def takes_tensors(self) -> bool:
        """Whether callers hand this engine's store torch tensors (device data)."""
        return self.io_mode != "host"

    def probes(self, cufiles: CuFiles | None = None) -> Probes | None:
        if self.gpu:
            return None  # the real probes
        if self.io_mode == "host":
            return Probes(cuda=lambda: Found(False, "CPU test"))
        files = cufiles if cufiles is not None else PosixCuFiles()
        return Probes(
            cuda=lambda: Found(True, "CPU stand-in"),
            kvikio=lambda: files,
            device_ops=CpuDeviceOps,
            device=lambda: torch.device("cpu"),
        )

    def open(self, root: Path, cufiles: CuFiles | None = None, **overrides: Any) -> KVStore:
        values: dict[str, Any] = {"durability": "none", "io_threads": 2, "io_mode": self.io_mode}
        values.update(overrides)
        config = StoreConfig(root=root).replace(**values)
        return KVStore(config, probes=self.probes(cufiles))


def _gpu_ready() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA"
    return None


def _kvikio_ready() -> str | None:
    try:
        import kvikio  # noqa: F401, PLC0415
    except ImportError:
        return "kvikio not installed"
    except Exception as exc:  # libkvikio's loader raises RuntimeError without libcufile
        return f"kvikio not usable ({type(exc).__name__}: {exc})"
    return None


CPU_KINDS = [EngineKind("host", "host"), EngineKind("pinned", "pinned"), EngineKind("gds", "gds")]
GPU_KINDS = [EngineKind("pinned-cuda", "pinned", gpu=True), EngineKind("gds-cuda", "gds", gpu=True)]


def ready_gpu_kinds() -> list[EngineKind]:
    """The GPU kinds this machine can run (none without CUDA)."""
    return [
        k
        for k in GPU_KINDS
        if (_gpu_ready() or (_kvikio_ready() if k.io_mode == "gds" else None)) is None
    ]


def kind_params() -> list[Any]:
    """pytest params: the CPU kinds, then the GPU kinds marked ``gpu`` and skipped without."""
    params: list[Any] = [pytest.param(k, id=k.name) for k in CPU_KINDS]
    for kind in GPU_KINDS:
        why = _gpu_ready() or (_kvikio_ready() if kind.io_mode == "gds" else None)
        marks = [pytest.mark.gpu]
        if why is not None:
            marks.append(pytest.mark.skip(reason=why))
        params.append(pytest.param(kind, id=kind.name, marks=marks))
    return params

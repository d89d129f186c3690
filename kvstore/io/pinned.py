"""Pinned staging engine: the host engine's file I/O behind pinned-memory staging.

Device pages are gathered on the device (one batched gather per batch) and copied into pooled,
page-aligned pinned host buffers on a side CUDA stream, one event per batch
(:class:`~kvstore.io.staging.PinnedStaging`); the I/O threads then write those rows with the
host engine's ``pwritev`` (O_DIRECT where the probe passed: pinned rows are page aligned, so
no further copy). Loads are the reverse. The files are exactly the host engine's.
"""

from __future__ import annotations

from kvstore.config import StoreConfig
from kvstore.io.device import DeviceOps
from kvstore.io.fileio import FileIO
from kvstore.io.host import HostEngine
from kvstore.io.native_fileio import DEFAULT_FILEIO
from kvstore.io.staging import PinnedStaging


class PinnedEngine(HostEngine):
    """:class:`HostEngine` file I/O plus a :class:`PinnedStaging` for device pages."""

    name = "pinned"

    def __init__(
        self,
        config: StoreConfig,
        ops: DeviceOps,
        fio: FileIO = DEFAULT_FILEIO,
        probe: bool = True,
    ) -> None:
        super().__init__(config, fio, probe)
        self.ops = ops
        self.staging = PinnedStaging(ops)

    def describe(self) -> str:
        host = super().describe().removeprefix("host engine, ")
        return f"pinned engine ({self.ops.name} staging, pooled pinned buffers), {host}"

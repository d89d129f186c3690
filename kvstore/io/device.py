"""Device operations the pinned and GDS engines need, behind one small replaceable object.

:class:`DeviceOps` is everything those engines ask of CUDA: a side stream ordered after the
current stream, an event per batch, pinned host buffers, aligned device buffers, a sync. The
engines' logic (pools, staging, alignment, bounce regions) is written against it, so the CPU
test suite runs that logic with :class:`CpuDeviceOps`, where "device" memory is host memory
and every operation completes at once. :class:`CudaDeviceOps` is the thin real one (run only
where a GPU is present: ``tests`` marked ``gpu``, ``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Protocol

import torch

from kvstore.io.align import ALIGN
from kvstore.io.buffers import aligned_buffer


class Event(Protocol):
    """A point in device work; :meth:`synchronize` blocks until it has passed."""

    def synchronize(self) -> None: ...


class _Done:
    def synchronize(self) -> None:
        return


DONE: Event = _Done()


class DeviceOps(Protocol):
    """CUDA as the engines use it (see the module docstring)."""

    name: str

    def side_stream(self, device: torch.device) -> contextlib.AbstractContextManager[None]:
        """Work issued inside runs on this thread's side stream of ``device``, which first
        waits for the work already queued on the current stream."""
        ...

    def record(self, device: torch.device) -> Event:
        """An event after the work issued so far on the current stream of ``device``."""
        ...

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """A page-aligned, page-locked uint8 host tensor of ``nbytes``."""
        ...

    def device_empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` on ``device`` whose address is 4 KiB aligned."""
        ...

    def synchronize(self, device: torch.device) -> None:
        """Wait for all work queued on the current stream of ``device``."""
        ...


class CpuDeviceOps:
    """The stand-in of the CPU tests: host memory plays the device, every op is immediate."""

    name = "cpu stand-in"

    def side_stream(self, device: torch.device) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def record(self, device: torch.device) -> Event:
        return DONE

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        return torch.from_numpy(aligned_buffer(nbytes))

    def device_empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.from_numpy(aligned_buffer(nbytes))

    def synchronize(self, device: torch.device) -> None:
        return


class CudaDeviceOps:  # pragma: no cover - needs CUDA; exercised by the gpu tests
    """CUDA streams, events and allocations through torch."""

    name = "cuda"

    def __init__(self) -> None:
        self._local = threading.local()  # one side stream per (thread, device)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        streams: dict[torch.device, torch.cuda.Stream] = getattr(self._local, "streams", {})
        self._local.streams = streams
        if device not in streams:
            streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        return streams[device]

    @contextlib.contextmanager
    def _on_side(self, device: torch.device) -> Iterator[None]:
        side = self._stream(device)
        with torch.cuda.device(device):
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                yield

    def side_stream(self, device: torch.device) -> contextlib.AbstractContextManager[None]:
        return self._on_side(device)

    def record(self, device: torch.device) -> Event:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(device))
        return event

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        # Page-locked and registered with the driver once, here (the pool keeps it), 4 KiB
        # aligned so O_DIRECT can write it without another copy. torch's pinned allocator
        # rounds every request up to a power of two and cudaHostAlloc returns page-aligned
        # memory: ask for exactly ``nbytes`` (the pool's classes are powers of two) and pad
        # only if this allocator's memory is not aligned (padding would double the size).
        raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if raw.data_ptr() % ALIGN == 0:
            return raw
        raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=True)
        skip = -raw.data_ptr() % ALIGN
        return raw[skip : skip + nbytes]

    def device_empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        # torch's CUDA caching allocator aligns blocks to 512 bytes only: pad and slice.
        raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, device=device)
        skip = -raw.data_ptr() % ALIGN
        return raw[skip : skip + nbytes]

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.current_stream(device).synchronize()

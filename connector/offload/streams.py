"""Ordering transfers against the engine's compute stream, in one small replaceable object.

A store must copy its source pages after the forward pass that wrote them and before vLLM
reuses the blocks; a load must land after any work already queued on those blocks (vLLM
zeroes fresh blocks on the compute stream) and be complete on the device before the worker
reports it. :class:`Streams` hides how:

* :class:`HostStreams` (CPU tensors, what the tests run): the copy happens synchronously
  when it is issued, so every fence is already passed.
* :class:`CudaStreams` (GPU tensors; **not exercised by the CPU test suite**): snapshots run
  on a side stream that first waits on the current (compute) stream and are fenced by an
  event; loads run on a transfer stream that waits on an event recorded on the compute stream
  at submission, and the I/O thread synchronizes on their completion event before reporting.

Where the snapshot's bytes go is the store engine's business, not this module's: the worker
stages through :meth:`kvstore.rank_io.RankIO.stage` (pooled pinned rows for the pinned engine,
device rows for the GDS engine; :mod:`kvstore.io.staging`), which itself orders its side
stream after the stream current here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class Fence(ABC):
    """A point in device work; :meth:`wait` blocks the calling thread until it has passed."""

    @abstractmethod
    def wait(self) -> None: ...


class Passed(Fence):
    """A fence that has already passed (synchronous copies)."""

    def wait(self) -> None:
        return


PASSED = Passed()


class EventFence(Fence):
    """A fence on anything with ``synchronize()`` (a CUDA event, a staged batch's event)."""

    def __init__(self, event: Any) -> None:
        self.event = event

    def wait(self) -> None:
        self.event.synchronize()


class AllOf(Fence):
    """Passes when every one of ``fences`` has."""

    def __init__(self, fences: Sequence[Fence]) -> None:
        self.fences = tuple(fences)

    def wait(self) -> None:
        for fence in self.fences:
            fence.wait()


class Streams(ABC):
    """How one worker orders its copies relative to the compute stream."""

    @abstractmethod
    def snapshot(self, copy: Callable[[], T]) -> tuple[T, Fence]:
        """Run ``copy`` (reads of the KV cache into host buffers) after the compute work
        issued so far; the fence passes when the host buffers hold the bytes."""

    @abstractmethod
    def mark(self) -> Fence:
        """A fence at the compute stream's current position (called when a load is issued)."""

    @abstractmethod
    def run_after(self, fence: Fence, write: Callable[[], T]) -> T:
        """From an I/O thread: run ``write`` (copies into the KV cache) after ``fence`` and
        return only once its copies are complete on the device."""

    @abstractmethod
    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer suited to device transfers (pinned on CUDA)."""


class HostStreams(Streams):
    """CPU tensors: every copy is synchronous, every fence has passed."""

    def snapshot(self, copy: Callable[[], T]) -> tuple[T, Fence]:
        return copy(), PASSED

    def mark(self) -> Fence:
        return PASSED

    def run_after(self, fence: Fence, write: Callable[[], T]) -> T:
        fence.wait()
        return write()

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)


class _EventFence(Fence):
    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self) -> None:
        self.event.synchronize()


class CudaStreams(Streams):  # pragma: no cover - needs CUDA; not run by the CPU suite
    """Side streams and events on one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # torch.cuda.Stream / Event are untyped in torch 2.14's stubs.
        self._store_stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self._load_stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def snapshot(self, copy: Callable[[], T]) -> tuple[T, Fence]:
        with torch.cuda.device(self.device):
            self._store_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._store_stream):
                result = copy()
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(self._store_stream)
        return result, _EventFence(event)

    def mark(self) -> Fence:
        with torch.cuda.device(self.device):
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(self.device))
        return _EventFence(event)

    def run_after(self, fence: Fence, write: Callable[[], T]) -> T:
        with torch.cuda.device(self.device), torch.cuda.stream(self._load_stream):
            if isinstance(fence, _EventFence):
                self._load_stream.wait_event(fence.event)
            else:
                fence.wait()
            result = write()
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self._load_stream)
        done.synchronize()
        return result

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)


def streams_for(device: torch.device) -> Streams:
    """The stream policy for KV tensors on ``device``."""
    if device.type == "cuda":  # pragma: no cover - needs CUDA
        return CudaStreams(device)
    if device.type != "cpu":
        raise NotImplementedError(
            f"kvstore connector: KV cache on {device.type!r} devices is not supported (cpu, cuda)"
        )
    return HostStreams()

"""Staging: where a batch of rows sits between the KV cache and the engine's file I/O.

:class:`kvstore.rank_io.RankIO` gathers a rank's share of a batch of blocks into rows
``(n_blocks, width)`` (one batched gather per batch, :func:`kvstore.layout.page.gather_blocks`)
and hands the rows to the group store; loads read into rows and scatter them back. Each engine
brings the staging that suits it:

* :class:`HostStaging` (host engine): a host tensor; device pages are gathered on the device
  and copied over with one blocking copy (the pre-engine behaviour; CPU tensors stay put).
* :class:`PinnedStaging` (pinned engine): rows live in page-aligned pinned host buffers from a
  :class:`BufferPool` allocated (and page-locked) once and reused; the gather and the D2H copy
  run on a side stream, one event per batch; loads copy H2D and scatter on a side stream, one
  event the caller waits on. Page-aligned rows let the host engine write them with O_DIRECT
  without another copy.
* :class:`DeviceStaging` (GDS engine): rows stay in device memory (4 KiB-aligned), handed to
  the group store as device tensors; cuFile moves them.

``store_rows`` returns at once with the batch's event in :attr:`Staged.ready`: whoever writes
the rows (an I/O thread, :meth:`kvstore.rank_io.RankIO.write_staged`) waits on it first, and
whoever may reuse the KV pages waits on it too (the connector's store fence), so the thread
that submits a store never blocks on the copy. ``deliver`` (loads) returns only when its
device work is complete: the caller's pages hold the bytes.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvstore.io.device import DONE, DeviceOps, Event

Fill = Callable[[torch.Tensor], object]


@dataclass
class Staged:
    """Rows of one batch; call :meth:`release` (or use ``with``) when the I/O is done."""

    rows: torch.Tensor  # (n, width) uint8: host for host/pinned staging, device for GDS
    _release: Callable[[], None] = field(default=lambda: None, repr=False)
    ready: Event = DONE  # passes when the rows hold the gathered bytes

    def release(self) -> None:
        release, self._release = self._release, lambda: None
        release()

    def __enter__(self) -> Staged:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Staging(ABC):
    """How rows of a batch are placed for one engine (see the module docstring)."""

    name: str
    on_device: bool  # rows are device tensors (the engine takes device segments)

    @abstractmethod
    def store_rows(self, n: int, width: int, device: torch.device, fill: Fill) -> Staged:
        """Rows holding what ``fill`` writes into a ``(n, width)`` uint8 tensor on ``device``
        once :attr:`Staged.ready` has passed."""

    @abstractmethod
    def load_rows(self, n: int, width: int, device: torch.device) -> Staged:
        """Rows the engine reads a batch into."""

    @abstractmethod
    def deliver(self, rows: torch.Tensor, consume: Fill, device: torch.device) -> None:
        """Run ``consume`` on ``rows`` (or a subset of them) made available on ``device``;
        complete on the device when this returns."""


class HostStaging(Staging):
    name = "host"
    on_device = False

    def store_rows(self, n: int, width: int, device: torch.device, fill: Fill) -> Staged:
        if device.type == "cpu":
            rows = torch.empty(n, width, dtype=torch.uint8)
            fill(rows)
            return Staged(rows)
        staged = torch.empty(n, width, dtype=torch.uint8, device=device)
        fill(staged)
        return Staged(staged.to("cpu"))

    def load_rows(self, n: int, width: int, device: torch.device) -> Staged:
        return Staged(torch.empty(n, width, dtype=torch.uint8))

    def deliver(self, rows: torch.Tensor, consume: Fill, device: torch.device) -> None:
        consume(rows.to(device))


class BufferPool:
    """Reusable buffers from ``allocate``, in power-of-two size classes (>= 1 MiB).

    Allocation (page-locking, on CUDA) happens once per buffer; released buffers are kept for
    the next batch, up to ``max_cached_bytes`` in all.
    """

    MIN_CLASS = 1 << 20

    def __init__(
        self, allocate: Callable[[int], torch.Tensor], max_cached_bytes: int = 1 << 30
    ) -> None:
        self._allocate = allocate
        self._max_cached = max_cached_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._cached = 0
        self._lock = threading.Lock()
        self.allocations = 0  # buffers allocated so far (tests check reuse)

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` (its full class size); give it back with :meth:`give`."""
        size = max(self.MIN_CLASS, 1 << max(0, nbytes - 1).bit_length())
        with self._lock:
            free = self._free.get(size)
            if free:
                self._cached -= size
                return free.pop()
            self.allocations += 1
        return self._allocate(size)

    def give(self, buffer: torch.Tensor) -> None:
        size = buffer.numel()
        with self._lock:
            if self._cached + size <= self._max_cached:
                self._free.setdefault(size, []).append(buffer)
                self._cached += size


class PinnedStaging(Staging):
    """Rows in pooled pinned host buffers, filled and drained on a side stream."""

    name = "pinned"
    on_device = False

    def __init__(self, ops: DeviceOps, pool: BufferPool | None = None) -> None:
        self.ops = ops
        self.pool = pool or BufferPool(ops.pinned_empty)

    def _pooled(self, n: int, width: int) -> Staged:
        buffer = self.pool.take(n * width)
        rows = buffer[: n * width].view(n, width)
        return Staged(rows, lambda: self.pool.give(buffer))

    def store_rows(self, n: int, width: int, device: torch.device, fill: Fill) -> Staged:
        staged = self._pooled(n, width)
        try:
            with self.ops.side_stream(device):
                gathered = self.ops.device_empty(n * width, device).view(n, width)
                fill(gathered)  # one batched gather on the device
                staged.rows.copy_(gathered, non_blocking=True)  # one D2H copy per batch
                staged.ready = self.ops.record(device)
                # ``gathered`` goes back to torch's allocator of the side stream, which does
                # not reuse it before the work queued there (this copy) has run.
        except BaseException:
            staged.release()
            raise
        return staged

    def load_rows(self, n: int, width: int, device: torch.device) -> Staged:
        return self._pooled(n, width)

    def deliver(self, rows: torch.Tensor, consume: Fill, device: torch.device) -> None:
        with self.ops.side_stream(device):
            on_device = self.ops.device_empty(rows.numel(), device).view(rows.shape)
            on_device.copy_(rows, non_blocking=True)  # one H2D copy per batch
            consume(on_device)
            event = self.ops.record(device)
        event.synchronize()


class DeviceStaging(Staging):
    """Rows in aligned device memory (GDS): no host copy at all."""

    name = "device"
    on_device = True

    def __init__(self, ops: DeviceOps) -> None:
        self.ops = ops

    def store_rows(self, n: int, width: int, device: torch.device, fill: Fill) -> Staged:
        with self.ops.side_stream(device):
            rows = self.ops.device_empty(n * width, device).view(n, width)
            fill(rows)
            # cuFile reads device memory outside any stream order: writers wait on this.
            ready = self.ops.record(device)
        return Staged(rows, ready=ready)

    def load_rows(self, n: int, width: int, device: torch.device) -> Staged:
        return Staged(self.ops.device_empty(n * width, device).view(n, width))

    def deliver(self, rows: torch.Tensor, consume: Fill, device: torch.device) -> None:
        with self.ops.side_stream(device):
            consume(rows)
            event = self.ops.record(device)
        event.synchronize()

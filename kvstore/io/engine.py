"""The contract every I/O engine implements, in one place.

An engine moves block bytes between memory and block files. Three implement it:

* :class:`kvstore.io.host.HostEngine` ("host"): host memory, ``pwritev``/``preadv`` from a
  thread pool, O_DIRECT whole-file writes where the probe passed.
* :class:`kvstore.io.pinned.PinnedEngine` ("pinned"): the host engine's file I/O, plus a
  :class:`~kvstore.io.staging.Staging` that moves device pages through a pool of pinned host
  buffers on a side CUDA stream.
* :class:`kvstore.io.gds.GdsEngine` ("gds"): also takes device tensors in its segments and
  writes/reads them with cuFile (kvikio) at 4 KiB-aligned offsets, without a host copy.

:mod:`kvstore.io.select` picks one per store. Every engine, given the same segments, leaves
byte-identical files (the conformance suite, ``tests/io/test_engine_conformance.py``, checks it).

Contract (:class:`Engine`):

* ``map(fn, items)`` runs ``fn`` over ``items`` on the I/O threads; results (or the exception,
  returned rather than raised: one bad block never fails a batch) in order.
* ``write_file(path, segments, file_nbytes, exclusive=...)`` writes ``(offset, bytes)``
  segments in the order given (a writer killed half way has written a prefix of the list).
  ``exclusive=True``: the file is new (``O_EXCL``, ``O_NOFOLLOW``, the config's owner-only
  mode) and the segments tile ``[0, file_nbytes)``; it ends at ``file_nbytes``. Otherwise
  the file may hold other writers' segments and is not truncated. Synced (fdatasync) before
  returning when the store is durable, unless ``sync=False``: the caller then syncs the file
  itself (the group store syncs a batch of files after writing them all, so that one journal
  commit covers many files instead of one each).
* ``write_new_file(path, segments, file_nbytes)``: ``write_file`` of a new file
  (``exclusive=True``), unsynced, returning its open descriptor, which the caller syncs when it
  chooses and closes (the group store syncs a batch on the descriptors its write pass holds,
  instead of opening each file again). On an error the descriptor is closed first.
* ``finish_file(path, file_nbytes, segments)``: the committer's last writes on a shared
  temporary file, cut to its final size, synced once.
* ``read_file(path, segments, file_nbytes, touch_if_older_than_ns, allow_trailer, direct)``
  fills segments from a published file after checking its size: missing ->
  :class:`~kvstore.errors.BlockMissingError`, wrong size or short read ->
  :class:`~kvstore.errors.CorruptBlockError` (carrying the file's identity); not a regular
  file -> :class:`~kvstore.errors.EntryKindError`, without blocking on a FIFO; mtime is
  refreshed when older than the bound. Returns the identity (device, inode) of the file read,
  so that a block found corrupt is quarantined only while its name still holds that file.
* ``close()``, ``describe()`` (one line), ``name``, ``config``, ``fio``, ``direct`` (the O_DIRECT
  probe outcome).

Capabilities (:class:`EngineCapabilities`, the engine's ``capabilities``) name what an engine
does beyond that. The store plans each array's reads and writes from them once, when the array
opens (:mod:`kvstore.store.plan`), and never asks an engine what type it is:

* ``hashed_io``: ``read_file_hashed`` and ``write_new_file_hashed``, for host segments: a
  block's chunks checksummed group by group as they move (:class:`~kvstore.io.types.Hashing`),
  while they are in the CPU cache.
* ``batches``: ``map_batches(call, items)``: ``call`` over one contiguous part of ``items`` per
  I/O thread (each part one native batch call), the per-item codes joined in order; a part
  whose call raises gives -1 for each of its items.
* ``device_segments``: segments may hold device tensors (below).

The three engines have the host engine's file I/O for host memory, so all three have
``hashed_io`` and ``batches``; only the GDS engine has ``device_segments``.

Segments hold host memory (``memoryview``). An engine with ``device_segments`` (the GDS
engine) also takes contiguous uint8 ``torch.Tensor`` segments: device memory (with the CPU
stand-ins of the tests, CPU tensors play the device). Their bytes must be final when handed
over: the engine synchronizes the current (default) stream before cuFile reads device memory,
so work queued on another stream must have been waited on (staging's ``Staged.ready``). Every
other engine is handed host memory only; the group store copies device data to the host
first (batches go through the engine's staging, :mod:`kvstore.io.staging`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import torch

from kvstore.config import StoreConfig
from kvstore.io.entries import FileId
from kvstore.io.fileio import FileIO
from kvstore.io.types import DirectIOProbe, EngineCapabilities, Hashing, Segment

__all__ = ["AnySegment", "Data", "DeviceEngine", "Engine", "EngineCapabilities", "device_engine"]

T = TypeVar("T")
R = TypeVar("R")

Data = memoryview | torch.Tensor
AnySegment = tuple[int, Data]  # (file offset, host bytes or a uint8 device tensor)


class Engine(Protocol):
    """What the group store needs from an I/O engine (see the module docstring)."""

    name: str
    config: StoreConfig
    fio: FileIO
    direct: DirectIOProbe
    capabilities: EngineCapabilities

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R | BaseException]: ...

    def map_batches(
        self, call: Callable[[Sequence[T]], list[int]], items: Sequence[T]
    ) -> list[int]: ...

    def write_file(
        self,
        path: str,
        segments: Sequence[Segment],
        file_nbytes: int,
        *,
        exclusive: bool,
        sync: bool = True,
    ) -> None: ...

    def write_new_file(self, path: str, segments: Sequence[Segment], file_nbytes: int) -> int: ...

    def write_new_file_hashed(
        self, path: str, segments: Sequence[Segment], file_nbytes: int, hashing: Hashing
    ) -> int: ...

    def finish_file(
        self, path: str, file_nbytes: int, segments: Sequence[Segment] = ()
    ) -> None: ...

    def read_file(  # noqa: PLR0913 - the engine contract's read: file, segments, expected size, mtime-touch threshold and two keyword-only modes
        self,
        path: str,
        segments: Sequence[Segment],
        file_nbytes: int,
        touch_if_older_than_ns: int = 0,
        *,
        allow_trailer: bool = False,
        direct: bool = False,
    ) -> FileId: ...

    def read_file_hashed(  # noqa: PLR0913 - read_file's arguments plus the checksums' plan
        self,
        path: str,
        segments: Sequence[Segment],
        file_nbytes: int,
        touch_if_older_than_ns: int,
        hashing: Hashing,
        *,
        direct: bool = False,
    ) -> FileId: ...

    def close(self) -> None: ...

    def describe(self) -> str: ...


class DeviceEngine(Engine, Protocol):
    """An engine that also moves device tensors in its segments (``device_segments``)."""

    def write_file(
        self,
        path: str,
        segments: Sequence[AnySegment],
        file_nbytes: int,
        *,
        exclusive: bool,
        sync: bool = True,
    ) -> None: ...

    def write_new_file(
        self, path: str, segments: Sequence[AnySegment], file_nbytes: int
    ) -> int: ...

    def finish_file(
        self, path: str, file_nbytes: int, segments: Sequence[AnySegment] = ()
    ) -> None: ...

    def read_file(  # noqa: PLR0913 - the engine contract's read: file, segments, expected size, mtime-touch threshold and two keyword-only modes
        self,
        path: str,
        segments: Sequence[AnySegment],
        file_nbytes: int,
        touch_if_older_than_ns: int = 0,
        *,
        allow_trailer: bool = False,
        direct: bool = False,
    ) -> FileId: ...


def device_engine(engine: Engine) -> DeviceEngine | None:
    """``engine`` as a :class:`DeviceEngine` when it takes device segments, else None."""
    if engine.capabilities.device_segments:
        return engine  # type: ignore[return-value]  # checked by the capability it declares
    return None

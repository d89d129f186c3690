"""Staging: events per batch, who waits on them, the pinned pool."""

from __future__ import annotations

from pathlib import Path

import torch

from kvstore.io.device import CpuDeviceOps, Event
from kvstore.io.staging import BufferPool, DeviceStaging, PinnedStaging
from kvstore.layout import LocalForm, ParallelLayout, map_rank
from kvstore.rank_io import RankIO, group_geometry
from tests.helpers import block_hash, make_small_identity
from tests.io.engines import EngineKind

CPU = torch.device("cpu")


class LazyEvent:
    def __init__(self) -> None:
        self.synced = False

    def synchronize(self) -> None:
        self.synced = True

    def waited(self) -> bool:
        return self.synced


class RecordingOps(CpuDeviceOps):
    """CPU stand-in whose events remember whether anyone waited on them."""

    def __init__(self) -> None:
        self.events: list[LazyEvent] = []
        self.side = 0

    def record(self, device: torch.device) -> Event:
        event = LazyEvent()
        self.events.append(event)
        return event


def test_pinned_store_rows_do_not_block_the_submitter() -> None:
    ops = RecordingOps()
    staging = PinnedStaging(ops)
    staged = staging.store_rows(2, 8, CPU, lambda out: out.fill_(7))
    assert len(ops.events) == 1
    assert staged.ready is ops.events[0]
    assert not ops.events[0].waited()  # one event per batch, waited on by the writer
    assert torch.equal(staged.rows, torch.full((2, 8), 7, dtype=torch.uint8))
    staged.release()


def test_deliver_waits_for_its_event() -> None:
    ops = RecordingOps()
    got: list[torch.Tensor] = []
    for staging in (PinnedStaging(ops), DeviceStaging(ops)):
        rows = torch.arange(6, dtype=torch.uint8).view(2, 3)
        staging.deliver(rows, got.append, CPU)
        assert ops.events[-1].waited()
        assert torch.equal(got[-1], rows)


def test_rank_io_writer_waits_for_the_batch_and_returns_the_buffer(tmp_path: Path) -> None:
    store = EngineKind("pinned", "pinned").open(tmp_path)
    identity = make_small_identity()
    group = store.namespace(identity).group(0)
    ops = RecordingOps()
    staging = PinnedStaging(ops)
    group.staging = staging
    geometry = group_geometry(identity, 0, range(3), 3)
    layout = ParallelLayout()
    mapping = map_rank(geometry, layout, LocalForm(), layout.ranks()[0])
    tensors = [torch.ones(3, mapping.page_bytes, dtype=torch.uint8) for _ in mapping.local_layers]
    rio = RankIO(group, mapping)
    pendings = group.begin_blocks([block_hash(i, "stage") for i in range(2)])
    shares = rio.stage(tensors, pendings, [0, 2])
    assert not ops.events[0].waited()
    assert shares.ready is ops.events[0]
    assert rio.write_staged(shares) == [None, None]
    assert ops.events[0].waited()
    assert staging.pool.allocations == 1
    shares.release()  # idempotent
    again = rio.stage(tensors, group.begin_blocks([block_hash(9, "stage")]), [1])
    assert staging.pool.allocations == 1  # the buffer came back to the pool and was reused
    again.release()
    store.close()


def test_buffer_pool_classes_reuse_and_cap() -> None:
    made: list[int] = []

    def allocate(n: int) -> torch.Tensor:
        made.append(n)
        return torch.empty(n, dtype=torch.uint8)

    pool = BufferPool(allocate, max_cached_bytes=3 << 20)
    a = pool.take(10)
    assert a.numel() == BufferPool.MIN_CLASS
    b = pool.take((1 << 20) + 1)
    assert b.numel() == 2 << 20
    pool.give(a)
    pool.give(b)
    assert pool.take(5).data_ptr() == a.data_ptr()
    assert pool.take(2 << 20).data_ptr() == b.data_ptr()
    pool.give(torch.empty(4 << 20, dtype=torch.uint8))  # over the cap: dropped
    pool.take(4 << 20)
    assert made == [1 << 20, 2 << 20, 4 << 20]

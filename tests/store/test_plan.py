"""Each array's read and write paths are planned once, from the engine's declared capabilities
and the array's fixed settings (kvstore/store/plan.py), never from the engine's type: a pinned
or GDS store (CPU stand-ins) takes the host store's batched and hashed paths for host memory,
and an engine that declares none of them gets the plain paths, with the same bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore import Identity
from kvstore.identity import attention_group
from kvstore.io.host import HostEngine
from kvstore.io.native_fileio import NativeFileIO
from kvstore.io.types import EngineCapabilities
from kvstore.store.group_store import GroupStore
from kvstore.store.plan import ArrayPlan, WholeRead
from kvstore.store.types import BlockRead, BlockWrite, ReadStatus, WriteStatus
from tests.helpers import block_bytes, block_hash, layer_names, make_small_identity
from tests.io.engines import CPU_KINDS, EngineKind

SMALL = make_small_identity()  # 3 layers x 2 heads x 16 tokens x 64, K and V: 24 KiB blocks
LARGE = Identity(  # 16 x 4 x 32 x 128 bf16, K and V: 1 MiB blocks, read in pieces, hashed
    model="test/large",
    kv_dtype="bfloat16",
    tokens_per_block=32,
    groups=(attention_group("full", layer_names(16), num_kv_heads=4, head_dim=128),),
)


def _group(kind: EngineKind, root: Path, identity: Identity, **overrides: Any) -> GroupStore:
    store = kind.open(root, **overrides)
    return store.namespace(identity).group(0)


def _plan(kind: EngineKind, root: Path, identity: Identity, **overrides: Any) -> ArrayPlan:
    return _group(kind, root, identity, **overrides).array.plan


def _kind(name: str) -> EngineKind:
    return next(k for k in CPU_KINDS if k.name == name)


@pytest.fixture
def batch_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Blocks handed to the native batch calls."""
    counts = {"publish": 0, "read": 0}
    publish, read = NativeFileIO.publish_pieces, NativeFileIO.read_pieces

    def publish_spy(self: NativeFileIO, blocks: Any, *args: Any) -> Any:
        counts["publish"] += len(blocks)
        return publish(self, blocks, *args)

    def read_spy(self: NativeFileIO, blocks: Any, *args: Any, **kwargs: Any) -> Any:
        counts["read"] += len(blocks)
        return read(self, blocks, *args, **kwargs)

    monkeypatch.setattr(NativeFileIO, "publish_pieces", publish_spy)
    monkeypatch.setattr(NativeFileIO, "read_pieces", read_spy)
    return counts


def test_the_plan_follows_the_array_and_the_store(tmp_path: Path) -> None:
    """Small raw dense blocks: one-buffer reads, batches of rows and buffers; large ones:
    read in pieces, hashed as written, rows only in batches; compressed arrays: the general
    path, no batches; durable stores write step by step; unverified reads never batch."""
    host = _kind("host")
    small = _plan(host, tmp_path / "small", SMALL)
    native = NativeFileIO().native_piece_batches
    assert small.reads.whole is WholeRead.SMALL and not small.writes.hashed
    assert small.reads.batch is native and small.reads.batch_buffers is native
    assert small.writes.batch is native and small.writes.batch_buffers is native
    large = _plan(host, tmp_path / "large", LARGE)
    assert large.reads.whole is WholeRead.HASHED and large.writes.hashed
    assert large.writes.batch is native and not large.writes.batch_buffers
    packed = _plan(host, tmp_path / "packed", SMALL, compression="lz4")
    assert packed.reads.whole is WholeRead.GENERAL
    assert not (packed.reads.batch or packed.writes.batch or packed.writes.hashed)
    durable = _plan(host, tmp_path / "durable", SMALL, durability="full")
    assert not durable.writes.batch and durable.reads.batch is native
    unverified = _plan(host, tmp_path / "unverified", LARGE, verify_reads=False)
    assert unverified.reads.whole is WholeRead.SMALL and not unverified.reads.batch
    crc = _plan(host, tmp_path / "crc", SMALL, checksum="crc32c")
    assert not (crc.reads.batch or crc.writes.batch)  # the batches compute xxh3 only
    assert "native batches" in small.describe()


@pytest.mark.parametrize("name", ["pinned", "gds"])
def test_device_engines_plan_the_host_paths_for_host_memory(tmp_path: Path, name: str) -> None:
    """The pinned and GDS engines do host memory's file I/O as the host engine does: the same
    plan as a host store with the same checksum (GDS stores write wsum64 by default, which
    the native batches do not compute)."""
    for identity in (SMALL, LARGE):
        kind = _kind(name)
        plan = _plan(kind, tmp_path / f"{name}-{identity.model}", identity)
        checksum = "wsum64" if name == "gds" else "xxh3_64"
        host_root = tmp_path / f"host-{identity.model}"
        host = _plan(_kind("host"), host_root, identity, checksum=checksum)
        assert plan == host


@pytest.mark.skipif(not NativeFileIO().native_piece_batches, reason="no native batches")
def test_a_pinned_store_reads_and_writes_in_native_batches(
    tmp_path: Path, batch_calls: dict[str, int]
) -> None:
    """A pinned store's batch of small host blocks is written and read in the native batch
    calls, byte-exact (the reader once asked for the host engine's exact type and lost them)."""
    group = _group(_kind("pinned"), tmp_path / "pinned", SMALL)
    canons = [block_bytes(group.layout, seed) for seed in range(6)]
    hashes = [block_hash(seed, "pinned") for seed in range(6)]
    written = group.write_blocks([BlockWrite(h, c) for h, c in zip(hashes, canons, strict=True)])
    assert [r.status for r in written] == [WriteStatus.WRITTEN] * 6
    outs = [np.zeros_like(c) for c in canons]
    got = group.read_blocks([BlockRead(h, o) for h, o in zip(hashes, outs, strict=True)])
    assert [r.status for r in got] == [ReadStatus.HIT] * 6
    assert all(np.array_equal(o, c) for o, c in zip(outs, canons, strict=True))
    assert batch_calls == {"publish": 6, "read": 6}


def test_an_engine_without_capabilities_gets_the_plain_paths(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    batch_calls: dict[str, int],
    frozen_time: int,
) -> None:
    """The store goes by what the engine declares: with no capability declared, a large block
    is neither hashed as written nor read in pieces, nothing is batched, and the blocks are
    the same, byte for byte, and read back verified; a corrupt one is still a miss."""
    with monkeypatch.context() as patched:
        patched.setattr(HostEngine, "capabilities", EngineCapabilities())
        plain = _group(_kind("host"), tmp_path / "plain", LARGE)
    assert plain.array.plan.reads.whole is WholeRead.SMALL
    assert not (plain.array.plan.writes.hashed or plain.array.plan.writes.batch)
    assert not plain.array.plan.reads.batch
    capable = _group(_kind("host"), tmp_path / "capable", LARGE)
    assert capable.array.plan.writes.hashed
    canons = [block_bytes(plain.layout, seed) for seed in range(3)]
    hashes = [block_hash(seed, "plain") for seed in range(3)]
    for group in (plain, capable):
        group.write_blocks([BlockWrite(h, c) for h, c in zip(hashes, canons, strict=True)])
    for h in hashes:
        mine = Path(plain.array.block_path(h)).read_bytes()
        assert mine == Path(capable.array.block_path(h)).read_bytes()
    assert batch_calls["publish"] == 0  # large blocks in one buffer are never batched
    outs = [np.zeros_like(c) for c in canons]
    got = plain.read_blocks([BlockRead(h, o) for h, o in zip(hashes, outs, strict=True)])
    assert [r.status for r in got] == [ReadStatus.HIT] * 3 and batch_calls["read"] == 0
    assert all(np.array_equal(o, c) for o, c in zip(outs, canons, strict=True))
    victim = Path(plain.array.block_path(hashes[1]))
    data = bytearray(victim.read_bytes())
    data[plain.layout.data_offset + 10] ^= 0xFF  # a byte of the first chunk
    victim.write_bytes(bytes(data))
    (bad,) = plain.read_blocks([BlockRead(hashes[1], outs[1])])
    assert bad.status is ReadStatus.CORRUPT

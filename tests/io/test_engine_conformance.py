"""One conformance suite for every I/O engine (``tests/io/engines.py`` lists them).

On the CPU it runs the host engine and the pinned and GDS engines with their CPU stand-ins;
with CUDA (and kvikio for GDS) the same tests run the real engines on device memory, marked
``gpu``. Engines that take device data are handed torch tensors (on their device); the host
engine numpy arrays. Every test goes through the store's public API, so what is checked is
what a caller sees: blocks round-trip byte-exact, bad files are misses, every engine writes
the same bytes and reads every other engine's files.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.checksum import WSUM64, XXH3_64
from kvstore.identity import Identity
from kvstore.io.cufile import PosixCuFiles
from kvstore.io.gds import GdsEngine
from kvstore.io.pinned import PinnedEngine
from kvstore.layout import LocalForm, ParallelLayout, map_rank
from kvstore.rank_io import RankIO, group_geometry
from kvstore.store.group_store import GroupStore
from kvstore.store.types import (
    BlockRead,
    BlockWrite,
    ChunkWrite,
    RangeWrite,
    ReadStatus,
    WriteStatus,
)
from tests.helpers import (
    block_bytes,
    block_hash,
    chunk_bytes,
    make_mla_identity,
    make_odd_identity,
    make_small_identity,
    shard_files,
)
from tests.io.engines import CPU_KINDS, EngineKind, kind_params, ready_gpu_kinds

KINDS = kind_params()
IDENTITIES = {"small": make_small_identity, "odd": make_odd_identity, "mla": make_mla_identity}


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> EngineKind:
    k: EngineKind = request.param
    return k


@pytest.fixture(params=sorted(IDENTITIES))
def identity(request: pytest.FixtureRequest) -> Identity:
    return IDENTITIES[request.param]()


def group_of(kind: EngineKind, root: Path, identity: Identity, **overrides: Any) -> GroupStore:
    store = kind.open(root, **overrides)
    return store.namespace(identity).group(0)


def given(kind: EngineKind, data: np.ndarray, shift: int = 0) -> Any:
    """``data`` as the engine's callers hand it; ``shift`` > 0: at an unaligned address."""
    if not kind.takes_tensors:
        if not shift:
            return data
        raw = np.zeros(len(data) + shift, dtype=np.uint8)
        raw[shift:] = data
        return raw[shift:]
    raw_t = torch.zeros(len(data) + shift, dtype=torch.uint8, device=kind.device)
    raw_t[shift:] = torch.from_numpy(data).to(kind.device)
    return raw_t[shift:]


def empty(kind: EngineKind, nbytes: int, shift: int = 0) -> Any:
    if kind.takes_tensors:
        return torch.zeros(nbytes + shift, dtype=torch.uint8, device=kind.device)[shift:]
    return np.zeros(nbytes + shift, dtype=np.uint8)[shift:]


def host(buffer: Any) -> np.ndarray:
    if isinstance(buffer, torch.Tensor):
        return buffer.to("cpu").numpy()
    return np.asarray(buffer)


def close(group: GroupStore) -> None:
    group.engine.close()


# -- whole blocks ---------------------------------------------------------------------------


@pytest.mark.parametrize("shift", [0, 1])
def test_whole_blocks_round_trip(
    kind: EngineKind, identity: Identity, tmp_path: Path, shift: int
) -> None:
    group = group_of(kind, tmp_path, identity)
    layout = group.layout
    datas = [block_bytes(layout, i) for i in range(3)]
    hashes = [block_hash(i) for i in range(3)]
    writes = [BlockWrite(h, given(kind, d, shift)) for h, d in zip(hashes, datas, strict=True)]
    assert [r.status for r in group.write_blocks(writes)] == [WriteStatus.WRITTEN] * 3
    assert [r.status for r in group.write_blocks(writes[:1])] == [WriteStatus.EXISTS]
    assert group.contains(hashes) == [True] * 3
    for h, data in zip(hashes, datas, strict=True):
        out = empty(kind, layout.block_nbytes, shift)
        assert group.read_blocks([BlockRead(h, out)])[0].status is ReadStatus.HIT
        assert np.array_equal(host(out), data)
    # Some chunks, out of order, into one buffer.
    chunks = [layout.num_chunks - 1, 0]
    out = empty(kind, len(chunks) * layout.chunk_nbytes, shift)
    assert group.read_blocks([BlockRead(hashes[1], out, chunks)])[0].ok
    assert np.array_equal(host(out), chunk_bytes(layout, datas[1], chunks))
    close(group)


def test_new_blocks_get_the_resolved_checksum(kind: EngineKind, tmp_path: Path) -> None:
    group = group_of(kind, tmp_path, make_small_identity())
    data = block_bytes(group.layout, 5)
    group.write_blocks([BlockWrite(block_hash(5), given(kind, data))])
    header, _ = group.read_header(block_hash(5))
    assert header.checksum_algo == (WSUM64 if kind.io_mode == "gds" else XXH3_64)
    close(group)


# -- multi-writer protocol ------------------------------------------------------------------


def test_multi_writer_chunks_and_commit(
    kind: EngineKind, identity: Identity, tmp_path: Path
) -> None:
    group = group_of(kind, tmp_path, identity)
    layout = group.layout
    data = block_bytes(layout, 7)
    pending = group.begin_blocks([block_hash(7)])[0]
    evens = list(range(0, layout.num_chunks, 2))
    odds = list(range(1, layout.num_chunks, 2))
    for chunks in (odds, evens):  # two writers, in either order
        if chunks:
            piece = given(kind, chunk_bytes(layout, data, chunks))
            assert group.write_chunks([ChunkWrite(pending, chunks, piece)]) == [None]
    assert [r.status for r in group.commit_blocks([pending])] == [WriteStatus.WRITTEN]
    out = empty(kind, layout.block_nbytes)
    assert group.read_blocks([BlockRead(block_hash(7), out)])[0].ok
    assert np.array_equal(host(out), data)
    close(group)


def test_multi_writer_ranges_checksummed_at_commit(
    kind: EngineKind, identity: Identity, tmp_path: Path
) -> None:
    group = group_of(kind, tmp_path, identity)
    layout = group.layout
    data = block_bytes(layout, 8)
    size = layout.chunk_nbytes
    half = size // 2 + 1  # unaligned split inside every chunk
    pending = group.begin_blocks([block_hash(8)])[0]
    for slot, (lo, hi) in enumerate([(0, half), (half, size)]):
        ranges = [
            (c * size + lo, given(kind, data[c * size + lo : c * size + hi]))
            for c in range(layout.num_chunks)
        ]
        assert group.write_ranges([RangeWrite(pending, ranges, slot)]) == [None]
    all_chunks = list(range(layout.num_chunks))
    results = group.commit_blocks([pending], [all_chunks], range_writers=2)
    assert [r.status for r in results] == [WriteStatus.WRITTEN]
    out = empty(kind, layout.block_nbytes, 1)
    assert group.read_blocks([BlockRead(block_hash(8), out)])[0].ok
    assert np.array_equal(host(out), data)
    close(group)


def test_commit_refuses_a_missing_writer(kind: EngineKind, tmp_path: Path) -> None:
    group = group_of(kind, tmp_path, make_odd_identity())
    layout = group.layout
    data = block_bytes(layout, 9)
    pending = group.begin_blocks([block_hash(9)])[0]
    piece = given(kind, chunk_bytes(layout, data, [0]))
    assert group.write_chunks([ChunkWrite(pending, [0], piece)]) == [None]
    assert [r.status for r in group.commit_blocks([pending])] == [WriteStatus.FAILED]
    assert group.contains([block_hash(9)]) == [False]
    close(group)


# -- bad files are misses -------------------------------------------------------------------


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x40
    path.chmod(0o600)
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", ["missing", "chunk", "short", "long"])
def test_bad_files_are_misses(kind: EngineKind, tmp_path: Path, damage: str) -> None:
    group = group_of(kind, tmp_path, make_odd_identity())
    layout = group.layout
    h = block_hash(11)
    if damage != "missing":
        group.write_blocks([BlockWrite(h, given(kind, block_bytes(layout, 11)))])
        path = Path(group.path_of(h))
        if damage == "chunk":
            _flip(path, layout.chunk_offset(2) + 100)
        elif damage == "short":
            path.write_bytes(path.read_bytes()[:-1])
        else:
            path.write_bytes(path.read_bytes() + b"\0")
    out = empty(kind, layout.block_nbytes)
    result = group.read_blocks([BlockRead(h, out)])[0]
    expected = ReadStatus.MISS if damage == "missing" else ReadStatus.CORRUPT
    assert result.status is expected
    assert group.contains([h]) == [False]  # quarantined: never served again
    close(group)


# -- same bytes, cross reads ----------------------------------------------------------------


def _write_everything(kind: EngineKind, root: Path, identity: Identity, checksum: str) -> None:
    """A whole block and a multi-writer block (chunks and ranges) with ``kind``."""
    group = group_of(kind, root, identity, checksum=checksum)
    layout = group.layout
    whole = block_bytes(layout, 21)
    group.write_blocks([BlockWrite(block_hash(21), given(kind, whole))])
    data = block_bytes(layout, 22)
    pending = group.begin_blocks([block_hash(22)], [block_hash(21)])[0]
    chunks = list(range(layout.num_chunks))
    size = layout.chunk_nbytes
    head = chunks[: len(chunks) // 2]
    if head:
        group.write_chunks(
            [ChunkWrite(pending, head, given(kind, chunk_bytes(layout, data, head)))]
        )
    tail = chunks[len(head) :]
    ranges = [(c * size + 3, given(kind, data[c * size + 3 : (c + 1) * size])) for c in tail]
    ranges += [(c * size, given(kind, data[c * size : c * size + 3])) for c in tail]
    group.write_ranges([RangeWrite(pending, ranges, 0)])
    assert group.commit_blocks([pending], [tail], range_writers=1)[0].status is WriteStatus.WRITTEN
    close(group)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in shard_files(root)}


@pytest.mark.parametrize(
    ("checksum", "kinds"),
    [
        # On a GPU machine the real engines join: their files must equal the CPU ones.
        ("wsum64", CPU_KINDS + ready_gpu_kinds()),
        ("xxh3_64", [k for k in CPU_KINDS + ready_gpu_kinds() if k.io_mode != "gds"]),
    ],
)
def test_every_engine_writes_the_same_bytes(
    tmp_path: Path,
    identity: Identity,
    frozen_time: int,
    checksum: str,
    kinds: list[EngineKind],
) -> None:
    written = {}
    for kind in kinds:
        _write_everything(kind, tmp_path / kind.name, identity, checksum)
        written[kind.name] = _files(tmp_path / kind.name)
    reference = written[kinds[0].name]
    assert len(reference) == 2
    for name, files in written.items():
        assert files == reference, f"{name} wrote different bytes than {kinds[0].name}"


@pytest.mark.parametrize("reader", KINDS)
@pytest.mark.parametrize("writer", KINDS)
def test_files_of_one_engine_are_read_by_every_other(
    tmp_path: Path, writer: EngineKind, reader: EngineKind
) -> None:
    identity = make_odd_identity()
    _write_everything(writer, tmp_path, identity, "auto")
    group = group_of(reader, tmp_path, identity)
    layout = group.layout
    for seed in (21, 22):
        out = empty(reader, layout.block_nbytes, 1)
        assert group.read_blocks([BlockRead(block_hash(seed), out)])[0].ok, (writer, reader)
        assert np.array_equal(host(out), block_bytes(layout, seed))
    close(group)


# -- ranks through the engine's staging -----------------------------------------------------


@pytest.mark.parametrize("write_layout", ["tp=2", "tp=4,dcp=2"])
def test_rank_io_through_the_engines_staging(
    kind: EngineKind, tmp_path: Path, write_layout: str
) -> None:
    identity = make_small_identity()
    geometry = group_geometry(identity, 0, range(3), 3)
    group = group_of(kind, tmp_path, identity)
    hashes = [block_hash(i, "rank") for i in range(3)]
    pendings = group.begin_blocks(hashes)
    layout = ParallelLayout.parse(write_layout)
    gen = torch.Generator().manual_seed(3)
    caches = {}
    rio = None
    for coord in layout.ranks():
        mapping = map_rank(geometry, layout, LocalForm(), coord)
        tensors = [
            torch.randint(0, 256, (5, mapping.page_bytes), generator=gen, dtype=torch.uint8)
            for _ in mapping.local_layers
        ]
        caches[coord] = tensors
        rio = RankIO(group, mapping)
        on_device = [t.to(kind.device) for t in tensors]
        assert rio.store(on_device, pendings, [4, 1, 2]) == [None] * 3
    assert rio is not None
    results = group.commit_blocks(
        pendings, [rio.commit_checksum_chunks] * 3, rio.commit_range_writers
    )
    assert [r.status for r in results] == [WriteStatus.WRITTEN] * 3
    for coord, tensors in caches.items():
        mapping = map_rank(geometry, layout, LocalForm(), coord)
        if not all(RankIO(group, mapping).elected(pendings)):
            continue  # another rank holds identical bytes and wrote them
        targets = [torch.zeros_like(t).to(kind.device) for t in tensors]
        loaded = RankIO(group, mapping).load(targets, hashes, [0, 3, 2])
        assert all(r.ok for r in loaded)
        for got, source in zip(targets, tensors, strict=True):
            assert torch.equal(got.cpu()[[0, 3, 2]], source[[4, 1, 2]])
    close(group)


# -- engine specifics (CPU stand-ins) -------------------------------------------------------


def test_gds_moves_chunks_by_aligned_cufile_calls_one_handle_per_file(tmp_path: Path) -> None:
    files = PosixCuFiles(strict=True)  # an unaligned cuFile call would raise
    kind = EngineKind("gds", "gds")
    store = kind.open(tmp_path, cufiles=files)
    assert isinstance(store.engine, GdsEngine)
    group = store.namespace(make_small_identity()).group(0)
    layout = group.layout
    files.calls.clear()
    files.opened.clear()
    datas = [block_bytes(layout, i) for i in range(4)]
    writes = [BlockWrite(block_hash(i), given(kind, d)) for i, d in enumerate(datas)]
    assert all(r.status is WriteStatus.WRITTEN for r in group.write_blocks(writes))
    assert len(files.opened) == 4  # one cuFile handle per file, shared by its writes
    written = sum(n for op, _, _, n in files.calls if op == "pwrite")
    assert written >= 4 * layout.block_nbytes  # the chunks went through cuFile
    files.calls.clear()
    out = empty(kind, layout.block_nbytes)
    assert group.read_blocks([BlockRead(block_hash(0), out)])[0].ok
    assert sum(n for op, _, _, n in files.calls if op == "pread") == layout.block_nbytes
    store.close()


def test_pinned_staging_reuses_its_pool(tmp_path: Path) -> None:
    kind = EngineKind("pinned", "pinned")
    store = kind.open(tmp_path)
    assert isinstance(store.engine, PinnedEngine)
    identity = make_small_identity()
    group = store.namespace(identity).group(0)
    geometry = group_geometry(identity, 0, range(3), 3)
    mapping = map_rank(geometry, ParallelLayout(), LocalForm(), ParallelLayout().ranks()[0])
    tensors = [torch.ones(4, mapping.page_bytes, dtype=torch.uint8) for _ in mapping.local_layers]
    rio = RankIO(group, mapping)
    for batch in range(3):
        pendings = group.begin_blocks([block_hash(i, f"pool{batch}") for i in range(2)])
        assert rio.store(tensors, pendings, [0, 1]) == [None, None]
        rio.load(tensors, [block_hash(0, "x")], [2])
    assert store.engine.staging.pool.allocations == 1
    store.close()


def test_device_reads_of_host_checksums_are_verified_through_the_host(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    identity = make_odd_identity()
    host_group = group_of(EngineKind("host", "host"), tmp_path, identity)
    layout = host_group.layout
    for i in range(2):
        host_group.write_blocks([BlockWrite(block_hash(i), block_bytes(layout, i))])
    _flip(Path(host_group.path_of(block_hash(1))), layout.chunk_offset(0) + 5)
    close(host_group)
    gds = EngineKind("gds", "gds")
    group = group_of(gds, tmp_path, identity)
    with caplog.at_level(logging.INFO, logger="kvstore"):
        for _ in range(2):
            out = empty(gds, layout.block_nbytes)
            assert group.read_blocks([BlockRead(block_hash(0), out)])[0].ok
            assert np.array_equal(host(out), block_bytes(layout, 0))
        bad = group.read_blocks([BlockRead(block_hash(1), empty(gds, layout.block_nbytes))])[0]
    assert bad.status is ReadStatus.CORRUPT
    notes = [r for r in caplog.records if "verified through host memory" in r.getMessage()]
    assert len(notes) == 1
    close(group)


def test_compressed_arrays_take_device_buffers_through_the_host(
    kind: EngineKind, tmp_path: Path
) -> None:
    group = group_of(kind, tmp_path, make_odd_identity(), compression="lz4")
    layout = group.layout
    data = block_bytes(layout, 31)
    written = group.write_blocks([BlockWrite(block_hash(31), given(kind, data))])
    assert written[0].status is WriteStatus.WRITTEN
    out = empty(kind, 2 * layout.chunk_nbytes)
    assert group.read_blocks([BlockRead(block_hash(31), out, [3, 1])])[0].ok
    assert np.array_equal(host(out), chunk_bytes(layout, data, [3, 1]))
    close(group)


def test_durable_whole_blocks_sync_on_the_write_descriptor(
    kind: EngineKind, tmp_path: Path
) -> None:
    """Durability full: every engine hands the publisher the descriptor of each new file
    (``write_new_file``, device segments included), which syncs the file on it and closes it
    at the end of the batch: the blocks read back and no descriptor is left open."""
    group = group_of(kind, tmp_path, make_small_identity(), durability="full")
    layout = group.layout
    datas = [block_bytes(layout, 40 + i) for i in range(3)]
    hashes = [block_hash(40 + i) for i in range(3)]
    for shift in (0, 1):  # aligned device memory written direct, then staged
        writes = [
            BlockWrite(bytes([shift]) + h[1:], given(kind, d, shift))
            for h, d in zip(hashes, datas, strict=True)
        ]
        open_before = len(os.listdir("/proc/self/fd"))
        assert [r.status for r in group.write_blocks(writes)] == [WriteStatus.WRITTEN] * 3
        assert len(os.listdir("/proc/self/fd")) == open_before
        for w, data in zip(writes, datas, strict=True):
            out = empty(kind, layout.block_nbytes)
            assert group.read_blocks([BlockRead(w.block_hash, out)])[0].status is ReadStatus.HIT
            assert np.array_equal(host(out), data)
    assert [p for p in tmp_path.rglob("*") if ".tmp-" in p.name] == []
    close(group)

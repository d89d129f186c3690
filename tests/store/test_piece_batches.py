"""Batches of whole blocks given as pieces (the vLLM tier's rows), written and named or read
and verified in one native call per I/O thread (NativeFileIO.publish_pieces / read_pieces, used by
store/writes/batch.py and store/reads/batch.py): the same files, results and quarantine as
the block-by-block path, which every block the batch cannot finish goes through."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore import Identity
from kvstore.io.buffers import aligned_buffer
from kvstore.io.fileio import FileIO
from kvstore.io.fileproto import native_fileproto
from kvstore.io.native_fileio import NativeFileIO
from kvstore.store.format import ShardLayout
from kvstore.store.group_store import GroupStore
from kvstore.store.pieces import PlanCache, block_pieces, piece_plan
from kvstore.store.types import BlockRead, BlockWrite, ReadStatus, WriteStatus
from tests.helpers import StoreFactory, block_bytes, block_hash, shard_files, tmp_files

pytestmark = pytest.mark.skipif(
    native_fileproto() is None, reason="the native file protocol is not built"
)

N = 5  # blocks per batch


def _rows(layout: ShardLayout, canon: np.ndarray, kind: str) -> np.ndarray:
    """A view whose C-order bytes are ``canon`` over rows laid out as the tier's are: whole
    chunks of the block permuted (``transposed``: [b][a] from an [a][b] row) or pieces of two
    chunks with a gap after each row (``multi-chunk``: pieces that do not tile a span)."""
    n, size = layout.num_chunks, layout.chunk_nbytes
    chunks = canon.reshape(n, size)
    if kind == "transposed":
        row = np.ascontiguousarray(chunks.reshape(3, 2, size).transpose(1, 0, 2))
        return row.transpose(1, 0, 2)
    wide = np.zeros((n // 2, 2 * size + 8192), dtype=np.uint8)
    wide[:, : 2 * size] = canon.reshape(n // 2, 2 * size)
    return wide[:, : 2 * size]


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in shard_files(root)}


class Reference(FileIO):
    """The reference FileIO: never the native batches (the block-by-block path)."""


def _group(make_store: StoreFactory, root: Path, **opts: Any) -> GroupStore:
    group = make_store(root, **opts).namespace(_identity()).group(0)
    assert group.layout.dense and group.layout.num_chunks == 6
    return group


def _identity() -> Identity:
    from tests.helpers import make_small_identity  # noqa: PLC0415 - one identity for all

    return make_small_identity()


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of the batch calls (blocks handed to each)."""
    counts = {"publish": 0, "read": 0, "read direct": 0}
    publish, read = NativeFileIO.publish_pieces, NativeFileIO.read_pieces

    def publish_spy(self: NativeFileIO, blocks: Any, *args: Any) -> Any:
        counts["publish"] += len(blocks)
        return publish(self, blocks, *args)

    def read_spy(self: NativeFileIO, blocks: Any, *args: Any, **kwargs: Any) -> Any:
        counts["read"] += len(blocks)
        counts["read direct"] += len(blocks) if kwargs.get("direct") else 0
        return read(self, blocks, *args, **kwargs)

    monkeypatch.setattr(NativeFileIO, "publish_pieces", publish_spy)
    monkeypatch.setattr(NativeFileIO, "read_pieces", read_spy)
    return counts


@pytest.mark.parametrize("direct_io", ["off", "auto"])
def test_a_batch_writes_the_files_block_by_block_writes(
    make_store: StoreFactory,
    tmp_path: Path,
    frozen_time: int,
    calls: dict[str, int],
    direct_io: str,
) -> None:
    """Byte for byte the files of the same blocks given as one buffer each; read back into
    rows by the batch read, byte-exact."""
    one = _group(make_store, tmp_path / "one", direct_io=direct_io, fio=Reference())
    batch = _group(make_store, tmp_path / "batch", direct_io=direct_io)
    layout = one.layout
    canons = [block_bytes(layout, seed) for seed in range(N)]
    hashes = [block_hash(seed, "batch") for seed in range(N)]
    parents = [None, *hashes[:-1]]
    one.write_blocks([BlockWrite(h, c, p) for h, c, p in zip(hashes, canons, parents, strict=True)])
    views = [_rows(layout, c, "transposed") for c in canons]
    results = batch.write_blocks(
        [BlockWrite(h, v, p) for h, v, p in zip(hashes, views, parents, strict=True)]
    )
    assert [r.status for r in results] == [WriteStatus.WRITTEN] * N
    assert calls["publish"] == N
    assert _files(tmp_path / "batch") == _files(tmp_path / "one")
    assert not tmp_files(tmp_path / "batch")
    assert batch.stats.blocks_written == N
    targets = [_rows(layout, np.zeros_like(c), "transposed") for c in canons]
    got = batch.read_blocks([BlockRead(h, t) for h, t in zip(hashes, targets, strict=True)])
    assert [r.status for r in got] == [ReadStatus.HIT] * N
    assert calls["read"] == N
    for target, canon in zip(targets, canons, strict=True):
        assert np.array_equal(np.ascontiguousarray(target).reshape(-1), canon)


def test_pieces_that_do_not_tile_a_span_and_mixed_batches_go_block_by_block(
    make_store: StoreFactory, tmp_path: Path, calls: dict[str, int]
) -> None:
    """Pieces with gaps, and a batch of pieces and one buffer, go block by block; a small
    block in one buffer is batched alone."""
    group = _group(make_store, tmp_path / "mixed")
    layout = group.layout
    canons = [block_bytes(layout, seed) for seed in range(4)]
    gapped = [
        BlockWrite(block_hash(i, "gap"), _rows(layout, c, "multi-chunk"))
        for i, c in enumerate(canons)
    ]
    mixed = [
        BlockWrite(block_hash(0, "mix"), _rows(layout, canons[0], "transposed")),
        BlockWrite(block_hash(1, "mix"), canons[1]),
    ]
    for writes in (gapped, mixed):
        assert all(r.status is WriteStatus.WRITTEN for r in group.write_blocks(writes))
    assert calls["publish"] == 0
    out = np.zeros(layout.block_nbytes, dtype=np.uint8)
    (hit,) = group.read_blocks([BlockRead(block_hash(1, "mix"), out)])
    assert hit.status is ReadStatus.HIT and calls["read"] == 1
    assert np.array_equal(out, canons[1])
    (alone,) = group.write_blocks([BlockWrite(block_hash(9, "mix"), canons[2])])
    assert alone.status is WriteStatus.WRITTEN and calls["publish"] == 1


def test_a_durable_store_and_the_reference_fileio_take_the_block_by_block_path(
    make_store: StoreFactory, tmp_path: Path, calls: dict[str, int]
) -> None:
    class Recording(FileIO):
        pass

    durable = _group(make_store, tmp_path / "durable", durability="full")
    subclass = _group(make_store, tmp_path / "subclass", fio=Recording())
    for group in (durable, subclass):
        canon = block_bytes(group.layout, 1)
        view = _rows(group.layout, canon, "transposed")
        writes = [BlockWrite(block_hash(i, "slow"), view) for i in range(3)]
        assert all(r.status is WriteStatus.WRITTEN for r in group.write_blocks(writes))
        target = _rows(group.layout, np.zeros_like(canon), "transposed")
        (hit,) = group.read_blocks([BlockRead(block_hash(0, "slow"), target)])
        assert hit.status is ReadStatus.HIT
    assert calls["publish"] == 0
    assert calls["read"] == 1  # the durable store's reads are batched (reads never sync)


def test_existing_blocks_lost_fanouts_and_taken_names(
    make_store: StoreFactory, tmp_path: Path, calls: dict[str, int]
) -> None:
    """A block already there is EXISTS (nothing written); a block whose fan-out directory
    vanished is WRITTEN (the block-by-block path recreates it); a name held by a directory or
    a FIFO fails that block with the block-by-block path's words, and leaves no temporary
    file; the others of the batch are WRITTEN."""
    group = _group(make_store, tmp_path / "hostile")
    layout = group.layout
    canons = [block_bytes(layout, seed) for seed in range(N)]
    hashes = [block_hash(seed, "hostile") for seed in range(N)]
    views = [_rows(layout, c, "transposed") for c in canons]
    (first,) = group.write_blocks([BlockWrite(hashes[0], views[0])])
    assert first.status is WriteStatus.WRITTEN
    fanouts = [Path(group.path_of(h)).parent for h in hashes]
    assert len(set(fanouts)) == N  # each block in its own fan-out directory
    fanouts[1].rmdir()  # lost (an admin's rm, a crash in a sweep)
    Path(group.path_of(hashes[2])).mkdir()
    os.mkfifo(group.path_of(hashes[3]))
    results = group.write_blocks([BlockWrite(h, v) for h, v in zip(hashes, views, strict=True)])
    assert [r.status for r in results] == [
        WriteStatus.EXISTS,
        WriteStatus.WRITTEN,
        WriteStatus.FAILED,
        WriteStatus.FAILED,
        WriteStatus.WRITTEN,
    ], results
    assert calls["publish"] == 1 + N  # block 0 alone, then the batch
    for failed in results[2:4]:
        assert failed.error is not None and "regular file" in failed.error, failed.error
    assert not tmp_files(tmp_path / "hostile")
    one = _group(make_store, tmp_path / "one", fio=Reference())
    one.write_blocks([BlockWrite(hashes[i], canons[i]) for i in (1, 4)])
    for i in (1, 4):
        blocks = {p.name: p for p in shard_files(tmp_path / "hostile")}
        name = Path(group.path_of(hashes[i])).name
        expected = Path(one.path_of(hashes[i])).read_bytes()
        assert blocks[name].read_bytes()[200:] == expected[200:]  # all but the times


@pytest.mark.parametrize("into", ["transposed", "contiguous"])
def test_a_batch_read_finds_what_the_block_by_block_read_finds(
    make_store: StoreFactory, tmp_path: Path, calls: dict[str, int], into: str
) -> None:
    """Hits, a missing block, a flipped data byte, a flipped header byte, a truncated file,
    another block's file under a name, a FIFO at a name: each the status and words of the
    block-by-block read, the corrupt files quarantined, the hits byte-exact."""
    stores = {
        "batch": _group(make_store, tmp_path / "batch"),
        "one": _group(make_store, tmp_path / "one", fio=Reference()),
    }
    layout = stores["one"].layout
    canons = [block_bytes(layout, seed) for seed in range(8)]
    hashes = [block_hash(seed, "reads") for seed in range(8)]
    outcomes: dict[str, list[tuple[ReadStatus, str]]] = {}
    for name, group in stores.items():
        group.write_blocks([BlockWrite(h, c) for h, c in zip(hashes, canons, strict=True)])
        paths = [Path(group.path_of(h)) for h in hashes]
        paths[1].unlink()  # missing
        for where, index in ((layout.data_end - 1, 2), (40, 3)):  # data, header
            raw = bytearray(paths[index].read_bytes())
            raw[where] ^= 0x5A
            paths[index].write_bytes(bytes(raw))
        paths[4].write_bytes(paths[4].read_bytes()[:-100])  # truncated
        paths[5].write_bytes(paths[0].read_bytes())  # block 0's file under block 5's name
        paths[6].unlink()
        os.mkfifo(paths[6])
        targets = [
            np.zeros_like(c) if into == "contiguous" else _rows(layout, np.zeros_like(c), into)
            for c in canons
        ]
        results = group.read_blocks([BlockRead(h, t) for h, t in zip(hashes, targets, strict=True)])
        root = str(tmp_path / name)
        outcomes[name] = [(r.status, (r.error or "").replace(root, "<root>")) for r in results]
        for i in (0, 7):
            assert results[i].status is ReadStatus.HIT
            assert np.array_equal(np.ascontiguousarray(targets[i]).reshape(-1), canons[i])
        for i in (2, 3, 4, 5):
            assert results[i].status is ReadStatus.CORRUPT, (i, results[i])
            assert not paths[i].exists(), i  # quarantined
    assert calls["read"] == 8  # every block went to the batch first
    assert outcomes["batch"] == outcomes["one"]


@pytest.mark.parametrize("fio", [NativeFileIO(), Reference()], ids=["native", "reference"])
def test_the_batch_calls_refuse_bad_plans(tmp_path: Path, fio: FileIO) -> None:
    """Bad geometry is a ValueError before any file is touched, natively and in the
    reference alike: pieces off their places, a slot order other than the one the starts
    give, a header of the wrong size."""
    row = np.zeros(6 * 4096, dtype=np.uint8)
    view = row.reshape(2, 3, 4096).transpose(1, 0, 2)
    pieces = block_pieces(view, row.size, 4096)
    assert pieces is not None
    plan = piece_plan(
        pieces.geometry, 4096 + row.size + 4096, memoryview(bytes(64)), 4096 + row.size
    )
    header = memoryview(bytearray(4096))
    final = str(tmp_path / "block")
    block = (str(tmp_path / ".block.tmp-x"), final, header, pieces.span)
    bad = {
        "to tile the": plan.__class__(**{**_fields(plan), "starts": plan.starts + 1}),
        "slot_of": plan.__class__(**{**_fields(plan), "slot_of": np.zeros_like(plan.slot_of)}),
    }
    for words, wrong in bad.items():
        with pytest.raises(ValueError, match=words):
            fio.publish_pieces([block], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, wrong)
    with pytest.raises(ValueError, match="expected a header of 4096 bytes"):
        fio.publish_pieces(
            [(block[0], final, memoryview(bytearray(512)), pieces.span)],
            os.O_WRONLY | os.O_CREAT | os.O_EXCL,
            0o600,
            plan,
        )
    assert list(tmp_path.iterdir()) == []
    assert fio.publish_pieces([block], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, plan) == [1]
    assert fio.read_pieces([(final, header, pieces.span)], 4096, plan, 0) == [1]


def _fields(plan: Any) -> dict[str, Any]:
    return {name: getattr(plan, name) for name in plan.__slots__}


def test_a_plan_is_never_handed_to_another_geometry() -> None:
    """Plans are cached per geometry object: a geometry allocated where a dropped one lived
    (the same id) gets its own plan, never the old one's starts."""
    rows = np.zeros(6 * 4096, dtype=np.uint8)
    first = block_pieces(rows.reshape(2, 3, 4096).transpose(1, 0, 2), rows.size, 4096)
    second = block_pieces(rows.reshape(3, 2, 4096).transpose(1, 0, 2), rows.size, 4096)
    assert first is not None and second is not None
    cache = PlanCache(4096 + rows.size + 4096, memoryview(bytes(64)), 4096 + rows.size)
    plan = cache.plan(first.geometry)
    assert cache.plan(first.geometry) is plan
    cache._plans[id(second.geometry)] = (first.geometry, plan)  # a reused address
    other = cache.plan(second.geometry)
    assert other is not plan and other.starts is second.geometry.starts_array
    assert not np.array_equal(other.starts, plan.starts)


def test_a_batch_call_that_raises_leaves_its_blocks_to_the_block_by_block_path(
    make_store: StoreFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A batch call refused before any I/O (bad input: a bug) costs speed, never blocks: each
    is written or read one by one, and one warning per refused part says so."""
    group = _group(make_store, tmp_path / "refused", io_threads=1)
    layout = group.layout
    canons = [block_bytes(layout, seed) for seed in range(3)]
    hashes = [block_hash(seed, "refused") for seed in range(3)]

    def refuse(self: NativeFileIO, *args: Any) -> list[int]:
        raise ValueError("refused for the test")

    monkeypatch.setattr(NativeFileIO, "publish_pieces", refuse)
    monkeypatch.setattr(NativeFileIO, "read_pieces", refuse)
    views = [_rows(layout, c, "transposed") for c in canons]
    with caplog.at_level("WARNING"):
        results = group.write_blocks([BlockWrite(h, v) for h, v in zip(hashes, views, strict=True)])
        assert [r.status for r in results] == [WriteStatus.WRITTEN] * 3
        targets = [_rows(layout, np.zeros_like(c), "transposed") for c in canons]
        got = group.read_blocks([BlockRead(h, t) for h, t in zip(hashes, targets, strict=True)])
    assert [r.status for r in got] == [ReadStatus.HIT] * 3
    for target, canon in zip(targets, canons, strict=True):
        assert np.array_equal(np.ascontiguousarray(target).reshape(-1), canon)
    refused = [r for r in caplog.records if "go one by one" in r.getMessage()]
    assert len(refused) == 2 and "refused for the test" in refused[0].getMessage()


def _cached_pages(path: Path) -> int:
    """How many of ``path``'s pages are in the page cache (mincore of a private mapping that
    is never touched; a probing read would start readahead itself)."""
    import ctypes  # noqa: PLC0415 - this test's probe only
    import mmap  # noqa: PLC0415

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    nbytes = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        mapping = mmap.mmap(
            fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    finally:
        os.close(fd)
    vec = (ctypes.c_ubyte * (-(-nbytes // mmap.PAGESIZE)))()
    first = ctypes.c_char.from_buffer(mapping)
    try:
        if libc.mincore(ctypes.addressof(first), nbytes, vec) != 0:
            raise OSError(ctypes.get_errno(), f"mincore {path}")
    finally:
        del first
        mapping.close()
    return sum(v & 1 for v in vec)


def _drop_cached(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_direct_reads_read_a_batch_with_o_direct(
    make_store: StoreFactory, tmp_path: Path, calls: dict[str, int]
) -> None:
    """With ``direct_reads`` a batch of aligned rows is read with O_DIRECT: verified,
    byte-exact, and nothing of the files left in the page cache (the buffered read of the
    same batch, the control, leaves them there)."""
    if not hasattr(os, "O_DIRECT") or not sys.platform.startswith("linux"):
        pytest.skip("O_DIRECT and mincore: Linux only")
    root = tmp_path / "store"
    writer = _group(make_store, root, direct_io="on")
    layout = writer.layout
    canons = [block_bytes(layout, seed) for seed in range(N)]
    hashes = [block_hash(seed, "direct") for seed in range(N)]
    writer.write_blocks([BlockWrite(h, c, None) for h, c in zip(hashes, canons, strict=True)])
    paths = shard_files(root)
    assert len(paths) == N

    def aligned_rows() -> np.ndarray:
        n, size = layout.num_chunks, layout.chunk_nbytes
        memory = aligned_buffer(n * size).reshape(2, n // 2, size)
        return memory.transpose(1, 0, 2)  # whole chunks permuted, as _rows' "transposed"

    for direct in (False, True):
        reader = _group(make_store, root, direct_io="on", direct_reads=direct)
        for path in paths:
            _drop_cached(path)
        if any(_cached_pages(p) for p in paths):
            pytest.skip("this file system keeps dropped pages cached (tmpfs?)")
        targets = [aligned_rows() for _ in hashes]
        got = reader.read_blocks([BlockRead(h, t) for h, t in zip(hashes, targets, strict=True)])
        assert [r.status for r in got] == [ReadStatus.HIT] * N
        for target, canon in zip(targets, canons, strict=True):
            assert np.array_equal(np.ascontiguousarray(target).reshape(-1), canon)
        assert calls["read direct"] == (N if direct else 0)
        # buffered: the header and the pieces at least (readahead may take the index too)
        data_pages = (layout.file_nbytes - layout.index_nbytes) // 4096
        cached = [_cached_pages(p) for p in paths]
        if direct:
            assert cached == [0] * N, f"direct_reads=True: pages cached {cached}"
        else:
            assert min(cached) >= data_pages, f"direct_reads=False: pages cached {cached}"

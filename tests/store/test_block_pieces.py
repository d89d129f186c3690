"""Whole blocks given as strided pieces (BlockWrite.data a non-contiguous numpy view): the
files are byte for byte those of the same block given as one buffer; bad pieces are refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from kvstore import Identity, KvstoreError
from kvstore.checksum import CRC32C, WSUM64, XXH3_64, chunk_sums, strided_chunk_sums
from kvstore.store.format import ShardLayout
from kvstore.store.pieces import _chunk_order, block_pieces
from kvstore.store.publish import Publisher
from kvstore.store.types import BlockRead, BlockWrite, ReadStatus, WriteStatus
from tests.helpers import StoreFactory, block_bytes, block_hash, shard_files


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in shard_files(root)}


def _views(layout: ShardLayout, canon: np.ndarray) -> dict[str, np.ndarray]:
    """Non-contiguous views whose C-order bytes are ``canon``, over freshly laid-out rows."""
    n, size = layout.num_chunks, layout.chunk_nbytes
    chunks = canon.reshape(n, size)
    views: dict[str, np.ndarray] = {}
    gapped = np.zeros((n, size + 4096), dtype=np.uint8)  # one chunk per piece, gaps between
    gapped[:, :size] = chunks
    views["gapped"] = gapped[:, :size]
    a = next((f for f in range(2, n) if n % f == 0), None)
    if a is not None:  # a transpose: canonical [b][a] from a row laid out [a][b]
        b = n // a
        row = np.ascontiguousarray(chunks.reshape(b, a, size).transpose(1, 0, 2))
        views["transposed"] = row.transpose(1, 0, 2)
        wide = np.zeros((n // a, a * size + 8192), dtype=np.uint8)  # pieces of `a` chunks
        wide[:, : a * size] = canon.reshape(n // a, a * size)
        views["multi-chunk"] = wide[:, : a * size]
    for view in views.values():
        assert not view.flags.c_contiguous
        assert np.array_equal(np.ascontiguousarray(view).reshape(-1), canon)
    return views


@pytest.mark.parametrize("durability", ["none", "full"])
@pytest.mark.parametrize("direct_io", ["off", "auto"])
def test_pieces_write_the_same_files_as_one_buffer(
    make_store: StoreFactory,
    tmp_path: Path,
    any_identity: Identity,
    durability: str,
    direct_io: str,
    frozen_time: int,
) -> None:
    one_root, pieces_root = tmp_path / "one", tmp_path / "pieces"
    opts = {"durability": durability, "direct_io": direct_io}
    one = make_store(one_root, **opts).namespace(any_identity).group(0)
    pieces = make_store(pieces_root, **opts).namespace(any_identity).group(0)
    layout = one.layout
    writes_one: list[BlockWrite] = []
    writes_pieces: list[BlockWrite] = []
    for seed in range(3):
        canon = block_bytes(layout, seed)
        for name, view in _views(layout, canon).items():
            h = block_hash(seed, name)
            parent = block_hash(seed + 100) if seed else None
            writes_one.append(BlockWrite(h, canon, parent))
            writes_pieces.append(BlockWrite(h, view, parent))
    assert writes_pieces
    for group, writes in ((one, writes_one), (pieces, writes_pieces)):
        results = group.write_blocks(writes)
        assert [r.status for r in results] == [WriteStatus.WRITTEN] * len(writes), results
    files = _files(pieces_root)
    assert len(files) == len(writes_pieces)
    assert files == _files(one_root)
    out = np.empty(layout.block_nbytes, dtype=np.uint8)
    for write in writes_pieces:
        (result,) = pieces.read_blocks([BlockRead(write.block_hash, out)])
        assert result.status is ReadStatus.HIT
        assert np.array_equal(out, np.ascontiguousarray(write.data).reshape(-1))


def test_bad_pieces_are_refused(make_store: StoreFactory, small_identity: Identity) -> None:
    group = make_store().namespace(small_identity).group(0)
    layout = group.layout
    n, size = layout.num_chunks, layout.chunk_nbytes
    canon = block_bytes(layout, 7)
    halves = np.zeros((2 * n, size // 2 + 64), dtype=np.uint8)  # half-chunk pieces
    halves[:, : size // 2] = canon.reshape(2 * n, size // 2)
    short = np.zeros((n - 1, size + 64), dtype=np.uint8)  # one chunk missing
    reversed_rows = canon.reshape(n, size)[::-1]  # negative stride
    columns = np.ascontiguousarray(canon.reshape(n, size).T).T  # last axis not contiguous
    cases = {
        "pieces of whole": halves[:, : size // 2],
        f"expected {layout.block_nbytes} bytes": short[:, :size],
        "non-negative strides": reversed_rows,
        "contiguous last axis": columns,
    }
    for i, (words, data) in enumerate(cases.items()):
        (result,) = group.write_blocks([BlockWrite(block_hash(i, "bad"), data)])
        assert result.status is WriteStatus.FAILED
        assert words in result.error, result.error
    out = np.empty(layout.block_nbytes, dtype=np.uint8)
    reads = [BlockRead(block_hash(i, "bad"), out) for i in range(len(cases))]
    assert all(r.status is ReadStatus.MISS for r in group.read_blocks(reads))  # nothing written


@pytest.mark.parametrize("algo", [XXH3_64, CRC32C, WSUM64])
def test_strided_chunk_sums_match_the_gathered_chunks(algo: int) -> None:
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, size=1 << 16, dtype=np.uint8)
    starts, stride, count, size = [5, 1000, 3], 7000, 4, 1500
    gathered = np.concatenate(
        [data[s + i * stride : s + i * stride + size] for s in starts for i in range(count)]
    )
    want = chunk_sums(algo, gathered.data, size, len(starts) * count)
    got = strided_chunk_sums(algo, data.data, starts, stride, count, size)
    assert np.array_equal(got, want)
    with pytest.raises(ValueError, match="stride"):
        strided_chunk_sums(algo, data[:20000].data, starts, stride, count, size)


@pytest.mark.parametrize("algo", [XXH3_64, CRC32C, WSUM64])
def test_chunk_sums_of_pieces_that_tile_their_span_are_taken_in_memory_order(algo: int) -> None:
    """Pieces that tile their span in whole chunks (a transposed row, as the vLLM tier hands
    over) are hashed front to back and the sums put in block order; pieces with gaps or
    overlapping pieces keep the per-run sums. Every case gives the gathered block's sums."""
    rng = np.random.default_rng(5)
    row = rng.integers(0, 256, 6 * 4 * 64, dtype=np.uint8)
    size = 64
    cases = {
        "transposed": (row.reshape(4, 6, size).transpose(1, 0, 2), True),  # [6][4] of [4][6]
        "multi-chunk pieces": (row.reshape(2, 3, 4 * size).transpose(1, 0, 2), True),
        "gapped": (row.reshape(12, 2 * size)[:, :size], False),
        # stride 0: pieces {0, 0, 192, 192} span 4 chunks but hold only two of them
        "overlapping": (as_strided(row, shape=(2, 2, size), strides=(3 * size, 0, 1)), False),
    }
    for name, (view, in_memory_order) in cases.items():
        pieces = block_pieces(view, view.nbytes, size)
        assert pieces is not None, name
        order = pieces.geometry.chunk_order
        assert (order is not None) == in_memory_order, name
        gathered = np.ascontiguousarray(view).reshape(-1)
        want = chunk_sums(algo, gathered.data, size, gathered.size // size)
        assert np.array_equal(pieces.chunk_sums(algo, size), want), name
        if order is not None:  # the order maps each block chunk to its bytes in the span
            span = np.frombuffer(pieces.span, dtype=np.uint8).reshape(-1, size)
            assert np.array_equal(span[order].reshape(-1), gathered), name


def test_dense_arrays_write_pieces_in_place_others_join(
    make_store: StoreFactory, any_identity: Identity, monkeypatch: pytest.MonkeyPatch
) -> None:
    group = make_store().namespace(any_identity).group(0)
    calls: list[int] = []
    original = Publisher._piece_segments

    def spy(self: Publisher, *args: Any) -> Any:
        calls.append(1)
        return original(self, *args)

    monkeypatch.setattr(Publisher, "_piece_segments", spy)
    canon = block_bytes(group.layout, 1)
    view = _views(group.layout, canon)["gapped"]
    (result,) = group.write_blocks([BlockWrite(block_hash(1, "spy"), view)])
    assert result.status is WriteStatus.WRITTEN
    assert bool(calls) == group.layout.dense


def test_piece_geometry_is_shared_per_shape_and_each_block_reads_its_own_memory() -> None:
    """The pieces' geometry is computed once per (shape, strides, dtype) and shared; the span
    and the segments of each block are that block's memory, and a view of another stride
    order gets its own geometry (a cache keyed on too little would serve wrong bytes)."""
    rows = np.random.default_rng(4).integers(0, 256, (3, 4 * 3 * 64), dtype=np.uint8)
    views = [row.reshape(4, 3, 64).transpose(1, 0, 2) for row in rows]  # [3][4] of [4][3]
    pieces = [block_pieces(v, v.nbytes, 64) for v in views]
    assert all(p is not None for p in pieces)
    assert pieces[0].geometry is pieces[1].geometry is pieces[2].geometry  # type: ignore[union-attr]
    for view, got in zip(views, pieces, strict=True):
        assert got is not None
        segments = got.segments(4096)
        assert [offset for offset, _ in segments] == [4096 + 64 * k for k in range(12)]
        joined = b"".join(bytes(piece) for _, piece in segments)
        assert joined == np.ascontiguousarray(view).tobytes()
    other = rows[0].reshape(3, 4, 64).transpose(1, 0, 2)  # same shape class, other strides
    other_pieces = block_pieces(other, other.nbytes, 64)
    assert other_pieces is not None and other_pieces.geometry is not pieces[0].geometry  # type: ignore[union-attr]
    joined = b"".join(bytes(piece) for _, piece in other_pieces.segments(0))
    assert joined == np.ascontiguousarray(other).tobytes()


def _empty_views(layout: ShardLayout) -> dict[str, np.ndarray]:
    """:func:`_views` over zeroed memory: where a read into pieces lands."""
    return _views(layout, np.zeros(layout.block_nbytes, dtype=np.uint8))


@pytest.mark.parametrize("verify", [True, False])
def test_whole_blocks_read_into_strided_views_byte_exact(
    make_store: StoreFactory, any_identity: Identity, verify: bool
) -> None:
    """A strided view is read into where it lies (the tier's promotion into a CPU-tier row):
    its C-order bytes are the block; padded and MLA arrays refuse it with words naming what
    is expected (their readers take contiguous memory)."""
    group = make_store(verify_reads=verify).namespace(any_identity).group(0)
    layout = group.layout
    canon = block_bytes(layout, 5)
    h = block_hash(5, "read-views")
    (written,) = group.write_blocks([BlockWrite(h, canon)])
    assert written.status is WriteStatus.WRITTEN
    for name, view in _empty_views(layout).items():
        if not layout.dense:
            with pytest.raises(ValueError, match="whole block of a raw, dense"):
                group.read_blocks([BlockRead(h, view)])
            continue
        (result,) = group.read_blocks([BlockRead(h, view)])
        assert result.status is ReadStatus.HIT, name
        assert np.array_equal(np.ascontiguousarray(view).reshape(-1), canon), name


def test_strided_reads_refuse_chunk_selections_and_read_only_views(
    make_store: StoreFactory, small_identity: Identity
) -> None:
    group = make_store().namespace(small_identity).group(0)
    layout = group.layout
    assert layout.dense
    h = block_hash(6, "refused")
    group.write_blocks([BlockWrite(h, block_bytes(layout, 6))])
    view = _empty_views(layout)["gapped"]
    with pytest.raises(ValueError, match="got one for chunk selections"):
        group.read_blocks([BlockRead(h, view[:2], chunks=[0, 1])])
    view.flags.writeable = False
    with pytest.raises(ValueError, match="expected writable memory"):
        group.read_blocks([BlockRead(h, view)])
    halves = np.zeros((2 * layout.num_chunks, layout.chunk_nbytes // 2 + 64), dtype=np.uint8)
    with pytest.raises(KvstoreError, match="pieces of whole"):
        group.read_blocks([BlockRead(h, halves[:, : layout.chunk_nbytes // 2])])


def test_corrupt_chunk_read_into_a_strided_view_is_a_quarantined_miss(
    make_store: StoreFactory, root: Path, small_identity: Identity
) -> None:
    """Every chunk is checked where it landed: a flipped byte in the last chunk makes the read
    CORRUPT (the file quarantined), a flipped header byte too; a good block still reads."""
    group = make_store().namespace(small_identity).group(0)
    layout = group.layout
    hashes = [block_hash(i, "corrupt-views") for i in range(3)]
    group.write_blocks([BlockWrite(h, block_bytes(layout, i)) for i, h in enumerate(hashes)])
    for h, where in ((hashes[0], layout.data_end - 1), (hashes[1], 40)):
        path = Path(group.path_of(h))
        raw = bytearray(path.read_bytes())
        raw[where] ^= 0x5A
        path.write_bytes(bytes(raw))
    views = [_empty_views(layout)["transposed"] for _ in hashes]
    results = group.read_blocks([BlockRead(h, v) for h, v in zip(hashes, views, strict=True)])
    assert [r.status for r in results] == [ReadStatus.CORRUPT, ReadStatus.CORRUPT, ReadStatus.HIT]
    assert f"inner chunk {layout.num_chunks - 1}" in results[0].error
    assert np.array_equal(np.ascontiguousarray(views[2]).reshape(-1), block_bytes(layout, 2))
    assert not Path(group.path_of(hashes[0])).exists()  # quarantined: never served again
    (again,) = group.read_blocks([BlockRead(hashes[0], views[0])])
    assert again.status is ReadStatus.MISS


def test_chunk_order_only_for_pieces_of_whole_chunks() -> None:
    """A piece shorter than a chunk never yields an order, even where its starts fall on chunk
    boundaries and the pieces tile their span (an order of no chunks would give no sums)."""
    assert _chunk_order(np.array([0]), 32, 32, 64) is None
    assert _chunk_order(np.array([0, 96]), 96, 192, 64) is None  # 1.5 chunks per piece
    order = _chunk_order(np.array([128, 0]), 128, 256, 64)
    assert order is not None and order.tolist() == [2, 3, 0, 1]

"""The multi-writer protocol (docs/design.md §5): begin, each writer fills its part, one commits."""

from __future__ import annotations

import logging
import multiprocessing
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import KvstoreError
from kvstore.identity import Identity
from kvstore.store.group_store import GroupStore
from kvstore.store.types import (
    BlockRead,
    BlockWrite,
    ChunkWrite,
    PendingBlock,
    RangeWrite,
    ReadStatus,
    WriteStatus,
)
from tests.helpers import (
    StoreFactory,
    block_bytes,
    block_hash,
    chunk_bytes,
    make_mla_identity,
    make_odd_identity,
    make_small_identity,
    make_two_group_identity,
    shard_files,
    tmp_files,
    write_chunks_in_process,
)


def writers(make_store: StoreFactory, identity: Identity, n: int) -> list[GroupStore]:
    """``n`` independent store objects on one root: one per writer rank."""
    return [make_store().namespace(identity).group(0) for _ in range(n)]


def read_whole(group: GroupStore, h: bytes) -> tuple[ReadStatus, np.ndarray]:
    out = np.zeros(group.layout.block_nbytes, dtype=np.uint8)
    (result,) = group.read_blocks([BlockRead(h, out)])
    return result.status, out


def chunk_write(
    group: GroupStore, pending: PendingBlock, data: np.ndarray, chunks: list[int]
) -> ChunkWrite:
    return ChunkWrite(pending, chunks, chunk_bytes(group.layout, data, chunks))


def test_two_writers_split_by_heads(
    make_store: StoreFactory, any_identity: Identity, root: Path
) -> None:
    a, b = writers(make_store, any_identity, 2)
    layout = a.layout
    h, parent = block_hash(1), block_hash(0)
    data = block_bytes(layout, 1)
    (pending,) = a.begin_blocks([h], [parent])
    if layout.num_heads > 1:
        mine, theirs = layout.chunks_of(range(0, 1), None), layout.chunks_of(range(1, 2), None)
    else:  # MLA: one head, split by layers (pipeline stages)
        mine, theirs = layout.chunks_of(None, range(0, 2)), layout.chunks_of(None, range(2, 4))
    assert a.write_chunks([chunk_write(a, pending, data, mine)]) == [None]
    assert b.contains([h]) == [False]  # not visible before the commit
    assert b.write_chunks([chunk_write(b, pending, data, theirs)]) == [None]
    assert b.contains([h]) == [False]
    assert len(tmp_files(root)) == 1  # both wrote the same temporary file
    (result,) = b.commit_blocks([pending])
    assert result.status is WriteStatus.WRITTEN
    assert tmp_files(root) == []
    for group in (a, b):
        status, out = read_whole(group, h)
        assert status is ReadStatus.HIT
        np.testing.assert_array_equal(out, data)
    header, _ = a.read_header(h)
    assert header.created_ns == pending.created_ns
    assert header.parent_hash == parent


def test_multi_writer_file_equals_whole_block_file(make_store: StoreFactory) -> None:
    """Apart from the file name, the bytes are those write_blocks produces."""
    identity = make_odd_identity()  # non-dense: padding must be zero in both
    a, b = writers(make_store, identity, 2)
    data = block_bytes(a.layout, 2)
    h1, h2 = block_hash(21), block_hash(22)
    (pending,) = a.begin_blocks([h1])
    a.write_chunks([chunk_write(a, pending, data, [5, 0, 3])])  # any order
    b.write_chunks([chunk_write(b, pending, data, [2, 4, 1])])
    assert a.commit_blocks([pending])[0].status is WriteStatus.WRITTEN
    assert a.write_blocks([BlockWrite(h2, data)])[0].status is WriteStatus.WRITTEN
    one = Path(a.path_of(h1)).read_bytes()
    two = Path(a.path_of(h2)).read_bytes()
    assert len(one) == len(two) == a.layout.file_nbytes
    # Differences only in the header: block hash and its crc, created_ns.
    differing = {i for i in range(len(one)) if one[i] != two[i]}
    assert differing
    assert max(differing) < 176
    assert one[176 : a.layout.header_nbytes] == two[176 : a.layout.header_nbytes]
    assert one[a.layout.header_nbytes :] == two[a.layout.header_nbytes :]


def test_missing_writer_fails_commit(make_store: StoreFactory, root: Path) -> None:
    (a,) = writers(make_store, make_small_identity(), 1)
    h = block_hash(3)
    data = block_bytes(a.layout, 3)
    (pending,) = a.begin_blocks([h])
    assert a.write_chunks([chunk_write(a, pending, data, [0, 1, 2])]) == [None]
    (result,) = a.commit_blocks([pending])  # the writer of chunks 3..5 never ran
    assert result.status is WriteStatus.FAILED
    assert result.error == (
        "KvstoreError: incomplete block: 3 of 6 inner chunks were never written (first: chunk 3)"
    )
    assert a.contains([h]) == [False]
    assert read_whole(a, h)[0] is ReadStatus.MISS
    assert tmp_files(root) == []
    assert shard_files(root) == []


def test_commit_without_any_writer(make_store: StoreFactory, root: Path) -> None:
    (a,) = writers(make_store, make_small_identity(), 1)
    (pending,) = a.begin_blocks([block_hash(4)])
    (result,) = a.commit_blocks([pending])
    assert result.status is WriteStatus.FAILED
    assert result.error.startswith("BlockMissingError")
    assert shard_files(root) == []


def dcp_ranges(
    group: GroupStore, data: np.ndarray, chunks: list[int], rank: int, world: int
) -> list[tuple[int, np.ndarray]]:
    """Token-interleaved ranges of ``rank`` (token t belongs to rank t % world), like DCP."""
    layout = group.layout
    token_bytes = layout.elems_per_token * layout.itemsize
    ranges = []
    for c in chunks:
        for t in range(rank, layout.tokens, world):
            offset = c * layout.chunk_nbytes + t * token_bytes
            ranges.append((offset, data[offset : offset + token_bytes]))
    return ranges


@pytest.mark.parametrize(
    "make_identity", [make_small_identity, make_odd_identity, make_mla_identity]
)
def test_dcp_token_split_with_checksums_at_commit(
    make_store: StoreFactory, root: Path, make_identity: Callable[[], Identity]
) -> None:
    identity = make_identity()
    a, b = writers(make_store, identity, 2)
    data = block_bytes(a.layout, 5)
    h = block_hash(5)
    all_chunks = list(range(a.layout.num_chunks))
    (pending,) = a.begin_blocks([h])
    assert a.write_ranges([RangeWrite(pending, dcp_ranges(a, data, all_chunks, 0, 2))]) == [None]
    assert b.write_ranges([RangeWrite(pending, dcp_ranges(b, data, all_chunks, 1, 2))]) == [None]
    (result,) = b.commit_blocks([pending], checksum_chunks=[all_chunks])
    assert result.status is WriteStatus.WRITTEN, result.error
    status, out = read_whole(a, h)
    assert status is ReadStatus.HIT
    np.testing.assert_array_equal(out, data)
    assert tmp_files(root) == []


def test_ranges_without_checksums_are_incomplete(make_store: StoreFactory) -> None:
    (a,) = writers(make_store, make_small_identity(), 1)
    data = block_bytes(a.layout, 6)
    h = block_hash(6)
    (pending,) = a.begin_blocks([h])
    chunks = list(range(a.layout.num_chunks))
    a.write_ranges([RangeWrite(pending, dcp_ranges(a, data, chunks, 0, 1))])
    (result,) = a.commit_blocks([pending])  # forgot checksum_chunks
    assert result.status is WriteStatus.FAILED
    assert "incomplete block: 6 of 6" in result.error


def test_mixed_chunk_and_range_writers(make_store: StoreFactory) -> None:
    """Head 0 by one writer (whole chunks), head 1's tokens split over two more (DCP)."""
    a, b, c = writers(make_store, make_small_identity(), 3)
    layout = a.layout
    data = block_bytes(layout, 7)
    h = block_hash(7)
    head0, head1 = layout.chunks_of(range(0, 1), None), layout.chunks_of(range(1, 2), None)
    (pending,) = a.begin_blocks([h])
    assert a.write_chunks([chunk_write(a, pending, data, head0)]) == [None]
    assert b.write_ranges([RangeWrite(pending, dcp_ranges(b, data, head1, 0, 2))]) == [None]
    assert c.write_ranges([RangeWrite(pending, dcp_ranges(c, data, head1, 1, 2))]) == [None]
    (result,) = c.commit_blocks([pending], checksum_chunks=[head1])
    assert result.status is WriteStatus.WRITTEN
    status, out = read_whole(b, h)
    assert status is ReadStatus.HIT
    np.testing.assert_array_equal(out, data)


def test_abort_removes_temp_files(make_store: StoreFactory, root: Path) -> None:
    a, b = writers(make_store, make_small_identity(), 2)
    data = block_bytes(a.layout, 8)
    hashes = [block_hash(80), block_hash(81)]
    pendings = a.begin_blocks(hashes)
    for pending in pendings:
        a.write_chunks([chunk_write(a, pending, data, [0, 1, 2])])
        b.write_chunks([chunk_write(b, pending, data, [3, 4, 5])])
    assert len(tmp_files(root)) == 2
    a.abort_blocks(pendings)
    assert tmp_files(root) == []
    assert a.contains(hashes) == [False, False]
    a.abort_blocks(pendings)  # idempotent
    results = a.commit_blocks(pendings)  # a late commit after abort publishes nothing
    assert [r.status for r in results] == [WriteStatus.FAILED] * 2
    assert shard_files(root) == []


def test_commit_of_present_block_is_exists(make_store: StoreFactory, root: Path) -> None:
    (a,) = writers(make_store, make_small_identity(), 1)
    h = block_hash(9)
    old = block_bytes(a.layout, 9)
    new = block_bytes(a.layout, 90)
    assert a.write_blocks([BlockWrite(h, old)])[0].status is WriteStatus.WRITTEN
    (pending,) = a.begin_blocks([h])
    a.write_chunks([chunk_write(a, pending, new, list(range(6)))])
    (result,) = a.commit_blocks([pending])
    assert result.status is WriteStatus.EXISTS
    assert tmp_files(root) == []
    status, out = read_whole(a, h)
    assert status is ReadStatus.HIT
    np.testing.assert_array_equal(out, old)  # never rewritten
    assert a.stats.snapshot()["blocks_existing"] == 1


def test_batch_commit_mixed_outcomes(make_store: StoreFactory, root: Path) -> None:
    a, b = writers(make_store, make_small_identity(), 2)
    present = block_hash(100)
    a.write_blocks([BlockWrite(present, block_bytes(a.layout, 100))])
    hashes = [block_hash(101), present, block_hash(102)]
    pendings = a.begin_blocks(hashes)
    for i, pending in enumerate(pendings):
        data = block_bytes(a.layout, 101 + i)
        a.write_chunks([chunk_write(a, pending, data, [0, 1, 2])])
        if i != 2:  # the second writer of the last block dies
            b.write_chunks([chunk_write(b, pending, data, [3, 4, 5])])
    results = b.commit_blocks(pendings)
    assert [r.status for r in results] == [
        WriteStatus.WRITTEN,
        WriteStatus.EXISTS,
        WriteStatus.FAILED,
    ]
    assert a.contains(hashes) == [True, True, False]
    assert tmp_files(root) == []


def test_write_errors_are_returned(make_store: StoreFactory) -> None:
    ns = make_store().namespace(make_two_group_identity())
    g0, g1 = ns.group(0), ns.group(1)
    (pending,) = g0.begin_blocks([block_hash(11)])
    size = g0.layout.chunk_nbytes
    errors = g0.write_chunks(
        [
            ChunkWrite(pending, [0], np.zeros(size - 1, dtype=np.uint8)),
            ChunkWrite(pending, [4], np.ones(size, dtype=np.uint8)),
            ChunkWrite(pending, [1], np.ones(size, dtype=np.uint8)),
        ]
    )
    assert isinstance(errors[0], KvstoreError)
    assert str(errors[0]) == f"chunk data: expected 1 x {size} bytes, got {size - 1}"
    assert isinstance(errors[1], KvstoreError)
    assert str(errors[1]) == "chunk numbers: expected 0..3, got [4]"  # 2 heads x 2 layers
    assert errors[2] is None
    (wrong_group,) = g1.write_chunks([ChunkWrite(pending, [0], np.ones(size, dtype=np.uint8))])
    assert isinstance(wrong_group, KvstoreError)
    assert "pending block belongs to" in str(wrong_group)
    crossing_range = (size - 10, np.ones(20, dtype=np.uint8))
    (crossing,) = g0.write_ranges([RangeWrite(pending, [crossing_range])])
    assert isinstance(crossing, KvstoreError)
    assert "inside one inner chunk" in str(crossing)
    (beyond,) = g0.write_ranges([RangeWrite(pending, [(4 * size, np.ones(1, np.uint8))])])
    assert isinstance(beyond, KvstoreError)
    g0.abort_blocks([pending])


def test_pending_block_is_small_and_picklable(make_store: StoreFactory) -> None:
    (a,) = writers(make_store, make_small_identity(), 1)
    (pending,) = a.begin_blocks([block_hash(12)], [block_hash(11)])
    raw = pickle.dumps(pending)
    assert len(raw) < 600
    assert pickle.loads(raw) == pending
    other = a.begin_blocks([block_hash(12)])[0]
    assert other.token != pending.token  # every attempt has its own temporary file


def test_writers_in_separate_processes(make_store: StoreFactory, root: Path) -> None:
    """Two spawned processes (fresh interpreters, like ranks) write half a block each."""
    identity = make_small_identity()
    (coordinator,) = writers(make_store, identity, 1)
    layout = coordinator.layout
    seeds = [13, 14]
    hashes = [block_hash(s) for s in seeds]
    pendings = coordinator.begin_blocks(hashes)
    jobs = []
    for pending, seed in zip(pendings, seeds, strict=True):
        for head in range(2):
            chunks = layout.chunks_of(range(head, head + 1), None)
            jobs.append((str(root), identity.to_json(), pending, chunks, seed))
    context = multiprocessing.get_context("spawn")
    with context.Pool(2) as pool:
        errors = pool.starmap(write_chunks_in_process, jobs)
    assert errors == [None] * 4
    results = coordinator.commit_blocks(pendings)
    assert [r.status for r in results] == [WriteStatus.WRITTEN] * 2
    for h, seed in zip(hashes, seeds, strict=True):
        status, out = read_whole(coordinator, h)
        assert status is ReadStatus.HIT
        np.testing.assert_array_equal(out, block_bytes(layout, seed))
    assert tmp_files(root) == []


def test_missing_range_writer_fails_commit(make_store: StoreFactory, root: Path) -> None:
    """A token-range writer that never ran leaves zeros that a checksum cannot tell from data;
    its missing completion marker makes the commit fail instead."""
    a, _ = writers(make_store, make_small_identity(), 2)
    data = block_bytes(a.layout, 15)
    h = block_hash(15)
    chunks = list(range(a.layout.num_chunks))
    (pending,) = a.begin_blocks([h])
    a.write_ranges([RangeWrite(pending, dcp_ranges(a, data, chunks, 0, 2), writer_slot=0)])
    (result,) = a.commit_blocks([pending], checksum_chunks=[chunks], range_writers=2)  # 1 died
    assert result.status is WriteStatus.FAILED
    assert "range writer slot(s) [1]" in result.error
    assert a.contains([h]) == [False]
    assert tmp_files(root) == []


def test_all_range_writers_reported_publishes_exact_size(make_store: StoreFactory) -> None:
    a, b = writers(make_store, make_small_identity(), 2)
    data = block_bytes(a.layout, 16)
    h = block_hash(16)
    chunks = list(range(a.layout.num_chunks))
    (pending,) = a.begin_blocks([h])
    a.write_ranges([RangeWrite(pending, dcp_ranges(a, data, chunks, 0, 2), writer_slot=0)])
    b.write_ranges([RangeWrite(pending, dcp_ranges(b, data, chunks, 1, 2), writer_slot=1)])
    (result,) = a.commit_blocks([pending], checksum_chunks=[chunks], range_writers=2)
    assert result.status is WriteStatus.WRITTEN
    assert Path(a.path_of(h)).stat().st_size == a.layout.file_nbytes  # markers cut off
    status, out = read_whole(a, h)
    assert status is ReadStatus.HIT
    np.testing.assert_array_equal(out, data)


def test_writers_without_a_coordinator_meet_by_token(
    make_store: StoreFactory, small_identity: Identity, root: Path
) -> None:
    """Writers that each derive the token themselves fill one file; is_complete says when
    every chunk is in, reading only (nothing is removed while others still write)."""
    a, b = writers(make_store, small_identity, 2)
    h = block_hash(7)
    data = block_bytes(a.layout, 7)
    n = a.layout.num_chunks
    (pa,) = a.begin_blocks([h], tokens=["sg-meet"])
    (pb,) = b.begin_blocks([h], tokens=["sg-meet"])
    assert a.temp_path(pa) == b.temp_path(pb)
    assert not a.pending_complete(pa)  # no file yet
    first, second = list(range(n // 2)), list(range(n // 2, n))
    assert a.write_chunks([chunk_write(a, pa, data, first)]) == [None]
    assert not a.pending_complete(pa) and not b.pending_complete(pb)
    assert [str(p) for p in tmp_files(root)] == [a.temp_path(pa)]
    assert b.write_chunks([chunk_write(b, pb, data, second)]) == [None]
    assert b.pending_complete(pb) and a.pending_complete(pa)
    (result,) = b.commit_blocks([pb])
    assert result.status is WriteStatus.WRITTEN
    status, out = read_whole(a, h)
    assert status is ReadStatus.HIT and bytes(out) == bytes(data)


def test_a_writer_whose_file_is_published_before_its_sync_succeeds(
    make_store: StoreFactory, small_identity: Identity, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a coordinator, a writer's checksum slots (written last) can complete the file
    before that writer syncs it: the other writer then publishes it (renames it away). The
    late sync finds the published block instead of the temporary file, and is a success."""
    a, b = (make_store(durability="full").namespace(small_identity).group(0) for _ in range(2))
    h = block_hash(21)
    data = block_bytes(a.layout, 21)
    n = a.layout.num_chunks
    (pa,) = a.begin_blocks([h], tokens=["sg-race"])
    (pb,) = b.begin_blocks([h], tokens=["sg-race"])
    assert a.write_chunks([chunk_write(a, pa, data, list(range(n // 2)))]) == [None]
    files = b._pending.files
    real_sync = files.sync_file
    synced: list[str] = []

    def a_commits_first(path: str) -> None:
        if not synced:  # b's slots are in: a publishes before b's sync
            assert a.pending_complete(pa)
            assert a.commit_blocks([pa])[0].status is WriteStatus.WRITTEN
        synced.append(path)
        real_sync(path)

    monkeypatch.setattr(files, "sync_file", a_commits_first)
    assert b.write_chunks([chunk_write(b, pb, data, list(range(n // 2, n)))]) == [None]
    assert synced == [b.temp_path(pb), b.path_of(h)]  # the file, then the block it became
    assert tmp_files(root) == []
    status, out = read_whole(b, h)
    assert status is ReadStatus.HIT and bytes(out) == bytes(data)
    # Gone without a published block (aborted, swept): still an error.
    (gone,) = b.begin_blocks([block_hash(22)], tokens=["sg-race"])

    def swept_first(path: str) -> None:
        b.abort_blocks([gone])
        real_sync(path)

    monkeypatch.setattr(files, "sync_file", swept_first)
    (error,) = b.write_chunks([chunk_write(b, gone, data, [0])])
    assert isinstance(error, FileNotFoundError)


def test_a_commit_that_loses_the_race_finds_the_block(
    make_store: StoreFactory,
    small_identity: Identity,
    root: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two writers without a coordinator that both find the block complete both commit; the
    one whose temporary file is renamed away mid-commit answers EXISTS, and logs nothing."""
    a, b = writers(make_store, small_identity, 2)
    h = block_hash(23)
    data = block_bytes(a.layout, 23)
    n = a.layout.num_chunks
    (pa,) = a.begin_blocks([h], tokens=["sg-both"])
    (pb,) = b.begin_blocks([h], tokens=["sg-both"])
    assert a.write_chunks([chunk_write(a, pa, data, list(range(n // 2)))]) == [None]
    assert b.write_chunks([chunk_write(b, pb, data, list(range(n // 2, n)))]) == [None]
    assert a.pending_complete(pa) and b.pending_complete(pb)
    pending_b = b._pending
    real_check = pending_b._complete_checksums

    def a_publishes_meanwhile(*args: object) -> object:  # after b's existence check
        assert a.commit_blocks([pa])[0].status is WriteStatus.WRITTEN
        return real_check(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(pending_b, "_complete_checksums", a_publishes_meanwhile)
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        (result,) = b.commit_blocks([pb])
    assert result.status is WriteStatus.EXISTS
    assert caplog.records == []
    assert tmp_files(root) == []
    status, out = read_whole(a, h)
    assert status is ReadStatus.HIT and bytes(out) == bytes(data)


def test_begin_blocks_checks_tokens(make_store: StoreFactory, small_identity: Identity) -> None:
    group = make_store().namespace(small_identity).group(0)
    with pytest.raises(KvstoreError, match="1 hashes but 2 tokens"):
        group.begin_blocks([block_hash(1)], tokens=["a", "b"])
    for bad in ["", "a.b", "../x", "A" * 3, "x" * 65]:
        with pytest.raises(KvstoreError, match="pending token"):
            group.begin_blocks([block_hash(1)], tokens=[bad])

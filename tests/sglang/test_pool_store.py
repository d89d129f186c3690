"""One pool's pages in the store across parallel layouts (connector.sglang.pool_store), with
fake pools and real stores: TP=2 -> TP=1 and back, pipeline stages, MLA, replicated heads,
writers that meet without a coordinator, and damaged data as misses. Runs without SGLang."""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import pytest
import torch

from connector.sglang.pages import MHA_LAYOUTS
from connector.sglang.pool_store import PoolStore, block_hash
from connector.sglang.stats import BackendStats
from kvstore import ConfigError, KVStore, StoreConfig
from kvstore.store.types import ChunkWrite
from tests.sglang.fakes import FakeMHAPool, FakeMLAPool, FakeStorageConfig

T, L, H, D, PAGES = 4, 3, 2, 8, 6
HEAD_AXIS = {"layer_first": 3, "page_first": 3, "page_first_direct": 4, "page_head": 2}
LAYER_AXIS = {"layer_first": 1, "page_first": 2, "page_first_direct": 2, "page_head": 4}
KEYS = [f"{i:02x}" * 32 for i in range(1, 5)]


def _full(layout: str, seed: int = 1) -> FakeMHAPool:
    pool = FakeMHAPool(layout, T, L, H, D, pages=PAGES)
    pool.fill_random(seed)
    return pool


def _slice(full: FakeMHAPool, heads: slice, layers: slice) -> FakeMHAPool:
    """The pool of a rank holding ``heads`` and ``layers`` of ``full``."""
    nh = len(range(H)[heads])
    nl = len(range(L)[layers])
    start = range(L)[layers][0]
    part = FakeMHAPool(full.layout, T, nl, nh, D, pages=PAGES, start_layer=start)
    index: list[slice] = [slice(None)] * full.kv_buffer.dim()
    index[HEAD_AXIS[full.layout]] = heads
    index[LAYER_AXIS[full.layout]] = layers
    part.kv_buffer.copy_(full.kv_buffer[tuple(index)])
    return part


def _blank_like(pool: FakeMHAPool) -> FakeMHAPool:
    return FakeMHAPool(
        pool.layout, T, pool.layer_num, pool.head_num, D, pages=PAGES, start_layer=pool.start_layer
    )


def _store(root: Path) -> KVStore:
    return KVStore(StoreConfig(root=root))


def _pool_store(
    root: Path,
    pool: object,
    tp: tuple[int, int] = (0, 1),
    pp: tuple[int, int] = (0, 1),
    layers: int = 0,
) -> PoolStore:
    storage = FakeStorageConfig(tp_rank=tp[0], tp_size=tp[1], pp_rank=pp[0], pp_size=pp[1])
    return PoolStore(_store(root), "kv", pool, storage, "test/model", (0, layers))


def _write(ps: PoolStore, pages: list[int], keys: list[str]) -> list[bool | None]:
    hashes = [block_hash(k) for k in keys]
    return ps.write_pages(hashes, [None, *hashes[:-1]], torch.tensor(pages), BackendStats())


def _read(
    ps: PoolStore, pages: list[int], keys: list[str], stats: BackendStats | None = None
) -> list[bool | None]:
    return ps.read([block_hash(k) for k in keys], torch.tensor(pages), stats or BackendStats())


def _same_pages(a: PoolStore, a_pages: list[int], b: PoolStore, b_pages: list[int]) -> bool:
    return torch.equal(a.pages.gather(torch.tensor(a_pages)), b.pages.gather(torch.tensor(b_pages)))


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_written_at_tp2_read_at_tp1(tmp_path: Path, layout: str) -> None:
    full = _full(layout)
    ranks = [
        _pool_store(tmp_path, _slice(full, slice(r, r + 1), slice(None)), (r, 2)) for r in range(2)
    ]
    assert _write(ranks[0], [1, 2], KEYS[:2]) == [True, True]
    # Half a block is no block: nothing is visible until the other rank has written.
    assert ranks[0].contains([block_hash(k) for k in KEYS[:2]]) == [False, False]
    assert _write(ranks[1], [1, 2], KEYS[:2]) == [True, True]
    assert ranks[0].leading([block_hash(k) for k in KEYS]) == 2
    reader = _pool_store(tmp_path, _blank_like(full))
    stats = BackendStats()
    assert _read(reader, [4, 0, 3], [KEYS[0], KEYS[1], KEYS[2]], stats) == [True, True, False]
    source = _pool_store(tmp_path / "other", full)
    assert _same_pages(reader, [4, 0], source, [1, 2])
    assert stats.hits == 2 and stats.misses == 1
    assert not list(tmp_path.rglob("*.tmp-*"))  # the committer left no temporary file


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_written_at_tp1_read_at_tp2(tmp_path: Path, layout: str) -> None:
    full = _full(layout, seed=7)
    writer = _pool_store(tmp_path, full)
    assert _write(writer, [0, 5], KEYS[:2]) == [True, True]
    for r in range(2):
        rank_pool = _slice(full, slice(r, r + 1), slice(None))
        reader = _pool_store(tmp_path, _blank_like(rank_pool), (r, 2))
        assert _read(reader, [2, 3], KEYS[:2]) == [True, True]
        truth = _pool_store(tmp_path / "truth", rank_pool, (r, 2))
        assert _same_pages(reader, [2, 3], truth, [0, 5])


def test_pipeline_stages_fill_one_block(tmp_path: Path) -> None:
    full = _full("page_first", seed=3)
    stage0 = _pool_store(tmp_path, _slice(full, slice(None), slice(0, 2)), pp=(0, 2), layers=L)
    stage1 = _pool_store(tmp_path, _slice(full, slice(None), slice(2, 3)), pp=(1, 2), layers=L)
    assert _write(stage1, [3], KEYS[:1]) == [True]
    assert stage1.leading([block_hash(KEYS[0])]) == 0
    assert _write(stage0, [3], KEYS[:1]) == [True]
    reader = _pool_store(tmp_path, _blank_like(full))
    assert _read(reader, [1], KEYS[:1]) == [True]
    assert _same_pages(reader, [1], _pool_store(tmp_path / "t", full), [3])


def test_pipeline_needs_the_model_layers(tmp_path: Path) -> None:
    pool = _slice(_full("page_first"), slice(None), slice(0, 2))
    with pytest.raises(ConfigError, match="set 'num_layers'"):
        _pool_store(tmp_path, pool, pp=(0, 2))


def test_replicated_heads_write_whole_blocks(tmp_path: Path) -> None:
    """One KV head over TP=2: each rank holds the whole block (publishing it alone)."""
    one = FakeMHAPool("page_first", T, L, 1, D, pages=PAGES)
    one.fill_random(5)
    storage = FakeStorageConfig(tp_rank=1, tp_size=2)
    ps = PoolStore(_store(tmp_path), "kv", one, storage, "test/model", (1, 0))
    assert ps.share.whole and ps.share.heads == (0,)
    assert _write(ps, [2], KEYS[:1]) == [True]
    reader = PoolStore(
        _store(tmp_path), "kv", _blank_like(one), FakeStorageConfig(), "test/model", (1, 0)
    )
    assert _read(reader, [0], KEYS[:1]) == [True]
    assert _same_pages(reader, [0], ps, [2])


@pytest.mark.parametrize(
    "layout", ["layer_first", "page_first", "page_first_direct", "page_first_kv_split"]
)
def test_mla_rank0_writes_every_rank_reads(tmp_path: Path, layout: str) -> None:
    pool = FakeMLAPool(layout, T, L, kv_lora_rank=8, qk_rope_head_dim=4, pages=PAGES)
    pool.fill_random(11)
    writer = _pool_store(tmp_path, pool, (0, 2))
    assert writer.share.whole
    assert _write(writer, [1, 4], KEYS[:2]) == [True, True]
    blank = FakeMLAPool(layout, T, L, kv_lora_rank=8, qk_rope_head_dim=4, pages=PAGES)
    reader = _pool_store(tmp_path, blank, (1, 2))
    assert _read(reader, [0, 2], KEYS[:2]) == [True, True]
    assert _same_pages(reader, [0, 2], writer, [1, 4])


def test_late_writer_of_a_published_block_succeeds(tmp_path: Path) -> None:
    full = _full("page_head")
    ranks = [
        _pool_store(tmp_path, _slice(full, slice(r, r + 1), slice(None)), (r, 2)) for r in range(2)
    ]
    _write(ranks[0], [0], KEYS[:1])
    _write(ranks[1], [0], KEYS[:1])
    assert _write(ranks[0], [0], KEYS[:1]) == [True]  # already published: nothing to do
    assert not list(tmp_path.rglob("*.tmp-*"))


def test_two_writers_that_both_see_the_block_complete(tmp_path: Path) -> None:
    """Both writers finish, then both commit: one publishes, the other finds it published."""
    full = _full("page_first")
    ranks = [
        _pool_store(tmp_path, _slice(full, slice(r, r + 1), slice(None)), (r, 2)) for r in range(2)
    ]
    h = block_hash(KEYS[0])
    assert h is not None
    pendings = []
    for ps in ranks:
        (pending,) = ps.group.begin_blocks([h], [None], [ps._token(h)])
        rows = ps.pages.gather(torch.tensor([0])).numpy()
        assert ps.group.write_chunks([ChunkWrite(pending, list(ps.share.chunks), rows[0])]) == [
            None
        ]
        pendings.append(pending)
    assert all(ps.group.pending_complete(p) for ps, p in zip(ranks, pendings, strict=True))
    statuses = [
        ps.group.commit_blocks([p])[0].status.name for ps, p in zip(ranks, pendings, strict=True)
    ]
    assert sorted(statuses) in (["EXISTS", "WRITTEN"], ["FAILED", "WRITTEN"])
    assert ranks[0].contains([h]) == [True]
    reader = _pool_store(tmp_path, _blank_like(full))
    assert _read(reader, [1], KEYS[:1]) == [True]


def test_a_rank_whose_pages_another_rank_published_before_its_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 1 writes its shares; before it syncs them, rank 0 writes its own, finds the blocks
    complete and publishes them (renames the temporary files away). Both ranks stored their
    pages: SGLang fails a whole batch for one page a rank reports unstored."""
    full = _full("page_first")
    ranks = [
        _pool_store(tmp_path, _slice(full, slice(r, r + 1), slice(None)), (r, 2)) for r in range(2)
    ]
    files = ranks[1].group._pending.files
    real_sync = files.sync_file
    first: list[list[bool | None]] = []
    once = threading.Lock()  # the syncs of a batch run on the store's I/O threads

    def rank0_publishes_first(path: str) -> None:
        with once:
            if not first:
                first.append(_write(ranks[0], [0, 1, 2], KEYS[:3]))
        real_sync(path)

    monkeypatch.setattr(files, "sync_file", rank0_publishes_first)
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        assert _write(ranks[1], [0, 1, 2], KEYS[:3]) == [True] * 3
    assert first == [[True] * 3]
    assert caplog.records == []
    assert ranks[1].contains([block_hash(k) for k in KEYS[:3]]) == [True] * 3
    assert not list(tmp_path.rglob("*.tmp-*"))
    reader = _pool_store(tmp_path, _blank_like(full))
    assert _read(reader, [3, 4, 5], KEYS[:3]) == [True] * 3
    assert _same_pages(reader, [3, 4, 5], _pool_store(tmp_path, full), [0, 1, 2])


def test_a_share_not_written_is_logged_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    full = _full("page_head")
    rank = _pool_store(tmp_path, _slice(full, slice(0, 1), slice(None)), (0, 2))
    files = rank.group._pending.files

    def failing_sync(path: str) -> None:
        raise OSError(errno.EIO, "Input/output error", path)

    monkeypatch.setattr(files, "sync_file", failing_sync)
    with caplog.at_level(logging.WARNING, logger="kvstore.sglang"):
        assert _write(rank, [0, 1], KEYS[:2]) == [False, False]
    (record,) = caplog.records
    message = record.getMessage()
    assert "share of 2 of 2 pages not stored" in message
    assert "OSError: [Errno 5] Input/output error" in message


def _block_file(ps: PoolStore, key: str) -> Path:
    h = block_hash(key)
    assert h is not None
    return Path(ps.group.path_of(h))


@pytest.mark.parametrize("damage", ["flip", "truncate", "vanish", "foreign"])
def test_damaged_blocks_are_misses_and_never_reach_the_pool(tmp_path: Path, damage: str) -> None:
    full = _full("page_first")
    writer = _pool_store(tmp_path, full)
    assert _write(writer, [0, 1, 2], KEYS[:3]) == [True, True, True]
    path = _block_file(writer, KEYS[1])
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[writer.group.layout.chunk_offset(1) + 10] ^= 0x40
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    elif damage == "vanish":
        path.unlink()
    else:  # another key's (valid) block under this key's name
        path.unlink()
        os.link(_block_file(writer, KEYS[2]), path)
    reader = _pool_store(tmp_path, _blank_like(full))
    before = reader.pages.gather(torch.tensor([4]))
    stats = BackendStats()
    assert _read(reader, [3, 4, 5], KEYS[:3], stats) == [True, False, True]
    assert torch.equal(reader.pages.gather(torch.tensor([4])), before)
    assert stats.misses == 1
    if damage != "vanish":
        assert stats.corrupt == 1
        # Quarantined: the next lookup stops before it.
        assert reader.leading([block_hash(k) for k in KEYS[:3]]) == 1


def test_keys_that_are_not_page_hashes_are_misses(tmp_path: Path) -> None:
    ps = _pool_store(tmp_path, _full("page_first"))
    bad = ["not-hex", "ab", None]
    assert [block_hash(k) for k in bad] == [None, None, None]
    hashes = [block_hash(k) for k in ["zz" * 32, KEYS[0]]]
    assert ps.write_pages(hashes, [None, None], torch.tensor([0, 1]), BackendStats()) == [
        False,
        True,
    ]
    assert _read(ps, [2, 3], ["zz" * 32, KEYS[0]]) == [False, True]


def test_identity_is_layout_free_and_names_the_engine(tmp_path: Path) -> None:
    full = _full("page_first")
    tp1 = _pool_store(tmp_path, full)
    tp2 = _pool_store(tmp_path, _slice(full, slice(1, 2), slice(None)), (1, 2))
    assert tp1.identity == tp2.identity
    assert tp1.identity.hash_algo == "sglang_sha256"
    other_layout = _pool_store(tmp_path, _full("layer_first"))
    assert other_layout.identity == tp1.identity  # host layout is not in the pages
    assert tp1.identity.groups[0].num_kv_heads == H


@pytest.mark.parametrize("layout", ["page_first", "page_head"])
def test_batches_move_in_staging_slices(tmp_path: Path, layout: str) -> None:
    """A batch larger than the staging rows moves slice by slice (here one page each), with a
    miss in the middle of a read: every hit lands on its own page, the miss's page untouched."""
    full = _full(layout, seed=11)
    writer = _pool_store(tmp_path, full)
    writer.pages_per_slice = 1
    hashes = [block_hash(k) for k in KEYS]
    assert (
        writer.write_pages(hashes, [None, *hashes[:-1]], torch.tensor([5, 4, 3, 2]), BackendStats())
        == [True] * 4
    )
    blank = _blank_like(full)
    reader = _pool_store(tmp_path, blank)
    reader.pages_per_slice = 2
    untouched = reader.pages.gather(torch.tensor([1])).clone()
    wanted = [KEYS[0], "ab" * 32, KEYS[2], KEYS[3]]  # the second is no stored block
    assert _read(reader, [0, 1, 2, 3], wanted) == [True, False, True, True]
    source = _pool_store(tmp_path / "other", full)
    assert _same_pages(reader, [0, 2, 3], source, [5, 3, 2])
    assert torch.equal(reader.pages.gather(torch.tensor([1])), untouched)

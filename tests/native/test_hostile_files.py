"""Hostile arguments to the file calls (write_new, read_regular and their hashed forms,
sync_and_rename, exists_many, the checksum batch) and through the public store API: snapshots,
misaligned buffers, empty segments, NULs, numpy integers, empty ranges. The contract and how
each call is run are in test_hostile_pieces.py's docstring."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from kvstore import checksum
from kvstore.checksum import XXH3_64, native_xxh3_capsule
from kvstore.config import StoreConfig
from kvstore.io.fileio import FileIO
from kvstore.io.native_fileio import NativeFileIO
from kvstore.io.types import PUBLISHED, VERIFIED, Hashing, PiecePlan
from kvstore.store.page_store import KVStore
from kvstore.store.types import (
    BlockRead,
    BlockWrite,
    ChunkWrite,
    RangeWrite,
    ReadStatus,
    WriteStatus,
)
from tests.helpers import block_bytes, block_hash, make_small_identity
from tests.native.hostile import (
    CHUNK,
    HEADER,
    IMPLS,
    NEW,
    OPS,
    ClearingPath,
    Reference,
    _closed,
    _entries,
    _fio,
    _header,
    _misaligned,
    _native_module,
    _noise,
    _require_native,
    block_file,
    expect_ok,
    expect_raised,
    hostile_pieces,
    make_plan,
)
from tests.native.isolated import run_isolated

BAD_SEGMENTS: dict[str, tuple[list[Any], int, int | None, type[BaseException]]] = {
    "a segment that is not a pair": ([(0, memoryview(b"abc"), 1)], 3, None, TypeError),
    "a str as the memory": ([(0, "abc")], 3, None, TypeError),
    "a negative offset": ([(-1, memoryview(b"abc"))], 3, None, ValueError),
    "an offset past maxsize": ([(2**63, memoryview(b"abc"))], 3, None, OverflowError),
    "offset + length past maxsize": ([(2**63 - 2, memoryview(b"abc"))], 3, None, OverflowError),
    "buffered_from past the segments": ([(0, memoryview(b"abc"))], 3, 2, ValueError),
    "a negative file size": ([(0, memoryview(b"abc"))], -1, None, ValueError),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(BAD_SEGMENTS))
def test_write_new_refuses_bad_arguments_before_creating_the_file(
    impl: str, case: str, tmp_path: Path
) -> None:
    """write_new's bad arguments are refused with the same exception type on both builds
    and before the file is created: TypeError for a segment that is not an (offset, buffer)
    pair or memory that is no buffer, ValueError for a negative offset, a buffered_from
    past the segments or a negative size, OverflowError for an offset (or where its bytes
    end) past sys.maxsize (formerly the reference opens the file first and fails later, with
    other types)."""
    fio = _fio(impl)
    segments, file_nbytes, buffered_from, exc = BAD_SEGMENTS[case]
    path = tmp_path / "new"
    outcome = run_isolated(
        lambda: _closed(fio.write_new(str(path), NEW, 0o600, segments, file_nbytes, buffered_from))
    )
    expect_raised(outcome, exc)
    assert _entries(tmp_path) == []


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", ["a segment that is not a pair", "a negative offset"])
def test_read_regular_refuses_bad_segments(impl: str, case: str, tmp_path: Path) -> None:
    """read_regular of a segment that is not a pair (TypeError) or at a negative offset
    (ValueError): the same type on both builds (formerly the reference raises ValueError and
    OSError EINVAL)."""
    fio = _fio(impl)
    path = tmp_path / "file"
    path.write_bytes(b"abc")
    memory = memoryview(bytearray(3))
    segments: list[Any] = (
        [(0, memory, 1)] if case == "a segment that is not a pair" else [(-1, memory)]
    )
    exc = TypeError if case == "a segment that is not a pair" else ValueError
    outcome = run_isolated(lambda: list(fio.read_regular(str(path), os.O_RDONLY, segments, 3)))
    expect_raised(outcome, exc)


# -- 5. __fspath__ / __index__ that mutate the sequence being walked ----------------------------


class ClearingIndex:
    """An offset whose ``__index__`` empties ``victim`` (the segment list being walked)."""

    def __init__(self, value: int, victim: list[Any]) -> None:
        self.value = value
        self.victim = victim

    def __index__(self) -> int:
        self.victim.clear()
        return self.value


def test_native_exists_many_snapshots_its_paths(tmp_path: Path) -> None:
    """kvstore._native._fileproto.exists_many([evil, file]) where evil's __fspath__ clears the list
    probes both names as they were: [0, 1] (formerly: a use-after-free, SIGSEGV)."""
    native = _native_module()
    (tmp_path / "there").write_bytes(b"x")
    paths: list[Any] = []
    paths.extend([ClearingPath(tmp_path / "missing", paths), str(tmp_path / "there")])
    assert expect_ok(run_isolated(lambda: native.exists_many(paths))) == [0, 1]


@pytest.mark.parametrize("impl", IMPLS)
def test_fileio_exists_many_snapshots_its_paths(impl: str, tmp_path: Path) -> None:
    """FileIO.exists_many with the same evil list answers for both names: [False, True] (the
    reference formerly stops after the first; the native build crashes)."""
    fio = _fio(impl)
    (tmp_path / "there").write_bytes(b"x")
    paths: list[Any] = []
    paths.extend([ClearingPath(tmp_path / "missing", paths), str(tmp_path / "there")])
    assert expect_ok(run_isolated(lambda: fio.exists_many(paths))) == [False, True]


VIAS = ["module", "native", "reference"]


def _via_publish(via: str, blocks: list[Any], plan: PiecePlan) -> Callable[[], object]:
    """publish_pieces of ``blocks`` through the extension module itself, NativeFileIO or
    the reference."""
    if via == "module":
        native = _native_module()
        xxh3 = native_xxh3_capsule()
        return lambda: native.publish_pieces(
            blocks, NEW, 0o600, plan.file_nbytes, plan.piece_nbytes, plan.starts,
            plan.slot_of, plan.chunk_nbytes, plan.slots_offset, plan.index,
            plan.index_offset, plan.alignment, xxh3,
        )  # fmt: skip
    fio = _fio(via)
    return lambda: fio.publish_pieces(blocks, NEW, 0o600, plan)


def _via_read(via: str, blocks: list[Any], plan: PiecePlan) -> Callable[[], list[int]]:
    """read_pieces of ``blocks`` through the extension module, NativeFileIO or the
    reference."""
    if via == "module":
        native = _native_module()
        xxh3 = native_xxh3_capsule()
        return lambda: list(
            native.read_pieces(
                blocks, os.O_RDONLY, plan.file_nbytes, HEADER, plan.piece_nbytes,
                plan.starts, plan.slot_of, plan.chunk_nbytes, plan.slots_offset, 0,
                plan.alignment, xxh3,
            )
        )  # fmt: skip
    fio = _fio(via)
    return lambda: fio.read_pieces(blocks, HEADER, plan, 0)


@pytest.mark.parametrize("via", VIAS)
def test_publish_pieces_snapshots_its_blocks(via: str, tmp_path: Path) -> None:
    """publish_pieces of two blocks where the first one's tmp name clears the block list:
    both published ([1, 1]) with the expected files (formerly: a use-after-free, SIGSEGV)."""
    plan = make_plan()
    spans = [_noise(2 * CHUNK, i) for i in range(2)]
    blocks: list[Any] = []
    blocks.extend(
        [
            (ClearingPath(tmp_path / ".b0.tmp-x", blocks), str(tmp_path / "b0"),
             _header().data, spans[0].data),
            (str(tmp_path / ".b1.tmp-x"), str(tmp_path / "b1"), _header().data, spans[1].data),
        ]
    )  # fmt: skip
    call = _via_publish(via, blocks, plan)
    assert expect_ok(run_isolated(call)) == [PUBLISHED, PUBLISHED]
    assert _entries(tmp_path) == ["b0", "b1"]
    for i in range(2):
        assert (tmp_path / f"b{i}").read_bytes() == block_file(spans[i], plan)


@pytest.mark.parametrize("via", VIAS)
def test_read_pieces_snapshots_its_blocks(via: str, tmp_path: Path) -> None:
    """read_pieces of two valid blocks where the first one's path clears the block list:
    both VERIFIED ([1, 1]) with their spans filled (formerly: a use-after-free, SIGSEGV)."""
    plan = make_plan()
    spans = [_noise(2 * CHUNK, i) for i in range(2)]
    for i in range(2):
        (tmp_path / f"b{i}").write_bytes(block_file(spans[i], plan))
    targets = [np.zeros(2 * CHUNK, np.uint8) for _ in range(2)]
    blocks: list[Any] = []
    blocks.extend(
        [
            (ClearingPath(tmp_path / "b0", blocks), np.zeros(HEADER, np.uint8).data,
             targets[0].data),
            (str(tmp_path / "b1"), np.zeros(HEADER, np.uint8).data, targets[1].data),
        ]
    )  # fmt: skip
    call = _via_read(via, blocks, plan)

    def read() -> dict[str, Any]:
        statuses = call()
        same = [bool(np.array_equal(t, s)) for t, s in zip(targets, spans, strict=True)]
        return {"statuses": statuses, "filled": same}

    assert expect_ok(run_isolated(read)) == {
        "statuses": [VERIFIED, VERIFIED],
        "filled": [True, True],
    }


@pytest.mark.parametrize("impl", IMPLS)
def test_write_new_snapshots_its_segments(impl: str, tmp_path: Path) -> None:
    """write_new of two segments whose first offset's __index__ clears the segment list
    writes both as they were (formerly: the native call reads freed memory; the reference
    cannot add an __index__-only offset)."""
    fio = _fio(impl)
    path = tmp_path / "new"
    segments: list[Any] = []
    segments.extend([(ClearingIndex(0, segments), memoryview(b"abc")), (3, memoryview(b"def"))])
    got = expect_ok(
        run_isolated(lambda: _closed(fio.write_new(str(path), NEW, 0o600, segments, 6)))
    )
    assert got == "fd"
    assert path.read_bytes() == b"abcdef"


# -- 6. misaligned uint64 / int64 buffers -----------------------------------------------------


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("impl", IMPLS)
def test_misaligned_hashing_sums_are_refused(impl: str, op: str, tmp_path: Path) -> None:
    """Hashing.sums one byte off an 8-byte boundary is ValueError naming sums, before any
    file is created (formerly both builds accept it)."""
    fio = _fio(impl)
    data = _noise(2 * CHUNK)
    hashing = Hashing(0, 1, XXH3_64, CHUNK, 2 * CHUNK, _misaligned(np.uint64, 2))
    path = tmp_path / "file"
    if op == "write":
        segments = [(0, data.data)]
        outcome = run_isolated(
            lambda: _closed(
                fio.write_new_hashed(str(path), NEW, 0o600, segments, data.size, hashing)
            )
        )
        expect_raised(outcome, ValueError, "sums")
        assert _entries(tmp_path) == []
        return
    path.write_bytes(data.tobytes())
    into = [(0, np.zeros(data.size, np.uint8).data)]
    outcome = run_isolated(
        lambda: list(fio.read_regular_hashed(str(path), os.O_RDONLY, into, data.size, hashing))
    )
    expect_raised(outcome, ValueError, "sums")


def test_misaligned_xxh3_batch_out_is_refused() -> None:
    """kvstore._native._xxh3batch.sums with ``out`` one byte off an 8-byte boundary is ValueError
    naming out (formerly it is accepted)."""
    _require_native()
    sums = checksum._native_sums()
    assert sums is not None
    data = _noise(2 * CHUNK).data
    out = _misaligned(np.uint64, 2)
    expect_raised(run_isolated(lambda: sums(data, CHUNK, 2, CHUNK, out.data)), ValueError, "out")


@pytest.mark.parametrize("which", ["starts", "slot_of"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("impl", IMPLS)
def test_misaligned_piece_arrays_are_refused(
    impl: str, op: str, which: str, tmp_path: Path
) -> None:
    """A plan's starts or slot_of one byte off an 8-byte boundary (valid values otherwise)
    is ValueError naming it, before any file is created (formerly the native call accepts it;
    the reference raises RuntimeError)."""
    plan = make_plan()
    misaligned = _misaligned(np.int64, 2)
    misaligned[:] = getattr(plan, which)
    if which == "starts":
        hostile = replace(plan, starts=misaligned)
    else:
        hostile = replace(plan, slot_of=misaligned)
    outcome, left = hostile_pieces(impl, op, tmp_path, hostile)
    expect_raised(outcome, ValueError, which)
    assert left == []


# -- 7. native and reference agree: empty segments, NULs, numpy ints, empty ranges -----------


EMPTY_SHAPES: dict[str, tuple[list[tuple[int, bytes]], int, bytes]] = {
    "only an empty segment": ([(0, b"")], 0, b""),
    "an empty segment after data": ([(0, b"abc"), (10, b"")], 16, b"abc" + bytes(13)),
    "an empty segment between runs": (
        [(0, b"ab"), (5, b""), (8, b"cd")],
        10,
        b"ab" + bytes(6) + b"cd",
    ),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", list(EMPTY_SHAPES))
def test_an_empty_segment_is_a_no_op_in_write_new(impl: str, shape: str, tmp_path: Path) -> None:
    """An empty segment writes nothing and fails nothing: both builds return the descriptor
    and the same file (formerly the reference raises ENOSPC, "pwritev made no progress")."""
    fio = _fio(impl)
    raw, file_nbytes, expected = EMPTY_SHAPES[shape]
    segments = [(offset, memoryview(data)) for offset, data in raw]
    path = tmp_path / "new"
    call = lambda: _closed(fio.write_new(str(path), NEW, 0o600, segments, file_nbytes))  # noqa: E731
    assert expect_ok(run_isolated(call)) == "fd"
    assert path.read_bytes() == expected


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("which", ["src", "dst"])
def test_a_nul_in_a_rename_name_is_refused(impl: str, which: str, tmp_path: Path) -> None:
    """sync_and_rename with a NUL in the source or the target is ValueError and renames
    nothing (formerly the reference renames to, or from, the name cut at the NUL)."""
    fio = _fio(impl)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(b"x")
    names = {"src": str(src), "dst": str(dst)}
    names[which] += "\0junk"
    outcome = run_isolated(lambda: fio.sync_and_rename(None, names["src"], names["dst"]))
    expect_raised(outcome, ValueError)
    assert _entries(tmp_path) == ["src"]


NUL_CALLS = [
    "write_new",
    "read_regular",
    "exists_many",
    "publish tmp",
    "publish final",
    "read_pieces",
]


def _nul_call(fio: FileIO, call: str, directory: Path) -> Callable[[], object]:
    """The call ``call`` with a NUL in its path (the name before the NUL exists where a read
    needs a file, so a cut name would be found)."""
    nul = str(directory / "b0") + "\0junk"
    (directory / "b0").write_bytes(block_file(_noise(2 * CHUNK, 3), make_plan()))
    plan = make_plan()
    span = _noise(2 * CHUNK).data
    if call == "write_new":
        segs = [(0, memoryview(b"abc"))]
        return lambda: _closed(fio.write_new(str(directory / "c") + "\0junk", NEW, 0o600, segs, 3))
    if call == "read_regular":
        into = [(0, memoryview(bytearray(plan.file_nbytes)))]
        return lambda: list(fio.read_regular(nul, os.O_RDONLY, into, plan.file_nbytes))
    if call == "exists_many":
        return lambda: fio.exists_many([nul])
    if call.startswith("publish"):
        tmp, final = str(directory / ".c.tmp-x"), str(directory / "c")
        if call == "publish tmp":
            tmp += "\0junk"
        else:
            final += "\0junk"
        blocks = [(tmp, final, _header().data, span)]
        return lambda: fio.publish_pieces(blocks, NEW, 0o600, plan)
    reads = [(nul, np.zeros(HEADER, np.uint8).data, np.zeros(2 * CHUNK, np.uint8).data)]
    return lambda: fio.read_pieces(reads, HEADER, plan, 0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("call", NUL_CALLS)
def test_a_nul_in_a_path_is_refused(impl: str, call: str, tmp_path: Path) -> None:
    """A NUL in any path of any call is ValueError on both builds, and nothing is created
    at the name cut at the NUL (the old native calls refuse it already; the reference's
    piece batches raise RuntimeError)."""
    fio = _fio(impl)
    outcome = run_isolated(_nul_call(fio, call, tmp_path))
    expect_raised(outcome, ValueError)
    assert _entries(tmp_path) == ["b0"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "op", ["write_new", "read_regular", "write_new_hashed", "read_regular_hashed"]
)
def test_numpy_segment_offsets_are_ints(impl: str, op: str, tmp_path: Path) -> None:
    """Segment offsets given as numpy int64 work as ints on both builds: the same file
    written, the same bytes read (formerly the native calls raise TypeError)."""
    fio = _fio(impl)
    data = _noise(2 * CHUNK)
    path = tmp_path / "file"
    sums = np.zeros(2, dtype=np.uint64)
    hashing = Hashing(0, 2, XXH3_64, CHUNK, 2 * CHUNK, sums)
    offsets = [np.int64(0), np.int64(CHUNK)]
    if op.startswith("write"):
        segments: list[Any] = [
            (o, data[i * CHUNK : (i + 1) * CHUNK].data) for i, o in enumerate(offsets)
        ]

        def write() -> object:
            if op == "write_new":
                return _closed(fio.write_new(str(path), NEW, 0o600, segments, data.size))
            fd = fio.write_new_hashed(str(path), NEW, 0o600, segments, data.size, hashing)
            return [_closed(fd), sums.tolist()]

        got = expect_ok(run_isolated(write))
        assert path.read_bytes() == data.tobytes()
        if op == "write_new_hashed":
            want = [xxhash.xxh3_64_intdigest(c.tobytes()) for c in data.reshape(2, CHUNK)]
            assert got == ["fd", want]
        return
    path.write_bytes(data.tobytes())

    def read() -> bool:
        out = np.zeros(data.size, np.uint8)
        into: list[Any] = [
            (o, out[i * CHUNK : (i + 1) * CHUNK].data) for i, o in enumerate(offsets)
        ]
        if op == "read_regular":
            fio.read_regular(str(path), os.O_RDONLY, into, data.size)
        else:
            fio.read_regular_hashed(str(path), os.O_RDONLY, into, data.size, hashing)
        return bool(np.array_equal(out, data))

    assert expect_ok(run_isolated(read)) is True


def _open_group(root: Path, impl: str) -> tuple[KVStore, Any]:
    """A store on ``root`` with ``impl``'s FileIO (opened in the child: a store's I/O
    threads do not survive a fork) and group 0 of the small identity (dense, 6 chunks)."""
    config = StoreConfig(root=root).replace(durability="none", io_threads=2)
    store = KVStore(config, fio=NativeFileIO() if impl == "native" else Reference())
    return store, store.namespace(make_small_identity()).group(0)


@pytest.mark.parametrize("impl", IMPLS)
def test_read_blocks_with_numpy_chunk_ids_is_a_hit(impl: str, tmp_path: Path) -> None:
    """Through the public API: a block written whole, then read back as chunks given as
    numpy integers (``list(np.arange(2))``), is a HIT with those chunks' bytes on both
    builds (formerly the native build reports a miss)."""
    if impl == "native":
        _require_native()
    root = tmp_path / "store"

    def scenario() -> dict[str, Any]:
        store, group = _open_group(root, impl)
        try:
            layout = group.layout
            data = block_bytes(layout, 1)
            h = block_hash(1, "numpy-chunks")
            (written,) = group.write_blocks([BlockWrite(h, data)])
            out = np.zeros(2 * layout.chunk_nbytes, dtype=np.uint8)
            (got,) = group.read_blocks([BlockRead(h, out, chunks=list(np.arange(2)))])
            return {
                "written": written.status.name,
                "read": got.status.name,
                "error": got.error,
                "bytes": bool(np.array_equal(out, data[: 2 * layout.chunk_nbytes])),
            }
        finally:
            store.close()

    assert expect_ok(run_isolated(scenario)) == {
        "written": WriteStatus.WRITTEN.name,
        "read": ReadStatus.HIT.name,
        "error": "",
        "bytes": True,
    }


@pytest.mark.parametrize("impl", IMPLS)
def test_a_zero_length_range_write_is_a_no_op(impl: str, tmp_path: Path) -> None:
    """Through the public API: a RangeWrite holding a zero-length range (alone in its chunk,
    so no neighbour absorbs it) succeeds and writes nothing; the block, completed and
    committed, reads back whole (formerly: a misleading ENOSPC on both builds)."""
    if impl == "native":
        _require_native()
    root = tmp_path / "store"

    def scenario() -> dict[str, Any]:
        store, group = _open_group(root, impl)
        try:
            layout = group.layout
            size = layout.chunk_nbytes
            data = block_bytes(layout, 2)
            h = block_hash(2, "empty-range")
            (pending,) = group.begin_blocks([h])
            ranges = [(0, data[: size // 2]), (size // 2, data[size // 2 : size]),
                      (size + 100, data[size + 100 : size + 100])]  # fmt: skip
            wrote = group.write_ranges([RangeWrite(pending, ranges)])
            rest = list(range(1, layout.num_chunks))
            chunks = group.write_chunks([ChunkWrite(pending, rest, data[size:])])
            (committed,) = group.commit_blocks([pending], checksum_chunks=[[0]])
            out = np.zeros_like(data)
            (got,) = group.read_blocks([BlockRead(h, out)])
            return {
                "ranges": [None if e is None else repr(e) for e in wrote],
                "chunks": [None if e is None else repr(e) for e in chunks],
                "commit": committed.status.name,
                "read": got.status.name,
                "bytes": bool(np.array_equal(out, data)),
            }
        finally:
            store.close()

    assert expect_ok(run_isolated(scenario)) == {
        "ranges": [None],
        "chunks": [None],
        "commit": WriteStatus.WRITTEN.name,
        "read": ReadStatus.HIT.name,
        "bytes": True,
    }

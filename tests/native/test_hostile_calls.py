"""Hostile arguments to the native file protocol (kvstore/_fileproto.c, kvstore/_xxh3batch.c)
and to FileIO's Python reference of the same calls.

Every entry point validates every argument before it touches memory or the file system: a bad
argument is ValueError (bad geometry, offsets, lengths, alignment; pieces outside their span,
overlapping or not in the checksum order ``slot_of`` says), OverflowError (an argument or a
derived size past ``sys.maxsize``) or TypeError; never a signal, never a ``-errno`` status
for a caller's mistake, never a file created for a refused call. The plain ``FileIO()`` (the
extension) and a subclass (:class:`Reference`, the Python reference) give the same result
for the same call. Sequences are snapshotted (a path's ``__fspath__`` or an offset's
``__index__`` that mutates the list being walked changes nothing), numpy integers are ints,
an empty segment or range is a no-op, a NUL in any path is ValueError, and uint64/int64
buffers must be 8-byte aligned.

Each hostile call runs in a forked child (:func:`~tests.native.isolated.run_isolated`), so a
crash is one failed test, not a dead runner; files are checked in the parent afterwards. The
native half of each test is skipped where the extensions are not bound.
"""

from __future__ import annotations

import errno
import os
import re
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
from kvstore.io.fileproto import native_fileproto
from kvstore.io.types import ALREADY_THERE, PUBLISHED, VERIFIED, Hashing, PiecePlan
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
from tests.native.isolated import Outcome, assert_clean, run_isolated

NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL
CHUNK = 4096  # chunk and (by default) piece size of the piece batches
HEADER = 4096  # header bytes of a piece-batch block file
SLOTS = 64  # where the checksum slots start in that header
INDEX = bytes(range(1, 65))  # the index written after the pieces
IMPLS = ["native", "reference"]
OPS = ["publish", "read"]


class Reference(FileIO):
    """A FileIO subclass: every compound call runs FileIO's Python reference."""


def _require_native() -> None:
    """Skip unless both extensions are bound (the native half of a test)."""
    if native_fileproto() is None or native_xxh3_capsule() is None:
        pytest.skip("the native file protocol or the native xxh3 batch is not bound")


def _fio(impl: str) -> FileIO:
    """The FileIO of ``impl``: the plain one (native; skips where unbound) or the reference."""
    if impl == "native":
        _require_native()
        return FileIO()
    return Reference()


def _native_module() -> Any:
    """The bound kvstore._fileproto module itself (skips where unbound)."""
    _require_native()
    return native_fileproto()


def expect_raised(outcome: Outcome, exc: type[BaseException], word: str | None = None) -> None:
    """``outcome`` is a clean raise of ``exc`` (or a subclass) whose words match ``word``
    (a regular expression, case-insensitive), when given."""
    assert_clean(outcome)
    assert outcome.kind == "raised", f"expected {exc.__name__}, the call {outcome.describe()}"
    assert exc.__name__ in outcome.mro, (
        f"expected {exc.__name__}, the call {outcome.describe()}\n{outcome.detail}"
    )
    if word is not None:
        assert re.search(word, outcome.message or "", re.IGNORECASE), (
            f"expected {exc.__name__} words to name {word!r}, got {outcome.message!r}"
        )


def expect_ok(outcome: Outcome) -> Any:
    """``outcome`` is a clean return; its value."""
    assert_clean(outcome)
    assert outcome.kind == "ok", (
        f"expected a return, the call {outcome.describe()}\n{outcome.detail}"
    )
    return outcome.value


def _noise(n: int, seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _misaligned(dtype: type[np.generic], count: int) -> np.ndarray:
    """``count`` zeroed items of an 8-byte ``dtype`` one byte past an aligned address."""
    raw = np.zeros(8 * count + 16, dtype=np.uint8)
    base = (-raw.ctypes.data) % 8  # the first 8-byte aligned byte
    view = raw[base + 1 : base + 1 + 8 * count].view(dtype)
    assert not view.flags.aligned
    return view


def _closed(fd: int) -> str:
    """What a call that returned a descriptor reports from the child (closed there)."""
    os.close(fd)
    return "fd"


def _entries(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


# -- piece batches: geometry and files ------------------------------------------------------


def make_plan(npieces: int = 2, **changes: Any) -> PiecePlan:
    """The plan of blocks of ``npieces`` one-chunk pieces in span order (identity slots), a
    ``HEADER``-byte header with slots at ``SLOTS`` and ``INDEX`` after the pieces;
    ``changes`` replace fields."""
    span = npieces * CHUNK
    plan = PiecePlan(
        file_nbytes=HEADER + span + len(INDEX),
        piece_nbytes=CHUNK,
        starts=np.arange(npieces, dtype=np.int64) * CHUNK,
        slot_of=np.arange(npieces, dtype=np.int64),
        chunk_nbytes=CHUNK,
        slots_offset=SLOTS,
        index=memoryview(INDEX),
        index_offset=HEADER + span,
        alignment=4096,
    )
    return replace(plan, **changes)


def _header() -> np.ndarray:
    """A header whose fixed part (before the slots) is a pattern and whose slots are 0."""
    header = np.zeros(HEADER, dtype=np.uint8)
    header[:SLOTS] = np.arange(1, SLOTS + 1, dtype=np.uint8)
    return header


def block_file(span: np.ndarray, plan: PiecePlan) -> bytes:
    """The file a valid ``plan`` publishes for ``span``: header (pattern, then each block
    chunk's xxh3 little-endian in its slot), the pieces back to back, the index."""
    data = b"".join(
        span[int(s) : int(s) + plan.piece_nbytes].tobytes() for s in plan.starts.tolist()
    )
    header = bytearray(_header().tobytes())
    for j in range(len(data) // plan.chunk_nbytes):
        chunk = data[j * plan.chunk_nbytes : (j + 1) * plan.chunk_nbytes]
        at = plan.slots_offset + 8 * j
        header[at : at + 8] = xxhash.xxh3_64_intdigest(chunk).to_bytes(8, "little")
    out = bytearray(plan.file_nbytes)
    out[: len(header)] = header
    out[len(header) : len(header) + len(data)] = data
    out[plan.index_offset : plan.index_offset + len(INDEX)] = INDEX
    return bytes(out)


def _publish_blocks(directory: Path, span_nbytes: int, count: int = 1) -> list[Any]:
    return [
        (
            str(directory / f".b{i}.tmp-x"),
            str(directory / f"b{i}"),
            _header().data,
            _noise(span_nbytes, i).data,
        )
        for i in range(count)
    ]


def hostile_pieces(
    impl: str, op: str, tmp_path: Path, plan: PiecePlan, span_nbytes: int | None = None
) -> tuple[Outcome, list[str]]:
    """``op`` (publish or read) of one block under ``plan`` through ``impl``, isolated: its
    outcome and the names the call left in the block directory (besides, for a read, the
    valid block file it was given to read)."""
    fio = _fio(impl)
    directory = tmp_path / "blocks"
    directory.mkdir(parents=True)
    nbytes = int(plan.starts.size) * plan.piece_nbytes if span_nbytes is None else span_nbytes
    nbytes = max(nbytes, 0)  # (negative pieces: any span, the plan is refused)
    if op == "publish":
        blocks = _publish_blocks(directory, nbytes)
        outcome = run_isolated(lambda: fio.publish_pieces(blocks, NEW, 0o600, plan))
        return outcome, _entries(directory)
    default = make_plan()
    path = directory / "b0"
    if plan.file_nbytes == default.file_nbytes:
        path.write_bytes(block_file(_noise(2 * CHUNK, 3), default))
    else:
        path.write_bytes(bytes(plan.file_nbytes))
    reads = [(str(path), np.zeros(HEADER, np.uint8).data, np.zeros(nbytes, np.uint8).data)]
    outcome = run_isolated(lambda: fio.read_pieces(reads, HEADER, plan, 0))
    return outcome, [n for n in _entries(directory) if n != "b0"]


# -- the piece batches' statuses: the reference is the native call's twin --------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_piece_batches_give_the_native_statuses_and_files(impl: str, tmp_path: Path) -> None:
    """Publish: a new block is PUBLISHED with exactly the expected file (pieces permuted,
    checksums in their slots), a taken name ALREADY_THERE, a name held by a directory
    -EEXIST, a missing directory -ENOENT, temporary files never left. Read: a valid block
    VERIFIED with the span filled, a flipped byte, a wrong size, a directory and a FIFO
    -EBADMSG, a missing file -ENOENT. The same for the native call and the reference
    (today the reference raises RuntimeError)."""
    fio = _fio(impl)
    plan = make_plan(starts=_i64(CHUNK, 0), slot_of=_i64(1, 0))  # the span's chunks swapped
    d = tmp_path / "blocks"
    d.mkdir()
    (d / "b1").write_bytes(b"taken")
    (d / "b2").mkdir()
    spans = [_noise(2 * CHUNK, i) for i in range(4)]
    names = [d / "b0", d / "b1", d / "b2", tmp_path / "gone" / "b3"]
    blocks = [
        (str(n.parent / f".{n.name}.tmp-x"), str(n), _header().data, s.data)
        for n, s in zip(names, spans, strict=True)
    ]
    got = expect_ok(run_isolated(lambda: fio.publish_pieces(blocks, NEW, 0o600, plan)))
    assert got == [PUBLISHED, ALREADY_THERE, -errno.EEXIST, -errno.ENOENT]
    assert (d / "b0").read_bytes() == block_file(spans[0], plan)
    assert (d / "b1").read_bytes() == b"taken"
    assert _entries(d) == ["b0", "b1", "b2"]
    again = blocks[:1]
    assert expect_ok(run_isolated(lambda: fio.publish_pieces(again, NEW, 0o600, plan))) == [
        ALREADY_THERE
    ]

    good = block_file(spans[0], plan)
    corrupt = bytearray(good)
    corrupt[HEADER + 10] ^= 0x5A
    (d / "corrupt").write_bytes(bytes(corrupt))
    (d / "short").write_bytes(good[:-1])
    os.mkfifo(d / "fifo")
    paths = [d / "b0", d / "corrupt", d / "short", d / "b2", d / "fifo", d / "missing"]

    def read() -> dict[str, Any]:
        targets = [(np.zeros(HEADER, np.uint8), np.zeros(2 * CHUNK, np.uint8)) for _ in paths]
        reads = [(str(p), h.data, s.data) for p, (h, s) in zip(paths, targets, strict=True)]
        statuses = fio.read_pieces(reads, HEADER, plan, 0)
        header, span = targets[0]
        return {
            "statuses": statuses,
            "span": bool(np.array_equal(span, spans[0])),
            "header": header.tobytes() == good[:HEADER],
        }

    bad = -errno.EBADMSG
    assert expect_ok(run_isolated(read)) == {
        "statuses": [VERIFIED, bad, bad, bad, bad, -errno.ENOENT],
        "span": True,
        "header": True,
    }


# -- 1. piece starts outside the span ---------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("start", [2 * CHUNK, 2**40, 2**62], ids=["just past", "2**40", "2**62"])
def test_a_piece_start_past_the_span_is_refused(
    impl: str, op: str, start: int, tmp_path: Path
) -> None:
    """A piece starting at or past the end of its span (on a chunk boundary, so only the
    range check can catch it) is ValueError before any byte moves: today the publish writes
    4,096 bytes of memory never given into the block file and the read writes 4,096 bytes
    past the span (far-out starts: a -EFAULT status instead of an exception)."""
    outcome, left = hostile_pieces(impl, op, tmp_path, make_plan(starts=_i64(0, start)))
    expect_raised(outcome, ValueError, r"start|span")
    assert left == []


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("starts", [(-CHUNK, 0), (1, CHUNK)], ids=["negative", "off a chunk"])
def test_a_negative_or_unaligned_piece_start_is_refused(
    impl: str, op: str, starts: tuple[int, int], tmp_path: Path
) -> None:
    """A negative start, or one off a chunk boundary, is ValueError (today's native code
    already refuses both; the reference must too)."""
    outcome, left = hostile_pieces(impl, op, tmp_path, make_plan(starts=_i64(*starts)))
    expect_raised(outcome, ValueError, r"start|chunk")
    assert left == []


# -- 2. pieces that overlap, or do not tile the checksum order ---------------------------------


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("impl", IMPLS)
def test_overlapping_pieces_are_refused(impl: str, op: str, tmp_path: Path) -> None:
    """Two pieces at the same start (in the span, on chunk boundaries, with a valid
    permutation as slot_of) are ValueError: today the publish stores checksums that do not
    match the block's chunks (one of them is another chunk's copy)."""
    plan = make_plan(starts=_i64(0, 0))
    outcome, left = hostile_pieces(impl, op, tmp_path, plan)
    expect_raised(outcome, ValueError, r"overlap|start|tile")
    assert left == []


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("impl", IMPLS)
def test_a_slot_order_the_starts_do_not_imply_is_refused(
    impl: str, op: str, tmp_path: Path
) -> None:
    """Pieces that tile the span in swapped order with the identity as slot_of (a
    permutation, but not the one the starts imply) are ValueError naming slot_of: today the
    publish stores each chunk's checksum in the other chunk's slot, and the read of a valid
    block reports it corrupt."""
    plan = make_plan(starts=_i64(CHUNK, 0), slot_of=_i64(0, 1))
    outcome, left = hostile_pieces(impl, op, tmp_path, plan)
    expect_raised(outcome, ValueError, "slot_of")
    assert left == []


# -- 3. checksum slots outside the header ------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("slots_offset", [-CHUNK, -8, HEADER - 8], ids=["-4096", "-8", "overrun"])
def test_slots_outside_the_header_are_refused(
    impl: str, op: str, slots_offset: int, tmp_path: Path
) -> None:
    """A negative slots_offset is ValueError naming it: today -4096 writes checksums before
    the header (read: reads before it, -EBADMSG). Slots running past the header's end
    (``overrun``) are refused today already."""
    outcome, left = hostile_pieces(impl, op, tmp_path, make_plan(slots_offset=slots_offset))
    expect_raised(outcome, ValueError, r"slot")
    assert left == []


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("impl", IMPLS)
def test_a_slots_offset_near_maxsize_is_refused(impl: str, op: str, tmp_path: Path) -> None:
    """slots_offset = 2**63 - 4 (the slots' end wraps past sys.maxsize) is refused cleanly,
    ValueError or OverflowError (the contract allows either reading), naming the slots:
    today it segfaults."""
    outcome, left = hostile_pieces(impl, op, tmp_path, make_plan(slots_offset=2**63 - 4))
    assert_clean(outcome)
    assert outcome.kind == "raised", outcome.describe()
    assert {"ValueError", "OverflowError"} & set(outcome.mro), outcome.describe()
    assert left == []


@pytest.mark.parametrize("op", OPS)
def test_a_slots_offset_near_maxsize_is_the_same_error_natively(op: str, tmp_path: Path) -> None:
    """Native and reference refuse slots_offset = 2**63 - 4 with the same exception type."""
    _require_native()
    types = []
    for impl in IMPLS:
        outcome, _ = hostile_pieces(impl, op, tmp_path / impl, make_plan(slots_offset=2**63 - 4))
        assert_clean(outcome)
        types.append(outcome.type)
    assert types[0] == types[1], types


# -- 4. sizes whose products wrap ------------------------------------------------------------


HUGE = 2**62
HUGE_STARTS = {"span of 2**63": (0, HUGE), "span wraps to 0": (0, HUGE, 0, HUGE)}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("variant", list(HUGE_STARTS))
def test_pieces_whose_span_overflows_are_refused(
    impl: str, op: str, variant: str, tmp_path: Path
) -> None:
    """Pieces (and chunks) of 2**62 bytes: npieces * piece_nbytes is past sys.maxsize, so
    OverflowError before anything else is checked or touched (the span, the index offset and
    the header are given as today's wrapped arithmetic expects them: the span 0 bytes). Today
    the publish segfaults inside XXH3 and the read returns -EFAULT."""
    starts = HUGE_STARTS[variant]
    plan = make_plan(
        piece_nbytes=HUGE,
        chunk_nbytes=HUGE,
        starts=_i64(*starts),
        slot_of=np.arange(len(starts), dtype=np.int64),
        index_offset=HEADER,
        file_nbytes=HEADER + len(INDEX),
    )
    outcome, left = hostile_pieces(impl, op, tmp_path, plan, span_nbytes=0)
    expect_raised(outcome, OverflowError)
    assert left == []


# -- the rest of the geometry: each bad argument alone -----------------------------------------


BAD_GEOMETRY: dict[str, dict[str, Any]] = {
    "no pieces": {"starts": _i64(), "slot_of": _i64()},
    "pieces of 0 bytes": {"piece_nbytes": 0},
    "negative pieces": {"piece_nbytes": -CHUNK},
    "chunks not dividing pieces": {"chunk_nbytes": 3000},
    "chunks of 0 bytes": {"chunk_nbytes": 0},
    "alignment 0": {"alignment": 0},
    "index past the file": {"file_nbytes": HEADER + 2 * CHUNK + len(INDEX) - 1},
    "index before the pieces end": {"index_offset": HEADER + 2 * CHUNK - 8},
}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(BAD_GEOMETRY))
def test_bad_piece_geometry_is_refused(impl: str, op: str, case: str, tmp_path: Path) -> None:
    """Each bad size of a plan alone (no pieces, empty or negative pieces, chunks that do
    not divide them, alignment 0, an index past the file's end or over the pieces) is
    ValueError before any file is created. Today's native calls refuse these already (the
    read leaves the index to its caller, so the index cases are for publish only); the
    reference must too."""
    if op == "read" and case.startswith("index"):
        pytest.skip("read_pieces takes no index")
    outcome, left = hostile_pieces(impl, op, tmp_path, make_plan(**BAD_GEOMETRY[case]))
    expect_raised(outcome, ValueError)
    assert left == []


WRONG_TYPES = ["block as a list", "header as a str", "starts as a list"]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", WRONG_TYPES)
def test_wrong_types_in_piece_batches_are_type_errors(
    impl: str, op: str, case: str, tmp_path: Path
) -> None:
    """A block given as a list instead of a tuple, a header that is no buffer, starts given
    as a Python list instead of an int64 buffer: TypeError on both builds, no file."""
    fio = _fio(impl)
    d = tmp_path / "blocks"
    d.mkdir()
    plan = make_plan()
    if case == "starts as a list":
        plan = replace(plan, starts=[0, CHUNK])  # type: ignore[arg-type]
    span = _noise(2 * CHUNK).data
    header: Any = "header" if case == "header as a str" else _header().data
    if op == "publish":
        block: Any = (str(d / ".b.tmp-x"), str(d / "b"), header, span)
        blocks: list[Any] = [list(block) if case == "block as a list" else block]
        outcome = run_isolated(lambda: fio.publish_pieces(blocks, NEW, 0o600, plan))
    else:
        (d / "b").write_bytes(block_file(_noise(2 * CHUNK, 3), make_plan()))
        read: Any = (str(d / "b"), header, np.zeros(2 * CHUNK, np.uint8).data)
        reads: list[Any] = [list(read) if case == "block as a list" else read]
        outcome = run_isolated(lambda: fio.read_pieces(reads, HEADER, plan, 0))
    expect_raised(outcome, TypeError)
    assert _entries(d) == ([] if op == "publish" else ["b"])


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
    end) past sys.maxsize (today the reference opens the file first and fails later, with
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
    (ValueError): the same type on both builds (today the reference raises ValueError and
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


class ClearingPath:
    """A path whose ``__fspath__`` empties ``victim`` (the list the call is walking)."""

    def __init__(self, path: Path, victim: list[Any]) -> None:
        self.path = str(path)
        self.victim = victim

    def __fspath__(self) -> str:
        self.victim.clear()
        return self.path


class ClearingIndex:
    """An offset whose ``__index__`` empties ``victim`` (the segment list being walked)."""

    def __init__(self, value: int, victim: list[Any]) -> None:
        self.value = value
        self.victim = victim

    def __index__(self) -> int:
        self.victim.clear()
        return self.value


def test_native_exists_many_snapshots_its_paths(tmp_path: Path) -> None:
    """kvstore._fileproto.exists_many([evil, file]) where evil's __fspath__ clears the list
    probes both names as they were: [0, 1] (today: a use-after-free, SIGSEGV)."""
    native = _native_module()
    (tmp_path / "there").write_bytes(b"x")
    paths: list[Any] = []
    paths.extend([ClearingPath(tmp_path / "missing", paths), str(tmp_path / "there")])
    assert expect_ok(run_isolated(lambda: native.exists_many(paths))) == [0, 1]


@pytest.mark.parametrize("impl", IMPLS)
def test_fileio_exists_many_snapshots_its_paths(impl: str, tmp_path: Path) -> None:
    """FileIO.exists_many with the same evil list answers for both names: [False, True] (the
    reference today stops after the first; the native build crashes)."""
    fio = _fio(impl)
    (tmp_path / "there").write_bytes(b"x")
    paths: list[Any] = []
    paths.extend([ClearingPath(tmp_path / "missing", paths), str(tmp_path / "there")])
    assert expect_ok(run_isolated(lambda: fio.exists_many(paths))) == [False, True]


VIAS = ["module", "native", "reference"]


def _via_publish(via: str, blocks: list[Any], plan: PiecePlan) -> Callable[[], object]:
    """publish_pieces of ``blocks`` through the extension module itself, the plain FileIO or
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
    """read_pieces of ``blocks`` through the extension module, the plain FileIO or the
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
    both published ([1, 1]) with the expected files (today: a use-after-free, SIGSEGV)."""
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
    both VERIFIED ([1, 1]) with their spans filled (today: a use-after-free, SIGSEGV)."""
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
    writes both as they were (today: the native call reads freed memory; the reference
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
    file is created (today both builds accept it)."""
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
    """kvstore._xxh3batch.sums with ``out`` one byte off an 8-byte boundary is ValueError
    naming out (today it is accepted)."""
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
    is ValueError naming it, before any file is created (today the native call accepts it;
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
    and the same file (today the reference raises ENOSPC, "pwritev made no progress")."""
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
    nothing (today the reference renames to, or from, the name cut at the NUL)."""
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
    at the name cut at the NUL (today's native calls refuse it already; the reference's
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
    written, the same bytes read (today the native calls raise TypeError)."""
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
    store = KVStore(config, fio=FileIO() if impl == "native" else Reference())
    return store, store.namespace(make_small_identity()).group(0)


@pytest.mark.parametrize("impl", IMPLS)
def test_read_blocks_with_numpy_chunk_ids_is_a_hit(impl: str, tmp_path: Path) -> None:
    """Through the public API: a block written whole, then read back as chunks given as
    numpy integers (``list(np.arange(2))``), is a HIT with those chunks' bytes on both
    builds (today the native build reports a miss)."""
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
    committed, reads back whole (today: a misleading ENOSPC on both builds)."""
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

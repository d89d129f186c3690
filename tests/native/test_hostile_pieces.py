"""Hostile arguments to the native file protocol (kvstore/_native/fileproto*.c,
kvstore/_native/xxh3batch.c) and to FileIO's Python reference of the same calls; here the piece
batches (publish_pieces, read_pieces), the other calls in test_hostile_files.py.

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
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.io.types import ALREADY_THERE, PUBLISHED, VERIFIED
from tests.native.hostile import (
    CHUNK,
    HEADER,
    IMPLS,
    INDEX,
    NEW,
    OPS,
    _entries,
    _fio,
    _header,
    _i64,
    _noise,
    _require_native,
    block_file,
    expect_ok,
    expect_raised,
    hostile_pieces,
    make_plan,
)
from tests.native.isolated import assert_clean, run_isolated

# -- the piece batches' statuses: the reference is the native call's twin --------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_piece_batches_give_the_native_statuses_and_files(impl: str, tmp_path: Path) -> None:
    """Publish: a new block is PUBLISHED with exactly the expected file (pieces permuted,
    checksums in their slots), a taken name ALREADY_THERE, a name held by a directory
    -EEXIST, a missing directory -ENOENT, temporary files never left. Read: a valid block
    VERIFIED with the span filled, a flipped byte, a wrong size, a directory and a FIFO
    -EBADMSG, a missing file -ENOENT. The same for the native call and the reference
    (formerly the reference raises RuntimeError)."""
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
    range check can catch it) is ValueError before any byte moves: formerly the publish writes
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
    """A negative start, or one off a chunk boundary, is ValueError (the old native code
    already refuses both; the reference must too)."""
    outcome, left = hostile_pieces(impl, op, tmp_path, make_plan(starts=_i64(*starts)))
    expect_raised(outcome, ValueError, r"start|chunk")
    assert left == []


# -- 2. pieces that overlap, or do not tile the checksum order ---------------------------------


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("impl", IMPLS)
def test_overlapping_pieces_are_refused(impl: str, op: str, tmp_path: Path) -> None:
    """Two pieces at the same start (in the span, on chunk boundaries, with a valid
    permutation as slot_of) are ValueError: formerly the publish stores checksums that do not
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
    permutation, but not the one the starts imply) are ValueError naming slot_of: formerly the
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
    """A negative slots_offset is ValueError naming it: formerly -4096 writes checksums before
    the header (read: reads before it, -EBADMSG). Slots running past the header's end
    (``overrun``) are refused formerly already."""
    outcome, left = hostile_pieces(impl, op, tmp_path, make_plan(slots_offset=slots_offset))
    expect_raised(outcome, ValueError, r"slot")
    assert left == []


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("impl", IMPLS)
def test_a_slots_offset_near_maxsize_is_refused(impl: str, op: str, tmp_path: Path) -> None:
    """slots_offset = 2**63 - 4 (the slots' end wraps past sys.maxsize) is refused cleanly,
    ValueError or OverflowError (the contract allows either reading), naming the slots:
    formerly it segfaults."""
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
    the header are given as the old wrapped arithmetic expects them: the span 0 bytes). Formerly
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
    ValueError before any file is created. Formerly's native calls refuse these already (the
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

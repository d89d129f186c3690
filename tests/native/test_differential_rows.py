"""check_rows (kvstore/_native/fileproto_rows.c) against its Python reference
(kvstore/io/row_rules.py): the same bytes for every rows-and-rules input, the same exception type
for every bad argument, never a crash.

Three angles: real block files (every single-byte flip of a small raw block, one row each, and
the rules :func:`raw_block_rules` builds for dense, padded and MLA layouts); generated rows
under generated rules (rows built to meet them, then damaged or not); and hostile arguments
(wrong types, out-of-row rules, bad coordinates, short or odd buffers), each native call run in
a forked child so that a crash is a failed test.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvstore.admin.scan import open_root
from kvstore.checksum import crc32c, native_xxh3_capsule
from kvstore.identity import Identity
from kvstore.io.fileproto import native_fileproto
from kvstore.io.row_rules import RowRules, check_rows, reference_check_rows
from kvstore.store.batch_check import raw_block_rules
from kvstore.store.check import ShardSpec
from kvstore.store.types import BlockWrite, WriteStatus
from tests.helpers import (
    StoreFactory,
    block_bytes,
    block_hash,
    make_mla_identity,
    make_odd_identity,
    make_small_identity,
)
from tests.native.hostile import expect_ok, expect_raised
from tests.native.isolated import run_isolated
from tests.native.values import DIFF, WRONG_TYPES

pytestmark = pytest.mark.usefixtures("both_extensions_bound")


def _native(*args: object) -> bytes:
    native = native_fileproto()
    assert native is not None
    call: Any = native.check_rows
    return bytes(call(*args, native_xxh3_capsule()))


def _args(rows: object, count: int, rules: RowRules, hi: object, lo: object) -> tuple[Any, ...]:
    return rules.arguments(rows, count, hi, lo)


def _agree(args: tuple[Any, ...]) -> Any:
    """Both sides on ``args``: the native one in a forked child; the same bytes, or the same
    exception type. What they returned (or the exception's type name)."""
    native = run_isolated(lambda: list(_native(*args)))
    try:
        want: Any = list(reference_check_rows(*args))
    except Exception as exc:
        expect_raised(native, type(exc))
        return type(exc).__name__
    assert expect_ok(native) == want
    return want


# -- real block files ------------------------------------------------------------------------


def _block_rows(make_store: StoreFactory, root: Path, identity: Identity) -> tuple[Any, ...]:
    """One written raw block: (its file's bytes, the array's rules, its coordinates)."""
    group = make_store().namespace(identity).group(0)
    h = block_hash(0, "rows")
    assert group.write_blocks([BlockWrite(h, block_bytes(group.layout, 3))])[0].status is (
        WriteStatus.WRITTEN
    )
    path = Path(group.path_of(h))
    ns = open_root(root).namespaces[0]
    rules = raw_block_rules(ShardSpec(ns.groups[0].layout, ns.digest, 0, None))
    return path.read_bytes(), rules, int(path.parent.name), int(path.name)


@pytest.mark.parametrize(
    "identity",
    [make_small_identity, make_odd_identity, make_mla_identity],
    ids=lambda make: make.__name__,
)
def test_every_byte_flip_of_a_block_agrees(
    make_store: StoreFactory, root: Path, identity: Callable[[], Identity]
) -> None:
    """A good block is 1 on both sides; each of its bytes flipped (one row per byte, all in one
    call: every header and index byte, and at most ~4,000 bytes spread over the chunks)
    gives the same verdict on both sides, and every flip is caught."""
    raw, rules, hi, lo = _block_rows(make_store, root, identity())
    n = len(raw)
    assert check_rows(memoryview(raw), 1, rules, [hi], [lo]) == b"\x01"
    first = rules.slots[2]  # where the chunks start: the header is before
    index_at = max(offset for offset, _ in rules.equal)  # the sharding index, at the end
    step = max(1, (index_at - first) // 4000)
    at = np.array(sorted({*range(first), *range(first, index_at, step), *range(index_at, n)}))
    table = np.frombuffer(raw, dtype=np.uint8).reshape(1, n).repeat(len(at), axis=0)
    table[np.arange(len(at)), at] ^= 0x5A
    args = _args(table.reshape(-1).data, len(at), rules, [hi] * len(at), [lo] * len(at))
    native = _native(*args)
    assert native == reference_check_rows(*args)
    # Every byte of a raw block is under a rule: the fixed header under the crc (and its
    # fields), the reserved word, slot tail and padding zero, the slots and chunks under the
    # checksums, the index equal to the array's.
    assert native == bytes(len(at)), [int(at[i]) for i, ok in enumerate(native) if ok]


def test_wrong_coordinates_are_no_match(make_store: StoreFactory, root: Path) -> None:
    raw, rules, hi, lo = _block_rows(make_store, root, make_small_identity())
    rows = memoryview(raw * 3)
    his, los = [hi, (hi + 1) % 256, hi], [lo, lo, lo ^ 1]
    assert check_rows(rows, 3, rules, his, los) == b"\x01\x00\x00"
    assert reference_check_rows(*_args(rows, 3, rules, his, los)) == b"\x01\x00\x00"


# -- generated rows under generated rules ----------------------------------------------------


@st.composite
def rule_cases(draw: st.DrawFn) -> dict[str, Any]:
    size = draw(st.integers(16, 160))
    count = draw(st.integers(0, 5))

    def run(max_len: int) -> tuple[int, int]:
        offset = draw(st.integers(0, size - 1))
        return offset, draw(st.integers(0, min(max_len, size - offset)))

    equal = []
    for _ in range(draw(st.integers(0, 3))):
        offset, length = run(12)
        equal.append((offset, bytes(draw(st.binary(min_size=length, max_size=length)))))
    zero = [run(10) for _ in range(draw(st.integers(0, 3)))]
    ranges = []
    for _ in range(draw(st.integers(0, 3))):
        low = draw(st.integers(0, 255))
        ranges.append((draw(st.integers(0, size - 1)), low, draw(st.integers(low, 255))))
    key = (draw(st.integers(0, size - 1)), draw(st.integers(0, size - 8)), draw(st.integers(1, 63)))
    chunk = draw(st.integers(1, 16))
    stride = chunk + draw(st.integers(0, 4))
    chunks = draw(st.integers(0, 4))
    span = (chunks - 1) * stride + chunk if chunks else 0
    slots = (
        draw(st.integers(0, max(0, size - 8 * chunks))) if 8 * chunks <= size else 0,
        chunks if 8 * chunks <= size and span <= size else 0,
        draw(st.integers(0, max(0, size - span))) if span <= size else 0,
        stride,
        chunk,
    )
    rules = RowRules(
        size, tuple(equal), tuple(zero), tuple(ranges), key, slots, draw(st.integers(0, size - 4))
    )
    rows = [_meeting(draw, rules) for _ in range(count)]
    return {
        "rules": rules,
        "count": count,
        "rows": rows,
        "hi": [draw(st.integers(0, 255)) for _ in range(count)],
        "lo": [draw(st.integers(0, (1 << (64 - key[2])) - 1)) for _ in range(count)],
        "keyed": draw(st.booleans()),
    }


def _meeting(draw: st.DrawFn, rules: RowRules) -> bytearray:
    """A row built to meet ``rules`` where they do not contradict each other (a later rule
    may overwrite an earlier one's bytes: then the row is simply bad), maybe damaged."""
    row = bytearray(draw(st.binary(min_size=rules.row_nbytes, max_size=rules.row_nbytes)))
    for offset, data in rules.equal:
        row[offset : offset + len(data)] = data
    for offset, length in rules.zero:
        row[offset : offset + length] = bytes(length)
    for offset, low, high in rules.ranges:
        row[offset] = draw(st.integers(low, high))
    slots_offset, chunks, first, stride, chunk = rules.slots
    for c in range(chunks):
        start = first + c * stride
        struct.pack_into(
            "<Q", row, slots_offset + 8 * c, xxhash.xxh3_64_intdigest(bytes(row[start:][:chunk]))
        )
    at = rules.crc_offset
    struct.pack_into("<I", row, at, crc32c(bytes(row[:at])))
    if draw(st.integers(0, 3)) == 0:
        row[draw(st.integers(0, len(row) - 1))] ^= 1 << draw(st.integers(0, 7))
    return row


@DIFF
@given(case=rule_cases())
def test_generated_rows_agree(case: dict[str, Any]) -> None:
    """Generated rules over rows built to meet them (or damaged): the same verdicts. With
    ``keyed``, each row's key is set to its coordinates first, so that rows can pass."""
    rules: RowRules = case["rules"]
    hi_offset, lo_offset, shift = rules.key
    rows = case["rows"]
    if case["keyed"]:
        for row, hi, lo in zip(rows, case["hi"], case["lo"], strict=True):
            low_bits = int.from_bytes(row[lo_offset : lo_offset + 8], "big") & ((1 << shift) - 1)
            row[lo_offset : lo_offset + 8] = ((lo << shift) | low_bits).to_bytes(8, "big")
            row[hi_offset] = hi
            at = rules.crc_offset
            struct.pack_into("<I", row, at, crc32c(bytes(row[:at])))
    flat = bytes(b"".join(rows))
    _agree(_args(flat, case["count"], rules, case["hi"], case["lo"]))


# -- hostile arguments -----------------------------------------------------------------------

GOOD = RowRules(64, ((0, b"ab"),), ((8, 4),), ((12, 1, 9),), (16, 17, 2), (32, 2, 40, 8, 8), 4)


def _good_args() -> list[Any]:
    return list(_args(bytes(128), 2, GOOD, [0, 1], [2, 3]))


# (argument index, bad value, the exception both sides raise)
HOSTILE: list[tuple[int, object, type[BaseException]]] = [
    (0, None, TypeError),  # rows: not a buffer
    (0, np.zeros((4, 64), np.uint8)[:, ::2], TypeError),  # not contiguous
    (0, bytes(127), ValueError),  # one byte short of two rows
    (1, -1, ValueError),
    (1, 2**62, OverflowError),  # rows x size past 2**63
    (1, 2**63, OverflowError),  # not a Py_ssize_t
    (1, "2", TypeError),
    (2, 0, ValueError),
    (2, 1.0, TypeError),
    (3, 5, TypeError),  # equal: not a sequence
    (3, [(0,)], TypeError),
    (3, [[0, b"a"]], TypeError),  # a list, not a tuple
    (3, [(0, 5)], TypeError),  # bytes that are not a buffer
    (3, [(0.5, b"a")], TypeError),
    (3, [(2**63, b"a")], OverflowError),
    (3, [(-1, b"a")], ValueError),
    (3, [(63, b"ab")], ValueError),  # past the row's end
    (4, [(0, 65)], ValueError),
    (4, [(0, -1)], ValueError),
    (4, [(1, 2, 3)], TypeError),
    (4, ["ab"], TypeError),
    (4, [(0, 2**64)], OverflowError),
    (5, [(64, 0, 1)], ValueError),
    (5, [(0, 5, 4)], ValueError),
    (5, [(0, 0, 256)], ValueError),
    (5, [(0, -1, 3)], ValueError),
    (6, (16, 57, 2), ValueError),  # the lo bytes past the row
    (6, (64, 17, 2), ValueError),
    (6, (16, 17, 0), ValueError),
    (6, (16, 17, 64), ValueError),
    (6, (16, 17), TypeError),
    (7, [0], ValueError),  # hash_hi: one value for two rows
    (7, [0, 256], ValueError),
    (7, [0, -1], ValueError),
    (7, [0, "1"], TypeError),
    (7, 3, TypeError),
    (8, [0, 2**62], ValueError),  # hash_lo: past 2**(64 - 2)
    (8, [0, 2**64], ValueError),
    (8, [0, None], TypeError),
    (9, (32, 2, 40, 8, 0), ValueError),  # no chunk bytes
    (9, (32, 2, 40, 4, 8), ValueError),  # a stride shorter than a chunk
    (9, (32, -1, 40, 8, 8), ValueError),
    (9, (60, 2, 40, 8, 8), ValueError),  # slots past the row
    (9, (32, 2, 50, 8, 8), ValueError),  # chunks past the row
    (9, (32, 2**61, 40, 8, 8), ValueError),  # slot bytes overflowing
    (9, (32, 3, 40, 2**62, 8), ValueError),  # a chunk span overflowing
    (9, (32, 2, 40, 8), TypeError),
    (10, 61, ValueError),  # the crc past the row
    (10, -1, ValueError),
    (10, None, TypeError),
]


@pytest.mark.parametrize(("index", "bad", "raised"), HOSTILE)
def test_hostile_arguments_raise_alike(
    index: int, bad: object, raised: type[BaseException]
) -> None:
    """Each bad argument: the same exception type on both sides, the native call in a child
    (a crash fails the test)."""
    args = _good_args()
    args[index] = bad
    assert _agree(tuple(args)) == raised.__name__


@pytest.mark.parametrize("wrong", WRONG_TYPES, ids=repr)
def test_wrong_scalar_types_raise_alike(wrong: object) -> None:
    for index in (1, 2, 10):
        args = _good_args()
        args[index] = wrong
        _agree(tuple(args))


def test_good_arguments_run_and_no_rows_is_empty() -> None:
    assert _agree(tuple(_good_args())) == [0, 0]
    args = _good_args()
    args[0], args[1], args[7], args[8] = b"", 0, [], []
    assert _agree(tuple(args)) == []

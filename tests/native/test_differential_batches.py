"""Differential tests (tests/native/differential.py) of the piece batches (publish_pieces,
read_pieces)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import example, given
from hypothesis import strategies as st

from kvstore.io.types import PiecePlan
from tests.native.differential import (
    CONTAINERS,
    MODES,
    TOUCH_TIMES,
    differential,
)
from tests.native.values import (
    ARRAY_FORMS,
    DIFF,
    NEW,
    O_DIRECT,
    Entry,
    Mem,
    PathArg,
    _fio,
    _noise,
    build_array,
    build_mem,
    entries,
    hostile_int,
    maybe_numpy,
    mem_kinds,
    mems,
    path_args,
    perturbed,
    resolve,
    scalar,
)

pytestmark = pytest.mark.usefixtures("both_extensions_bound")

# -- publish_pieces / read_pieces ------------------------------------------------------------


@dataclass(frozen=True)
class PlanCase:
    """A valid piece geometry (what block files and buffers are built from) and the plan
    the call is given (its fields perhaps hostile)."""

    chunk: int
    piece: int
    starts: tuple[int, ...]
    header: int
    slots_offset: int
    index: bytes
    file_nbytes: int
    plan: dict[str, Any]  # PiecePlan fields; starts/slot_of/index as (values or spec, form)

    @property
    def span(self) -> int:
        return len(self.starts) * self.piece


PLAN_FIELDS = (
    "starts",
    "starts_form",
    "slot_of",
    "slot_of_form",
    "piece_nbytes",
    "chunk_nbytes",
    "slots_offset",
    "index_offset",
    "file_nbytes",
    "alignment",
    "index",
)


def slot_order(starts: Sequence[int], piece: int, chunk: int) -> list[int]:
    """The slot_of that ``starts`` imply (kvstore/_native/fileproto_piece_args.c
    check_piece_places)."""
    piece_at = {start // piece: k for k, start in enumerate(starts)}
    per = piece // chunk
    return [piece_at[s // per] * per + s % per for s in range(len(starts) * per)]


@st.composite
def plan_cases(draw: st.DrawFn, hostile: frozenset[str]) -> PlanCase:
    """A valid plan (pieces of whole chunks permuted in their span, checksum slots in the
    header, the index after the pieces; sometimes 4 KiB-aligned for O_DIRECT), then the
    ``hostile`` fields perturbed: starts out of the span, overlapping, off a chunk or piece;
    slot_of permuted otherwise, too long or short; arrays of other types, misaligned,
    strided, big-endian; sizes and offsets off by a little or boundary values."""
    if draw(st.integers(0, 6)) == 0:
        chunk, per, slots_offset, header, alignment = 4096, 1, 64, 4096, 4096
        npieces = draw(st.integers(1, 2))
    else:
        chunk = draw(st.sampled_from((1, 3, 8, 16, 64)))
        per = draw(st.integers(1, 3))
        npieces = draw(st.integers(1, 4))
        slots_offset = draw(st.integers(0, 16))
        header = slots_offset + 8 * npieces * per + draw(st.integers(0, 16))
        alignment = draw(st.sampled_from((4096, 4096, 1, 8, 512)))
    piece = chunk * per
    span = npieces * piece
    starts = [k * piece for k in draw(st.permutations(range(npieces)))]
    slot_of = slot_order(starts, piece, chunk)
    index = _noise(draw(st.integers(0, 16)), 5).tobytes()
    index_offset = header + span
    file_nbytes = index_offset + len(index) + draw(st.sampled_from((0, 0, 0, 3)))
    given_starts = list(starts)
    if "starts" in hostile:
        k = draw(st.integers(0, npieces - 1))
        given_starts[k] = draw(
            st.sampled_from(
                (span, span + piece, 2**40, 2**62, -piece, starts[k] + 1, starts[0])
                + ((starts[k] + chunk,) if per > 1 else ())
            )
        )
    given_slots = list(slot_of)
    if "slot_of" in hostile:
        how = draw(st.sampled_from(("swap", "bump", "longer", "shorter", "identity")))
        if how == "swap" and len(given_slots) > 1:
            given_slots[0], given_slots[-1] = given_slots[-1], given_slots[0]
        elif how == "bump":
            given_slots[draw(st.integers(0, len(given_slots) - 1))] += 1
        elif how == "longer":
            given_slots.append(len(given_slots))
        elif how == "shorter":
            given_slots.pop()
        else:
            given_slots = list(range(len(given_slots)))
    index_kind = draw(mem_kinds(writable=False, hostile="index" in hostile))
    plan = {
        "file_nbytes": scalar(draw, file_nbytes, "file_nbytes" in hostile),
        "piece_nbytes": scalar(draw, piece, "piece_nbytes" in hostile),
        "starts": (
            given_starts,
            draw(st.sampled_from(ARRAY_FORMS)) if "starts_form" in hostile else "i64",
        ),
        "slot_of": (
            given_slots,
            draw(st.sampled_from(ARRAY_FORMS)) if "slot_of_form" in hostile else "i64",
        ),
        "chunk_nbytes": scalar(draw, chunk, "chunk_nbytes" in hostile),
        "slots_offset": scalar(draw, slots_offset, "slots_offset" in hostile),
        "index": Mem(index_kind, len(index), 5),
        "index_offset": scalar(draw, index_offset, "index_offset" in hostile),
        "alignment": scalar(draw, alignment, "alignment" in hostile),
    }
    return PlanCase(chunk, piece, tuple(starts), header, slots_offset, index, file_nbytes, plan)


def build_plan(case: PlanCase) -> tuple[PiecePlan, list[object | None]]:
    """The PiecePlan the call is given, and the backing memory of its arrays and index."""
    p = dict(case.plan)
    starts, starts_backing = build_array(*p["starts"])
    slot_of, slot_backing = build_array(*p["slot_of"])
    index, index_backing = build_mem(p["index"])
    p.update(starts=starts, slot_of=slot_of, index=index)
    return PiecePlan(**p), [starts_backing, slot_backing, index_backing]


@dataclass(frozen=True)
class BlockCase:
    """One block of a batch: its names (publish: tmp and final; read: the path), its header
    and span buffers, its tuple's shape, and what its names hold before the call."""

    names: tuple[PathArg, ...]
    header: Mem
    span: Mem
    shape: str
    entries: tuple[tuple[str, Entry], ...]


BLOCK_SHAPES = ("list", "short", "long", "none")


def _buffer_mem(draw: st.DrawFn, nbytes: int, writable: bool, aligned: bool, hostile: bool) -> Mem:
    """A header or span buffer of ``nbytes`` (4 KiB-aligned where the geometry is); hostile:
    of a refused kind, or a byte or eight off."""
    mem = Mem("aligned" if aligned else "ndarray", nbytes, draw(st.integers(0, 255)))
    if not hostile:
        return mem
    if draw(st.booleans()):
        return draw(mems(nbytes, writable, hostile=True))
    return Mem(mem.kind, max(nbytes + draw(st.sampled_from((-1, 1, 8))), 0), mem.seed)


def _block_file(case: PlanCase, span: np.ndarray, fixed_seed: int) -> bytes:
    """The file a valid publish of ``span`` under ``case``'s geometry writes: header (noise,
    then each block chunk's xxh3 little-endian in its slot), pieces in piece order, index,
    zeros to the file's size."""
    data = b"".join(span[s : s + case.piece].tobytes() for s in case.starts)
    header = bytearray(_noise(case.header, fixed_seed).tobytes())
    for j in range(len(data) // case.chunk):
        at = case.slots_offset + 8 * j
        digest = xxhash.xxh3_64_intdigest(data[j * case.chunk : (j + 1) * case.chunk])
        header[at : at + 8] = digest.to_bytes(8, "little")
    body = bytes(header) + data + case.index
    return body + bytes(case.file_nbytes - len(body))


@st.composite
def read_block_file(draw: st.DrawFn, case: PlanCase, k: int) -> Entry:
    """What block ``k``'s name holds for a read: a valid block file, one corrupt (a flipped
    byte in its header's fixed part, a slot, a piece or the index), short, long; a
    directory, a FIFO, a socket, a link, nothing."""
    good = _block_file(case, _noise(case.span, 40 + k), 50 + k)
    how = draw(
        st.sampled_from(("valid",) * 4 + ("flip", "flip", "short", "long", "other", "absent"))
    )
    if how == "valid":
        return ("data", good)
    if how == "flip":
        at = draw(st.integers(0, len(good) - 1)) if good else 0
        data = bytearray(good)
        if data:
            data[at] ^= 0x5A
        return ("data", bytes(data))
    if how == "short":
        return ("data", good[:-1])
    if how == "long":
        return ("data", good + b"\0")
    if how == "absent":
        return ("absent",)
    return draw(entries())


@st.composite
def block_cases(draw: st.DrawFn, case: PlanCase, reading: bool, hostile: bool) -> list[BlockCase]:
    """Up to three blocks; hostile: one of them broken (a name, a buffer or its tuple)."""
    aligned = case.chunk == 4096
    count = draw(st.integers(1 if hostile else 0, 3))
    broken = draw(st.integers(0, count - 1)) if hostile else -1
    blocks = []
    for k in range(count):
        name = f"b{k}"
        part = draw(st.sampled_from(("names", "header", "span", "shape"))) if k == broken else ""
        planted: list[tuple[str, Entry]] = []
        if reading:
            names: tuple[PathArg, ...] = (draw(path_args((name,), part == "names")),)
            planted.append((name, draw(read_block_file(case, k))))
        else:
            tmp = draw(path_args((f".{name}.tmp",), part == "names" and draw(st.booleans())))
            final = draw(path_args((name, name, name, f"gone/{name}"), part == "names"))
            names = (tmp, final)
            if draw(st.integers(0, 3)) == 0:  # the final name taken already
                planted.append((name, draw(entries())))
            if draw(st.integers(0, 9)) == 0:  # a stale temporary file
                planted.append((f".{name}.tmp", ("file", 5, k)))
        blocks.append(
            BlockCase(
                names=names,
                header=_buffer_mem(draw, case.header, True, aligned, part == "header"),
                span=_buffer_mem(draw, case.span, reading, aligned, part == "span"),
                shape=draw(st.sampled_from(BLOCK_SHAPES)) if part == "shape" else "tuple",
                entries=tuple(planted),
            )
        )
    return blocks


def build_blocks(
    blocks: Sequence[BlockCase], root: str, buffers: Sequence[tuple[object, object]]
) -> list[object]:
    """The batch's items below ``root``: each block's names and its (shared) buffers."""
    items: list[object] = []
    for block, (header, span) in zip(blocks, buffers, strict=True):
        fields = [*(resolve(p, root) for p in block.names), header, span]
        if block.shape == "tuple":
            items.append(tuple(fields))
        elif block.shape == "list":
            items.append(fields)
        elif block.shape == "short":
            items.append(tuple(fields[:-1]))
        elif block.shape == "long":
            items.append((*fields, None))
        else:
            items.append(None)
    return items


def _batch_layout(blocks: Sequence[BlockCase]) -> dict[str, Entry]:
    layout: dict[str, Entry] = {"sub": ("dir",), "linkdir": ("link", "sub"), "a": ("file", 9, 1)}
    layout.update(
        (name, entry) for block in blocks for name, entry in block.entries if entry[0] != "absent"
    )
    return layout


PUBLISH_FLAGS = (NEW, NEW, NEW, NEW | O_DIRECT, os.O_WRONLY | os.O_CREAT, os.O_RDWR | os.O_CREAT)


def simple_plan(**changes: object) -> PlanCase:
    """The plan of the explicit examples: one piece of one 8-byte chunk after an 8-byte
    header (its one slot), no index; ``changes`` replace fields of the plan given."""
    plan: dict[str, Any] = {
        "file_nbytes": 16,
        "piece_nbytes": 8,
        "starts": ([0], "i64"),
        "slot_of": ([0], "i64"),
        "chunk_nbytes": 8,
        "slots_offset": 0,
        "index": Mem("bytes", 0, 5),
        "index_offset": 16,
        "alignment": 4096,
    }
    plan.update(changes)
    return PlanCase(8, 8, (0,), 8, 0, b"", 16, plan)


def simple_block(reading: bool, entry: Entry | None = None) -> BlockCase:
    """Block ``b0`` of the explicit examples (``entry``: what its name holds)."""
    names = (PathArg("b0"),) if reading else (PathArg(".b0.tmp"), PathArg("b0"))
    planted = (("b0", entry),) if entry is not None else ()
    return BlockCase(names, Mem("ndarray", 8, 1), Mem("ndarray", 8, 2), "tuple", planted)


# Found by this test: numpy uint64 flags; the reference's ``flags & ~O_DIRECT`` is OverflowError.
NUMPY_FLAGS_PUBLISH = {
    "plan": simple_plan(),
    "blocks": [simple_block(False)],
    "container": "list",
    "flags": np.uint64(NEW),
    "mode": 0o600,
}
# Found by this test: an alignment given as a numpy int32 with O_DIRECT; the reference's
# ``address % alignment`` is OverflowError (numpy int32 arithmetic), the native call gives the
# block's status.
INT32_ALIGNMENT_PUBLISH = {
    "plan": simple_plan(alignment=np.int32(8)),
    "blocks": [simple_block(False)],
    "container": "list",
    "flags": NEW | O_DIRECT,
    "mode": 0o600,
}
# Found by this test: mode None is TypeError natively; the reference skips its mode checks
# (None stands for "no mode" there) and returns [] for an empty batch.
NO_MODE_PUBLISH = {
    "plan": simple_plan(),
    "blocks": [],
    "container": "list",
    "flags": NEW,
    "mode": None,
}


@st.composite
def publish_cases(draw: st.DrawFn) -> dict[str, Any]:
    hostile = perturbed(draw, (*PLAN_FIELDS, "flags", "mode", "blocks"), most=2)
    plan = draw(plan_cases(hostile))
    blocks = draw(block_cases(plan, reading=False, hostile="blocks" in hostile))
    flags = draw(st.sampled_from(PUBLISH_FLAGS))
    return {
        "plan": plan,
        "blocks": blocks,
        "container": draw(st.sampled_from(CONTAINERS)) if "blocks" in hostile else "list",
        "flags": draw(hostile_int()) if "flags" in hostile else draw(maybe_numpy(flags)),
        "mode": scalar(draw, draw(st.sampled_from(MODES)), "mode" in hostile),
    }


def _containerize(items: list[object], container: str) -> object:
    if container == "tuple":
        return tuple(items)
    if container == "generator":
        return (item for item in items)
    return items


def _block_buffers(
    blocks: Sequence[BlockCase],
) -> tuple[list[tuple[object, object]], list[object | None]]:
    buffers, memory = [], []
    for block in blocks:
        header, header_backing = build_mem(block.header)
        span, span_backing = build_mem(block.span)
        buffers.append((header, span))
        memory += [header_backing, span_backing]
    return buffers, memory


# Found by this test: index_offset a numpy int64 near 2**63 (a 3-byte index ending past it).
# The native call raises OverflowError; the reference's overflow check adds in numpy int64,
# wraps, and a later check raises ValueError.
WRAPPING_INDEX_PUBLISH = {
    **NUMPY_FLAGS_PUBLISH,
    "plan": simple_plan(index=Mem("bytes", 3, 5), index_offset=np.int64(2**63 - 2)),
    "flags": NEW,
}


@DIFF
@given(case=publish_cases())
@example(case=NUMPY_FLAGS_PUBLISH)
@example(case=WRAPPING_INDEX_PUBLISH)
@example(case=INT32_ALIGNMENT_PUBLISH)
@example(case=NO_MODE_PUBLISH)
def test_publish_pieces_matches_its_reference(case: dict[str, Any]) -> None:
    """FileIO().publish_pieces (native) and the reference agree: the same statuses
    (PUBLISHED, ALREADY_THERE for a regular file there, -EEXIST for a directory, link or
    FIFO there, -ENOENT below a missing directory, -EEXIST for a stale temporary file, ...),
    the same published files byte for byte, the same checksums written into every header,
    no temporary file left; and the same exception type for every hostile plan (starts out
    of the span, overlapping, off a chunk; slot_of not the order the starts give; arrays
    misaligned, strided, of other types; slots, header, index or file size out of bounds;
    boundary integers) and every hostile block (wrong tuple, NUL, wrong-sized, read-only or
    strided buffers)."""
    plan, memory = build_plan(case["plan"])
    blocks: list[BlockCase] = case["blocks"]
    buffers, block_memory = _block_buffers(blocks)

    def make(side: str, root: str) -> tuple[Callable[[], object], list[object | None], None]:
        fio = _fio(side)
        items = _containerize(build_blocks(blocks, root, buffers), case["container"])
        flags, mode = case["flags"], case["mode"]
        return lambda: fio.publish_pieces(items, flags, mode, plan), memory + block_memory, None  # type: ignore[arg-type]

    differential(_batch_layout(blocks), make)


@st.composite
def read_pieces_cases(draw: st.DrawFn) -> dict[str, Any]:
    hostile = perturbed(draw, (*PLAN_FIELDS, "header_nbytes", "touch", "blocks"), most=2)
    plan = draw(plan_cases(hostile))
    return {
        "plan": plan,
        "blocks": draw(block_cases(plan, reading=True, hostile="blocks" in hostile)),
        "container": draw(st.sampled_from(CONTAINERS)) if "blocks" in hostile else "list",
        "header_nbytes": scalar(draw, plan.header, "header_nbytes" in hostile),
        "touch": scalar(draw, draw(st.sampled_from(TOUCH_TIMES)), "touch" in hostile),
        "direct": draw(st.booleans()),
    }


# Found by this test (read_pieces' twins of the publish mismatches): an int32 alignment with
# O_DIRECT; header_nbytes None (the reference then takes the header as publish_pieces does, from
# the index); touch_if_older_than_ns None (the reference compares it only with a file's mtime).
INT32_ALIGNMENT_READ = {
    "plan": simple_plan(alignment=np.int32(8)),
    "blocks": [simple_block(True, ("file", 16, 3))],
    "container": "list",
    "header_nbytes": 8,
    "touch": 0,
    "direct": True,
}
NO_HEADER_SIZE_READ = {**INT32_ALIGNMENT_READ, "plan": simple_plan(), "header_nbytes": None}
NO_TOUCH_READ = {
    **NO_HEADER_SIZE_READ,
    "blocks": [simple_block(True)],  # b0 missing: the reference returns [-ENOENT]
    "header_nbytes": 8,
    "touch": None,
    "direct": False,
}


@DIFF
@given(case=read_pieces_cases())
@example(case=INT32_ALIGNMENT_READ)
@example(case=NO_HEADER_SIZE_READ)
@example(case=NO_TOUCH_READ)
def test_read_pieces_matches_its_reference(case: dict[str, Any]) -> None:
    """FileIO().read_pieces (native) and the reference agree: the same statuses (VERIFIED
    for a valid block, also one with a flipped index byte or header byte outside the slots;
    -EBADMSG for a flipped slot or piece byte, a short or long file, a directory, FIFO or
    socket; -ENOENT, -ELOOP, ...), the same bytes landed in every header and span (also for
    the blocks that fail), the same mtimes touched, buffered or O_DIRECT; and the same
    exception type for every hostile plan, header size, touch time or block."""
    plan, memory = build_plan(case["plan"])
    blocks: list[BlockCase] = case["blocks"]
    buffers, block_memory = _block_buffers(blocks)

    def make(side: str, root: str) -> tuple[Callable[[], object], list[object | None], None]:
        fio = _fio(side)
        items = _containerize(build_blocks(blocks, root, buffers), case["container"])

        def call() -> object:
            return fio.read_pieces(
                items,  # type: ignore[arg-type]
                case["header_nbytes"],
                plan,
                case["touch"],
                direct=case["direct"],
            )

        return call, memory + block_memory, None

    differential(_batch_layout(blocks), make)

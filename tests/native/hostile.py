"""Shared pieces of the hostile-argument tests (test_hostile_pieces.py, test_hostile_files.py):
the two sides (native, reference), outcome checks, misaligned arrays, and piece plans, block
files and hostile piece lists for the batch calls."""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from kvstore.checksum import native_xxh3_capsule
from kvstore.io.fileio import FileIO
from kvstore.io.fileproto import native_fileproto
from kvstore.io.native_fileio import NativeFileIO
from kvstore.io.types import PiecePlan
from tests.native.isolated import Outcome, assert_clean, run_isolated

NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL
CHUNK = 4096  # chunk and (by default) piece size of the piece batches
HEADER = 4096  # header bytes of a piece-batch block file
SLOTS = 64  # where the checksum slots start in that header
INDEX = bytes(range(1, 65))  # the index written after the pieces
IMPLS = ["native", "reference"]
OPS = ["publish", "read"]


class ClearingPath:
    """A path whose ``__fspath__`` empties ``victim`` (the list the call is walking)."""

    def __init__(self, path: Path, victim: list[Any]) -> None:
        self.path = str(path)
        self.victim = victim

    def __fspath__(self) -> str:
        self.victim.clear()
        return self.path


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
        return NativeFileIO()
    return Reference()


def _native_module() -> Any:
    """The bound kvstore._native._fileproto module itself (skips where unbound)."""
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

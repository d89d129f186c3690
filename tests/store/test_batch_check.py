"""The batch check of raw block files (what ``kvstore verify`` runs first) calls a file intact
only when :func:`check_file` finds no fault in it, and calls every good file intact.

Its verdict is one-sided (module doc of :mod:`kvstore.store.batch_check`): a file it does not
call intact goes to :func:`check_file`, whose finding is the verdict. These tests damage every
region of a file in every way (bit flips, header edits with the crc made valid again, sizes,
other entry kinds, another key or array), alone and among good files (both ways of batching
the checksums), with the extensions and with the Python reference (``KVSTORE_NATIVE=off``),
then compare whole ``kvstore verify`` documents with and without the batch check.
"""

from __future__ import annotations

import os
import shutil
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore import checksum
from kvstore.admin import verify
from kvstore.admin.scan import open_root
from kvstore.checksum import crc32c
from kvstore.identity import Identity
from kvstore.io import fileproto
from kvstore.store import batch_check, full_check
from kvstore.store import format as fmt
from kvstore.store.batch_check import RawBatchCheck
from kvstore.store.check import ShardSpec
from kvstore.store.group_store import GroupStore
from kvstore.store.types import BlockWrite, WriteStatus
from tests.admin.test_verify_matrix import damage
from tests.helpers import (
    StoreFactory,
    block_bytes,
    block_hash,
    make_mla_identity,
    make_odd_identity,
    make_small_identity,
)

IDENTITIES = {"dense": make_small_identity, "padded": make_odd_identity, "mla": make_mla_identity}
GOOD = 8  # more files than inner chunks (6): a batch hashes one run per chunk number


@pytest.fixture(params=["auto", "off"])
def native(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The extensions (where built) or the Python reference alone, bound afresh."""
    monkeypatch.setenv("KVSTORE_NATIVE", request.param)
    fileproto.NATIVE_FILEPROTO.reset()
    checksum.NATIVE_BATCH.reset()
    yield request.param
    monkeypatch.undo()
    fileproto.NATIVE_FILEPROTO.reset()
    checksum.NATIVE_BATCH.reset()


def _group(make_store: StoreFactory, identity: Identity) -> tuple[GroupStore, list[bytes]]:
    group = make_store().namespace(identity).group(0)
    hashes = [block_hash(i, "batch") for i in range(GOOD)]
    writes = [BlockWrite(h, block_bytes(group.layout, i)) for i, h in enumerate(hashes)]
    assert all(r.status is WriteStatus.WRITTEN for r in group.write_blocks(writes))
    return group, hashes


def _spec(root: Path, group: int = 0) -> ShardSpec:
    ns = open_root(root).namespaces[0]
    g = ns.groups[0]
    return ShardSpec(g.layout, ns.digest, group, None)


def _coords(path: str) -> tuple[int, int]:
    return int(Path(path).parent.name), int(Path(path).name)


def _intact(batch: RawBatchCheck, paths: list[str], coords: list[tuple[int, int]]) -> list[bool]:
    return batch.intact(paths, [hi for hi, _ in coords], [lo for _, lo in coords])


def _agree(spec: ShardSpec, path: str, good: list[str], coords: tuple[int, int]) -> bool:
    """Whether the batch calls ``path`` (found at ``coords``) intact - alone and among good
    files - exactly when check_file finds no fault; check_file's verdict."""
    full, _ = full_check.check_file(path, spec, coords=coords, chunk_states=False)
    batch = RawBatchCheck(spec)
    alone = _intact(batch, [path], [coords])
    among = _intact(batch, [*good, path], [*map(_coords, good), coords])
    assert alone == [full.fault is None], (path, full.fault)
    assert among == [True] * len(good) + [full.fault is None], (path, full.fault)
    return full.fault is None


def _fixed_header_edit(raw: bytes, offset: int, bit: int) -> bytes:
    """One bit of the fixed header flipped, its crc recomputed: only the field checks see it."""
    out = bytearray(raw)
    out[offset] ^= 1 << bit
    out[fmt.CRC_OFFSET : fmt.CRC_OFFSET + 4] = struct.pack(
        "<I", crc32c(bytes(out[: fmt.CRC_OFFSET]))
    )
    return bytes(out)


@pytest.mark.parametrize("layout_kind", sorted(IDENTITIES))
def test_intact_exactly_when_check_file_finds_nothing(
    root: Path, make_store: StoreFactory, layout_kind: str, native: str
) -> None:
    group, hashes = _group(make_store, IDENTITIES[layout_kind]())
    spec = _spec(root)
    layout = spec.layout
    paths = [group.path_of(h) for h in hashes]
    victim, good = paths[0], paths[1:]
    coords = _coords(victim)
    pristine = Path(victim).read_bytes()
    assert _agree(spec, victim, good, coords)
    damaged: list[bytes] = []
    offsets = {0, 7, layout.header_nbytes - 1, len(pristine) - 1}
    offsets |= set(range(fmt.HEADER_FIXED_NBYTES - 4, fmt.checksum_slot_offset(layout.num_chunks)))
    for c in range(layout.num_chunks):
        start = layout.chunk_offset(c)
        offsets |= {start, start + layout.chunk_nbytes - 1, start + layout.chunk_stride - 1}
    offsets |= set(range(layout.data_end, len(pristine), 3))
    for offset in sorted(offsets):
        flipped = bytearray(pristine)
        flipped[offset] ^= 0x10
        damaged.append(bytes(flipped))
    slots = fmt.HEADER_FIXED_NBYTES
    damaged.append(pristine[:slots] + bytes(8) + pristine[slots + 8 :])  # an unwritten slot
    damaged += [pristine[:n] for n in (0, 10, layout.header_nbytes, len(pristine) - 1)]
    damaged.append(pristine + b"\0")
    for raw in damaged:
        Path(victim).write_bytes(raw)
        assert not _agree(spec, victim, good, coords)
    # Every field of the fixed header changed with a valid crc: the hash lengths, algorithm,
    # key, namespace, group, geometry are faults; the parent hash, creation time and the
    # reserved byte are not (a block of another chain, or written at another time).
    edits = [_fixed_header_edit(pristine, o, b) for o in range(fmt.CRC_OFFSET) for b in (0, 3)]
    verdicts = []
    for raw in edits:
        Path(victim).write_bytes(raw)
        verdicts.append(_agree(spec, victim, good, coords))
    assert 0 < verdicts.count(True) < verdicts.count(False)
    Path(victim).write_bytes(pristine)
    # Found under another key's name (mis-keyed), or checked as another array's (misplaced).
    other = str(Path(victim).with_name(str(coords[1] ^ 1)))
    shutil.copy(victim, other)
    assert not _agree(spec, other, good, _coords(other))
    assert not _agree(_spec(root, group=1), victim, [], coords)
    os.unlink(other)


def test_other_entries_are_never_intact_and_never_block(
    root: Path, make_store: StoreFactory, native: str
) -> None:
    group, hashes = _group(make_store, make_small_identity())
    spec = _spec(root)
    paths = [group.path_of(h) for h in hashes]
    good = paths[:-1]
    base = Path(paths[-1])
    os.unlink(base)
    assert not _agree(spec, str(base), good, _coords(str(base)))  # vanished
    os.mkfifo(base)
    done: list[bool] = []
    worker = threading.Thread(
        target=lambda: done.append(_agree(spec, str(base), good, _coords(str(base)))),
        daemon=True,
    )
    worker.start()
    worker.join(timeout=10)
    assert done == [False], "a FIFO blocked or passed"
    os.unlink(base)
    os.mkdir(base)
    assert not _agree(spec, str(base), good, _coords(str(base)))
    os.rmdir(base)
    os.symlink(paths[0], base)  # a link to a good block: never followed
    assert not _agree(spec, str(base), good, _coords(str(base)))


def test_the_check_changes_no_file(root: Path, make_store: StoreFactory, native: str) -> None:
    group, hashes = _group(make_store, make_small_identity())
    paths = [group.path_of(h) for h in hashes]
    for i, path in enumerate(paths):  # before the epoch too: nothing is "older" than them
        os.utime(path, ns=(10**9, (i - 4) * 10**9))
    before = [os.stat(p).st_mtime_ns for p in paths]
    assert _intact(RawBatchCheck(_spec(root)), paths, [_coords(p) for p in paths]) == [True] * GOOD
    assert [os.stat(p).st_mtime_ns for p in paths] == before


def test_rounds_of_any_size_agree(
    root: Path, make_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    group, hashes = _group(make_store, make_odd_identity())
    paths = [group.path_of(h) for h in hashes]
    Path(paths[3]).write_bytes(Path(paths[3]).read_bytes()[:-1])
    coords = [_coords(p) for p in paths]
    want = [i != 3 for i in range(GOOD)]
    for rows in (1, 3, GOOD, 100):
        monkeypatch.setattr(batch_check, "ROUND_NBYTES", rows * group.layout.file_nbytes)
        assert _intact(RawBatchCheck(_spec(root)), paths, coords) == want
    with pytest.raises(ValueError, match="one coordinate pair per path"):
        _intact(RawBatchCheck(_spec(root)), paths, coords[:-1])


def _verify_doc(root: Path, *, batch: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    with monkeypatch.context() as m:
        if not batch:
            m.setattr(RawBatchCheck, "intact", lambda self, paths, hi, lo: [False] * len(paths))
        return verify.verify_store(root, verify.VerifyOptions(progress=False, threads=2))


@pytest.mark.parametrize("layout_kind", sorted(IDENTITIES))
def test_verify_finds_the_same_with_and_without_the_batch(
    root: Path,
    make_store: StoreFactory,
    layout_kind: str,
    native: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    group, hashes = _group(make_store, IDENTITIES[layout_kind]())
    more = [block_hash(i, "more") for i in range(GOOD)]
    layout = group.layout
    writes = [BlockWrite(h, block_bytes(layout, 100 + i)) for i, h in enumerate(more)]
    assert all(r.status is WriteStatus.WRITTEN for r in group.write_blocks(writes))
    damage(group, hashes, "none")  # oversized, truncated, index cut off, chunk bit flipped
    paths = [group.path_of(h) for h in hashes]
    raw = Path(paths[4]).read_bytes()
    Path(paths[4]).write_bytes(_fixed_header_edit(raw, fmt.ALGO_OFFSET, 1))  # another algorithm
    Path(paths[5]).write_bytes(raw[:100] + b"\xff" + raw[101:])  # header crc
    os.unlink(paths[6])
    os.mkfifo(paths[6])
    os.unlink(paths[7])
    os.symlink(group.path_of(more[0]), paths[7])
    misnamed = Path(group.path_of(more[1]))
    shutil.copy(misnamed, misnamed.with_name(str(_coords(str(misnamed))[1] ^ 1)))
    with_batch = _verify_doc(root, batch=True, monkeypatch=monkeypatch)
    without = _verify_doc(root, batch=False, monkeypatch=monkeypatch)
    assert with_batch == without
    # The FIFO and the link are findings of the scan, not blocks; the copy is one more block.
    assert with_batch["blocks"]["checked"] == 2 * GOOD - 1
    kinds = {f["kind"] for f in with_batch["findings"]}
    assert {"oversized", "truncated", "corrupt", "mis-keyed", "symlink", "special-file"} <= kinds

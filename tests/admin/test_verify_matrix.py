"""verify and kvstore-inspect accept every kind of block the store writes, and still find damage.

The matrix: every compression setting the store accepts (none, lz4, zstd at the lowest and the
highest level) x every way a block is published (``write_blocks`` whole; ``begin_blocks`` +
``write_chunks`` from two writers + ``commit_blocks``; ``write_ranges`` from two token-split
writers + commit) x incompressible (uniform random) and compressible (KV-like) data x the three
layout paths (dense, padded, MLA). Random data matters: blosc stores an incompressible chunk with
its 16-byte header, so such a compressed file is *larger* than the raw file of the same block
(issue 14, item 1: ``verify --fix`` quarantined those acknowledged blocks, and ``kvstore-inspect
overview`` counted every compressed block as "bad size").

The same matrix is damaged on purpose in the second half, so these checks can fail both ways.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvstore.admin.blockfile import (
    CORRUPT,
    OVERSIZED,
    TRUNCATED,
    BlockFault,
    check_block_file,
    read_header,
)
from kvstore.checksum import checksum_function
from kvstore.errors import CorruptBlockError
from kvstore.identity import Identity
from kvstore.inspect.cli import main as inspect_main
from kvstore.keys import hash_coords
from kvstore.store import format as fmt
from kvstore.store.codec import compressed_bounds
from kvstore.store.group_store import GroupStore
from kvstore.store.types import (
    BlockRead,
    BlockWrite,
    ChunkWrite,
    RangeWrite,
    ReadStatus,
    WriteStatus,
)
from tests.admin.util import cli_json
from tests.helpers import (
    StoreFactory,
    block_bytes,
    block_hash,
    chunk_bytes,
    make_mla_identity,
    make_odd_identity,
    make_small_identity,
)

COMPRESSIONS = ["none", "lz4", "zstd-1", "zstd-9"]
IDENTITIES: dict[str, Callable[[], Identity]] = {
    "dense": make_small_identity,
    "padded": make_odd_identity,
    "mla": make_mla_identity,
}
WRITE_KINDS = ("whole", "chunks", "ranges")
DATA_KINDS = ("random", "compressible")


def random_data(group: GroupStore, seed: int) -> np.ndarray:
    """Uniform random bytes: blosc cannot compress them (stored chunk = raw + 16 bytes)."""
    return block_bytes(group.layout, seed)


def compressible_data(group: GroupStore, seed: int) -> np.ndarray:
    """KV-like bytes: 16-bit patterns of small normal values (high bytes repeat), stamped per
    chunk like :func:`block_bytes` so a misplaced chunk is still caught."""
    layout = group.layout
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(layout.block_nbytes // 2, dtype=np.float32)
    data = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    stamped = block_bytes(layout, seed)
    for c in range(layout.num_chunks):
        start = c * layout.chunk_nbytes
        data[start : start + 8] = stamped[start : start + 8]
    return data


def token_ranges(
    group: GroupStore, data: np.ndarray, rank: int, world: int
) -> list[tuple[int, np.ndarray]]:
    """Rank ``rank``'s token-interleaved ranges of every chunk (token t goes to t % world)."""
    layout = group.layout
    token_bytes = layout.elems_per_token * layout.itemsize
    out = []
    for c in range(layout.num_chunks):
        for t in range(rank, layout.tokens, world):
            offset = c * layout.chunk_nbytes + t * token_bytes
            out.append((offset, data[offset : offset + token_bytes]))
    return out


def publish(a: GroupStore, b: GroupStore, kind: str, h: bytes, data: np.ndarray) -> None:
    """Publish block ``h`` with contents ``data`` the way ``kind`` names (a, b: two writers)."""
    n = a.layout.num_chunks
    if kind == "whole":
        (result,) = a.write_blocks([BlockWrite(h, data)])
    elif kind == "chunks":
        (pending,) = a.begin_blocks([h])
        first, second = list(range(n // 2)), list(range(n // 2, n))
        assert a.write_chunks([ChunkWrite(pending, first, chunk_bytes(a.layout, data, first))]) == [
            None
        ]
        assert b.write_chunks(
            [ChunkWrite(pending, second, chunk_bytes(a.layout, data, second))]
        ) == [None]
        (result,) = b.commit_blocks([pending])
    else:
        (pending,) = a.begin_blocks([h])
        assert a.write_ranges([RangeWrite(pending, token_ranges(a, data, 0, 2), 0)]) == [None]
        assert b.write_ranges([RangeWrite(pending, token_ranges(b, data, 1, 2), 1)]) == [None]
        (result,) = a.commit_blocks([pending], checksum_chunks=[list(range(n))], range_writers=2)
    assert result.status is WriteStatus.WRITTEN, result.error


def populate(
    make_store: StoreFactory, identity: Identity, compression: str
) -> tuple[GroupStore, dict[bytes, np.ndarray]]:
    """One block of every (write kind, data kind); the writer group and hash -> contents."""
    a = make_store(compression=compression).namespace(identity).group(0)
    b = make_store(compression=compression).namespace(identity).group(0)
    blocks: dict[bytes, np.ndarray] = {}
    for i, kind in enumerate(WRITE_KINDS):
        for j, data_kind in enumerate(DATA_KINDS):
            h = block_hash(10 * i + j, f"{compression}/{kind}/{data_kind}")
            maker = random_data if data_kind == "random" else compressible_data
            data = maker(a, 10 * i + j)
            publish(a, b, kind, h, data)
            blocks[h] = data
    return a, blocks


def read_back(group: GroupStore, blocks: dict[bytes, np.ndarray]) -> dict[bytes, bool]:
    """hash -> whether a whole read of it is a hit with exactly the written bytes."""
    out: dict[bytes, bool] = {}
    for h, data in blocks.items():
        buf = np.zeros(group.layout.block_nbytes, dtype=np.uint8)
        (result,) = group.read_blocks([BlockRead(h, buf)])
        out[h] = result.status is ReadStatus.HIT and bytes(buf) == data.tobytes()
    return out


def inspect_overview(
    capsys: pytest.CaptureFixture[str], root: Path, *extra: str
) -> tuple[int, dict[str, object]]:
    import json  # noqa: PLC0415 - only here

    rc = inspect_main(["overview", str(root), "--json", *extra])
    out = capsys.readouterr().out
    return rc, json.loads(out)


@pytest.fixture(params=list(IDENTITIES))
def identity(request: pytest.FixtureRequest) -> Identity:
    return IDENTITIES[request.param]()


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_every_block_kind_verifies_clean(
    root: Path,
    make_store: StoreFactory,
    identity: Identity,
    compression: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    group, blocks = populate(make_store, identity, compression)
    sizes = {os.path.getsize(group.path_of(h)) for h in blocks}
    if compression != "none":
        # The matrix really holds both shapes: incompressible files at the largest size the
        # geometry allows (larger than the raw file where chunks are not padded) and files that
        # compressed.
        high = compressed_bounds(group.layout)[1]
        assert high in sizes and min(sizes) < high, sizes
        assert high > group.layout.file_nbytes or not group.layout.dense
    assert all(read_back(group, blocks).values())
    for h in blocks:
        hi, lo = hash_coords(h)
        fault = check_block_file(
            group.path_of(h),
            group.layout,
            group.namespace_digest,
            0,
            hi,
            lo,
            compression,
        )
        assert fault is None, fault

    rc, doc = cli_json(capsys, "verify", root)
    assert (rc, doc["findings"]) == (0, [])
    assert doc["blocks"]["checked"] == len(blocks)
    rc, doc = cli_json(capsys, "verify", root, "--fix")
    assert (rc, doc["findings"]) == (0, [])
    quarantine = root / identity.namespace / "quarantine"
    assert not quarantine.exists() or not any(quarantine.iterdir())
    assert all(read_back(group, blocks).values()), "verify --fix changed a valid block"

    rc, overview = inspect_overview(capsys, root)
    totals = overview["totals"]
    assert isinstance(totals, dict)
    assert (rc, totals["bad_size"], totals["blocks"]) == (0, 0, len(blocks))
    rc, overview = inspect_overview(capsys, root, "--check")
    totals = overview["totals"]
    assert isinstance(totals, dict)
    assert (rc, totals["bad_size"], totals["damaged"]) == (0, 0, 0)


def damage(group: GroupStore, blocks: list[bytes], compression: str) -> dict[bytes, str]:
    """Damage blocks in ways a reader must refuse; hash -> the verify finding kind expected."""
    layout = group.layout
    if compression == "none":
        low = high = layout.file_nbytes
    else:
        low, high = compressed_bounds(layout)
    expected: dict[bytes, str] = {}
    grown, shrunk, appended, flipped = (group.path_of(h) for h in blocks[:4])
    with open(grown, "ab") as f:  # past the largest size the geometry allows
        f.write(b"\0" * (high + 1 - os.path.getsize(grown)))
    expected[blocks[0]] = OVERSIZED
    os.truncate(shrunk, low - 1)  # below the smallest size the geometry allows
    expected[blocks[1]] = TRUNCATED
    if compression == "none":
        os.truncate(appended, layout.file_nbytes - layout.index_nbytes)  # index cut off
        expected[blocks[2]] = TRUNCATED
    else:
        # 16 bytes more, within the bounds: the header's file size and the index disagree.
        with open(appended, "ab") as f:
            f.write(b"\0" * 16)
        expected[blocks[2]] = CORRUPT
    # A bit in the middle of the stored chunks (raw or compressed): a checksum mismatch.
    size = os.path.getsize(flipped)
    with open(flipped, "r+b") as f:
        offset = layout.header_nbytes + (size - layout.header_nbytes - layout.index_nbytes) // 2
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))
    expected[blocks[3]] = CORRUPT
    return expected


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_damaged_blocks_are_still_found(
    root: Path,
    make_store: StoreFactory,
    identity: Identity,
    compression: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    group, blocks = populate(make_store, identity, compression)
    hashes = list(blocks)
    # Grow, shrink and flip random-data blocks (the largest files); append to a compressible
    # one (within the size bounds).
    order = [hashes[0], hashes[2], hashes[1], hashes[4]]
    expected = damage(group, order, compression)
    intact = [h for h in hashes if h not in expected]
    bad_size = sum(kind in (OVERSIZED, TRUNCATED) for kind in expected.values())

    rc, overview = inspect_overview(capsys, root)
    totals = overview["totals"]
    assert isinstance(totals, dict)
    assert (rc, totals["bad_size"]) == (1, bad_size)
    rc, overview = inspect_overview(capsys, root, "--check")
    totals = overview["totals"]
    assert isinstance(totals, dict)
    assert (rc, totals["damaged"]) == (1, len(expected))

    rc, doc = cli_json(capsys, "verify", root, "--fix")
    assert rc == 1
    found = {f["path"]: f["kind"] for f in doc["findings"]}
    want = {
        os.path.relpath(group.path_of(h), root.absolute()): kind for h, kind in expected.items()
    }
    assert found == want
    assert all(f["action"].startswith("quarantined as ") for f in doc["findings"])
    assert not any(os.path.exists(group.path_of(h)) for h in expected)
    assert all(read_back(group, {h: blocks[h] for h in intact}).values())
    rc, doc = cli_json(capsys, "verify", root)
    assert (rc, doc["findings"], doc["blocks"]["checked"]) == (0, [], len(intact))


def test_chunk_that_verifies_but_does_not_decode_is_found(
    root: Path, make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stored chunk whose checksum matches but whose blosc header lies (a crafted or
    miswritten file): verify and ``overview --check`` decode every chunk, as a reader does."""
    group, blocks = populate(make_store, make_small_identity(), "lz4")
    h = next(iter(blocks))
    path = Path(group.path_of(h))
    raw = bytearray(path.read_bytes())
    layout = group.layout
    start = int(layout.data_offset)
    end = start + int.from_bytes(raw[len(raw) - layout.index_nbytes + 8 :][:8], "little")
    raw[start + 4 : start + 8] = (layout.chunk_nbytes * 2).to_bytes(4, "little")  # nbytes field
    algo = fmt.decode_header(raw).checksum_algo
    slot = checksum_function(algo)(memoryview(raw)[start:end])
    raw[fmt.checksum_slot_offset(0) : fmt.checksum_slot_offset(0) + 8] = slot.to_bytes(8, "little")
    path.write_bytes(raw)
    rc, overview = inspect_overview(capsys, root, "--check")
    totals = overview["totals"]
    assert isinstance(totals, dict)
    assert (rc, totals["bad_size"], totals["damaged"]) == (1, 0, 1)
    rc, doc = cli_json(capsys, "verify", root)
    assert rc == 1
    assert [(f["kind"], f["path"]) for f in doc["findings"]] == [
        (CORRUPT, os.path.relpath(path, root.absolute()))
    ]


def test_a_fifo_at_a_block_path_is_refused_without_blocking(
    make_store: StoreFactory,
) -> None:
    group = make_store(compression="lz4").namespace(make_small_identity()).group(0)
    h = block_hash(1, "fifo")
    path = group.path_of(h)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.mkfifo(path)
    outcome: list[object] = []

    def check() -> None:
        hi, lo = hash_coords(h)
        outcome.append(
            check_block_file(path, group.layout, group.namespace_digest, 0, hi, lo, "lz4")
        )
        try:
            read_header(path)
        except CorruptBlockError as exc:
            outcome.append(str(exc))

    worker = threading.Thread(target=check, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "opening a FIFO blocked"
    fault, error = outcome
    assert isinstance(fault, BlockFault) and fault.kind == CORRUPT and "FIFO" in fault.detail
    assert isinstance(error, str) and "expected a regular file, got a FIFO" in error

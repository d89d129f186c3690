"""``kvstore verify`` finds every planted fault, fixes what --fix may fix, else changes nothing."""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore.admin.blockfile import CORRUPT, MIS_KEYED, check_block_file
from kvstore.identity import Identity
from kvstore.keys import hash_coords
from kvstore.store.format import HEADER_FIXED_NBYTES
from kvstore.store.types import BlockRead
from tests.admin.util import NS_PER_S, cli, cli_json, set_mtime, snapshot, write
from tests.helpers import StoreFactory, block_hash, make_small_identity


def flip(path: str, offset: int, bit: int = 6) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


@pytest.fixture
def planted(root: Path, make_store: StoreFactory) -> dict[str, str]:
    """A store with one of every fault; returns fault name -> path."""
    store = make_store()
    ident = make_small_identity()
    group = store.namespace(ident).group(0)
    hashes = [block_hash(i) for i in range(12)]
    paths = write(group, hashes)
    layout = group.layout
    faults: dict[str, str] = {}
    flip(paths[0], layout.chunk_offset(1) + 123)  # a bit flip in the data
    faults["bitflip-data"] = paths[0]
    flip(paths[1], 60)  # a bit flip in the header's block hash
    faults["bitflip-header"] = paths[1]
    flip(paths[2], HEADER_FIXED_NBYTES + 8 * 2 + 3)  # in a checksum slot
    faults["bitflip-slot"] = paths[2]
    flip(paths[3], layout.data_end + 5)  # in the sharding index
    faults["bitflip-index"] = paths[3]
    os.truncate(paths[4], layout.file_nbytes - 100)
    faults["truncated"] = paths[4]
    miskeyed = group.path_of(block_hash(0, "copy"))
    shutil.copyfile(paths[5], miskeyed)  # a shard copied under another hash's name
    faults["mis-keyed"] = miskeyed
    # The same block hash written by another namespace, copied into this one.
    other = store.namespace(make_small_identity(revision="other")).group(0)
    foreign_block = write(other, [block_hash(100)])[0]
    misplaced = group.path_of(block_hash(100))
    shutil.copyfile(foreign_block, misplaced)
    faults["misplaced"] = misplaced
    orphan = paths[6] + ".tmp-00000000deadbeef"
    Path(orphan).write_bytes(b"t" * 4096)
    set_mtime(orphan, time.time_ns() - 7200 * NS_PER_S)
    faults["orphan-temp"] = orphan
    young = paths[7] + ".tmp-00000000cafef00d"
    Path(young).write_bytes(b"t" * 4096)
    faults["young-temp"] = young
    fanout = os.path.dirname(paths[8])
    Path(fanout, "notes.txt").write_text("hello")
    faults["foreign-fanout-file"] = os.path.join(fanout, "notes.txt")
    Path(fanout, "12345").mkdir()
    faults["foreign-fanout-dir"] = os.path.join(fanout, "12345")
    Path(store.root / ident.namespace / "extra.bin").write_bytes(b"e" * 10)
    faults["foreign-namespace-entry"] = str(store.root / ident.namespace / "extra.bin")
    Path(group.array_path / "c" / "7").mkdir()
    faults["foreign-c-tree"] = str(group.array_path / "c" / "7")
    return faults


def findings_by_path(doc: dict[str, object], root: Path) -> dict[str, str]:
    return {str(root / f["path"]): f["kind"] for f in doc["findings"]}  # type: ignore[attr-defined]


def test_verify_finds_every_planted_fault(
    root: Path, planted: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    before = snapshot(root)
    rc, doc = cli_json(capsys, "verify", root)
    assert rc == 1
    assert snapshot(root) == before, "verify without --fix must not change anything"
    found = findings_by_path(doc, root.absolute())
    expected = {
        "bitflip-data": "corrupt",
        "bitflip-header": "corrupt",
        "bitflip-slot": "corrupt",
        "bitflip-index": "corrupt",
        "truncated": "truncated",
        "mis-keyed": "mis-keyed",
        "misplaced": "misplaced",
        "orphan-temp": "orphan-temp",
        "foreign-fanout-file": "foreign",
        "foreign-fanout-dir": "foreign",
        "foreign-namespace-entry": "foreign",
        "foreign-c-tree": "foreign",
    }
    assert {name: found.get(planted[name]) for name in expected} == expected
    assert len(doc["findings"]) == len(expected)  # nothing else: the other blocks are intact
    assert [t["path"] for t in doc["in_flight_temps"]] == [
        os.path.relpath(planted["young-temp"], root.absolute())
    ]
    assert (
        doc["blocks"]["found"] == 15 and doc["blocks"]["checked"] == 15
    )  # 12 + 2 copies + other ns
    assert doc["counts"]["foreign"] == 4
    assert all(f["action"] is None for f in doc["findings"])
    rc, out, _ = cli(capsys, "verify", root)
    assert rc == 1 and "12 finding(s)" in out and "mis-keyed" in out


def test_verify_fix_then_clean(
    root: Path, planted: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, doc = cli_json(capsys, "verify", root, "--fix")
    assert rc == 1  # findings were made, even though all were fixed
    actions = {f["kind"]: f["action"] for f in doc["findings"]}
    assert actions["orphan-temp"] == "deleted"
    assert actions["corrupt"].startswith("quarantined as ")
    assert actions["foreign"].startswith("quarantined as ")
    for name, path in planted.items():
        assert os.path.lexists(path) == (name == "young-temp"), name
    ns_dir = root / make_small_identity().namespace
    quarantined = sorted(p.name for p in (ns_dir / "quarantine").iterdir())
    assert len(quarantined) == 11  # 7 bad blocks + 4 foreign entries
    assert sum(q.startswith("foreign-") for q in quarantined) == 4
    rc, doc = cli_json(capsys, "verify", root)
    assert rc == 0 and doc["findings"] == [] and len(doc["in_flight_temps"]) == 1
    assert doc["blocks"]["found"] == 8
    rc, out, _ = cli(capsys, "verify", root)
    assert rc == 0 and "no findings" in out


def test_verify_root_foreign_is_reported_not_moved(
    root: Path, make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    store = make_store()
    write(store.namespace(make_small_identity()).group(0), [block_hash(1)])
    (root / "README").write_text("mine")
    rc, doc = cli_json(capsys, "verify", root, "--fix")
    assert rc == 1
    (finding,) = doc["findings"]
    assert finding["kind"] == "foreign" and finding["namespace"] is None
    assert finding["action"] == "left in place (outside any namespace)"
    assert (root / "README").exists()


def test_verify_sample(
    root: Path, make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--sample p`` checks each block with probability p (a seeded draw per block): every
    block is bad here, so the findings name the blocks chosen."""
    store = make_store()
    group = store.namespace(make_small_identity()).group(0)
    paths = write(group, [block_hash(i) for i in range(40)])
    for path in paths:
        flip(path, group.layout.chunk_offset(0) + 1)
    orphan = paths[0] + ".tmp-0000000000000001"
    Path(orphan).write_bytes(b"")
    set_mtime(orphan, time.time_ns() - 7200 * NS_PER_S)

    def sample(seed: int) -> tuple[dict[str, int], set[str]]:
        rc, doc = cli_json(capsys, "verify", root, "--sample", "0.25", "--seed", str(seed))
        assert rc == 1
        chosen = {f["path"] for f in doc["findings"] if f["kind"] == "corrupt"}
        assert doc["counts"] == {"corrupt": len(chosen), "orphan-temp": 1}  # temps: all
        return doc["blocks"], chosen

    blocks, chosen = sample(3)
    assert 0 < len(chosen) < 40
    assert blocks == {
        "found": 40,
        "chosen": len(chosen),
        "checked": len(chosen),
        "checked_bytes": len(chosen) * group.layout.file_nbytes,
        "vanished": 0,
    }
    assert sample(3) == (blocks, chosen)  # the same seed, the same listing: the same blocks
    assert sample(4)[1] != chosen
    rc, out, _ = cli(capsys, "verify", root, "--sample", "0.25", "--seed", "3")
    assert rc == 1 and f"(sample 0.25: {len(chosen)} chosen)" in out
    with pytest.raises(SystemExit) as exc:
        cli(capsys, "verify", root, "--sample", "0")
    assert exc.value.code == 2
    assert "expected a fraction in (0, 1]" in capsys.readouterr().err


def test_tmp_age_option(
    root: Path, make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    store = make_store()
    paths = write(store.namespace(make_small_identity()).group(0), [block_hash(1)])
    temp = paths[0] + ".tmp-00000000000000aa"
    Path(temp).write_bytes(b"x")
    set_mtime(temp, time.time_ns() - 120 * NS_PER_S)
    assert cli_json(capsys, "verify", root)[0] == 0  # 2 minutes old: maybe in flight
    rc, doc = cli_json(capsys, "verify", root, "--tmp-age", "1m")
    assert rc == 1 and doc["counts"] == {"orphan-temp": 1}


def test_every_bit_flip_is_found(any_identity: Identity, make_store: StoreFactory) -> None:
    """A flipped bit anywhere in a block file (header, slots, data, padding, index) is found."""
    group = make_store().namespace(any_identity).group(0)
    (path,) = write(group, [block_hash(7)])
    hi, lo = hash_coords(block_hash(7))
    layout = group.layout
    assert check_block_file(path, layout, any_identity.digest, 0, hi, lo) is None
    original = Path(path).read_bytes()
    rng = random.Random(any_identity.model)
    regions = [
        (0, HEADER_FIXED_NBYTES),
        (HEADER_FIXED_NBYTES, layout.header_nbytes),
        (layout.data_offset, layout.data_end),
        (layout.data_end, layout.file_nbytes),
    ]
    offsets = [rng.randrange(a, b) for a, b in regions for _ in range(6)]
    if not layout.dense:  # the padding after a chunk
        offsets.append(layout.chunk_offset(0) + layout.chunk_nbytes + 17)
    for offset in offsets:
        flip(path, offset, rng.randrange(8))
        fault = check_block_file(path, layout, any_identity.digest, 0, hi, lo)
        assert fault is not None, f"flip at {offset} not found"
        assert fault.kind in (CORRUPT, MIS_KEYED, "misplaced"), fault
        Path(path).write_bytes(original)


def test_verify_never_serves_a_fixed_block(
    root: Path, make_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """After --fix the engine misses on the quarantined block and reads the others."""
    group = make_store().namespace(make_small_identity()).group(0)
    hashes = [block_hash(i) for i in range(3)]
    paths = write(group, hashes)
    flip(paths[1], group.layout.chunk_offset(0))
    assert cli_json(capsys, "verify", root, "--fix")[0] == 1
    out = np.zeros(group.layout.block_nbytes, dtype=np.uint8)
    statuses = [group.read_blocks([BlockRead(h, out)])[0].status.value for h in hashes]
    assert statuses == ["hit", "miss", "hit"]

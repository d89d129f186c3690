"""``check_file(chunk_states=False)`` (what ``kvstore verify`` runs) reaches the full check's
verdict on every file: good blocks, and every kind of damage anywhere in the file.

The fast path only decides "every chunk's checksum matches" in one batch and skips the
per-chunk records; whatever else it finds, the full check runs. These tests hold it to that.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from kvstore.admin.scan import open_root
from kvstore.identity import Identity
from kvstore.store import full_check
from kvstore.store.check import ShardSpec
from kvstore.store.codec import Codec
from kvstore.store.types import BlockWrite, WriteStatus
from tests.helpers import (
    StoreFactory,
    block_bytes,
    block_hash,
    make_odd_identity,
    make_small_identity,
)


def _one_block(root: Path, make_store: StoreFactory, identity: Identity) -> tuple[Path, ShardSpec]:
    group = make_store().namespace(identity).group(0)
    h = block_hash(7)
    (result,) = group.write_blocks([BlockWrite(h, block_bytes(group.layout, 7))])
    assert result.status is WriteStatus.WRITTEN
    ns = open_root(root).namespaces[0]
    g = ns.groups[0]
    spec = ShardSpec(g.layout, ns.digest, g.index, Codec.for_name(g.compression, g.layout.itemsize))
    return Path(group.path_of(h)), spec


def _verdicts(path: Path, spec: ShardSpec) -> tuple[object, object]:
    coords = (int(path.parent.name), int(path.name))
    full, _ = full_check.check_file(path, spec, coords=coords)
    fast, _ = full_check.check_file(path, spec, coords=coords, chunk_states=False)
    assert fast.faults == full.faults and fast.content_faults == full.content_faults
    assert fast.ok == full.ok and fast.file_nbytes == full.file_nbytes
    return fast.fault, full.fault


@pytest.mark.parametrize("batch_from", [1, 1000], ids=["batched", "records"])
@pytest.mark.parametrize(
    "identity", [make_small_identity(), make_odd_identity()], ids=["dense", "padded"]
)
def test_the_fast_verdict_is_the_full_one_for_every_damage(
    root: Path,
    make_store: StoreFactory,
    identity: Identity,
    batch_from: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # These layouts have 6 inner chunks: below the batch's threshold unless lowered.
    monkeypatch.setattr(full_check, "_BATCH_FROM_CHUNKS", batch_from)
    path, spec = _one_block(root, make_store, identity)
    good = path.read_bytes()
    fast, full = _verdicts(path, spec)
    assert fast is None and full is None
    coords = (int(path.parent.name), int(path.name))
    intact, _ = full_check.check_file(path, spec, coords=coords, chunk_states=False)
    # No per-chunk records when every checksum matched in one batch.
    assert (intact.chunks == ()) is (batch_from == 1)
    rng = random.Random(3)
    layout = spec.layout
    # Every region: fixed header, checksum slots, header tail, each chunk and (odd layout)
    # its stride padding, the sharding index; then random bytes anywhere.
    offsets = {0, 5, layout.header_nbytes - 1, layout.data_offset, len(good) - 1}
    for c in range(layout.num_chunks):
        start = layout.chunk_offset(c)
        offsets |= {start, start + layout.chunk_nbytes - 1, start + layout.chunk_stride - 1}
    offsets |= {rng.randrange(len(good)) for _ in range(100)}
    flips = 0
    for offset in sorted(o for o in offsets if 0 <= o < len(good)):
        damaged = bytearray(good)
        damaged[offset] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(damaged))
        fast, full = _verdicts(path, spec)
        assert fast == full, offset
        assert full is not None, f"a flipped bit at {offset} went unnoticed"
        flips += 1
    for size in (0, 10, layout.header_nbytes, layout.data_offset + 1, len(good) - 1):
        path.write_bytes(good[:size])
        fast, full = _verdicts(path, spec)
        assert fast == full and full is not None, size
    path.write_bytes(good + b"\0")
    assert _verdicts(path, spec)[0] == _verdicts(path, spec)[1] is not None
    path.write_bytes(good)
    os.utime(path)
    assert _verdicts(path, spec) == (None, None)
    assert flips > layout.num_chunks

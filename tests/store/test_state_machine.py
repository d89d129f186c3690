"""A hypothesis state machine: a GroupStore against a dict model of published blocks.

Rules cover every block operation of the GroupStore contract, the multi-writer protocol
(chunk splits, token-range splits, a writer that never ran, abort), corruption and a restart
(a new KVStore object on the same root). After every step the store must equal the model
exactly: reads, existence, and no temporary file left behind.

Creating a namespace makes 256 fan-out directories, which costs about a second per example
(create and remove) on the reference VM's filesystem; so each machine class keeps one store
root for all its examples and empties the directories its blocks can land in between them.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import ClassVar

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.config import StoreConfig
from kvstore.identity import Identity
from kvstore.store.group_store import GroupStore
from kvstore.store.page_store import KVStore
from kvstore.store.paths import TMP_MARK
from kvstore.store.types import (
    BlockRead,
    BlockWrite,
    ChunkWrite,
    RangeWrite,
    ReadStatus,
    WriteStatus,
)
from tests.helpers import (
    block_bytes,
    chain_hashes,
    chunk_bytes,
    make_odd_identity,
    make_small_identity,
    tmp_files,
)

CHAIN = 5
CHAINS = [chain_hashes(CHAIN, "a"), chain_hashes(CHAIN, "b")]
POOL = CHAINS[0] + CHAINS[1]
PARENT = {h: (chain[i - 1] if i else None) for chain in CHAINS for i, h in enumerate(chain)}

picks = st.lists(st.integers(0, len(POOL) - 1), min_size=1, max_size=5, unique=True)
one = st.integers(0, len(POOL) - 1)

_ROOTS: dict[str, tempfile.TemporaryDirectory[str]] = {}


def shared_root(name: str) -> Path:
    """One store root per machine class, removed when the interpreter exits."""
    if name not in _ROOTS:
        _ROOTS[name] = tempfile.TemporaryDirectory(prefix=f"kvstore-sm-{name}-")
    return Path(_ROOTS[name].name) / "store"


class GroupStoreMachine(RuleBasedStateMachine):
    identity: ClassVar[Identity] = make_small_identity()

    def __init__(self) -> None:
        super().__init__()
        self.root = shared_root(type(self).__name__)
        self.store = self._open()
        group = self.group
        # Every file a block operation creates (published, temporary, quarantined) lies in
        # one of these directories: empty them so that this example starts from scratch.
        self.watched = sorted(
            {os.path.dirname(group.path_of(h)) for h in POOL}
            | {str(group.array_path.parent / "quarantine")}
        )
        for directory in self.watched:
            for entry in os.scandir(directory) if os.path.isdir(directory) else []:
                os.unlink(entry.path)
        self.model: dict[bytes, np.ndarray] = {}
        self.seed = 0

    # -- helpers -------------------------------------------------------------------------------

    def _open(self) -> KVStore:
        return KVStore(StoreConfig(root=self.root, durability="none", io_threads=2))

    @property
    def group(self) -> GroupStore:
        return self.store.namespace(self.identity).group(0)

    @property
    def num_chunks(self) -> int:
        return self.group.layout.num_chunks

    def fresh(self) -> np.ndarray:
        self.seed += 1
        return block_bytes(self.group.layout, self.seed)

    def expect_publish(self, h: bytes, data: np.ndarray, status: WriteStatus) -> None:
        """A publish attempt of ``data`` under ``h``: EXISTS (unchanged) or WRITTEN."""
        if h in self.model:
            assert status is WriteStatus.EXISTS
        else:
            assert status is WriteStatus.WRITTEN
            self.model[h] = data

    def files(self) -> list[str]:
        """Names of every file in the watched directories."""
        return sorted(
            entry.name
            for directory in self.watched
            if os.path.isdir(directory)
            for entry in os.scandir(directory)
        )

    def teardown(self) -> None:
        self.store.close()

    # -- rules ---------------------------------------------------------------------------------

    @rule(indices=picks)
    def write_blocks(self, indices: list[int]) -> None:
        hashes = [POOL[i] for i in indices]
        datas = [self.fresh() for _ in hashes]  # new bytes even for present blocks
        results = self.group.write_blocks(
            [BlockWrite(h, d, PARENT[h]) for h, d in zip(hashes, datas, strict=True)]
        )
        for h, d, r in zip(hashes, datas, results, strict=True):
            self.expect_publish(h, d, r.status)

    @rule(
        indices=picks,
        chunks=st.one_of(st.none(), st.lists(st.integers(0, 5), min_size=1, max_size=8)),
    )
    def read_blocks(self, indices: list[int], chunks: list[int] | None) -> None:
        group = self.group
        layout = group.layout
        sel = None if chunks is None else [c % layout.num_chunks for c in chunks]
        count = layout.num_chunks if sel is None else len(sel)
        outs = [np.zeros(count * layout.chunk_nbytes, dtype=np.uint8) for _ in indices]
        reads = [BlockRead(POOL[i], out, sel) for i, out in zip(indices, outs, strict=True)]
        for i, out, result in zip(indices, outs, group.read_blocks(reads), strict=True):
            h = POOL[i]
            if h in self.model:
                assert result.status is ReadStatus.HIT, result
                want = self.model[h] if sel is None else chunk_bytes(layout, self.model[h], sel)
                np.testing.assert_array_equal(out, want)
            else:
                assert result.status is ReadStatus.MISS, result

    @rule(indices=picks)
    def contains(self, indices: list[int]) -> None:
        hashes = [POOL[i] for i in indices]
        assert self.group.contains(hashes) == [h in self.model for h in hashes]

    @rule(which=st.integers(0, 1), length=st.integers(0, CHAIN))
    def longest_prefix(self, which: int, length: int) -> None:
        chain = CHAINS[which][:length]
        r = self.group.longest_prefix(chain)
        present = [h in self.model for h in chain]
        true_prefix = present.index(False) if False in present else len(chain)
        assert true_prefix <= r <= len(chain)
        assert r == len(chain) or not present[r]
        assert r == 0 or present[r - 1]
        if all(not p for p in present[true_prefix:]):  # prefix-closed: exact
            assert r == true_prefix

    @rule(indices=picks)
    def delete_blocks(self, indices: list[int]) -> None:
        hashes = [POOL[i] for i in indices]
        expected = sum(h in self.model for h in hashes)
        assert self.group.delete_blocks(hashes) == expected
        for h in hashes:
            self.model.pop(h, None)

    @rule(index=one, split=st.lists(st.booleans(), min_size=18, max_size=18))
    def two_writers(self, index: int, split: list[bool]) -> None:
        """Chunks split between writer A (True) and writer B (False); B commits."""
        group = self.group
        h = POOL[index]
        data = self.fresh()
        (pending,) = group.begin_blocks([h], [PARENT[h]])
        for side in (True, False):
            chunks = [c for c in range(self.num_chunks) if split[c] is side]
            if chunks:
                payload = chunk_bytes(group.layout, data, chunks)
                assert group.write_chunks([ChunkWrite(pending, chunks, payload)]) == [None]
        assert group.contains([h]) == [h in self.model]  # nothing new visible yet
        (result,) = group.commit_blocks([pending])
        self.expect_publish(h, data, result.status)

    @rule(index=one)
    def token_split_writers(self, index: int) -> None:
        """DCP style: every chunk's tokens interleaved over two writers, checksummed at commit."""
        group = self.group
        layout = group.layout
        h = POOL[index]
        data = self.fresh()
        token = layout.elems_per_token * layout.itemsize
        (pending,) = group.begin_blocks([h], [PARENT[h]])
        for rank in range(2):
            ranges = []
            for c in range(layout.num_chunks):
                for t in range(rank, layout.tokens, 2):
                    offset = c * layout.chunk_nbytes + t * token
                    ranges.append((offset, data[offset : offset + token]))
            assert group.write_ranges([RangeWrite(pending, ranges)]) == [None]
        (result,) = group.commit_blocks([pending], [list(range(layout.num_chunks))])
        self.expect_publish(h, data, result.status)

    @rule(index=one, missing=st.integers(1, 6))
    def writer_never_ran(self, index: int, missing: int) -> None:
        group = self.group
        h = POOL[index]
        data = self.fresh()
        written = list(range(self.num_chunks - missing))
        (pending,) = group.begin_blocks([h])
        if written:
            payload = chunk_bytes(group.layout, data, written)
            assert group.write_chunks([ChunkWrite(pending, written, payload)]) == [None]
        (result,) = group.commit_blocks([pending])
        if h in self.model:
            assert result.status is WriteStatus.EXISTS
        else:
            assert result.status is WriteStatus.FAILED
            assert "incomplete block" in result.error or "BlockMissingError" in result.error

    @rule(index=one)
    def abort(self, index: int) -> None:
        group = self.group
        h = POOL[index]
        (pending,) = group.begin_blocks([h])
        data = self.fresh()
        first = data[: group.layout.chunk_nbytes]
        assert group.write_chunks([ChunkWrite(pending, [0], first)]) == [None]
        group.abort_blocks([pending])

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def corrupt_one(self, data: st.DataObject) -> None:
        h = data.draw(st.sampled_from(sorted(self.model)))
        group = self.group
        path = Path(group.path_of(h))
        raw = bytearray(path.read_bytes())
        raw[group.layout.data_offset + 1] ^= 0xFF
        path.write_bytes(bytes(raw))
        out = np.zeros(group.layout.block_nbytes, dtype=np.uint8)
        (result,) = group.read_blocks([BlockRead(h, out)])
        assert result.status is ReadStatus.CORRUPT
        del self.model[h]

    @rule()
    def restart(self) -> None:
        self.store.close()
        self.store = self._open()
        # iter_blocks scans all 256 fan-out directories: checked here rather than every step.
        assert sorted(b.path.name for b in self.group.iter_blocks()) == sorted(
            Path(self.group.path_of(h)).name for h in self.model
        )
        assert tmp_files(self.root) == []

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def store_equals_model(self) -> None:
        group = self.group
        outs = [np.zeros(group.layout.block_nbytes, dtype=np.uint8) for _ in POOL]
        results = group.read_blocks([BlockRead(h, o) for h, o in zip(POOL, outs, strict=True)])
        for h, out, result in zip(POOL, outs, results, strict=True):
            if h in self.model:
                assert result.status is ReadStatus.HIT, result
                np.testing.assert_array_equal(out, self.model[h])
            else:
                assert result.status is ReadStatus.MISS, result
        assert group.contains(POOL) == [h in self.model for h in POOL]

    @invariant()
    def no_temporary_files(self) -> None:
        names = self.files()
        assert [n for n in names if TMP_MARK in n] == []
        published = [n for n in names if n.isdigit()]
        assert sorted(published) == sorted(Path(self.group.path_of(h)).name for h in self.model)


class OddLayoutMachine(GroupStoreMachine):
    """The same, on the padded (non-dense) layout."""

    identity: ClassVar[Identity] = make_odd_identity()


SETTINGS = settings(
    max_examples=30,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

TestGroupStoreMachine = GroupStoreMachine.TestCase
TestGroupStoreMachine.settings = SETTINGS
TestOddLayoutMachine = OddLayoutMachine.TestCase
TestOddLayoutMachine.settings = SETTINGS

"""Block operations on one KV-cache group array: the hot path of kvstore.

Contract (every method takes and returns batches; one bad block never fails its batch):

* :meth:`GroupStore.contains` - which hashes have a published block.
* :meth:`GroupStore.longest_prefix` - how many leading blocks of a hash chain are present.
* :meth:`GroupStore.write_blocks` - write whole blocks, publish atomically.
* :meth:`GroupStore.begin_blocks`, :meth:`write_chunks`, :meth:`write_ranges`,
  :meth:`commit_blocks`, :meth:`abort_blocks` - the multi-writer protocol of docs/design.md §5:
  every writer (rank) fills the same temporary file at fixed offsets, one party publishes.
* :meth:`GroupStore.read_blocks` - read whole blocks or chosen inner chunks (heads x layers)
  into caller buffers, touching only those byte ranges; every read verifies the header against
  the key and each chunk against its checksum. A missing, short, mis-keyed, foreign or corrupt
  block is a miss: one log line, counted, quarantined, never served.
* :meth:`GroupStore.delete_blocks`, :meth:`iter_blocks`, :meth:`read_header`.

This class is a facade: each job lives in a module of its own, all sharing one
:class:`~kvstore.store.array.GroupArray` (who the array is, where its files are, how bytes
move): lookup (:mod:`.lookup`), whole-block publishing (:mod:`.publish`), the multi-writer
protocol (:mod:`.pending`) and verified reads with quarantine (:mod:`.read`).

Data and read buffers are host memory (anything with the buffer protocol) or uint8-viewable
``torch.Tensor`` objects. With an engine that takes device segments (GDS) a tensor stays where
it is: its checksums are computed on its device (``wsum64``) and its bytes move by cuFile; a
device read is verified on the device when the block's algorithm allows it, otherwise its
chunks are copied to the host for verification (logged once per store). With the other
engines a tensor is copied to host memory first (the efficient batched staging of device pages
is :class:`kvstore.rank_io.RankIO`'s, through the engine's :mod:`kvstore.io.staging`).

Published block files are immutable: they appear by ``rename`` of a complete, synced temporary
file and are only ever removed, so a reader never sees a partial block. A crash leaves only
``*.tmp-*`` files, which the admin CLI sweeps.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from kvstore.identity import GroupSpec
from kvstore.io.engine import Engine
from kvstore.io.staging import HostStaging, Staging
from kvstore.keys import check_hash
from kvstore.store.array import GroupArray
from kvstore.store.format import BlockHeader, ShardLayout
from kvstore.store.lookup import Lookup
from kvstore.store.paths import BlockFile
from kvstore.store.pending import PendingWriter
from kvstore.store.publish import Publisher
from kvstore.store.read import Reader
from kvstore.store.types import (
    BlockRead,
    BlockWrite,
    ChunkWrite,
    PendingBlock,
    RangeWrite,
    ReadResult,
    StoreStats,
    WriteResult,
)


class GroupStore:
    """Blocks of one KV-cache group (array ``g<index>``) of one namespace."""

    def __init__(self, array: GroupArray, staging: Staging | None = None) -> None:
        self.array = array
        # How RankIO stages batches of rows for this engine (host, pinned or device rows).
        self.staging: Staging = staging or HostStaging()
        self._lookup = Lookup(array)
        self._publisher = Publisher(array)
        self._pending = PendingWriter(array, self._publisher)
        self._reader = Reader(array)

    # -- what it is --------------------------------------------------------------------------

    @property
    def namespace(self) -> str:
        return self.array.namespace

    @property
    def namespace_digest(self) -> bytes:
        return self.array.namespace_digest

    @property
    def index(self) -> int:
        return self.array.index

    @property
    def spec(self) -> GroupSpec:
        return self.array.spec

    @property
    def layout(self) -> ShardLayout:
        return self.array.layout

    @property
    def array_path(self) -> Path:
        return self.array.array_path

    @property
    def engine(self) -> Engine:
        return self.array.engine

    @property
    def stats(self) -> StoreStats:
        return self.array.stats

    @property
    def read_only(self) -> bool:
        return self.array.read_only

    @property
    def compression(self) -> str:
        """The array's inner-chunk compression (its zarr.json decides)."""
        return self.array.compression

    # -- naming ------------------------------------------------------------------------------

    def path_of(self, block_hash: bytes) -> str:
        """Absolute path of the block's published shard file."""
        return self.array.block_path(block_hash)

    def fanout_dir(self, hash_hi: int) -> Path:
        """Directory holding the shard files whose hash starts with byte ``hash_hi``."""
        return self.array.paths.fanout_dir(hash_hi)

    # -- lookup ------------------------------------------------------------------------------

    def contains(self, hashes: Sequence[bytes]) -> list[bool]:
        """:meth:`Lookup.contains <kvstore.store.lookup.Lookup.contains>`."""
        return self._lookup.contains(hashes)

    def longest_prefix(self, chain: Sequence[bytes]) -> int:
        """:meth:`Lookup.longest_prefix <kvstore.store.lookup.Lookup.longest_prefix>`."""
        return self._lookup.longest_prefix(chain)

    # -- writes ------------------------------------------------------------------------------

    def write_blocks(self, writes: Sequence[BlockWrite]) -> list[WriteResult]:
        """:meth:`Publisher.write_blocks <kvstore.store.publish.Publisher.write_blocks>`."""
        return self._publisher.write_blocks(writes)

    def begin_blocks(
        self,
        hashes: Sequence[bytes],
        parents: Sequence[bytes | None] | None = None,
        tokens: Sequence[str] | None = None,
    ) -> list[PendingBlock]:
        """:meth:`~kvstore.store.pending.PendingWriter.begin_blocks`."""
        return self._pending.begin_blocks(hashes, parents, tokens)

    def pending_complete(self, pending: PendingBlock) -> bool:
        """:meth:`~kvstore.store.pending.PendingWriter.is_complete`."""
        return self._pending.is_complete(pending)

    def temp_path(self, pending: PendingBlock) -> str:
        """The temporary file all writers of ``pending`` fill."""
        return self._pending.temp_path(pending)

    def write_chunks(self, writes: Sequence[ChunkWrite]) -> list[BaseException | None]:
        """:meth:`~kvstore.store.pending.PendingWriter.write_chunks`."""
        return self._pending.write_chunks(writes)

    def write_ranges(self, writes: Sequence[RangeWrite]) -> list[BaseException | None]:
        """:meth:`~kvstore.store.pending.PendingWriter.write_ranges`."""
        return self._pending.write_ranges(writes)

    def commit_blocks(
        self,
        pendings: Sequence[PendingBlock],
        checksum_chunks: Sequence[Sequence[int]] | None = None,
        range_writers: int = 0,
    ) -> list[WriteResult]:
        """:meth:`~kvstore.store.pending.PendingWriter.commit_blocks`."""
        return self._pending.commit_blocks(pendings, checksum_chunks, range_writers)

    def abort_blocks(self, pendings: Sequence[PendingBlock]) -> None:
        """Remove the temporary files of pending blocks that will not be committed."""
        self._pending.abort_blocks(pendings)

    # -- reads -------------------------------------------------------------------------------

    def read_blocks(self, reads: Sequence[BlockRead]) -> list[ReadResult]:
        """:meth:`Reader.read_blocks <kvstore.store.read.Reader.read_blocks>`."""
        return self._reader.read_blocks(reads)

    def read_header(self, block_hash: bytes) -> tuple[BlockHeader, np.ndarray]:
        """The verified header and checksum slots of a published block (for tools)."""
        return self._reader.read_header(block_hash)

    # -- removal and iteration ---------------------------------------------------------------

    def delete_blocks(self, hashes: Sequence[bytes]) -> int:
        """Remove published blocks; returns how many existed."""
        self.array.check_writable()
        removed = 0
        for h in hashes:
            try:
                self.array.fio.unlink(self.path_of(check_hash(h)))
                removed += 1
            except FileNotFoundError:
                pass
        return removed

    def iter_blocks(self) -> Iterator[BlockFile]:
        """Every published block file of this group (temporary files skipped), unordered."""
        return self.array.paths.list_blocks()

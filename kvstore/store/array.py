"""One group array as its block operations see it: who it is, where its files are, how bytes move.

A :class:`GroupArray` is fixed when a namespace is opened (:mod:`kvstore.store.page_store`)
and shared by the modules that implement :class:`~kvstore.store.group_store.GroupStore`:
lookup (:mod:`.lookup`), publishing (:mod:`.publish`, :mod:`.pending`) and reading
(:mod:`.read`). Its only mutable state is the memo of fan-out directories already checked
(:meth:`GroupArray.block_path`); the stats object it points to counts for the whole store.
"""

from __future__ import annotations

import contextlib
import math
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from time import monotonic  # (a name of this module: tests move its clock)

from kvstore.checksum import checksum_id
from kvstore.errors import EntryKindError, KvstoreError
from kvstore.identity import GroupSpec
from kvstore.io.engine import DeviceEngine, Engine, device_engine
from kvstore.io.entries import describe_kind
from kvstore.io.fileio import FileIO
from kvstore.keys import HASH_HI_FANOUT, hash_coords
from kvstore.store.check import ShardSpec
from kvstore.store.codec import Codec
from kvstore.store.compression import CompressedShards
from kvstore.store.format import ShardLayout
from kvstore.store.paths import ArrayPaths
from kvstore.store.plan import ArrayPlan, plan_array
from kvstore.store.types import StoreStats

# Seconds a fan-out directory seen to be a real directory is trusted before it is checked
# again: bounds how long a link put in its place while the server runs is followed, at one
# lstat per fan-out directory per period (256 per array at most).
FANOUT_RECHECK_S = 5.0


@dataclass(frozen=True)
class GroupArray:
    """Array ``g<index>`` of one namespace, and how this store reads and writes it."""

    namespace: str  # the namespace's directory name
    namespace_digest: bytes  # SHA-256 of its identity (every block header carries it)
    index: int  # k of g<k>
    spec: GroupSpec  # the KV-cache group
    layout: ShardLayout  # byte layout of its shard files
    paths: ArrayPaths  # where its files live
    engine: Engine  # the store's I/O engine (threads, host / pinned / GDS)
    stats: StoreStats  # the store's counters
    checksum: str  # algorithm of new blocks ("xxh3_64", "crc32c", "wsum64")
    verify_reads: bool  # verify every chunk read against its checksum
    quarantine_dir: Path | None  # where corrupt blocks go; None: they are removed
    read_only: bool = False  # nothing is written, quarantined or touched
    compression: str = "none"  # the array's inner-chunk compression (its zarr.json decides)

    @property
    def label(self) -> str:
        return f"{self.namespace}/g{self.index}"

    @property
    def array_path(self) -> Path:
        return self.paths.array

    @cached_property
    def fio(self) -> FileIO:
        return self.engine.fio

    @cached_property
    def checksum_algo(self) -> int:
        return checksum_id(self.checksum)

    @cached_property
    def device_engine(self) -> DeviceEngine | None:
        """The engine if it takes device segments (GDS): tensors then go to it as they are."""
        return device_engine(self.engine)

    @cached_property
    def codec(self) -> Codec | None:
        return Codec.for_name(self.compression, self.layout.itemsize)

    @cached_property
    def shard(self) -> ShardSpec:
        """What every block file of this array must be (:mod:`kvstore.store.check`)."""
        return ShardSpec(self.layout, self.namespace_digest, self.index, self.codec)

    @cached_property
    def plan(self) -> ArrayPlan:
        """The paths this array's reads and writes take (:mod:`kvstore.store.plan`)."""
        return plan_array(
            self.layout,
            self.engine,
            compressed=self.codec is not None,
            checksum_algo=self.checksum_algo,
            verify_reads=self.verify_reads,
            read_only=self.read_only,
        )

    @cached_property
    def compressed(self) -> CompressedShards | None:
        """The compressed block reader and writer; None for raw chunks."""
        if self.codec is None:
            return None
        return CompressedShards(self.codec, self.shard, self.engine)

    def block_path(self, block_hash: bytes) -> str:
        """Absolute path of the published shard file of a (checked) block hash.

        Block files are opened, created and renamed by this path with ``O_NOFOLLOW``, which
        refuses a link only at the last component, and the directories above the fan-out
        directories were entered with no link followed when the namespace was opened. So the
        block's fan-out directory is checked here (one ``lstat``, then again once
        :data:`FANOUT_RECHECK_S` have passed): a link (to anywhere), file or FIFO at its name
        raises :class:`~kvstore.errors.EntryKindError` (an OSError: lookups and reads count a
        miss, writes fail) instead of taking the operation through it, perhaps outside the
        root. A missing fan-out directory is not remembered: a writer creates it with no link
        followed (:meth:`open_dir`), and the next call checks it. A directory replaced by a
        link while the server runs can be followed until its next check (at most
        :data:`FANOUT_RECHECK_S`); the directories above the fan-out directories are checked
        only when the namespace is opened.
        """
        hi, lo = hash_coords(block_hash)
        now = monotonic()
        if now - self._fanouts_checked[hi] > FANOUT_RECHECK_S:
            self._check_fanout(hi, now)
        return f"{self.paths.prefix}{hi}{os.sep}{lo}"

    def block_paths(self, hashes: Sequence[bytes]) -> list[str | OSError]:
        """:meth:`block_path` of each (checked) hash, or the error its fan-out directory's
        check raised, in one loop (a lookup batch: vLLM's tier probes 256 keys per step on
        a thread that holds the GIL for all of it)."""
        prefix, sep = self.paths.prefix, os.sep
        checked = self._fanouts_checked
        now = monotonic()
        out: list[str | OSError] = []
        for block_hash in hashes:
            hi, lo = hash_coords(block_hash)
            if now - checked[hi] > FANOUT_RECHECK_S:
                try:
                    self._check_fanout(hi, now)
                except OSError as exc:
                    out.append(exc)
                    continue
            out.append(f"{prefix}{hi}{sep}{lo}")
        return out

    @cached_property
    def _fanouts_checked(self) -> list[float]:
        """When (monotonic seconds) each fan-out directory was last seen to be a real
        directory; -inf: not yet."""
        return [-math.inf] * HASH_HI_FANOUT

    def _check_fanout(self, hash_hi: int, now: float) -> None:
        # The string block_path builds on (paths.fanout_dir's, without a Path per check: a
        # fresh store checks up to 256 of them in its first seconds).
        path = f"{self.paths.prefix}{hash_hi}"
        try:
            mode = self.fio.lstat_at(None, path).st_mode
        except FileNotFoundError:
            return  # nothing there to follow; an open below it fails with ENOENT
        if not stat.S_ISDIR(mode):
            raise EntryKindError(f"{path}: expected a directory, got {describe_kind(mode)}")
        self._fanouts_checked[hash_hi] = now

    def check_writable(self) -> None:
        if self.read_only:
            raise KvstoreError(f"{self.label}: store opened read-only")

    def open_dir(self, directory: str, created: list[str] | None = None) -> int:
        """A descriptor of ``directory`` (below the store root), entered from the root with no
        link followed (:func:`~kvstore.io.entries.open_dir_nofollow`); missing directories are
        created (and listed in ``created``) when ``created`` is given. The caller closes it."""
        root = self.array_path.parent.parent  # <root>/<namespace>/g<k>
        parts = os.path.relpath(directory, root).split(os.sep)
        mode = None if created is None else self.engine.config.dir_mode
        return self.fio.open_dir(root, parts, mode, created)

    def remove_quietly(self, path: str) -> None:
        with contextlib.suppress(OSError):
            self.fio.unlink(path)


def short_hash(block_hash: bytes) -> str:
    """A block hash as log lines show it."""
    return block_hash.hex()[:16]

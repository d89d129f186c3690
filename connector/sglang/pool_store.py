"""One SGLang host pool's pages in its kvstore namespace: lookups, share writes, share reads.

Writes. A rank whose share is the whole block (TP=1, MLA, or heads replicated onto it)
publishes it alone through the whole-block path (one temporary file, renamed into place).
Otherwise the ranks of the block meet in one temporary file of the multi-writer protocol
(docs/design.md, write protocol) without a coordinator: SGLang's ranks never tell each other
what they stored, so each derives the file's token from the namespace and the key, writes its
inner chunks with their checksums (fsync'd when the store is durable), then reads the file's
checksum slots; the writer that finds every slot filled commits the block (the rename never
replaces a published block, so two writers that both see it complete publish it once). A
block is visible only once every share is in, and a rank that never writes leaves a temporary
file that ``kvstore gc`` sweeps.

Reads. A rank reads only its own inner chunks, each verified against its checksum; a missing,
corrupt, short or foreign block is a miss (a corrupt one is quarantined, so the next lookup
stops before it), and nothing of it reaches the pool.

Threads. Only the calling thread (SGLang's) touches the pool: it gathers pages into its
staging rows before a write and scatters read rows into the pool after the read. The file
I/O of each slice goes through a runner: here on the same thread, in the backend on its own
threads within the call's deadline (:mod:`connector.sglang.deadlines`). A slice the runner
gave up on keeps its rows (the stuck I/O still reads into or writes from them): the calling
thread takes new ones, and nothing of that slice reaches the pool.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from connector.sglang.pages import PoolGeometry, PoolPages, pool_buffers, pool_geometry
from connector.sglang.share import RankShare, pool_identity, rank_share
from connector.sglang.stats import BackendStats
from kvstore import ConfigError, Identity, KVStore
from kvstore.keys import MAX_HASH_BYTES, MIN_HASH_BYTES
from kvstore.store.group_store import GroupStore
from kvstore.store.types import (
    BlockRead,
    BlockWrite,
    ChunkWrite,
    PendingBlock,
    ReadStatus,
    WriteStatus,
)

# Per thread and pool, the rows a batch moves between the pool and the store go through one
# staging buffer of at most this size, reused call after call: SGLang hands over up to 128
# pages per call (1 GiB of an 8 MiB-page model), and freshly allocated rows cost a page fault
# per 4 KiB on every call (measured: it halved a batch write's speed).
STAGING_BYTES = 64 << 20

logger = logging.getLogger("kvstore.sglang")

# A slice's file I/O, and what runs it: the runner returns the step's per-key results, or None
# when it gave up waiting (the step may still be running; ``int``: its staging bytes).
Step = Callable[[], list[bool]]
Runner = Callable[[Step, int], list[bool] | None]


def run_here(step: Step, held_bytes: int = 0) -> list[bool] | None:
    """The runner without a deadline: ``step`` on the calling thread."""
    return step()


def block_hash(key: object) -> bytes | None:
    """SGLang's page key (hex digits of its SHA-256 chain) as a block hash; None for a key
    that is not one (a miss, never an exception)."""
    if not isinstance(key, str):
        return None
    try:
        raw = bytes.fromhex(key)
    except ValueError:
        return None
    return raw if MIN_HASH_BYTES <= len(raw) <= MAX_HASH_BYTES else None


class PoolStore:
    """Moves one rank's share of one host pool's pages to and from its namespace."""

    def __init__(  # noqa: PLR0913 - the store, the pool and what identifies the rank and model
        self,
        store: KVStore,
        name: str,
        pool: Any,
        storage: Any,
        model: str,
        totals: tuple[int, int],
    ) -> None:
        self.name = name
        self.geometry: PoolGeometry = pool_geometry(pool)
        self.pages = PoolPages(self.geometry, pool_buffers(pool, self.geometry))
        num_kv_heads, num_layers = totals
        start_layer = int(getattr(pool, "start_layer", 0) or 0)
        self.share: RankShare = rank_share(
            self.geometry, storage, start_layer, num_kv_heads, num_layers
        )
        self.identity: Identity = pool_identity(model, name, self.geometry, self.share)
        self.group: GroupStore = store.namespace(self.identity).group(0)
        layout = self.group.layout
        share_nbytes = len(self.share.chunks) * layout.chunk_nbytes
        if share_nbytes != self.geometry.share_nbytes:
            raise ConfigError(
                f"pool {name}: a share of {len(self.share.chunks)} chunks is {share_nbytes} "
                f"bytes in the store, {self.geometry.share_nbytes} in the pool"
            )
        self._read_chunks = None if self.share.whole else list(self.share.chunks)
        self._digest = self.group.namespace_digest
        self._staging = threading.local()
        self.pages_per_slice = max(1, STAGING_BYTES // self.geometry.share_nbytes)

    @property
    def namespace(self) -> str:
        return self.group.namespace

    # -- lookups -------------------------------------------------------------------------------

    def contains(self, hashes: Sequence[bytes | None]) -> list[bool]:
        """Per key, whether its block is published (one ``stat`` each, batched)."""
        valid = [i for i, h in enumerate(hashes) if h is not None]
        found = self.group.contains([hashes[i] for i in valid]) if valid else []  # type: ignore[misc]
        out = [False] * len(hashes)
        for i, present in zip(valid, found, strict=True):
            out[i] = present
        return out

    def leading(self, hashes: Sequence[bytes | None]) -> int:
        """How many keys from the start are published."""
        present = self.contains(hashes)
        return present.index(False) if False in present else len(present)

    # -- writes --------------------------------------------------------------------------------

    def write_pages(  # noqa: PLR0913 - the blocks, where their pages are, and how to run the I/O
        self,
        hashes: Sequence[bytes | None],
        parents: Sequence[bytes | None],
        ids: torch.Tensor,
        stats: BackendStats,
        pages: Sequence[PoolPages] | None = None,
        run: Runner = run_here,
    ) -> list[bool | None]:
        """Write this rank's share of pool pages ``ids`` (or, with ``pages``, of page 0 of each
        key's own one-page view: the flat pages of the generic interface) as blocks
        ``hashes``, slice by slice through this thread's staging rows.

        Per key: True once this rank's share is stored (durably when the store is durable)
        or the block is published already; False when it is not (the reason is logged);
        None when ``run`` gave up on its slice (later slices are not tried). A slice given up
        on may still publish once its I/O returns: its rows hold the pages as they were when
        this call gathered them, and a block appears whole or not at all.
        """
        done: list[bool | None] = []
        for part in self._slices(len(hashes)):
            rows = self._rows(part.stop - part.start)
            self._gather(rows, ids[part], None if pages is None else pages[part])
            start = time.perf_counter()
            step = partial(self._write_rows, hashes[part], parents[part], rows.numpy())
            written = run(step, _held_bytes(rows))
            if written is None:
                self._drop_rows()
                break
            self._count_write(stats, written, time.perf_counter() - start)
            done += written
        return done + [None] * (len(hashes) - len(done))

    def _slices(self, count: int) -> list[slice]:
        step = self.pages_per_slice
        return [slice(i, min(i + step, count)) for i in range(0, count, step)]

    def _rows(self, count: int) -> torch.Tensor:
        """``count`` staging rows of this thread (uint8 ``(count, share_nbytes)``), valid until
        its next call."""
        nbytes = self.geometry.share_nbytes
        buffer: torch.Tensor | None = getattr(self._staging, "rows", None)
        if buffer is None or buffer.shape[0] < count:
            buffer = torch.empty((max(count, 1), nbytes), dtype=torch.uint8)
            self._staging.rows = buffer
        return buffer[:count]

    def _drop_rows(self) -> None:
        """Leave this thread's rows to the I/O that was given up on (it may still use them)."""
        self._staging.rows = None

    def _gather(
        self, rows: torch.Tensor, ids: torch.Tensor, pages: Sequence[PoolPages] | None
    ) -> None:
        if pages is None:
            self.pages.gather(ids, out=rows)
            return
        first = torch.zeros(1, dtype=torch.int64)
        for i, view in enumerate(pages):
            view.gather(first, out=rows[i : i + 1])

    def _write_rows(
        self, hashes: Sequence[bytes | None], parents: Sequence[bytes | None], data: np.ndarray
    ) -> list[bool]:
        """The file I/O of a write: share rows ``data`` as blocks ``hashes``."""
        todo = [i for i, h in enumerate(hashes) if h is not None]
        done = [False] * len(hashes)
        if todo:
            ok = (
                self._write_whole(hashes, parents, data, todo)
                if self.share.whole
                else self._write_shared(hashes, parents, data, todo)
            )
            for i, success in zip(todo, ok, strict=True):
                done[i] = success
        return done

    def _count_write(self, stats: BackendStats, done: list[bool], seconds: float) -> None:
        written = sum(done)
        nbytes = written * self.geometry.share_nbytes
        stats.add(pages_written=written, write_failures=len(done) - written)
        stats.add(bytes_written=nbytes, write_seconds=seconds)
        stats.record_io("write", written, nbytes, seconds)

    def _write_whole(
        self,
        hashes: Sequence[bytes | None],
        parents: Sequence[bytes | None],
        data: np.ndarray,
        todo: list[int],
    ) -> list[bool]:
        writes = [BlockWrite(hashes[i], data[i], parents[i]) for i in todo]  # type: ignore[arg-type]
        results = self.group.write_blocks(writes)
        return [r.status in (WriteStatus.WRITTEN, WriteStatus.EXISTS) for r in results]

    def _write_shared(
        self,
        hashes: Sequence[bytes | None],
        parents: Sequence[bytes | None],
        data: np.ndarray,
        todo: list[int],
    ) -> list[bool]:
        present = self.contains([hashes[i] for i in todo])
        ok = list(present)
        new = [k for k, p in enumerate(present) if not p]
        if not new:
            return ok
        keys = [hashes[todo[k]] for k in new]
        pendings = self.group.begin_blocks(
            keys,  # type: ignore[arg-type]
            [parents[todo[k]] for k in new],
            [self._token(h) for h in keys],  # type: ignore[arg-type]
        )
        chunks = list(self.share.chunks)
        errors = self.group.write_chunks(
            [ChunkWrite(p, chunks, data[todo[k]]) for p, k in zip(pendings, new, strict=True)]
        )
        complete: list[tuple[int, PendingBlock]] = []
        failed: list[tuple[bytes, BaseException]] = []
        for k, pending, error in zip(new, pendings, errors, strict=True):
            if error is not None:  # the temporary file is left for the others
                failed.append((pending.block_hash, error))
                continue
            ok[k] = True
            if self.group.pending_complete(pending):
                complete.append((k, pending))
        if failed:
            self._log_share_failures(failed, len(todo))
        if complete:
            # A failed commit is logged by the store (one line per batch, with the reason).
            results = self.group.commit_blocks([p for _, p in complete])
            for (k, pending), result in zip(complete, results, strict=True):
                if result.status is WriteStatus.FAILED:
                    # Another writer of the block may have committed it between our check
                    # and our rename: then it is published and this share is in it.
                    ok[k] = self.group.contains([pending.block_hash])[0]
        return ok

    def _log_share_failures(self, failed: list[tuple[bytes, BaseException]], total: int) -> None:
        """One line per call for the shares this rank could not write (the store returns
        these errors without logging them)."""
        block, error = failed[0]
        logger.warning(
            "kvstore HiCache write: this rank's share of %d of %d pages not stored in %s "
            "(pool %r), first: %s (%s: %s)",
            len(failed),
            total,
            self.namespace,
            self.name,
            block.hex()[:16],
            type(error).__name__,
            error,
        )

    def _token(self, block: bytes) -> str:
        """The temporary file's token every writer of ``block`` derives alike."""
        return "sg" + hashlib.blake2b(self._digest + block, digest_size=8).hexdigest()

    # -- reads ---------------------------------------------------------------------------------

    def read(
        self,
        hashes: Sequence[bytes | None],
        ids: torch.Tensor,
        stats: BackendStats,
        pages: Sequence[PoolPages] | None = None,
        run: Runner = run_here,
    ) -> list[bool | None]:
        """Read blocks ``hashes`` and scatter this rank's share of the hits into pool pages
        ``ids`` (or, with ``pages``, into page 0 of each key's own one-page view: the flat
        pages of the generic interface). Per key: whether it was served; None when ``run``
        gave up on its slice (later slices are not tried). Nothing is written for a miss, nor
        for a slice given up on, ever."""
        served: list[bool | None] = []
        for part in self._slices(len(hashes)):
            rows = self._rows(part.stop - part.start)
            start = time.perf_counter()
            step = partial(self._read_rows, hashes[part], rows.numpy(), stats)
            found = run(step, _held_bytes(rows))
            if found is None:
                self._drop_rows()
                break
            self._scatter(rows, found, ids[part], None if pages is None else pages[part])
            self._count_read(stats, found, time.perf_counter() - start)
            served += found
        return served + [None] * (len(hashes) - len(served))

    def _scatter(
        self,
        rows: torch.Tensor,
        served: list[bool],
        ids: torch.Tensor,
        pages: Sequence[PoolPages] | None,
    ) -> None:
        hits = [i for i, s in enumerate(served) if s]
        if hits and pages is None and len(hits) == len(served):
            self.pages.scatter(ids, rows)
        elif hits and pages is None:
            for i in hits:  # row slices are views: no copy of the rows that were read
                self.pages.scatter(ids[i : i + 1], rows[i : i + 1])
        elif hits and pages is not None:
            first = torch.zeros(1, dtype=torch.int64)
            for i in hits:
                pages[i].scatter(first, rows[i : i + 1])

    def _count_read(self, stats: BackendStats, served: list[bool], seconds: float) -> None:
        hits = sum(served)
        nbytes = hits * self.geometry.share_nbytes
        stats.add(hits=hits, misses=len(served) - hits, bytes_read=nbytes)
        stats.add(read_seconds=seconds)
        stats.record_io("read", hits, nbytes, seconds)

    def _read_rows(
        self, hashes: Sequence[bytes | None], rows: np.ndarray, stats: BackendStats
    ) -> list[bool]:
        """The file I/O of a read: blocks ``hashes`` into staging ``rows`` (corrupt counted)."""
        valid = [i for i, h in enumerate(hashes) if h is not None]
        served = [False] * len(hashes)
        if valid:
            results = self.group.read_blocks(
                [BlockRead(hashes[i], rows[i], self._read_chunks) for i in valid]  # type: ignore[arg-type]
            )
            corrupt = 0
            for i, result in zip(valid, results, strict=True):
                served[i] = result.ok
                corrupt += result.status is ReadStatus.CORRUPT
            stats.add(corrupt=corrupt)
        return served


def _held_bytes(rows: torch.Tensor) -> int:
    """Bytes of the staging buffer ``rows`` lie in (a slice keeps all of it alive)."""
    return int(rows.untyped_storage().nbytes())

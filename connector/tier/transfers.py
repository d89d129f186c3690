"""The tier's job functions: one part of a store or promotion job, on a tier job thread.

:class:`connector.tier.manager.KVStoreTier` cuts each job into parts and hands
:class:`connector.tier.jobs.JobRunner` a :class:`BlockTransfers` method per part, bound to the
part's keys and CPU-tier chunks; the runner calls it with the part's gate.

* :meth:`BlockTransfers.store` copies the chunks out of the rows, under the gate, into the
  thread's staging buffer and publishes their canonical blocks
  (:meth:`kvstore.GroupStore.write_blocks`);
* :meth:`BlockTransfers.load` reads and verifies the blocks
  (:meth:`kvstore.GroupStore.read_blocks`) straight into the rows where the tier decided so
  (``loads_in_place``, claiming the gate before the read), otherwise into the thread's staging
  buffer, then scatters the hits into the rows once the gate is claimed.

Nothing reaches or leaves the rows without the part's gate (:mod:`connector.tier.jobs`), so a
part cut short never touches chunks vLLM already reuses. Each returns an
:class:`connector.tier.jobs.Outcome` (the keys written or present, or arrived) and never
raises for a block that failed: that key is left out. Every store call's return, in time or
late, tells :class:`connector.tier.health.TierHealth` that the store answers. Each job thread
keeps one staging buffer of its own (a thread stuck in the file system keeps its own).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from connector.identity import GROUP_ID_BYTES, KeyMap
from connector.tier.chunks import ChunkMap
from connector.tier.health import TierHealth
from connector.tier.jobs import NOTHING, Outcome
from connector.tier.lookup import split_key
from kvstore import BlockRead, BlockWrite, Namespace, WriteStatus
from kvstore.io.buffers import aligned_buffer
from kvstore.io.deadline import DeliveryGate


class BlockTransfers:
    """Moves one part's blocks between the CPU tier's rows and the store (job threads)."""

    def __init__(  # noqa: PLR0913 - keyword-only: the tier's collaborators a part needs, and the paths it chose per array
        self,
        *,
        chunks: ChunkMap,
        namespace: Namespace,
        key_map: KeyMap,
        block_bytes: Mapping[bytes, int],
        present: Container[bytes],
        health: TierHealth,
        in_place: Sequence[bool],
        loads_in_place: Sequence[bool],
    ) -> None:
        self.chunks = chunks
        self.namespace = namespace
        self.key_map = key_map
        # a key's group id suffix -> the bytes of its canonical block
        self._block_bytes = block_bytes
        self._present = present  # keys the tier knows present: a store skips them
        self._health = health
        # per array: stores hand the store strided views of row copies (else gathered blocks)
        self.in_place = list(in_place)
        # per array: promotions read straight into the rows (else staged and scattered)
        self.loads_in_place = list(loads_in_place)
        self._staging = threading.local()  # per job thread: a reused staging buffer

    def store(
        self,
        keys: Sequence[bytes],
        chunk_ids: Sequence[int],
        parents: Sequence[bytes | None],
        gate: DeliveryGate,
    ) -> Outcome:
        """(one part of a store job) Publish the canonical blocks of the chunks; the keys
        written or already present.

        The chunks are copied out of the rows first, under ``gate`` (not at all if the job was
        given up on before), into this thread's staging buffer: a write that outlives the
        job's deadline reads only that copy, whatever vLLM puts in the rows meanwhile. A
        failed write is logged by the store (one line per batch, with the first error) and
        leaves the key out: the job fails, and vLLM's backpressure counts it."""
        ok = {k for k in keys if k in self._present}
        todo = {
            array: [(i, h) for i, h in items if keys[i] not in ok]
            for array, items in _by_array(self.key_map, keys).items()
        }
        todo = {array: items for array, items in todo.items() if items}
        if not todo:
            return Outcome(frozenset(ok), 0)
        if not gate.claim():  # cut short before it read the rows: no copy, no write
            return NOTHING
        try:
            blocks = self._copy_out(todo, chunk_ids)
        finally:
            gate.release()
        stored: list[bytes] = []
        for array, items in todo.items():
            writes = [BlockWrite(h, blocks[array][j], parents[i]) for j, (i, h) in enumerate(items)]
            results = self._call(self.namespace.group(array).write_blocks, writes)
            for (i, _), result in zip(items, results, strict=True):
                if result.status in (WriteStatus.WRITTEN, WriteStatus.EXISTS):
                    stored.append(keys[i])
        return Outcome(frozenset(ok.union(stored)), self.nbytes(stored))

    def _copy_out(
        self, todo: dict[int, list[tuple[int, bytes]]], chunk_ids: Sequence[int]
    ) -> dict[int, list[np.ndarray]]:
        """Copy the chunks of ``todo`` (per array: positions in ``chunk_ids`` and hashes) out
        of the rows into this thread's staging buffer; per array, the blocks as the store
        takes them (views of row copies, written as pieces, or gathered canonical blocks)."""
        chunks = self.chunks
        size = {
            a: chunks.source_span_bytes(a) if self.in_place[a] else chunks.groups[a].block_bytes
            for a in todo
        }
        buffer = self._buffer(sum(len(items) * size[a] for a, items in todo.items()))
        blocks: dict[int, list[np.ndarray]] = {}
        offset = 0
        for array, items in todo.items():
            out = buffer[offset : offset + len(items) * size[array]]
            offset += len(items) * size[array]
            copy = chunks.source_views if self.in_place[array] else chunks.to_blocks
            blocks[array] = copy(array, [chunk_ids[i] for i, _ in items], out)
        return blocks

    def load(self, keys: Sequence[bytes], chunk_ids: Sequence[int], gate: DeliveryGate) -> Outcome:
        """(one part of a promotion job) Read and verify the blocks into their chunk rows;
        the keys that arrived.

        Nothing reaches the rows without ``gate``: blocks read straight into the rows (vLLM
        0.34) claim it before the read, staged blocks after theirs, before the scatter. A
        part given up on before its claim leaves the rows untouched (what it read stays in
        this thread's buffer). A block that fails leaves its row partly written, which
        nothing reads: vLLM frees the chunks of failed promotion keys
        (TieringOffloadingManager._complete_promotion: complete_write(..., False))."""
        by_array = _by_array(self.key_map, keys)
        into_rows = any(self.loads_in_place[a] for a in by_array)
        if gate.abandoned or (into_rows and not gate.claim()):  # cut short: no read
            return NOTHING
        ok: set[bytes] = set()
        for array, items in by_array.items():
            if self.loads_in_place[array]:
                ok.update(self._read_into_rows(array, items, keys, chunk_ids))
        staged = {a: items for a, items in by_array.items() if not self.loads_in_place[a]}
        scatters = self._read_staged(staged, keys, chunk_ids)
        if scatters and not into_rows and not gate.claim():  # given up while it read
            return NOTHING
        for array, blocks, rows, arrived in scatters:
            self.chunks.from_blocks(array, blocks, rows)
            ok.update(arrived)
        gate.release()
        return Outcome(frozenset(ok), self.nbytes(ok))

    def _read_into_rows(
        self,
        array: int,
        items: Sequence[tuple[int, bytes]],
        keys: Sequence[bytes],
        chunk_ids: Sequence[int],
    ) -> list[bytes]:
        """Read and verify blocks of ``array`` straight into their rows; the keys that
        arrived."""
        views = self.chunks.destination_views(array, [chunk_ids[i] for i, _ in items])
        reads = [BlockRead(h, views[j]) for j, (_, h) in enumerate(items)]
        results = self._call(self.namespace.group(array).read_blocks, reads)
        return [keys[i] for (i, _), r in zip(items, results, strict=True) if r.ok]

    def _read_staged(
        self,
        staged: dict[int, list[tuple[int, bytes]]],
        keys: Sequence[bytes],
        chunk_ids: Sequence[int],
    ) -> list[tuple[int, torch.Tensor, list[int], list[bytes]]]:
        """Read and verify blocks into this thread's staging buffer; per array with hits,
        ``(array, blocks, rows, keys)`` for the scatter into the rows."""
        sizes = {a: self.chunks.groups[a].block_bytes for a in staged}
        buffer = self._buffer(sum(len(items) * sizes[a] for a, items in staged.items()))
        scatters = []
        offset = 0
        for array, items in staged.items():
            n, size = len(items), sizes[array]
            blocks = buffer[offset : offset + n * size].view(n, size)
            offset += n * size
            reads = [BlockRead(h, blocks[j].numpy()) for j, (_, h) in enumerate(items)]
            results = self._call(self.namespace.group(array).read_blocks, reads)
            hits = [j for j, r in enumerate(results) if r.ok]
            if hits:
                rows = [chunk_ids[items[j][0]] for j in hits]
                arrived = [keys[items[j][0]] for j in hits]
                scatters.append((array, blocks[hits] if len(hits) < n else blocks, rows, arrived))
        return scatters

    def nbytes(self, keys: Iterable[bytes]) -> int:
        """Bytes of the canonical blocks of ``keys``."""
        return sum(self._block_bytes.get(k[-GROUP_ID_BYTES:], 0) for k in keys)

    def _call(self, call: Callable[[Sequence[Any]], list[Any]], items: Sequence[Any]) -> list[Any]:
        """A store call from a job thread; its return, in time or late, with results or an
        exception, tells that the store answers (ends an unresponsive episode)."""
        try:
            return call(items)
        finally:
            self._health.responsiveness.answered()

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """This job thread's staging buffer of at least ``nbytes`` bytes (grown, kept; flat
        uint8). A thread stuck in the file system keeps its own: no other thread uses it."""
        buffer: torch.Tensor | None = getattr(self._staging, "buffer", None)
        if buffer is None or buffer.numel() < nbytes:
            # page-aligned, so O_DIRECT reads (direct_reads) land in it without a bounce
            buffer = torch.from_numpy(aligned_buffer(max(nbytes, 1)))
            self._staging.buffer = buffer
        return buffer


def _by_array(key_map: Any, keys: Sequence[bytes]) -> dict[int, list[tuple[int, bytes]]]:
    """Keys grouped by array: ``array -> [(position in keys, block hash)]``."""
    out: dict[int, list[tuple[int, bytes]]] = defaultdict(list)
    for i, key in enumerate(keys):
        where = split_key(key_map, key)
        if where is not None:
            out[where[0]].append((i, where[1]))
    return out

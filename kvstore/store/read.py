"""Reading blocks: verified reads into caller buffers, and quarantine of what fails.

:meth:`Reader.read_blocks` reads whole blocks or chosen inner chunks (heads x layers) into
caller buffers, touching only those byte ranges: the header and each contiguous run of chunks.
Every read checks the header against the key it asked for and each chunk against its checksum
(:mod:`kvstore.store.check`). A missing, short, mis-keyed, foreign or corrupt block is a miss:
one log line, counted, and the corrupt file quarantined (:mod:`kvstore.store.quarantine`) -
never served.

How a read goes is decided in two steps. When the array opens, its plan
(:mod:`kvstore.store.plan`) says which paths it may take; the reader builds one strategy
object per path then (:mod:`kvstore.store.reads`). Each request then takes the strategy its
buffer and its chunks call for, in one dispatch (:meth:`Reader._read_one`):

* a batch of whole blocks into rows or small buffers: :mod:`~kvstore.store.reads.batch`, one
  native call per I/O thread (what it cannot finish comes back to the block-by-block path);
* a strided numpy view: :mod:`~kvstore.store.reads.strided`;
* a whole block into host memory (not a tensor): :mod:`~kvstore.store.reads.whole`, or
  :mod:`~kvstore.store.reads.hashed` for large blocks;
* anything else (chunks, padded or compressed arrays, tensors):
  :mod:`~kvstore.store.reads.general`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from kvstore.errors import BlockMissingError, CorruptBlockError, KvstoreError
from kvstore.io.entries import FileId
from kvstore.keys import check_hash
from kvstore.store import check
from kvstore.store import format as fmt
from kvstore.store.array import GroupArray, short_hash
from kvstore.store.format import BlockHeader
from kvstore.store.plan import WholeRead
from kvstore.store.quarantine import quarantine
from kvstore.store.reads.batch import BatchRead
from kvstore.store.reads.context import ReadContext
from kvstore.store.reads.general import GeneralRead
from kvstore.store.reads.hashed import HashedRead
from kvstore.store.reads.strided import StridedRead
from kvstore.store.reads.whole import WholeRead as WholeBufferRead
from kvstore.store.types import BlockRead, ReadResult, ReadStatus

log = logging.getLogger("kvstore")

_HIT = ReadResult(ReadStatus.HIT)


class Reader:
    """Verified reads of one group array's blocks."""

    def __init__(self, array: GroupArray) -> None:
        self.array = array
        ctx = ReadContext(array)
        plan = ctx.plan
        hashed = HashedRead(ctx) if plan.whole is WholeRead.HASHED else None
        self._whole: WholeBufferRead | HashedRead | None = (
            WholeBufferRead(ctx) if plan.whole is WholeRead.SMALL else hashed
        )
        self._strided = StridedRead(ctx)
        self._general = GeneralRead(ctx, hashed)
        self._batch = BatchRead(ctx, self._read_one) if plan.batch else None

    def read_blocks(self, reads: Sequence[BlockRead]) -> list[ReadResult]:
        """Read and verify blocks into the callers' buffers; failures are misses."""
        batched = self._batch.read(reads) if self._batch is not None else None
        outcomes = self.array.engine.map(self._read_one, reads) if batched is None else batched
        results: list[ReadResult] = []
        hits = misses = corrupt = errors = total = 0
        for outcome, req in zip(outcomes, reads, strict=True):
            if type(outcome) is int:  # the bytes of a hit
                total += outcome
                hits += 1
                results.append(_HIT)  # immutable: one object for every hit
                continue
            assert isinstance(outcome, BaseException)
            result = self._read_failure(outcome, req.block_hash)
            hits += result.status is ReadStatus.HIT
            misses += result.status is ReadStatus.MISS
            corrupt += result.status is ReadStatus.CORRUPT
            errors += result.status is ReadStatus.ERROR
            results.append(result)
        self.array.stats.add(
            hits=hits, misses=misses, corrupt=corrupt, read_errors=errors, bytes_read=total
        )
        return results

    def _read_one(self, req: BlockRead) -> int:
        """One block, block by block: the strategy its buffer and chunks call for."""
        block_hash = check_hash(req.block_hash)
        given = req.out
        if type(given) is np.ndarray and not given.flags.c_contiguous:
            return self._strided.read(block_hash, given, req.chunks)
        if req.chunks is None and self._whole is not None and not isinstance(given, torch.Tensor):
            return self._whole.read(block_hash, given)
        return self._general.read(block_hash, given, req.chunks)

    def _read_failure(self, exc: BaseException, block_hash: bytes) -> ReadResult:
        if isinstance(exc, BlockMissingError):
            return ReadResult(ReadStatus.MISS)
        if isinstance(exc, ValueError | KvstoreError) and not isinstance(
            exc, CorruptBlockError | OSError
        ):
            raise exc  # a caller bug (bad buffer, bad hash), not a block problem
        label = self.array.label
        if isinstance(exc, CorruptBlockError):
            where = self.quarantine(block_hash, exc.file_id)
            log.warning(
                "kvstore: block %s of %s is corrupt (%s); served as a miss, %s",
                short_hash(block_hash),
                label,
                exc,
                where,
            )
            return ReadResult(ReadStatus.CORRUPT, str(exc))
        log.warning(
            "kvstore: reading block %s of %s failed (%s); served as a miss",
            short_hash(block_hash),
            label,
            exc,
        )
        return ReadResult(ReadStatus.ERROR, str(exc))

    def quarantine(self, block_hash: bytes, read_id: FileId | None) -> str:
        """Move the corrupt file read (``read_id``) aside (:func:`~kvstore.store.quarantine.
        quarantine`); the words for the log line say what happened."""
        return quarantine(self.array, block_hash, read_id)

    def read_header(self, block_hash: bytes) -> tuple[BlockHeader, np.ndarray]:
        """The verified header and checksum slots of a published block (for tools)."""
        array = self.array
        block_hash = check_hash(block_hash)
        path = array.block_path(block_hash)
        if array.compressed is not None:
            return array.compressed.read_header(path, block_hash)
        layout = array.layout
        header = bytearray(layout.header_nbytes)
        array.engine.read_file(path, [(0, memoryview(header))], layout.file_nbytes)
        decoded = check.check_header(header, array.shard, block_hash)
        return decoded, fmt.decode_checksums(header, layout.num_chunks).copy()

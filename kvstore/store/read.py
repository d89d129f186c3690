"""Reading blocks: verified reads into caller buffers, and quarantine of what fails.

:meth:`Reader.read_blocks` reads whole blocks or chosen inner chunks (heads x layers) into
caller buffers, touching only those byte ranges: the header and each contiguous run of chunks,
one ``preadv`` for a whole block (a padded layout's stride padding goes to a scratch buffer).
Every read checks the header against the key it asked for and each chunk against its checksum
(:mod:`kvstore.store.check`: one header check, and one call that checksums all the chunks read,
nothing more; for a whole block read into host memory both are one call, with the per-block
Python kept small because it is a visible share of a small block's time, issue 17). Whole
blocks of 1 MiB or more are read and verified in pieces of about 512 KiB, header first, each
piece checksummed while it is still in the CPU cache
(:meth:`Reader._read_in_pieces`). A missing, short, mis-keyed, foreign or corrupt block is a
miss: one log line, counted, and the corrupt file quarantined - never served.

Read buffers are host memory (anything with the buffer protocol) or uint8-viewable tensors. A
device engine (GDS) reads into a device tensor directly and verifies it on the device when the
block's algorithm allows it, otherwise its chunks are copied to the host for verification
(logged once per store); other engines read a device tensor's bytes through a host bounce
buffer.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import numpy as np
import torch

from kvstore.checksum import DEVICE_ALGOS, NAMES, XXH3_64
from kvstore.errors import BlockMissingError, CorruptBlockError, EntryKindError, KvstoreError
from kvstore.io.buffers import ThreadStaging, is_aligned
from kvstore.io.engine import AnySegment, Data
from kvstore.io.entries import FileId, move_if_same, remove_if_same
from kvstore.io.host import HostEngine
from kvstore.io.types import VERIFIED, Hashing, PiecePlan, Segment
from kvstore.keys import check_hash, hash_coords
from kvstore.store import check
from kvstore.store import format as fmt
from kvstore.store.array import GroupArray, short_hash
from kvstore.store.format import BlockHeader
from kvstore.store.paths import held_block_name
from kvstore.store.pieces import BlockPieces, PlanCache, batch_spans, block_pieces
from kvstore.store.segments import byte_view, chunk_segments, host_segments, tensor_bytes
from kvstore.store.types import BlockRead, ReadResult, ReadStatus

log = logging.getLogger("kvstore")

# Bytes read and checksummed at a time in a large whole-block read: well inside a core's L2
# (1 MiB on the measured VM), large enough that the extra preadv per piece is noise (~2 µs
# per 512 KiB). Measured on tmpfs, 32 MiB blocks: verified reads 0.78x -> 0.88x the raw floor.
# Since the pieces are checksummed inside the native read (FileIO.read_regular_hashed), CPU
# time of 8 x 32 MiB reads from tmpfs, best of 7, relative to the same reads unhashed: pieces
# of 256 KiB 0.88-0.99, 512 KiB 0.89-0.98, 1 MiB 0.87-0.95, 64 KiB 0.85-0.89, whole block read
# then hashed 0.83-0.93 (four runs of a FileIO-level micro-benchmark, session 25): 256 and
# 512 KiB alike, 512 kept.
_PIECE_NBYTES = 512 << 10

_HIT = ReadResult(ReadStatus.HIT)
_LITTLE_ENDIAN = sys.byteorder == "little"  # checksum slots are u64 little endian
# Engines whose store already logged a device read verified through the host (once per store).
_HOST_VERIFY_LOGGED: weakref.WeakSet[object] = weakref.WeakSet()


class Reader:
    """Verified reads of one group array's blocks."""

    def __init__(self, array: GroupArray) -> None:
        self.array = array
        self._fio = array.fio
        config = array.engine.config
        self._access_granularity_ns = config.access_granularity_s * 1_000_000_000
        # O_DIRECT reads of aligned requests (config direct_reads, where O_DIRECT works).
        self._direct_reads = config.direct_reads and array.engine.direct.enabled
        self._header_staging = ThreadStaging()
        # Each thread's header buffer as the memoryview a read fills (attribute "header"):
        # one lookup per block instead of a lookup and two numpy calls.
        self._local = threading.local()
        self._pad_sink = ThreadStaging()  # where padded layouts' padding is read to (unused)
        # Large whole blocks are verified piece by piece as they are read (_read_in_pieces):
        # needs the host engine's read_file_hashed (the host engine itself: a device engine
        # has paths of its own for host memory too) and verification on. Not with O_DIRECT
        # reads: their bytes arrive by DMA, not through the CPU cache, and one large request
        # keeps the device busier than a row of 512 KiB ones issued one after another.
        engine = array.engine
        self._pieces = (
            engine
            if type(engine) is HostEngine and array.verify_reads and not self._direct_reads
            else None
        )
        # What every whole-block read of this array shares, computed once (the array, its
        # layout and its settings are fixed for the store's life).
        layout = array.layout
        self._all_chunks = range(layout.num_chunks)
        self._data_offset = layout.chunk_offset(0)  # where chunk 0 starts in the file
        self._dense = layout.dense
        self._raw_whole = array.codec is None  # check.check_whole_block applies
        self._pieces_whole = (
            self._pieces if layout.dense and layout.block_nbytes >= 2 * _PIECE_NBYTES else None
        )
        # Whole blocks read into host memory take _read_small_whole: raw dense arrays whose
        # blocks are not read in pieces.
        self._small_whole = self._raw_whole and layout.dense and self._pieces_whole is None
        self._touches = bool(self._access_granularity_ns) and not array.read_only
        self._block_nbytes = layout.block_nbytes
        self._file_nbytes = layout.file_nbytes
        # Batches of whole blocks read into pieces (the vLLM tier's rows) are read and
        # verified in one native call per I/O thread (_read_pieces).
        self._piece_reads = (
            type(engine) is HostEngine
            and self._raw_whole
            and layout.dense
            and array.verify_reads
            and array.checksum_algo == XXH3_64  # what the batch verifies (others: read again)
            and _LITTLE_ENDIAN
            and self._fio.native_piece_batches
        )
        # ... and of small whole blocks read into host memory, unless those are read O_DIRECT.
        self._small_batch = self._small_whole and not self._direct_reads
        self._batch_headers = ThreadStaging()
        self._piece_plans = PlanCache(layout.file_nbytes, memoryview(b""), layout.file_nbytes)

    def read_blocks(self, reads: Sequence[BlockRead]) -> list[ReadResult]:
        """Read and verify blocks into the callers' buffers; failures are misses."""
        batched = self._read_pieces(reads) if self._piece_reads else None
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

    def _read_pieces(self, reads: Sequence[BlockRead]) -> list[int | BaseException] | None:
        """:meth:`read_blocks` of whole blocks all read into pieces of one geometry that tiles
        its span in whole chunks (the vLLM tier's rows): each I/O thread reads and verifies
        its share of the batch in one native call (:meth:`FileIO.read_pieces
        <kvstore.io.fileio.FileIO.read_pieces>`: the GIL released from the first block to the
        last), and only the header's fields are checked here (:func:`check.header_algo`).
        Same checks as :meth:`_read_into_pieces`; a block that fails any of them (missing,
        not regular, short, corrupt, another algorithm than xxh3) is read again by
        :meth:`_read_one`, which names, counts and quarantines what is wrong. None: not such
        a batch (the caller reads it block by block)."""
        batch = self._piece_batch(reads)
        if batch is None:
            return None
        plan, spans = batch
        array = self.array
        hn = array.layout.header_nbytes
        headers = self._batch_headers.get(len(reads) * hn)
        blocks: list[tuple[str, memoryview, memoryview]] = []
        hashes: list[bytes] = []
        at: list[int] = []  # the position in reads of each of blocks
        outcomes: list[int | BaseException | None] = [None] * len(reads)
        for i, req in enumerate(reads):
            try:
                block_hash = check_hash(req.block_hash)
                path = array.block_path(block_hash)
            except Exception as exc:  # as HostEngine.map reports it: this block's outcome
                outcomes[i] = exc
                continue
            blocks.append((path, headers[i * hn : (i + 1) * hn].data, spans[i]))
            hashes.append(block_hash)
            at.append(i)
        touch_before = time.time_ns() - self._access_granularity_ns if self._touches else 0
        engine = array.engine
        assert isinstance(engine, HostEngine)  # _piece_reads says so
        codes = engine.map_batches(
            lambda part: self._fio.read_pieces(
                part, hn, plan, touch_before, direct=self._direct_reads
            ),
            blocks,
        )
        for i, block, block_hash, code in zip(at, blocks, hashes, codes, strict=True):
            outcomes[i] = self._piece_outcome(reads[i], block[1], block_hash, code)
        return cast("list[int | BaseException]", outcomes)

    def _piece_batch(self, reads: Sequence[BlockRead]) -> tuple[PiecePlan, list[memoryview]] | None:
        """The plan and the spans of a batch :meth:`_read_pieces` takes, or None: whole
        blocks into pieces, or into one buffer each where :meth:`_read_small_whole` would
        read them."""
        if any(req.chunks is not None for req in reads):
            return None
        batch = batch_spans(
            [req.out for req in reads],
            self._block_nbytes,
            self.array.layout.chunk_nbytes,
            whole=self._small_batch,
            writable=True,
        )
        if batch is None:
            return None
        geometry, spans = batch
        return self._piece_plans.plan(geometry), spans

    def _piece_outcome(
        self, req: BlockRead, header: memoryview, block_hash: bytes, code: int
    ) -> int | BaseException:
        """A block's outcome (its bytes, or the exception) from its read_pieces ``code``."""
        if code == VERIFIED:
            try:
                if check.header_algo(header, self.array.shard, block_hash) == XXH3_64:
                    return self._block_nbytes
            except CorruptBlockError:
                pass  # _read_one reads it again and reports it
        try:
            return self._read_one(req)
        except Exception as exc:  # as HostEngine.map reports it: this block's outcome
            return exc

    def _read_one(self, req: BlockRead) -> int:  # noqa: PLR0912, PLR0915 - one verified read: buffer checks, engine choice, verify, quarantine on a bad file, copy-out; each step commented
        array = self.array
        block_hash = check_hash(req.block_hash)
        given = req.out
        if type(given) is np.ndarray and not given.flags.c_contiguous:
            return self._read_into_pieces(block_hash, given, req.chunks)
        if req.chunks is None and self._small_whole and not isinstance(given, torch.Tensor):
            return self._read_small_whole(block_hash, given)
        layout = array.layout
        whole = req.chunks is None
        chunks: Sequence[int] = self._all_chunks if whole else list(req.chunks or ())
        need = len(chunks) * layout.chunk_nbytes
        compressed = array.compressed
        device = array.device_engine
        # A device buffer with a host-only engine (or a compressed array) is read through a
        # host bounce buffer and copied over after verification.
        device_out: torch.Tensor | None = None
        out: Data
        if isinstance(req.out, torch.Tensor):
            flat = tensor_bytes(req.out)
            if device is not None and compressed is None:
                out = flat
            elif flat.device.type == "cpu":
                out = flat.numpy().data
            else:
                device_out = flat
                out = torch.empty(need, dtype=torch.uint8).numpy().data
        else:
            out = byte_view(req.out)
            if out.readonly:
                raise ValueError("read buffer: expected writable memory, got a read-only buffer")
        got = len(out) if isinstance(out, memoryview) else out.numel()
        if got < need:
            raise ValueError(f"read buffer: expected at least {need} bytes, got {got}")
        if not whole and any(not 0 <= c < layout.num_chunks for c in chunks):
            raise ValueError(f"chunk numbers: expected 0..{layout.num_chunks - 1}, got {chunks}")
        touch_before = (
            time.time_ns() - self._access_granularity_ns
            if self._access_granularity_ns and not array.read_only
            else 0
        )
        path = array.block_path(block_hash)
        if compressed is not None:
            assert isinstance(out, memoryview)
            # CorruptBlockError carries the identity of the file read (CompressedShards.read)
            compressed.read(path, block_hash, chunks, out, array.verify_reads, touch_before)
            if device_out is not None:
                device_out[:need].copy_(torch.frombuffer(out, dtype=torch.uint8)[:need])
            return need
        # A per-thread aligned header buffer (reused: no allocation per block; aligned, so the
        # whole read may be O_DIRECT). Every byte of it is read from the file or the read fails.
        header: memoryview | None = getattr(self._local, "header", None)
        if header is None:
            header = self._new_header()
        if self._pieces_whole is not None and whole and isinstance(out, memoryview):
            # a large block of a dense layout (chunks back to back in the file as in memory)
            self._read_in_pieces(self._pieces_whole, path, block_hash, header, out, touch_before)
            if device_out is not None:
                device_out[:need].copy_(torch.frombuffer(out, dtype=torch.uint8)[:need])
            return need
        segments: list[AnySegment]
        if whole and self._dense:  # the common case: header, then the chunks in one piece
            segments = [(0, header), (self._data_offset, out[:need])]
        elif whole and isinstance(out, memoryview):
            # Padded layout: each chunk's stride padding goes to a scratch buffer, so the
            # block is one contiguous preadv rather than one per chunk.
            sink = self._pad_sink.get(fmt.ALIGN)[: layout.chunk_stride - layout.chunk_nbytes].data
            size = layout.chunk_nbytes
            segments = [(0, header)]
            for c in range(layout.num_chunks):
                segments.append((layout.chunk_offset(c), out[c * size : (c + 1) * size]))
                if c + 1 < layout.num_chunks:
                    segments.append((layout.chunk_offset(c) + size, sink))
        else:
            segments = [(0, header), *chunk_segments(layout, chunks, out)]
        if not whole:  # chunks in the caller's order; whole blocks are in file order already
            segments.sort(key=_offset)
        # Host memory (the common case): every segment is a memoryview, no need to look.
        host = (
            cast("list[Segment]", segments)
            if isinstance(out, memoryview)
            else host_segments(segments)
        )
        read_id: FileId
        if host is None:
            assert device is not None
            read_id = device.read_file(path, segments, layout.file_nbytes, touch_before)
        else:
            direct = self._direct_reads and all(
                offset % fmt.ALIGN == 0 and is_aligned(data) for offset, data in host
            )
            read_id = array.engine.read_file(
                path, host, layout.file_nbytes, touch_before, direct=direct
            )
        try:
            if whole and self._raw_whole and isinstance(out, memoryview):
                # small whole blocks in host memory (the common case): one call
                check.check_whole_block(
                    array.shard, header, block_hash, out, verify=array.verify_reads
                )
            else:
                algo = check.header_algo(header, array.shard, block_hash)
                if array.verify_reads:
                    if isinstance(out, torch.Tensor) and algo not in DEVICE_ALGOS:
                        self._log_host_verify(algo)
                    check.verify_chunks(layout, algo, header, chunks, out)
        except CorruptBlockError as exc:
            exc.file_id = read_id  # quarantine this file, not whatever has the name later
            raise
        if device_out is not None:
            device_out[:need].copy_(torch.frombuffer(out, dtype=torch.uint8)[:need])
        return need

    def _read_small_whole(self, block_hash: bytes, given: object) -> int:
        """:meth:`_read_one` of a whole block of a raw dense array into host memory (the
        common case; large blocks are read in pieces): the same checks in the same order, the
        same reads (header and data in one ``preadv``) and the same errors, without the
        general case's branches (per-block Python is a visible share of a small block's
        time, issue 17)."""
        array = self.array
        out = byte_view(given)
        if out.readonly:
            raise ValueError("read buffer: expected writable memory, got a read-only buffer")
        need = self._block_nbytes
        if len(out) < need:
            raise ValueError(f"read buffer: expected at least {need} bytes, got {len(out)}")
        touch_before = time.time_ns() - self._access_granularity_ns if self._touches else 0
        path = array.block_path(block_hash)
        header: memoryview | None = getattr(self._local, "header", None)
        if header is None:
            header = self._new_header()
        data = out[:need]
        # Both offsets (0 and the aligned header size) are aligned: only the memory is checked.
        direct = self._direct_reads and is_aligned(header) and is_aligned(data)
        read_id = array.engine.read_file(
            path,
            [(0, header), (self._data_offset, data)],
            self._file_nbytes,
            touch_before,
            direct=direct,
        )
        try:
            check.check_whole_block(array.shard, header, block_hash, out, verify=array.verify_reads)
        except CorruptBlockError as exc:
            exc.file_id = read_id  # quarantine this file, not whatever has the name later
            raise
        return need

    def _read_into_pieces(
        self, block_hash: bytes, given: np.ndarray, chunks: Sequence[int] | None
    ) -> int:
        """A whole block of a raw dense array read straight into a strided host view (the
        vLLM tier's row of a CPU-tier chunk: no staging buffer, no scatter copy after): one
        ``preadv`` of the header and every piece where it lies
        (:func:`~kvstore.store.pieces.block_pieces`, the mirror of a write from pieces), then
        the header's check and every chunk's checksum computed where it landed, compared with
        the header's slots. Same checks, order of failure and errors as a contiguous read; a
        block that fails leaves the view's bytes partly written (the caller must not use
        them: the read is a miss). Always buffered (``direct_reads`` needs aligned memory,
        which pieces of a caller's rows need not be). Anything else given a strided view is
        refused."""
        array = self.array
        layout = array.layout
        if chunks is not None or not self._raw_whole or not self._dense:
            what = "chunk selections" if chunks is not None else f"{array.label}'s layout"
            raise ValueError(
                "read buffer: a strided numpy view is read only as a whole block of a raw, "
                f"dense (unpadded, uncompressed) array; got one for {what}: pass contiguous "
                "memory"
            )
        if not given.flags.writeable:
            raise ValueError("read buffer: expected writable memory, got a read-only view")
        pieces = block_pieces(given, self._block_nbytes, layout.chunk_nbytes)
        assert pieces is not None  # a non-contiguous ndarray
        touch_before = time.time_ns() - self._access_granularity_ns if self._touches else 0
        path = array.block_path(block_hash)
        header: memoryview | None = getattr(self._local, "header", None)
        if header is None:
            header = self._new_header()
        segments: list[Segment] = [(0, header), *pieces.segments(self._data_offset)]
        read_id = array.engine.read_file(path, segments, self._file_nbytes, touch_before)
        try:
            algo = check.header_algo(header, array.shard, block_hash)
            if array.verify_reads:
                check.check_algo(algo)  # an unknown algorithm id is a corrupt block
                self._verify_pieces(algo, header, pieces)
        except CorruptBlockError as exc:
            exc.file_id = read_id  # quarantine this file, not whatever has the name later
            raise
        return self._block_nbytes

    def _verify_pieces(self, algo: int, header: memoryview, pieces: BlockPieces) -> None:
        """Every chunk of a block read into ``pieces`` against the header's slots (chunk
        order: the pieces' order)."""
        layout = self.array.layout
        count = layout.num_chunks
        sums = pieces.chunk_sums(algo, layout.chunk_nbytes)
        end = fmt.checksum_slot_offset(count)
        if _LITTLE_ENDIAN and sums.tobytes() == bytes(header[fmt.HEADER_FIXED_NBYTES : end]):
            return
        bad = np.flatnonzero(sums != fmt.decode_checksums(header, count))
        if bad.size:
            raise CorruptBlockError(f"checksum mismatch in inner chunk {int(bad[0])}")

    def _new_header(self) -> memoryview:
        """The calling thread's header buffer (per-thread, aligned, reused: no allocation per
        block; aligned, so the whole read may be O_DIRECT)."""
        nbytes = self.array.layout.header_nbytes
        view = self._header_staging.get(nbytes)[:nbytes].data
        self._local.header = view
        return view

    def _read_in_pieces(  # noqa: PLR0913 - _read_one's state for one whole-block read
        self,
        engine: HostEngine,
        path: str,
        block_hash: bytes,
        header: memoryview,
        out: memoryview,
        touch_before: int,
    ) -> None:
        """A whole block of a large dense array, read and checksummed piece by piece.

        Verifying a block after reading all of it reads its bytes from memory a second time
        once the block is larger than the CPU cache (a 256-token block is 16-80 MiB): the
        checksums then cost as much as the copy. Here each piece of about
        :data:`_PIECE_NBYTES` (whole chunks) is checksummed right after its ``preadv``, while
        it is in the cache, inside the engine's read (one native call for NativeFileIO:
        :meth:`HostEngine.read_file_hashed`), with the array's algorithm. Then the header is
        checked, before any chunk (a bad header fails as it always did), and the sums are
        compared with its slots; a header naming another algorithm gets its chunks
        checksummed again with that one. Same checks, same errors.
        """
        array = self.array
        layout = array.layout
        size = layout.chunk_nbytes
        data = out[: layout.num_chunks * size]
        sums = np.empty(layout.num_chunks, dtype=np.uint64)
        hashing = Hashing(1, 2, array.checksum_algo, size, _PIECE_NBYTES, sums)
        segments: list[Segment] = [(0, header), (self._data_offset, data)]
        direct = (
            self._direct_reads
            and self._data_offset % fmt.ALIGN == 0
            and is_aligned(header)
            and is_aligned(data)
        )
        identity = engine.read_file_hashed(
            path, segments, layout.file_nbytes, touch_before, hashing, direct=direct
        )
        try:
            algo = check.header_algo(header, array.shard, block_hash)
            check.check_algo(algo)  # an unknown algorithm id is a corrupt block
            slots = fmt.decode_checksums(header, layout.num_chunks)
            if algo != hashing.algo or np.count_nonzero(sums != slots):
                # Another algorithm, or a mismatch: verify_run checksums the chunks with the
                # header's algorithm and raises, naming the first bad chunk.
                check.verify_run(algo, slots, 0, data, size)
        except CorruptBlockError as exc:
            exc.file_id = identity  # the file found corrupt, whatever the name holds now
            raise

    def _log_host_verify(self, algo: int) -> None:
        engine = self.array.engine
        if engine in _HOST_VERIFY_LOGGED:
            return
        _HOST_VERIFY_LOGGED.add(engine)
        log.info(
            "kvstore: blocks checksummed with %s are verified through host memory when read "
            "into device buffers (write them with wsum64 to verify on the device)",
            NAMES.get(algo, algo),
        )

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

    def quarantine(self, block_hash: bytes, read_id: FileId | None) -> str:  # noqa: PLR0911 - each early return is one outcome in words for the log line (read-only, unknown file, gone, cannot enter, moved, removed)
        """Move the corrupt file that was read (``read_id``) out of the block's name, into
        ``<namespace>/quarantine``; the words for the log line say what happened.

        Every directory on the way is entered without following a symbolic link
        (:func:`~kvstore.io.entries.open_dir_nofollow`, from the store root), and the rename
        goes between those open directories: a link planted at ``quarantine`` (or anywhere
        above the block) never takes the file out of the root. If ``quarantine`` is not a real
        directory the file is removed instead (it is never served either way). The file is
        moved only while the name still holds the file read (:func:`move_if_same`): another
        reader or ``verify --fix`` may have removed it and a writer re-published a good copy.
        """
        array = self.array
        path = array.block_path(block_hash)
        if array.read_only:
            return "left in place (store opened read-only)"
        if read_id is None:  # an engine that does not say what it read: touch nothing
            return "left in place (the file read is not known)"
        fanout = os.path.dirname(path)
        name = os.path.basename(path)
        qdir = array.quarantine_dir
        try:
            src_fd = array.open_dir(fanout)
        except FileNotFoundError:
            return "already gone"
        except (OSError, ValueError) as exc:
            return f"left in place (cannot enter {fanout}: {exc})"
        try:
            if qdir is None:
                return _outcome(remove_if_same(self._fio, src_fd, name, read_id), None)
            target = held_block_name(array.index, *hash_coords(block_hash), time.time_ns())
            try:
                q_fd = self._fio.open_dir(
                    qdir.parent.parent,
                    [qdir.parent.name, qdir.name],
                    create_mode=array.engine.config.dir_mode,
                )
            except (EntryKindError, OSError) as exc:
                outcome = remove_if_same(self._fio, src_fd, name, read_id)
                return f"{_outcome(outcome, None)}: cannot quarantine ({exc})"
            try:
                outcome = move_if_same(self._fio, src_fd, name, q_fd, target, read_id)
            finally:
                self._fio.close(q_fd)
            return _outcome(outcome, qdir / target)
        except OSError as exc:
            return f"could not quarantine ({exc})"
        finally:
            self._fio.close(src_fd)

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


def _offset(segment: AnySegment) -> int:
    return segment[0]


def _outcome(outcome: str, target: Path | None) -> str:
    """Log words for a :func:`move_if_same` / :func:`remove_if_same` outcome."""
    if outcome == "moved":
        return f"quarantined as {target}"
    if outcome == "gone":
        return "already gone"
    if outcome == "replaced":
        return "left in place (the name holds another file since the read)"
    return outcome  # "removed"

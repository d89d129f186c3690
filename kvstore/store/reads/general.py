"""Every read the other strategies do not take: chosen chunks, padded layouts, compressed
arrays, device tensors.

Read buffers are host memory (anything with the buffer protocol) or uint8-viewable tensors. An
engine with ``device_segments`` (GDS) reads into a device tensor directly and verifies it on
the device when the block's algorithm allows it, otherwise its chunks are copied to the host
for verification (logged once per store); with other engines, or for a compressed array, a
device tensor's bytes are read through a host bounce buffer and copied over after
verification. Chunks are read in file order, each contiguous run of them in one piece; a
padded layout's whole block is one ``preadv``, its stride padding going to a scratch buffer.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import cast

import torch

from kvstore.checksum import DEVICE_ALGOS, NAMES
from kvstore.errors import CorruptBlockError
from kvstore.io.buffers import ThreadStaging, is_aligned
from kvstore.io.engine import AnySegment, Data
from kvstore.io.entries import FileId
from kvstore.io.types import Segment
from kvstore.store import check
from kvstore.store import format as fmt
from kvstore.store.reads.context import ReadContext
from kvstore.store.reads.hashed import HashedRead
from kvstore.store.segments import byte_view, chunk_segments, host_segments, tensor_bytes

log = logging.getLogger("kvstore")

# Engines whose store already logged a device read verified through the host (once per store).
_HOST_VERIFY_LOGGED: weakref.WeakSet[object] = weakref.WeakSet()


class GeneralRead:
    """Reads of chunks, padded or compressed blocks and tensors, for one array."""

    def __init__(self, ctx: ReadContext, hashed: HashedRead | None) -> None:
        self._ctx = ctx
        self._array = ctx.array
        self._hashed = hashed  # whole blocks of host memory, where the plan says so
        self._all_chunks = range(ctx.layout.num_chunks)
        self._pad_sink = ThreadStaging()  # where padded layouts' padding is read to (unused)

    def read(self, block_hash: bytes, given: object, chunks: Sequence[int] | None) -> int:
        """Read and verify ``chunks`` (None: the whole block) of ``block_hash`` into
        ``given``; returns the bytes read."""
        ctx = self._ctx
        array = self._array
        layout = ctx.layout
        whole = chunks is None
        wanted: Sequence[int] = self._all_chunks if chunks is None else list(chunks)
        need = len(wanted) * layout.chunk_nbytes
        compressed = array.compressed
        device = array.device_engine
        # A device buffer with a host-only engine (or a compressed array) is read through a
        # host bounce buffer and copied over after verification.
        device_out: torch.Tensor | None = None
        out: Data
        if isinstance(given, torch.Tensor):
            flat = tensor_bytes(given)
            if device is not None and compressed is None:
                out = flat
            elif flat.device.type == "cpu":
                out = flat.numpy().data
            else:
                device_out = flat
                out = torch.empty(need, dtype=torch.uint8).numpy().data
        else:
            out = byte_view(given)
            if out.readonly:
                raise ValueError("read buffer: expected writable memory, got a read-only buffer")
        got = len(out) if isinstance(out, memoryview) else out.numel()
        if got < need:
            raise ValueError(f"read buffer: expected at least {need} bytes, got {got}")
        if not whole and any(not 0 <= c < layout.num_chunks for c in wanted):
            raise ValueError(f"chunk numbers: expected 0..{layout.num_chunks - 1}, got {wanted}")
        touch_before = ctx.touch_before()
        if compressed is not None:
            assert isinstance(out, memoryview)
            path = array.block_path(block_hash)
            # CorruptBlockError carries the identity of the file read (CompressedShards.read)
            compressed.read(path, block_hash, wanted, out, array.verify_reads, touch_before)
        elif self._hashed is not None and whole and isinstance(out, memoryview):
            self._hashed.read_into(block_hash, out, touch_before)
        else:
            self._read_raw(block_hash, out, wanted, whole, touch_before)
        if device_out is not None:
            device_out[:need].copy_(torch.frombuffer(out, dtype=torch.uint8)[:need])
        return need

    def _read_raw(
        self, block_hash: bytes, out: Data, chunks: Sequence[int], whole: bool, touch_before: int
    ) -> None:
        """Chunks of a raw array into host memory or a tensor ``out``, then verified."""
        ctx = self._ctx
        array = self._array
        layout = ctx.layout
        path = array.block_path(block_hash)
        header = ctx.header()
        segments = self._segments(header, out, chunks, whole)
        # Host memory (the common case): every segment is a memoryview, no need to look.
        host = (
            cast("list[Segment]", segments)
            if isinstance(out, memoryview)
            else host_segments(segments)
        )
        read_id: FileId
        if host is None:
            device = array.device_engine
            assert device is not None
            read_id = device.read_file(path, segments, layout.file_nbytes, touch_before)
        else:
            direct = ctx.direct and all(
                offset % fmt.ALIGN == 0 and is_aligned(data) for offset, data in host
            )
            read_id = array.engine.read_file(
                path, host, layout.file_nbytes, touch_before, direct=direct
            )
        try:
            if whole and isinstance(out, memoryview):
                # a whole raw block in host memory: one call
                check.check_whole_block(
                    array.shard, header, block_hash, out, verify=array.verify_reads
                )
            else:
                algo = check.header_algo(header, array.shard, block_hash)
                if array.verify_reads:
                    if isinstance(out, torch.Tensor) and algo not in DEVICE_ALGOS:
                        _log_host_verify(array.engine, algo)
                    check.verify_chunks(layout, algo, header, chunks, out)
        except CorruptBlockError as exc:
            exc.file_id = read_id  # quarantine this file, not whatever has the name later
            raise

    def _segments(
        self, header: memoryview, out: Data, chunks: Sequence[int], whole: bool
    ) -> list[AnySegment]:
        """The file's segments of a raw read: the header, then the chunks in file order."""
        ctx = self._ctx
        layout = ctx.layout
        segments: list[AnySegment]
        if whole and layout.dense:  # header, then the chunks in one piece
            return [(0, header), (ctx.data_offset, out[: ctx.block_nbytes])]
        if whole and isinstance(out, memoryview):
            # Padded layout: each chunk's stride padding goes to a scratch buffer, so the
            # block is one contiguous preadv rather than one per chunk.
            sink = self._pad_sink.get(fmt.ALIGN)[: layout.chunk_stride - layout.chunk_nbytes].data
            size = layout.chunk_nbytes
            segments = [(0, header)]
            for c in range(layout.num_chunks):
                segments.append((layout.chunk_offset(c), out[c * size : (c + 1) * size]))
                if c + 1 < layout.num_chunks:
                    segments.append((layout.chunk_offset(c) + size, sink))
            return segments
        segments = [(0, header), *chunk_segments(layout, chunks, out)]
        if not whole:  # chunks in the caller's order; whole blocks are in file order already
            segments.sort(key=_offset)
        return segments


def _log_host_verify(engine: object, algo: int) -> None:
    if engine in _HOST_VERIFY_LOGGED:
        return
    _HOST_VERIFY_LOGGED.add(engine)
    log.info(
        "kvstore: blocks checksummed with %s are verified through host memory when read "
        "into device buffers (write them with wsum64 to verify on the device)",
        NAMES.get(algo, algo),
    )


def _offset(segment: AnySegment) -> int:
    return segment[0]

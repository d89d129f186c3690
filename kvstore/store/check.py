"""The hot-path block check: is this shard file the block a reader asked for? Raises at the first
problem.

A shard file belongs to one array (a :class:`ShardSpec`: its layout, namespace digest, group
index and codec) and one key. What is checked (the offline check,
:mod:`kvstore.store.full_check`, checks the same, and everything else in the file too):

* **header**: magic, version, header crc32c (:func:`~kvstore.store.format.decode_header`); the
  key the reader asked for; namespace digest and group; flags and geometry;
* **checksums**: every inner chunk read against the checksum slot its writer filled.

The read path (:meth:`GroupStore.read_blocks <kvstore.store.group_store.GroupStore.read_blocks>`
and the compressed reader) calls :func:`check_header` (raw arrays: :func:`header_algo`, the
same checks on the header's bytes) and :func:`verify_chunks` (or :func:`verify_run` per piece
of a large block); each raises :class:`~kvstore.errors.CorruptBlockError` at the first
problem, one call each per block (the per-chunk work is one checksum call, driven from C,
nothing more); a whole raw block read into host memory takes both in one call,
:func:`check_whole_block`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from kvstore.checksum import (
    Checksum,
    checksum_function,
    checksum_tensor_rows,
    chunk_sums,
    crc32c,
)
from kvstore.errors import CorruptBlockError, StoreFormatError
from kvstore.store import format as fmt
from kvstore.store.codec import Codec, compressed_bounds
from kvstore.store.format import BlockHeader, ShardLayout

if TYPE_CHECKING:
    import torch

_LITTLE_ENDIAN = sys.byteorder == "little"
# crc32c of any message followed by its own crc32c (u32 little endian) is this constant (the
# CRC residue): one crc call checks the header crc, with no slice and no integer decode.
_CRC32C_RESIDUE = 0x48674BC7
# Header offsets bound here: the hot path reads them per block (a module global, not an
# attribute of another module).
_HASH_LEN_OFFSET = fmt.HASH_LEN_OFFSET
_HASH_OFFSET = fmt.HASH_OFFSET
_GEOMETRY_OFFSET = fmt.GEOMETRY_OFFSET
_ALGO_OFFSET = fmt.ALGO_OFFSET
_CRC_END = fmt.CRC_OFFSET + 4
_MAX_HASH = fmt.MAX_HASH

# Kinds of fault (``kvstore verify``'s finding kinds for block files).


@dataclass(frozen=True)
class ShardSpec:
    """What every shard file of one array must be."""

    layout: ShardLayout
    namespace_digest: bytes  # SHA-256 of the namespace identity
    group: int  # array index k of g<k>
    codec: Codec | None = None  # the array's compression; None: raw chunks

    @cached_property
    def raw_template(self) -> tuple[bytes, bytes]:
        """The header bytes every raw block of this array has: [0, hash lengths) (magic,
        version, flags, header size, namespace, group) and the geometry [tokens, created)."""
        fixed = fmt.encode_fixed_header(
            self.layout, self.namespace_digest, self.group, b"\x01", None, 0, 0
        )
        return (
            fixed[: fmt.HASH_LEN_OFFSET],
            fixed[fmt.GEOMETRY_OFFSET : fmt.CREATED_OFFSET],
        )

    @cached_property
    def whole_block(self) -> tuple[int, int, int, int]:
        """(header bytes, end of the checksum slots, chunk bytes, chunks) of a raw block: what
        :func:`check_whole_block` needs per block, looked up once."""
        layout = self.layout
        slots_end = fmt.checksum_slot_offset(layout.num_chunks)
        return layout.header_nbytes, slots_end, layout.chunk_nbytes, layout.num_chunks

    @property
    def size_bounds(self) -> tuple[int, int]:
        """(smallest, largest) size of a valid file."""
        if self.codec is not None:
            return compressed_bounds(self.layout)
        return self.layout.file_nbytes, self.layout.file_nbytes


# -- the hot path: raise at the first problem -------------------------------------------------


def check_header(
    buf: bytes | bytearray | memoryview,
    spec: ShardSpec,
    block_hash: bytes,
    file_nbytes: int | None = None,
) -> BlockHeader:
    """The decoded header of a block read for key ``block_hash``, checked against ``spec``.

    ``file_nbytes``: the file's size, required for compressed arrays (their headers record it).
    :class:`CorruptBlockError` names the first problem.
    """
    header = fmt.decode_header(buf)
    fmt.check_header(
        header,
        spec.layout,
        spec.namespace_digest,
        spec.group,
        block_hash,
        compressed_file_nbytes=file_nbytes if spec.codec is not None else None,
    )
    return header


def header_algo(buf: bytes | bytearray | memoryview, spec: ShardSpec, block_hash: bytes) -> int:
    """:func:`check_header` for the hot path of raw arrays: the checksum algorithm id of a
    header read for key ``block_hash``, with every check :func:`check_header` makes.

    The fields a reader knows in advance (magic, version, flags, header size, namespace, group,
    the key, the geometry) are compared as bytes against the array's template, the lengths as
    integers, and the crc32c over the fixed part is checked, without decoding the header into
    an object. Anything that does not match goes through :func:`check_header`, so a damaged
    header raises the same :class:`CorruptBlockError`, with the same words, as it always did.
    """
    if spec.codec is None and len(buf) >= fmt.HEADER_FIXED_NBYTES:
        # One copy of the fixed part (176 bytes), compared in place (_template_algo).
        algo = _template_algo(bytes(buf[: fmt.HEADER_FIXED_NBYTES]), spec, block_hash)
        if algo is not None:
            return algo
    return check_header(buf, spec, block_hash).checksum_algo


def _template_algo(fixed: bytes, spec: ShardSpec, block_hash: bytes) -> int | None:
    """The algorithm id of a raw array's header whose fixed part (``fixed``: at least
    :data:`fmt.HEADER_FIXED_NBYTES` bytes) matches the array's template, the key, the lengths
    and its crc32c; None for anything else (:func:`check_header` then names the problem).

    Fields are compared in place in ``bytes`` (``startswith`` at an offset: no slice object,
    and no memoryview comparison, which goes element by element): about half the time of
    comparing memoryview slices.
    """
    prefix, geometry = spec.raw_template
    n = len(block_hash)
    if (
        fixed.startswith(prefix)
        and fixed.startswith(geometry, _GEOMETRY_OFFSET)
        and fixed.startswith(block_hash, _HASH_OFFSET)
        and fixed[_HASH_LEN_OFFSET] == n
        and 0 < n <= _MAX_HASH
        and fixed[_HASH_LEN_OFFSET + 1] <= _MAX_HASH
        and crc32c(fixed[:_CRC_END]) == _CRC32C_RESIDUE  # the crc over [0, CRC_OFFSET)
    ):
        return fixed[_ALGO_OFFSET]
    return None


def check_whole_block(
    spec: ShardSpec, header: memoryview, block_hash: bytes, data: memoryview, *, verify: bool
) -> None:
    """:func:`header_algo` then (``verify``) :func:`verify_chunks` of every inner chunk, for a
    whole block of a raw array read into host memory ``data``: the hot path of small blocks,
    where each call and copy is a visible share of a block's time.

    The header's fixed part and checksum slots are copied to ``bytes`` once; the template, the
    key and the crc32c are compared there, and the chunks' checksums (one call,
    :func:`~kvstore.checksum.chunk_sums`) are compared with the slots as bytes. Same checks,
    same order of failure (the header first), same :class:`CorruptBlockError` words as the two
    calls: anything that does not match goes through them.
    """
    header_nbytes, slots_end, chunk_nbytes, count = spec.whole_block
    if spec.codec is not None or len(header) < header_nbytes:
        got = "a compressed array" if spec.codec is not None else f"{len(header)} header bytes"
        raise ValueError(
            f"check_whole_block: expected a raw array's whole header "
            f"({header_nbytes} bytes), got {got}"
        )
    fixed = bytes(header[:slots_end])
    algo = _template_algo(fixed, spec, block_hash)
    if algo is None:
        algo = check_header(header, spec, block_hash).checksum_algo
    if not verify:
        return
    if algo not in _KNOWN_ALGOS:
        check_algo(algo)  # an unknown algorithm id is a corrupt block
    sums = chunk_sums(algo, data, chunk_nbytes, count)
    if _LITTLE_ENDIAN and fixed.startswith(sums.tobytes(), fmt.HEADER_FIXED_NBYTES):
        return
    _compare(sums, fmt.decode_checksums(header, count), range(count))


def chunk_checksum(algo: int) -> Checksum:
    """The checksum function a header names; an unknown id is a corrupt block."""
    try:
        return checksum_function(algo)
    except StoreFormatError as exc:
        raise CorruptBlockError(str(exc)) from None


# Algorithm ids :func:`chunk_checksum` accepted (a set lookup per block instead of a call).
_KNOWN_ALGOS: set[int] = set()


def check_algo(algo: int) -> None:
    """:class:`CorruptBlockError` unless ``algo`` is a known checksum algorithm id."""
    if algo not in _KNOWN_ALGOS:
        chunk_checksum(algo)
        _KNOWN_ALGOS.add(algo)


def verify_chunks(
    layout: ShardLayout,
    algo: int,
    header: bytes | bytearray | memoryview,
    chunks: Sequence[int],
    data: memoryview | torch.Tensor,
) -> None:
    """Check inner chunks ``chunks``, read back to back into ``data``, against the header's
    checksum slots; :class:`CorruptBlockError` names the first that differs.

    Host memory: one checksum call per chunk, driven from C (:func:`~kvstore.checksum.chunk_sums`).
    A tensor: one batched call on its device
    (:func:`~kvstore.checksum.checksum_tensor_rows`; the caller decides whether that is
    acceptable for ``algo``).
    """
    check_algo(algo)  # an unknown algorithm id is a corrupt block
    size = layout.chunk_nbytes
    count = len(chunks)
    if isinstance(data, memoryview):
        sums = chunk_sums(algo, data, size, count)
    else:  # a tensor (tested this way round: the tools never import torch)
        rows = data[: count * size].view(count, size)
        sums = np.asarray(checksum_tensor_rows(algo, rows), dtype=np.uint64)
    run = type(chunks) is range and chunks.step == 1  # a whole block or a run of chunks
    if run and _LITTLE_ENDIAN:
        # The slots are u64 little endian: compared as bytes with the sums (0.5 µs, against
        # 1.9 for decoding and comparing them); a difference is named by the slow path below.
        start = fmt.checksum_slot_offset(chunks[0]) if count else 0
        if sums.tobytes() == bytes(header[start : start + 8 * count]):
            return
    slots = fmt.decode_checksums(header, layout.num_chunks)
    if run:  # a whole block or a run: a view
        assert isinstance(chunks, range)
        wanted = slots[chunks.start : chunks.stop]
    else:
        wanted = slots[np.asarray(chunks, dtype=np.intp)]
    _compare(sums, wanted, chunks)


def verify_run(
    algo: int, slots: np.ndarray, first: int, data: memoryview, chunk_nbytes: int
) -> None:
    """Check the consecutive inner chunks from ``first`` that fill host memory ``data``
    (``len(data) // chunk_nbytes`` of them, back to back) against the checksum slots
    ``slots`` (:func:`fmt.decode_checksums`; the caller checked the header and ``algo`` with
    :func:`header_algo`): :func:`verify_chunks` for one piece of a block, while that piece is
    in the CPU cache."""
    count = len(data) // chunk_nbytes
    sums = chunk_sums(algo, data, chunk_nbytes, count)
    _compare(sums, slots[first : first + count], range(first, first + count))


def _compare(sums: np.ndarray, wanted: np.ndarray, chunks: Sequence[int]) -> None:
    if np.count_nonzero(sums != wanted):  # (ndarray.any goes through a Python wrapper)
        bad = np.flatnonzero(sums != wanted)
        raise CorruptBlockError(f"checksum mismatch in inner chunk {chunks[int(bad[0])]}")

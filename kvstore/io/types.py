"""The types of the engine contract, shared by :mod:`kvstore.io.engine` and the engines.

They live apart from any engine so that the contract imports no implementation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Segment = tuple[int, memoryview]  # (file offset, host bytes)


@dataclass(frozen=True)
class DirectIOProbe:
    """Outcome of the O_DIRECT probe of a store directory."""

    enabled: bool
    reason: str


@dataclass(frozen=True, slots=True)
class Hashing:
    """Checksums of whole chunks computed as a file's bytes pass through memory
    (:meth:`FileIO.write_new_hashed <kvstore.io.fileio.FileIO.write_new_hashed>`,
    :meth:`FileIO.read_regular_hashed <kvstore.io.fileio.FileIO.read_regular_hashed>`).

    Segments ``[first, last)`` of the call, each a whole number of ``chunk_nbytes`` chunks,
    are moved in groups of at most ``group_nbytes`` (file-contiguous whole chunks; at least
    one chunk, however large), each
    group hashed with checksum algorithm ``algo`` just before its write or just after its
    read, while it is in the CPU cache; ``sums`` (uint64, one per chunk of those segments, in
    order) receives the values.
    """

    first: int
    last: int
    algo: int
    chunk_nbytes: int
    group_nbytes: int
    sums: np.ndarray

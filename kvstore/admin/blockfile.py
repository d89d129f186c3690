"""The admin tools' use of the offline block check (:mod:`kvstore.store.full_check`): verdicts.

``kvstore verify`` checks files found by listing, so the full hash comes from the header and
is compared with the coordinates the path gives. Every byte of a block file is covered by some
check (header crc, hash coordinates, identity, geometry, the sharding index, each inner chunk's
checksum, zero padding), so a flipped bit anywhere is found; the checks themselves live in
:mod:`kvstore.store.full_check` (with ``kvstore-inspect``; the server's read path runs the
same header and checksum checks, :mod:`kvstore.store.check`). The
files are read through a plain descriptor that never blocks (a FIFO is a corrupt block, never
opened) and never sets their mtime (a reader's record of last use; the tools are not readers).
"""

from __future__ import annotations

from kvstore.errors import EntryKindError
from kvstore.io.entries import FileId
from kvstore.store import full_check
from kvstore.store.check import ShardSpec
from kvstore.store.codec import Codec
from kvstore.store.format import BlockHeader, ShardLayout
from kvstore.store.full_check import CORRUPT, MIS_KEYED, MISPLACED, OVERSIZED, TRUNCATED
from kvstore.store.full_check import Fault as BlockFault

__all__ = [
    "CORRUPT",
    "MISPLACED",
    "MIS_KEYED",
    "OVERSIZED",
    "TRUNCATED",
    "BlockFault",
    "check_block_file",
    "judge_block_file",
    "read_header",
]


def read_header(path: str) -> BlockHeader:
    """The self-checked fixed header of a block file (:func:`kvstore.store.full_check.read_header`):
    :class:`~kvstore.errors.CorruptBlockError` for a bad header or a file that is not regular,
    ``OSError`` (FileNotFoundError when it vanished) for I/O failures."""
    return full_check.read_header(path)[0]


def check_block_file(  # noqa: PLR0913 - a listed block's coordinates spelled out (tests and reliability checks hold these values, not a ShardSpec)
    path: str,
    layout: ShardLayout,
    namespace_digest: bytes,
    group: int,
    hi: int,
    lo: int,
    compression: str = "none",
) -> BlockFault | None:
    """The verdict on the block file at ``path`` (found at hash coordinates ``hi``/``lo`` of
    group ``group``): its first fault, None when intact.

    ``OSError`` propagates when the file cannot be read (FileNotFoundError: it vanished while
    we looked); another kind of entry than a regular file is a CORRUPT fault.
    """
    spec = ShardSpec(layout, namespace_digest, group, Codec.for_name(compression, layout.itemsize))
    return judge_block_file(path, spec, hi, lo)[0]


def judge_block_file(
    path: str, spec: ShardSpec, hi: int, lo: int
) -> tuple[BlockFault | None, FileId | None]:
    """:func:`check_block_file` for an array's ``spec``, with the identity (st_dev, st_ino)
    of the file judged (None when it was not a regular file): a fix moves that file only,
    never whatever holds the name by the time it runs."""
    result, _ = full_check.check_file(path, spec, coords=(hi, lo), chunk_states=False)
    if result.error is not None and not isinstance(result.error, EntryKindError):
        raise result.error
    return result.fault, result.identity

"""Types of the C extension kvstore/_fileproto.c (see its docstrings).

Every function checks every argument before it touches memory, and raises (never a signal,
never a status) for a caller's mistake: TypeError for a wrong type (a non-integer, a
non-buffer, read-only memory where the call writes, a path that is not str, bytes or
os.PathLike), OverflowError for a number or a derived size (offset + length, pieces x
piece size, slots) past 2**63, ValueError for the rest (a negative size or offset, a NUL in a
path, a mode outside 0..0o7777, int64/uint64 buffers not 8-byte aligned or of the wrong
format or count, pieces that do not tile their span, a slot order other than the one their
starts give, checksum slots outside the header, a header, span or index outside the file).
Any integer is taken where an int is (numpy integers included). Sequences are copied once
when the call starts: a list changed meanwhile (by an item's __fspath__ or __index__)
changes nothing. An empty segment moves nothing. The Python reference of each function
(kvstore/io/fileio.py, kvstore/io/piece_batch.py, checked by kvstore/io/callcheck.py) raises
the same types and returns the same values and statuses.
"""

from collections.abc import Sequence

from typing_extensions import Buffer

def write_new(
    path: str,
    flags: int,
    mode: int,
    segments: Sequence[tuple[int, Buffer]],
    buffered_from: int,
    file_nbytes: int,
    /,
) -> int: ...
def read_regular(
    path: str,
    flags: int,
    segments: Sequence[tuple[int, Buffer]],
    expected_size: int,
    allow_trailer: bool,
    touch_if_older_than_ns: int,
    /,
) -> tuple[int, int, int, int, int, tuple[int, int, int] | None]: ...
def write_new_hashed(
    path: str,
    flags: int,
    mode: int,
    segments: Sequence[tuple[int, Buffer]],
    buffered_from: int,
    file_nbytes: int,
    first: int,
    last: int,
    chunk_nbytes: int,
    group_nbytes: int,
    sums: Buffer,
    xxh3: object,
    /,
) -> int: ...
def read_regular_hashed(
    path: str,
    flags: int,
    segments: Sequence[tuple[int, Buffer]],
    expected_size: int,
    touch_if_older_than_ns: int,
    first: int,
    last: int,
    chunk_nbytes: int,
    group_nbytes: int,
    sums: Buffer,
    xxh3: object,
    /,
) -> tuple[int, int, int, int, int, tuple[int, int, int] | None]: ...
def sync_and_rename(fd: int, src: str, dst: str, /) -> bool: ...
def first_unaligned(
    segments: Sequence[tuple[int, Buffer]], alignment: int, /
) -> tuple[int, bool]: ...
def publish_pieces(
    blocks: Sequence[tuple[str, str, Buffer, Buffer]],
    flags: int,
    mode: int,
    file_nbytes: int,
    piece_nbytes: int,
    starts: Buffer,
    slot_of: Buffer,
    chunk_nbytes: int,
    slots_offset: int,
    index: Buffer,
    index_offset: int,
    alignment: int,
    xxh3: object,
    /,
) -> list[int]:
    """Per block, in order: 1 (PUBLISHED) written and named; 0 (ALREADY_THERE) a regular file
    had the name, at the probe or at the no-replace rename (nothing of this call's left);
    -errno of the step that failed (-EEXIST: the name holds another kind of entry), the
    temporary file removed. A bad argument raises before any block is touched."""

def exists_many(paths: Sequence[str], /) -> list[int]:
    """Per path, from one lstat: 1 a regular file, 0 no such name (ENOENT), -1 anything else
    (another kind of entry, or an error: ask again one by one for the words)."""

def read_pieces(
    blocks: Sequence[tuple[str, Buffer, Buffer]],
    flags: int,
    file_nbytes: int,
    header_nbytes: int,
    piece_nbytes: int,
    starts: Buffer,
    slot_of: Buffer,
    chunk_nbytes: int,
    slots_offset: int,
    touch_if_older_than_ns: int,
    alignment: int,
    xxh3: object,
    /,
) -> list[int]:
    """Per block, in order: 1 (VERIFIED) read whole and every chunk matches its slot; -errno
    of the step that failed (-ENOENT, -ELOOP for a symbolic link, ...), -EBADMSG for an entry
    that is not a regular file, has the wrong size, reads short or differs from its
    checksums. A bad argument raises before any block is touched."""

def constants() -> dict[str, int]: ...

"""Types of the C extension kvstore/_fileproto.c (see its docstrings)."""

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
) -> list[int]: ...
def exists_many(paths: Sequence[str], /) -> list[int]: ...
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
) -> list[int]: ...
def constants() -> dict[str, int]: ...

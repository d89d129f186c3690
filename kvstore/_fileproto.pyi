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
def constants() -> dict[str, int]: ...

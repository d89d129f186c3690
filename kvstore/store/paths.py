"""Every on-disk name of format v1: the one place the store, admin and inspect take them from.

::

    <root>/zarr.json                               the store (a zarr v3 group)
    <root>/.zarr.json.tmp-*                        a metadata document being replaced
    <root>/.trash-<ns>-<ns time>                   a namespace removed by ``kvstore rm``
    <root>/.kvstore-probe-*                        the engine's O_DIRECT probe (kvstore.io.host)
    <root>/<ns>/zarr.json                          a namespace (its identity)
    <root>/<ns>/quarantine/g<k>-<hi>-<lo>-<time>   a corrupt block moved aside by a reader
    <root>/<ns>/trash/<hi>/g<k>-<hi>-<lo>-<time>   a block evicted by ``kvstore gc``
    <root>/<ns>/g<k>/zarr.json                     array ``g<k>`` (KV-cache group k)
    <root>/<ns>/g<k>/c/0/.../0/<hi>/<lo>           the shard file of one block
    <root>/<ns>/g<k>/c/0/.../0/<hi>/.<lo>.tmp-<t>  a block being written (token ``t``)

The ``0`` levels are the array's dimensions before the two hash dimensions
(:func:`kvstore.store.metadata.leading_dims`: 5 for attention groups, 3 for MLA); ``hi`` and
``lo`` are the block hash's chunk coordinates (:func:`kvstore.keys.hash_coords`): one fan-out
directory per value of ``hi`` (:data:`FANOUT`), one file per block in it.

This module only computes and parses names, and lists directories: :func:`list_dir` is the one
listing every tool goes through (never following a link, never blocking), :func:`list_blocks`
and :func:`list_temps` the walk of the fan-out directories. The block path of the hot path is
a string concatenation (:meth:`ArrayPaths.block`): pathlib objects cost microseconds per block.
"""

from __future__ import annotations

import errno
import itertools
import os
import re
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.errors import EntryKindError
from kvstore.io.dirlist import EntryStat, ListedStat, dir_entry_batches
from kvstore.io.entries import describe_kind, describe_os_error, open_dir_nofollow
from kvstore.keys import HASH_HI_FANOUT, HASH_LO_BITS, hash_coords

ZARR_JSON = "zarr.json"
DOC_TMP_PREFIX = f".{ZARR_JSON}.tmp-"  # a metadata document being written (a crash may leave one)
TMP_MARK = ".tmp-"  # in the name of every temporary file
QUARANTINE = "quarantine"  # <ns>/quarantine/: corrupt blocks moved aside by readers
TRASH = "trash"  # <ns>/trash/: evicted blocks waiting out the grace period
REMOVED_PREFIX = ".trash-"  # <root>/.trash-<ns>-<time_ns>: a namespace being removed
FANOUT = range(HASH_HI_FANOUT)  # the values of hash_hi: one fan-out directory each
#: hex digits of the block hash that a shard file's path determines (70 bits -> 17 digits).
PATH_HEX_DIGITS = 17
Problems = dict[str, str]  # path -> why it could not be listed or used (the tools report these)

# Opening a directory for listing: never through a symbolic link, never blocking.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_GROUP_DIR = re.compile(r"g(0|[1-9][0-9]*)")
_TRAILING_NS = re.compile(r"-([0-9]+)$")
_LO_LIMIT = 1 << HASH_LO_BITS
_MAX_LO_DIGITS = len(str(_LO_LIMIT - 1))


def array_dir(namespace_path: Path, index: int) -> Path:
    """The directory of array ``g<index>`` of a namespace."""
    return namespace_path / f"g{index}"


def parse_group_dir(name: str) -> int | None:
    """The index ``k`` of an array directory name ``g<k>``, None if ``name`` is not one."""
    m = _GROUP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def parse_lo(name: str) -> int | None:
    """``hash_lo`` of a published block's file name (ASCII decimal, no leading zero, below
    2^62), None if the name is not one."""
    # String predicates, not a regular expression: the admin scan calls this once per block
    # of the store (3x faster). isascii: isdigit alone takes other scripts' digits ("²").
    if len(name) > _MAX_LO_DIGITS or not (name.isdigit() and name.isascii()):
        return None
    if name[0] == "0" and len(name) > 1:
        return None
    value = int(name)
    return value if value < _LO_LIMIT else None


def temp_path_for(final: str, token: str) -> str:
    """The temporary file that becomes ``final``: ``<dir>/.<name>.tmp-<token>``.

    The dot-name shape is rsync's, which distributed file systems place like the final name:
    GlusterFS's default ``rsync-hash-regex`` (``^\\.(.+)\\.[^.]+$``) hashes it as ``<name>``, so
    temporary and final name live on the same brick and publishing with ``link(2)`` is one
    atomic link there. With any other shape, half the temporary files land on another brick
    and DHT's two-step cross-brick link lets two nodes both publish one block (measured:
    docs/shared-filesystems.md). Tokens never contain a dot.
    """
    # One partition and one f-string, not pathlib or os.path: this runs once per block written.
    directory, sep, name = final.rpartition(os.sep)
    return f"{directory}{sep}.{name}{TMP_MARK}{token}"


def final_path_of(temp: str) -> str:
    """Inverse of :func:`temp_path_for`."""
    directory, sep, name = temp.rpartition(os.sep)
    return f"{directory}{sep}{name[1 : name.rindex(TMP_MARK)]}"


def parse_temp_lo(name: str) -> int | None:
    """``hash_lo`` of a block's temporary file name, None if the name is not one.

    ``.<lo>.tmp-<token>`` (:func:`temp_path_for`); ``<lo>.tmp-<token>``, the shape of versions
    before the dot-name, is recognised too (such files are still swept).
    """
    base, mark, _token = name.removeprefix(".").partition(TMP_MARK)
    return parse_lo(base) if mark else None


def held_block_name(group: int, hash_hi: int, hash_lo: int, now_ns: int) -> str:
    """Name of a block file moved into quarantine or trash: ``g<k>-<hi>-<lo>-<time ns>``."""
    return f"g{group}-{hash_hi}-{hash_lo}-{now_ns}"


def removed_namespace_name(namespace: str, now_ns: int) -> str:
    """Name of a namespace directory removed by ``kvstore rm``: ``.trash-<ns>-<time ns>``."""
    return f"{REMOVED_PREFIX}{namespace}-{now_ns}"


def held_since_ns(name: str) -> int | None:
    """When a quarantined / trashed / removed entry was put there: its name's trailing time."""
    m = _TRAILING_NS.search(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class BlockFile:
    """One published shard file found in a fan-out directory."""

    path: Path
    hash_hi: int  # first byte of the block hash (fan-out directory)
    hash_lo: int  # next 62 bits (file name)
    nbytes: int  # size (st_size)
    mtime_ns: int  # last use (see kvstore.admin.gc)
    allocated: int = 0  # bytes it holds on the disk (st_blocks * 512, at least nbytes)

    @property
    def path_hex(self) -> str:
        """The first :data:`PATH_HEX_DIGITS` hex digits of the hash, as the path encodes them."""
        bits = (self.hash_hi << HASH_LO_BITS) | self.hash_lo  # 70 bits
        return f"{bits >> 2:0{PATH_HEX_DIGITS}x}"


@dataclass(frozen=True)
class ArrayPaths:
    """Where the files of one group array live."""

    array: Path  # <root>/<ns>/g<k>
    leading_dims: int  # array dimensions before the two hash dimensions
    # <array>/c/0/.../0/: the directory holding the fan-out directories, as a string prefix.
    prefix: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix", str(self.fanout_root) + os.sep)

    @property
    def fanout_root(self) -> Path:
        """The directory holding the fan-out directories."""
        return self.array.joinpath("c", *(["0"] * self.leading_dims))

    def chain(self) -> list[Path]:
        """The directories from the array to the fan-out root: ``c``, ``c/0``, ..."""
        level = self.array / "c"
        out = [level]
        for _ in range(self.leading_dims):
            level = level / "0"
            out.append(level)
        return out

    def fanout_dir(self, hash_hi: int) -> Path:
        """Directory holding the shard files whose hash starts with byte ``hash_hi``."""
        return self.fanout_root / str(hash_hi)

    def block(self, block_hash: bytes) -> str:
        """Absolute path of the published shard file of a (checked) block hash."""
        hi, lo = hash_coords(block_hash)
        return f"{self.prefix}{hi}{os.sep}{lo}"

    def block_at(self, hash_hi: int, hash_lo: int) -> str:
        """Absolute path of the shard file at chunk coordinates ``(hash_hi, hash_lo)``."""
        return f"{self.prefix}{hash_hi}{os.sep}{hash_lo}"

    def list_blocks(
        self,
        fanouts: Iterable[int] = FANOUT,
        *,
        root: Path | None = None,
        problems: Problems | None = None,
    ) -> Iterator[BlockFile]:
        """Published shard files of the fan-out directories ``fanouts``, in their order
        (within one directory: listing order). See :func:`list_blocks`."""
        for hi in fanouts:
            yield from list_blocks(self.fanout_dir(hi), hi, root=root, problems=problems)

    def list_blocks_and_temps(
        self,
        fanouts: Iterable[int] = FANOUT,
        *,
        root: Path | None = None,
        problems: Problems | None = None,
    ) -> Iterator[BlockFile | Path]:
        """:meth:`list_blocks` and :meth:`list_temps` in one listing of each fan-out
        directory: a published file as a :class:`BlockFile`, a temporary one as its path."""
        for hi in fanouts:
            directory = self.fanout_dir(hi)
            for name, st in _listing(directory, root, problems):
                lo = parse_lo(name)
                if lo is not None:
                    found = _block_or_problem(directory, name, hi, lo, st, problems)
                    if found is not None:
                        yield found
                elif parse_temp_lo(name) is not None and stat.S_ISREG(st.st_mode):
                    yield directory / name

    def block_file(
        self, block_hash: bytes, *, root: Path | None = None, problems: Problems | None = None
    ) -> BlockFile | None:
        """The published shard file of ``block_hash`` with one ``lstat`` (no listing), or
        None. See :func:`block_file`."""
        hi, lo = hash_coords(block_hash)
        return block_file(self.fanout_dir(hi), hi, lo, root=root, problems=problems)

    def list_temps(
        self,
        fanouts: Iterable[int] = FANOUT,
        *,
        root: Path | None = None,
        problems: Problems | None = None,
    ) -> Iterator[Path]:
        """Temporary block files of the fan-out directories ``fanouts``."""
        for hi in fanouts:
            yield from list_temps(self.fanout_dir(hi), root=root, problems=problems)


def list_blocks(
    directory: Path, hash_hi: int, *, root: Path | None = None, problems: Problems | None = None
) -> Iterator[BlockFile]:
    """The published shard files in fan-out directory ``directory`` (of ``hash_hi``).

    Only regular files whose name is a block name (:func:`parse_lo`) count: temporary files and
    other names are not blocks (``kvstore verify`` reports them); a block name holding a link,
    FIFO, directory or device is never opened and goes to ``problems``, as does a directory
    that cannot be listed (see :func:`list_dir` for ``root``). Entries that vanish while
    listed (eviction, quarantine) are skipped.
    """
    for name, st in _listing(directory, root, problems):
        lo = parse_lo(name)
        if lo is None:
            continue
        found = _block_or_problem(directory, name, hash_hi, lo, st, problems)
        if found is not None:
            yield found


def block_file(
    directory: Path,
    hash_hi: int,
    hash_lo: int,
    *,
    root: Path | None = None,
    problems: Problems | None = None,
) -> BlockFile | None:
    """The shard file at ``(hash_hi, hash_lo)`` in fan-out directory ``directory``, found with
    one ``lstat`` in that directory (opened as :func:`list_dir` opens it), or None: missing, or
    not a regular file (never opened; recorded in ``problems``), or a directory that cannot be
    entered (recorded too). What :func:`list_blocks` would yield for that name."""
    name = str(hash_lo)
    st = _lstat_in(directory, name, root, problems)
    return (
        None if st is None else _block_or_problem(directory, name, hash_hi, hash_lo, st, problems)
    )


def _block_or_problem(  # noqa: PLR0913 - where the entry is, what it is called and what lstat said
    directory: Path,
    name: str,
    hash_hi: int,
    hash_lo: int,
    st: EntryStat,
    problems: Problems | None,
) -> BlockFile | None:
    """The entry at a block name as a :class:`BlockFile` when it is a regular file; anything
    else is never opened and goes to ``problems``."""
    if stat.S_ISREG(st.st_mode):
        allocated = max(st.st_blocks * 512, st.st_size)
        return BlockFile(directory / name, hash_hi, hash_lo, st.st_size, st.st_mtime_ns, allocated)
    if problems is not None:
        problems[str(directory / name)] = (
            f"{directory / name}: expected a block file, got {describe_kind(st.st_mode)} "
            "(never opened)"
        )
    return None


def _record_unlistable(directory: Path, exc: OSError, problems: Problems | None) -> None:
    """Record in ``problems`` why ``directory`` could not be entered or listed."""
    if problems is None:
        return
    if isinstance(exc, EntryKindError):
        problems.setdefault(str(exc).split(":", 1)[0], f"{exc} (not entered)")
    else:
        problems[str(directory)] = f"{directory}: cannot list ({describe_os_error(exc)})"


def _lstat_in(
    directory: Path, name: str, root: Path | None, problems: Problems | None
) -> os.stat_result | None:
    """``lstat`` of ``name`` in ``directory`` (entered as :func:`list_dir` enters it); None
    when either is missing or the directory cannot be entered (then recorded in
    ``problems``)."""
    try:
        fd = _open_listed(directory, root)
    except OSError as exc:
        _record_unlistable(directory, exc, problems)
        return None
    if fd is None:
        return None
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if problems is not None:
            problems[str(directory / name)] = f"{directory / name}: {describe_os_error(exc)}"
        return None
    finally:
        os.close(fd)


def list_temps(
    directory: Path, *, root: Path | None = None, problems: Problems | None = None
) -> Iterator[Path]:
    """The temporary block files (:func:`parse_temp_lo`) in fan-out directory ``directory``."""
    for name, st in _listing(directory, root, problems):
        if parse_temp_lo(name) is not None and stat.S_ISREG(st.st_mode):
            yield directory / name


def list_dir(path: str | Path, *, root: str | Path | None = None) -> list[tuple[str, ListedStat]]:
    """``(name, lstat)`` of every entry of directory ``path``, never following a link.

    Without ``root``, ``path`` is opened with ``O_NOFOLLOW | O_DIRECTORY | O_NONBLOCK``: a
    symbolic link, FIFO or file there lists as empty (its parent's listing shows what it is).
    With ``root`` (a directory above ``path``), every component below ``root`` is entered
    without following a link (:func:`~kvstore.io.entries.open_dir_nofollow`), and one that is
    not a real directory raises :class:`~kvstore.errors.EntryKindError` naming it. Either way
    a missing directory lists as empty and entries that vanish while listed are left out; any
    other failure (EACCES, EIO, ...) raises that ``OSError``.
    """
    return list(iter_dir(path, root=root))


def iter_dir(
    path: str | Path, *, root: str | Path | None = None
) -> Iterator[tuple[str, ListedStat]]:
    """:func:`list_dir` one entry at a time: a directory of any size in constant memory.

    The directory is opened (and a failure to open it raised) at the call, not at the first
    ``next``; an error while reading it is raised from the iteration."""
    return itertools.chain.from_iterable(iter_dir_batches(path, root=root))


def _open_listed(path: str | Path, root: str | Path | None) -> int | None:
    """The directory's descriptor for :func:`iter_dir`; None when it lists as empty."""
    try:
        if root is None:
            return os.open(path, _DIR_FLAGS)
        return open_dir_nofollow(root, Path(path).relative_to(root).parts)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except EntryKindError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symbolic link: not entered
            return None
        raise


def iter_dir_batches(
    path: str | Path, *, root: str | Path | None = None
) -> Iterator[list[tuple[str, ListedStat]]]:
    """:func:`iter_dir` a batch of entries at a time (:func:`~kvstore.io.dirlist.
    dir_entry_batches`): what a walk of millions of entries iterates. Every listing of the
    tools goes through here (:func:`iter_dir` too)."""
    fd = _open_listed(path, root)
    return iter(()) if fd is None else _batches(fd)


def _batches(fd: int) -> Iterator[list[tuple[str, ListedStat]]]:
    # The listing beats the tools' hung-mount watchdog as it advances, and once at its end: a
    # run of empty fan-out directories is no silence.
    try:
        yield from dir_entry_batches(fd)
    finally:
        os.close(fd)


def _listing(
    directory: Path, root: Path | None, problems: Problems | None
) -> Iterator[tuple[str, ListedStat]]:
    """:func:`iter_dir`, one entry at a time (a fan-out directory of 10^8 blocks' store holds
    390k); a directory that cannot be listed counts as empty, one failing part-way as what
    was listed before (either recorded in ``problems`` when given)."""
    try:
        yield from iter_dir(directory, root=root)
    except OSError as exc:
        _record_unlistable(directory, exc, problems)

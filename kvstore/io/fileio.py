"""Every file-system call kvstore makes, in one small replaceable object.

The page store and the I/O engines never call ``os`` directly for store files: they call a
:class:`FileIO`.

A hostile tree is normal input: any entry may be a symbolic link, FIFO, socket, device or
directory where kvstore expects a file, or the reverse. Hence the rules every open here keeps:

* no open blocks: ``O_NONBLOCK`` always (a FIFO with no writer would block ``open(2)``
  forever; on regular files Linux ignores the flag);
* no symbolic link is followed below the root: ``O_NOFOLLOW`` on the last component, and
  :func:`~kvstore.io.entries.open_dir_nofollow` for directories entered by a rare path
  (quarantine, trash);
* a file is read only after ``fstat`` says it is regular (:meth:`FileIO.open_regular`,
  :meth:`FileIO.exists`); anything else is :class:`~kvstore.errors.EntryKindError`;
* a file is moved or removed only if it is still the file that was read
  (:func:`~kvstore.io.entries.move_if_same`, :func:`~kvstore.io.entries.remove_if_same`),
  never "whatever has the name now";
* a rename never replaces a name (:func:`kvstore.io.rename.rename_noreplace`).

The primitives behind those rules live in :mod:`kvstore.io.entries` (what a name holds, which
file it is, no-follow directories, identity-checked moves) and :mod:`kvstore.io.rename` (the
no-replace rename); this module holds the object that calls them. The loops the reference
compound operations are made of are :mod:`kvstore.io.vectored` (full vectored reads and writes)
and :mod:`kvstore.io.hashed_groups` (a hashed transfer's groups).

Tests substitute a subclass that records operations (to replay a power loss) or injects errors
(EIO, ENOSPC, short transfers) at any call. The default implementation is a thin,
allocation-free layer over ``os``; ``pwritev``/``preadv`` release the GIL.

Compound operations do one block file's whole protocol (:meth:`FileIO.write_new`,
:meth:`FileIO.read_regular`, :meth:`FileIO.sync_and_rename`, their hashed forms, the batched
existence probe and the piece batches). Their bodies here, composed of the primitives above
and nothing else, are the reference. :class:`kvstore.io.native_fileio.NativeFileIO` overrides
them with one GIL-free call each of the C extension ``kvstore._native._fileproto``
(:mod:`kvstore.io.fileproto`): the same system calls, flags and errors, a fraction of the
Python cost per small block; it is the default (``DEFAULT_FILEIO``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import operator
import os
import stat
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.callargs import snapshot
from kvstore.errors import CorruptBlockError, EntryKindError
from kvstore.io import file_batch, piece_batch
from kvstore.io.callcheck import (
    check_new_file,
    check_paths,
    check_read,
    check_sync_and_rename,
)
from kvstore.io.entries import FileId, describe_kind, file_id, not_regular, open_dir_nofollow
from kvstore.io.hashed_groups import hash_parts, hashed_groups, plain_hashing
from kvstore.io.rename import rename_noreplace, rename_noreplace_at
from kvstore.io.types import Hashing, PieceBlock, PiecePlan, Segment
from kvstore.io.vectored import check_size, coalesce, read_run, write_fully, write_runs

O_DIRECT: int = getattr(os, "O_DIRECT", 0)
NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL  # a whole new block file's open flags
PROBE_PREFIX = ".kvstore-probe-"  # the O_DIRECT probe file in a store root (crashes leave it)
# Every open of a store file: never blocks (FIFO), never follows a final symbolic link.
_OPEN_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """The type of the file system holding ``path`` as the kernel names it ("ext4", "xfs",
    "tmpfs", "fuse.glusterfs", "nfs4", ...), from the longest mount point above it in
    ``/proc/self/mountinfo``; "" where that cannot be read (not Linux)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    target = os.path.realpath(path)
    best, kind = -1, ""
    for line in lines:
        fields = line.split()
        try:
            separator = fields.index("-")
            mount_point = fields[4].replace("\\040", " ")
            fs_type = fields[separator + 1]
        except (ValueError, IndexError):
            continue
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) > best:
            best, kind = len(mount_point), fs_type
    return kind


class FileIO:
    """File operations on absolute paths and raw descriptors, and the Python reference of the
    compound operations, built only on them. Subclass to record or inject: every step of a
    compound operation goes through the primitives a subclass overrides."""

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        """``os.open`` with ``O_NOFOLLOW`` (a symlink planted inside the store is never
        followed out of it) and ``O_NONBLOCK`` (a FIFO planted there never blocks the open;
        Linux ignores the flag for regular files, so reads and writes are unchanged)."""
        return os.open(path, flags | _OPEN_FLAGS, mode)

    def open_regular(self, path: str, flags: int = os.O_RDONLY) -> tuple[int, os.stat_result]:
        """Open an existing file to read it: a descriptor and its ``fstat``, or
        :class:`~kvstore.errors.EntryKindError` (descriptor closed) when ``path`` holds anything
        but a regular file (FIFO, socket, device, directory). The one ``fstat`` is the one a
        reader needs anyway (size check, mtime, identity): no extra system call."""
        try:
            fd = self.open(path, flags)
        except OSError as exc:
            refused = refused_open(path, exc)
            if refused is exc:
                raise
            raise refused from None
        try:
            st = self.fstat(fd)
        except BaseException:
            self.close(fd)
            raise
        if not stat.S_ISREG(st.st_mode):
            self.close(fd)
            raise not_regular(path, st.st_mode)
        return fd, st

    def close(self, fd: int) -> None:
        os.close(fd)

    def pwritev(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def fstat_size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def fstat(self, fd: int) -> os.stat_result:
        return os.fstat(fd)

    def touch(self, fd: int) -> None:
        """Set the file's modification time to now (readers record last use this way)."""
        os.utime(fd)

    def clear_direct(self, fd: int, open_flags: int | None = None) -> None:
        """Turn O_DIRECT off on an open descriptor (Linux allows it through F_SETFL).

        ``open_flags``: the flags :meth:`open` was given for ``fd``, when the caller knows
        them. The status flags then follow from them (plus the ones :meth:`open` adds) and
        one ``fcntl`` does, instead of ``F_GETFL`` then ``F_SETFL``. F_SETFL changes only the
        status flags (append, async, direct, noatime, nonblock) and ignores the access mode
        and creation flags in its argument.
        """
        flags = fcntl.fcntl(fd, fcntl.F_GETFL) if open_flags is None else open_flags | _OPEN_FLAGS
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~O_DIRECT)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def rename_at(self, src_dir_fd: int | None, src: str, dst_dir_fd: int | None, dst: str) -> None:
        """:meth:`rename` between open directories (:func:`rename_noreplace_at`)."""
        rename_noreplace_at(src_dir_fd, src, dst_dir_fd, dst)

    def lstat_at(self, dir_fd: int | None, name: str) -> os.stat_result:
        """``lstat`` of ``name`` in an open directory (links not followed)."""
        return os.lstat(name, dir_fd=dir_fd)

    def unlink_at(self, dir_fd: int | None, name: str) -> None:
        os.unlink(name, dir_fd=dir_fd)

    def open_dir(
        self,
        root: str | os.PathLike[str],
        parts: Sequence[str],
        create_mode: int | None = None,
        created: list[str] | None = None,
    ) -> int:
        """:func:`open_dir_nofollow` (a descriptor; the caller closes it)."""
        return open_dir_nofollow(root, parts, create_mode=create_mode, created=created)

    def rename(self, src: str, dst: str) -> None:
        """Atomically give ``src`` the name ``dst``; ``dst`` must not exist (FileExistsError).

        kvstore renames only to publish a new name (a block, a metadata document, a
        quarantined file) and never replaces one: on a shared file system a name replaced
        under a reader on another node fails that reader's reads (GlusterFS: ENOENT on its
        open descriptor), and two nodes publishing the same block must leave one copy rather
        than swap it under readers. See :func:`rename_noreplace`.
        """
        rename_noreplace(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def exists(self, path: str) -> bool:
        """Whether a regular file has the name ``path`` (the existence probe of lookups).

        ``lstat``: a symbolic link is not followed. A name held by anything but a regular file
        (a link, FIFO, socket, device, directory) raises
        :class:`~kvstore.errors.EntryKindError`, which lookups count as a failed probe: a miss,
        logged.
        """
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(mode):
            raise not_regular(path, mode)
        return True

    def exists_many(self, paths: Sequence[str]) -> list[bool | OSError]:
        """:meth:`exists` of each path: True, False, or the OSError its probe raised (an
        :class:`~kvstore.errors.EntryKindError` for a name held by anything but a regular
        file). :class:`~kvstore.io.native_fileio.NativeFileIO` probes the whole batch in one
        native call without the GIL."""
        names = snapshot(paths, "exists_many: expected a sequence of paths")
        check_paths(names)  # what the native call refuses, refused alike
        return [self._exists_or_error(p) for p in names]

    def _exists_or_error(self, path: str) -> bool | OSError:
        """:meth:`exists`, or the OSError it raised."""
        try:
            return self.exists(path)
        except OSError as exc:
            return exc

    def makedirs(self, path: str, mode: int = 0o700) -> list[str]:
        """Create ``path`` and missing parents, each with ``mode`` (os.makedirs gives parents
        the umask's default, which would leave intermediate directories world-readable).

        Returns the directories this call created, outermost first (see :func:`sync_parents`).
        """
        missing = []
        current = os.path.abspath(path)
        while not os.path.isdir(current):
            missing.append(current)
            parent = os.path.dirname(current)
            if parent == current:
                break
            current = parent
        created = []
        for directory in reversed(missing):
            try:
                os.mkdir(directory, mode)
                created.append(directory)
            except FileExistsError:
                # Created meanwhile by another process: it must be a real directory (a link
                # there would take everything below it out of the store).
                mode = os.lstat(directory).st_mode
                if not stat.S_ISDIR(mode):
                    raise EntryKindError(
                        f"{directory}: expected a directory, got {describe_kind(mode)}"
                    ) from None
        return created

    # -- compound operations: one block file's protocol in one call -------------------------

    def write_new(  # noqa: PLR0913 - the file, its flags, its bytes and where they go
        self,
        path: str,
        flags: int,
        mode: int,
        segments: Sequence[Segment],
        file_nbytes: int,
        buffered_from: int | None = None,
    ) -> int:
        """Create ``path`` (``flags`` must hold ``O_CREAT | O_EXCL``) and write ``segments``
        (``(offset, bytes)`` in file order) with one vectored write per file-contiguous run
        (:func:`write_fully`); returns the open descriptor, unsynced (the caller syncs and
        closes it).

        ``buffered_from``: with ``O_DIRECT`` in ``flags``, the segments from that index on are
        written after O_DIRECT is cleared (one ``F_SETFL``: :meth:`clear_direct`). A file
        whose bytes do not end at ``file_nbytes`` is cut (or extended) to it. On an error the
        descriptor is closed before the exception propagates; the file is left for the
        caller to remove.
        """
        stop = len(segments) if buffered_from is None else buffered_from
        checked, flags, mode = check_new_file(path, flags, mode, segments, stop, file_nbytes)
        fd = self.open(path, flags, mode)
        try:
            end = write_runs(self, fd, flags, checked, 0, len(checked), stop, 0)
            if end != file_nbytes:  # a new file ends where its last byte went
                self.ftruncate(fd, file_nbytes)
        except BaseException:
            self.close(fd)
            raise
        return fd

    def write_new_hashed(  # noqa: PLR0913 - write_new's arguments and the checksums' plan
        self,
        path: str,
        flags: int,
        mode: int,
        segments: Sequence[Segment],
        file_nbytes: int,
        hashing: Hashing,
        buffered_from: int | None = None,
    ) -> int:
        """:meth:`write_new`, checksumming the chunks of segments ``hashing.first`` to
        ``hashing.last`` into ``hashing.sums`` as they are written (:class:`Hashing`): those
        segments go first, group by group, each group hashed just before its vectored write
        (its bytes are then in the CPU cache when the write copies them), then the other
        segments in order. A caller writes a block's data this way and its header, whose
        checksum slots ``hashing.sums`` may be, after it: the file is a temporary one that
        nothing reads before it is renamed.

        With ``O_DIRECT`` the hashed segments must lie before ``buffered_from`` (O_DIRECT,
        once cleared, is not set again). Bad geometry is a ValueError before any file is
        created.
        """
        stop = len(segments) if buffered_from is None else buffered_from
        h = hashing
        geometry = (h.first, h.last, h.chunk_nbytes, h.group_nbytes)
        checked, flags, mode = check_new_file(
            path, flags, mode, segments, stop, file_nbytes, geometry
        )
        h = plain_hashing(h)
        groups = hashed_groups(checked, h)
        if flags & O_DIRECT and h.last > stop and h.last > h.first:
            raise ValueError(
                f"write_new_hashed: expected the hashed segments [{h.first}, {h.last}) before "
                f"buffered_from ({stop}) with O_DIRECT"
            )
        fd = self.open(path, flags, mode)
        try:
            end = done = 0
            for offset, parts in groups:
                done = hash_parts(h, parts, done)
                end = max(end, offset + write_fully(self, fd, parts, offset))
            end = write_runs(self, fd, flags, checked, 0, h.first, stop, end)
            end = write_runs(self, fd, flags, checked, h.last, len(checked), stop, end)
            if end != file_nbytes:  # a new file ends where its last byte went
                self.ftruncate(fd, file_nbytes)
        except BaseException:
            self.close(fd)
            raise
        return fd

    def read_regular(  # noqa: PLR0913 - the file, its expected size, and what to fill
        self,
        path: str,
        flags: int,
        segments: Sequence[Segment],
        file_nbytes: int,
        allow_trailer: bool = False,
        touch_if_older_than_ns: int = 0,
    ) -> FileId:
        """Fill ``segments`` (``(offset, writable memory)``) from the regular file ``path`` of
        ``file_nbytes`` bytes (``allow_trailer``: or more); returns its identity. The file is
        closed before this returns.

        Raises what :meth:`open_regular` raises (FileNotFoundError,
        :class:`~kvstore.errors.EntryKindError` for anything but a regular file, never
        blocking on a FIFO), and :class:`~kvstore.errors.CorruptBlockError` carrying the
        file's identity when its size is wrong or a read comes back short. A file whose mtime
        is older than ``touch_if_older_than_ns`` gets now as its mtime after the read (best
        effort: a read-only mount keeps its times).
        """
        checked, flags = check_read(
            path, flags, segments, file_nbytes, touch_if_older_than_ns, (), allow_trailer
        )

        def read(fd: int) -> None:
            for offset, buffers in coalesce(checked):
                read_run(self, fd, buffers, offset)

        return self._read_regular_with(
            path, flags, file_nbytes, allow_trailer, touch_if_older_than_ns, read
        )

    def _read_regular_with(  # noqa: PLR0913 - read_regular's arguments, the read itself apart
        self,
        path: str,
        flags: int,
        file_nbytes: int,
        allow_trailer: bool,
        touch_if_older_than_ns: int,
        read: Callable[[int], None],
    ) -> FileId:
        """The Python reference of the compound reads: open the regular file, check its size,
        ``read(fd)``, touch an old mtime, close; a :class:`CorruptBlockError` carries the
        identity of the file found corrupt, whatever the name holds by then."""
        fd, st = self.open_regular(path, flags)
        try:
            check_size(st.st_size, file_nbytes, allow_trailer)
            read(fd)
            if st.st_mtime_ns < touch_if_older_than_ns:
                # A read-only mount or foreign owner: last-use tracking is best effort.
                with contextlib.suppress(OSError):
                    self.touch(fd)
        except CorruptBlockError as exc:
            exc.file_id = file_id(st)
            raise
        finally:
            self.close(fd)
        return file_id(st)

    def read_regular_hashed(  # noqa: PLR0913 - read_regular's arguments and the checksums' plan
        self,
        path: str,
        flags: int,
        segments: Sequence[Segment],
        file_nbytes: int,
        hashing: Hashing,
        touch_if_older_than_ns: int = 0,
    ) -> FileId:
        """:meth:`read_regular` (no trailer), checksumming the chunks of segments
        ``hashing.first`` to ``hashing.last`` into ``hashing.sums`` as they are read
        (:class:`Hashing`): each group right after its vectored read, while it is in the CPU
        cache. The segments are read in order; the caller compares the values (after checking
        the header it read) - this only computes them. A short read stops the read (values
        after it are not written) and raises what :meth:`read_regular` raises."""
        h = hashing
        geometry = (h.first, h.last, h.chunk_nbytes, h.group_nbytes)
        checked, flags = check_read(
            path, flags, segments, file_nbytes, touch_if_older_than_ns, geometry
        )
        h = plain_hashing(h)
        groups = hashed_groups(checked, h)

        def read(fd: int) -> None:
            for offset, buffers in coalesce(checked[: h.first]):
                read_run(self, fd, buffers, offset)
            done = 0
            for offset, parts in groups:
                read_run(self, fd, parts, offset)
                done = hash_parts(h, parts, done)
            for offset, buffers in coalesce(checked[h.last :]):
                read_run(self, fd, buffers, offset)

        return self._read_regular_with(
            path, flags, file_nbytes, False, touch_if_older_than_ns, read
        )

    def sync_and_rename(self, fd: int | None, tmp: str, final: str) -> None:
        """Publish a written temporary file: ``fdatasync`` it on ``fd`` (None: not synced,
        a store without durability), then :meth:`rename` it to ``final``, never replacing a
        name (FileExistsError, ``filename2`` = ``final``). ``fd`` stays open."""
        check_sync_fd(fd)
        check_sync_and_rename(fd, tmp, final)  # names first: nothing synced for a bad name
        if fd is not None:
            self.fdatasync(operator.index(fd))
        self.rename(tmp, final)

    @property
    def native_piece_batches(self) -> bool:
        """Whether :meth:`publish_pieces` and :meth:`read_pieces` run as one native call per
        batch (:class:`~kvstore.io.native_fileio.NativeFileIO`); here they never do."""
        return False

    def publish_pieces(
        self, blocks: Sequence[PieceBlock], flags: int, mode: int, plan: PiecePlan
    ) -> list[int]:
        """Write and name whole raw dense blocks given as pieces (:class:`PiecePlan`), in one
        native call with the GIL released for the whole batch where
        :attr:`native_piece_batches`, else block by block through this object's primitives
        (:mod:`kvstore.io.piece_batch`, the reference: the same steps and statuses).

        Per block ``(tmp, final, header, span)``, in order: ``lstat(final)`` (a regular file
        there: :data:`ALREADY_THERE`, nothing written), the span's chunks hashed (xxh3) into
        the header's slots, ``tmp`` opened ``O_EXCL`` with ``flags`` (O_DIRECT dropped for a
        block whose header or pieces are not aligned), header and pieces in one ``pwritev``,
        the index after them (buffered), closed, then renamed to ``final`` never replacing
        a name (taken: :data:`ALREADY_THERE`, ``tmp`` removed): :data:`PUBLISHED`. The
        same steps as :meth:`exists`, :meth:`write_new` and :meth:`sync_and_rename` without a
        sync, so the same file. Any other outcome is ``-errno`` of the step that failed,
        with ``tmp`` removed: the caller takes that block through those methods one by one
        (they are the reference, and report the failure in their words). No sync: for
        stores without durability."""
        return piece_batch.publish_pieces(self, blocks, flags, mode, plan)

    def read_files(self, paths: Sequence[str], file_nbytes: int, rows: Any) -> list[int]:
        """Read whole small files of ``file_nbytes`` bytes each into the rows of one writable
        buffer (file ``i`` into ``rows[i * file_nbytes:(i + 1) * file_nbytes]``), as the
        offline checks read tiny blocks: one native call with the GIL released for the whole
        batch in :class:`~kvstore.io.native_fileio.NativeFileIO`, else file by file through
        this object's primitives (:mod:`kvstore.io.file_batch`, the reference).

        Per file, in order: open (``O_RDONLY``, never following a link, never blocking),
        ``fstat``, one read of the whole regular file of exactly ``file_nbytes`` bytes, close;
        no mtime is touched. Outcome :data:`~kvstore.io.file_batch.READ_WHOLE` (1), ``-errno``
        of the step that failed, or ``-EBADMSG`` for a file that is not regular, has another
        size or reads short. Beats the tools' hung-mount watchdog (:mod:`kvstore.io.stall`)
        after each file."""
        return file_batch.read_files(self, paths, file_nbytes, rows)

    def read_pieces(
        self,
        blocks: Sequence[tuple[str, memoryview, memoryview]],
        header_nbytes: int,
        plan: PiecePlan,
        touch_if_older_than_ns: int,
        direct: bool = False,
    ) -> list[int]:
        """Read whole raw dense blocks into pieces and verify them (:class:`PiecePlan`: the
        index is not read), in one native call with the GIL released for the whole batch
        where :attr:`native_piece_batches`, else block by block through this object's
        primitives (:mod:`kvstore.io.piece_batch`, the reference: the same statuses).

        Per block ``(path, header, span)``, in order: :meth:`read_regular`'s steps (open,
        ``fstat``, a regular file of ``plan.file_nbytes`` bytes, one ``preadv`` of the
        ``header_nbytes``-byte header and every piece where it lies, touch, close), then each
        chunk's xxh3 against its slot in the header read: :data:`VERIFIED`. Any other outcome
        is ``-errno`` (``-EBADMSG``: not regular, wrong size, short, or a checksum differs):
        the caller reads that block again through its reference path, which names and
        quarantines what is wrong. The header's other fields are the caller's to check.
        ``direct``: open with O_DIRECT each block whose header and pieces are aligned to
        ``plan.alignment`` in address and length (the others buffered)."""
        flags = os.O_RDONLY | (O_DIRECT if direct else 0)
        return piece_batch.read_pieces(
            self, blocks, flags, header_nbytes, plan, touch_if_older_than_ns
        )

    def drop_cache(self, fd: int) -> None:
        """Ask the kernel to drop this file's clean cached pages (benchmarks' cold reads)."""
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def sync_parents(fio: FileIO, created: Sequence[str]) -> None:
    """fsync the parent of every directory in ``created`` (what :meth:`FileIO.makedirs` made).

    A new directory's name lives in its parent: until the parent is synced a power loss may
    drop it, and every file below with it, however well those files were synced.
    """
    for parent in sorted({os.path.dirname(d) for d in created}):
        fio.fsync_dir(parent)


def drop_tree_cache(directory: str | os.PathLike[str]) -> None:
    """Evict a tree's clean pages from the page cache, so the next read is cold (benchmarks)."""
    for dirpath, _, files in os.walk(directory):
        for name in files:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def check_sync_fd(fd: int | None) -> None:
    """A :meth:`FileIO.sync_and_rename` descriptor: >= 0, or None for no sync (the native
    call's -1 means "no sync", never a caller's)."""
    if fd is not None and fd < 0:
        raise ValueError(
            f"sync_and_rename: expected a descriptor >= 0, or None for no sync, got {fd}"
        )


def refused_open(path: str, exc: OSError) -> OSError:
    """What an open of ``path`` that failed with ``exc`` raises: ELOOP (O_NOFOLLOW met a
    symbolic link) and ENXIO (a socket, or a device without a driver) become
    :class:`~kvstore.errors.EntryKindError` naming what the name holds - the ``lstat`` costs
    nothing on the path that succeeds; anything else is ``exc`` itself."""
    if exc.errno not in (errno.ELOOP, errno.ENXIO):
        return exc
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return exc
    if stat.S_ISREG(mode):
        return exc
    return not_regular(path, mode)

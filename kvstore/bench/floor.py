"""The protocol floor: what kvstore's publish-and-verify protocol costs, in the leanest Python.

The raw floor (:class:`~kvstore.bench.common.RawFloor`) writes a block as one file with open,
``pwrite`` (and ``fdatasync``), close, and reads it with open, ``preadv``, close. kvstore must
do more, whatever its code looks like:

* publish atomically: a temporary file created ``O_EXCL`` beside the final name, then
  ``renameat2(RENAME_NOREPLACE)`` to it (a block already published is never replaced), after
  an ``lstat`` that skips blocks already stored; under durability ``full`` an ``fdatasync``
  per file before its rename and an ``fsync`` per fan-out directory per batch after them;
* write the format: a header page (key, geometry, crc32c, one xxh3_64 per inner chunk) before
  the chunks and the zarr index after them, so the file is ``layout.file_nbytes`` bytes;
* verify every read: the header against the key, its crc32c, and the xxh3_64 of every inner
  chunk against its slot.

:class:`ProtocolFloor` does exactly that and nothing else, with the raw floor's threads, batches,
O_DIRECT mode and durability: per block written ``lstat``, open, ``pwritev`` (O_DIRECT: then
one ``fcntl`` and a ``pwrite`` of the index's unaligned last page), ``fdatasync``, close,
``renameat2``; per batch open/``fsync``/close of each fan-out directory; per block read open,
``fstat`` (a regular file of the right size; kvstore also reads the last-use mtime from it),
``preadv`` of header page and chunks, close. Checksums are one native call per block
(:func:`kvstore.checksum.chunk_sums`). Its files are valid kvstore block files (same header,
chunks and index), named by the raw floor's fan-out (``<root>/<hash[0]>/<hash[1:9] hex>``).

What kvstore pays beyond this is its own code's cost (objects, checks, engine layers); what
this pays beyond the raw floor is the protocol's. Not included, as no protocol step needs it:
a random token per temporary name (a per-process random prefix and a counter are unique too;
``O_EXCL`` refuses any clash), holding descriptors to the end of a batch, and the large-block
piecewise verification kvstore does for cache locality (here: one ``preadv``, then one
checksum pass).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import itertools
import os
import stat
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvstore.bench.common import RawFloor, Workload, run_pool
from kvstore.checksum import XXH3_64, chunk_sums, crc32c
from kvstore.errors import CorruptBlockError
from kvstore.io.align import ALIGN
from kvstore.io.buffers import aligned_buffer, is_aligned
from kvstore.io.fileio import O_DIRECT
from kvstore.io.native_fileio import NativeFileIO
from kvstore.io.rename import AT_FDCWD, RENAME_NOREPLACE, load_renameat2, rename_noreplace
from kvstore.store import format as fmt
from kvstore.store.format import ShardLayout

_OPEN = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK  # as kvstore's FileIO.open
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
# [52, 120): hash lengths, checksum algorithm, reserved, block hash, parent hash (padded)
_KEYS = struct.Struct("<BBBx32s32s")
_CREATED = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_CRC_END = fmt.CRC_OFFSET + 4
_CRC32C_RESIDUE = 0x48674BC7  # crc32c over data followed by its own crc32c (little endian)


_renameat2 = load_renameat2()  # the binding kvstore publishes with


def publish_noreplace(tmp: str, final: str) -> None:
    """``renameat2(tmp, final, RENAME_NOREPLACE)``: FileExistsError when ``final`` exists.
    (Elsewhere: kvstore's own fallbacks, :func:`kvstore.io.rename.rename_noreplace`.)"""
    if _renameat2 is None:
        rename_noreplace(tmp, final)
        return
    if _renameat2(AT_FDCWD, tmp.encode(), AT_FDCWD, final.encode(), RENAME_NOREPLACE) == 0:
        return
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # the file system lacks the flag
        rename_noreplace(tmp, final)
        return
    raise OSError(err, os.strerror(err), tmp, None, final)


def _pwritev(fd: int, buffers: list[memoryview], offset: int, want: int) -> None:
    """``buffers`` at ``offset``, ``want`` bytes in all (one call up to IOV_MAX buffers)."""
    if len(buffers) <= _IOV_MAX:
        done = os.pwritev(fd, buffers, offset)
    else:
        done = 0
        for start in range(0, len(buffers), _IOV_MAX):
            done += os.pwritev(fd, buffers[start : start + _IOV_MAX], offset + done)
    if done != want:
        raise OSError(f"protocol floor: short write, {done} of {want} bytes")


def stored(path: str) -> bool:
    """Is a block already published at ``path`` (one ``lstat``; links not followed)?"""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    return True


class ProtocolFloor(RawFloor):
    """kvstore's mandatory protocol per block, leanest Python (see the module docstring).

    ``layout`` and ``namespace_digest`` fix the header's geometry and namespace (group 0);
    ``threads``, ``durable`` and ``direct`` are the raw floor's.
    """

    name = "floor"

    def __init__(  # noqa: PLR0913 - the raw floor's arguments plus the block format's geometry and namespace
        self,
        root: Path,
        layout: ShardLayout,
        namespace_digest: bytes,
        threads: int,
        durable: bool,
        direct: bool = False,
    ) -> None:
        super().__init__(root, threads, durable, direct)  # root, pool, fan-out directories
        self.layout = layout
        self.written = 0  # blocks published by this floor (not skipped, not refused)
        self._file_nbytes = layout.file_nbytes
        template = fmt.encode_fixed_header(layout, namespace_digest, 0, b"\x01", None, 0, 0)
        self._prefix = template[: fmt.HASH_LEN_OFFSET]  # magic .. group
        self._geometry = template[fmt.GEOMETRY_OFFSET : fmt.CREATED_OFFSET]
        self._template = template[: fmt.HEADER_FIXED_NBYTES]
        self._slots_end = fmt.checksum_slot_offset(layout.num_chunks)
        index = aligned_buffer(layout.index_nbytes)
        index[:] = np.frombuffer(layout.index_bytes, dtype=np.uint8)
        head = layout.index_nbytes - layout.index_nbytes % ALIGN
        self._index = index.data
        self._index_head, self._index_tail = index.data[:head], index.data[head:]
        self._pad = memoryview(bytes(layout.chunk_stride - layout.chunk_nbytes))
        self._local = threading.local()
        self._tmp_prefix = f".tmp-{os.getpid():x}{os.urandom(4).hex()}-"
        self._tmp_counter = itertools.count()  # next() is atomic under the GIL

    def describe(self) -> str:
        mode = "O_DIRECT" if self.direct else "buffered"
        sync = ", fdatasync per file, fsync per fan-out directory per batch" if self.durable else ""
        return (
            f"protocol floor: lstat, O_EXCL temporary file, {mode} pwritev of header, chunks and "
            f"index{sync}, renameat2(RENAME_NOREPLACE); reads: open, fstat, preadv, close, "
            "header and xxh3_64 of every chunk checked (one native call per block)"
        )

    # -- per-thread buffers ------------------------------------------------------------------

    def _header_buffer(self) -> memoryview:
        """This thread's aligned header page, with the array's fixed fields written once."""
        buf: memoryview | None = getattr(self._local, "header", None)
        if buf is None:
            buf = aligned_buffer(self.layout.header_nbytes).data
            buf[: fmt.HEADER_FIXED_NBYTES] = self._template
            self._local.header = buf
        return buf

    def _read_header_buffer(self) -> memoryview:
        buf: memoryview | None = getattr(self._local, "read_header", None)
        if buf is None:
            buf = memoryview(bytearray(self.layout.header_nbytes))
            self._local.read_header = buf
        return buf

    def _scratch(self, nbytes: int) -> np.ndarray:
        buf: np.ndarray | None = getattr(self._local, "scratch", None)
        if buf is None or len(buf) < nbytes:
            buf = aligned_buffer(nbytes)
            self._local.scratch = buf
        return buf

    # -- writes ------------------------------------------------------------------------------

    def _header(self, block_hash: bytes, parent: bytes | None, data: memoryview) -> memoryview:
        layout = self.layout
        buf = self._header_buffer()
        parent = parent or b""
        keys = (len(block_hash), len(parent), XXH3_64, block_hash, parent)
        _KEYS.pack_into(buf, fmt.HASH_LEN_OFFSET, *keys)
        _CREATED.pack_into(buf, fmt.CREATED_OFFSET, time.time_ns())
        _CRC.pack_into(buf, fmt.CRC_OFFSET, crc32c(buf[: fmt.CRC_OFFSET]))
        sums = chunk_sums(XXH3_64, data, layout.chunk_nbytes, layout.num_chunks)
        buf[fmt.HEADER_FIXED_NBYTES : self._slots_end] = (
            sums.astype("<u8", copy=False).view(np.uint8).data
        )
        return buf

    def _data_iovecs(self, data: memoryview) -> list[memoryview]:
        """The data region's buffers: the block itself (dense layouts), else each chunk and
        its zero padding (buffered) or one padded image in aligned memory (O_DIRECT)."""
        layout = self.layout
        if layout.dense:
            if self.direct and not is_aligned(data):
                staged = self._scratch(len(data))
                staged[: len(data)] = np.frombuffer(data, dtype=np.uint8)
                return [staged[: len(data)].data]
            return [data]
        n, size, stride = layout.num_chunks, layout.chunk_nbytes, layout.chunk_stride
        if self.direct:
            image = self._scratch(n * stride)[: n * stride].reshape(n, stride)
            image[:, :size] = np.frombuffer(data, dtype=np.uint8, count=n * size).reshape(n, size)
            image[:, size:] = 0
            return [image.reshape(-1).data]
        pad = self._pad
        out: list[memoryview] = []
        for c in range(n):
            out += (data[c * size : (c + 1) * size], pad)
        return out

    def _publish_one(self, args: tuple[bytes, bytes | None, np.ndarray]) -> int | None:
        """One block: the fan-out directory it was published in, None when already stored
        (before or, by another writer, during its write)."""
        block_hash, parent, array = args
        final = self.path(block_hash)
        if stored(final):
            return None
        data = array.data
        header = self._header(block_hash, parent, data)
        directory, _, name = final.rpartition("/")
        tmp = f"{directory}/.{name}{self._tmp_prefix}{next(self._tmp_counter)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN | (O_DIRECT if self.direct else 0)
        fd = os.open(tmp, flags, 0o600)
        try:
            if self.direct:
                tail = self._index_tail
                head = self._file_nbytes - len(tail)
                _pwritev(fd, [header, *self._data_iovecs(data), self._index_head], 0, head)
                if len(tail):  # the index's last page is partial: written buffered
                    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~O_DIRECT)
                    _pwritev(fd, [tail], head, len(tail))
            else:
                _pwritev(fd, [header, *self._data_iovecs(data), self._index], 0, self._file_nbytes)
            if self.durable:
                os.fdatasync(fd)
        except BaseException:
            os.close(fd)
            Path(tmp).unlink(missing_ok=True)
            raise
        os.close(fd)
        try:
            publish_noreplace(tmp, final)
        except FileExistsError:
            Path(tmp).unlink()  # another writer published the block meanwhile: theirs stays
            return None
        return block_hash[0]

    def _sync_dir(self, hi: int) -> None:
        fd = os.open(f"{self.root}/{hi}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def write(self, work: Workload) -> float:
        start = time.perf_counter()
        for batch in work.batches():
            items = [(work.hashes[i], work.parents[i], work.data(i)) for i in batch]
            if self.pool is None:
                dirs = [self._publish_one(item) for item in items]
            else:
                dirs = list(self.pool.map(self._publish_one, items))
            fanouts = {hi for hi in dirs if hi is not None}
            if self.durable and fanouts:
                run_pool(self.pool, self._sync_dir, sorted(fanouts))
            self.written += len([hi for hi in dirs if hi is not None])
        return time.perf_counter() - start

    # -- reads -------------------------------------------------------------------------------

    def _read_one(self, args: tuple[bytes, np.ndarray]) -> None:
        block_hash, out = args
        layout = self.layout
        path = self.path(block_hash)
        header = self._read_header_buffer()
        data = out.data
        fd = os.open(path, os.O_RDONLY | _OPEN)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != layout.file_nbytes:
                raise CorruptBlockError(
                    f"{path}: expected a regular file of {layout.file_nbytes} bytes, got "
                    f"mode {st.st_mode:o}, {st.st_size} bytes"
                )
            if layout.dense:
                buffers = [header, data]
            else:
                size, pad = layout.chunk_nbytes, self._scratch(ALIGN).data[: len(self._pad)]
                buffers = [header]
                for c in range(layout.num_chunks):
                    buffers += (data[c * size : (c + 1) * size], pad)
            want = layout.data_end
            got = 0
            for start in range(0, len(buffers), _IOV_MAX):
                got += os.preadv(fd, buffers[start : start + _IOV_MAX], got)
        finally:
            os.close(fd)
        if got != want:
            raise CorruptBlockError(f"{path}: short read, {got} of {want} bytes")
        self._verify(path, header, block_hash, data)

    def _verify(self, path: str, header: memoryview, block_hash: bytes, data: memoryview) -> None:
        """The header is this array's, for this key, undamaged; every chunk matches its slot."""
        layout = self.layout
        fixed = bytes(header[: self._slots_end])
        if not (
            fixed.startswith(self._prefix)
            and fixed.startswith(self._geometry, fmt.GEOMETRY_OFFSET)
            and fixed.startswith(block_hash, fmt.HASH_OFFSET)
            and fixed[fmt.HASH_LEN_OFFSET] == len(block_hash)
            and fixed[fmt.ALGO_OFFSET] == XXH3_64
        ):
            raise CorruptBlockError(f"{path}: header does not match the array and key")
        if crc32c(fixed[:_CRC_END]) != _CRC32C_RESIDUE:
            raise CorruptBlockError(f"{path}: header checksum mismatch")
        sums = chunk_sums(XXH3_64, data, layout.chunk_nbytes, layout.num_chunks)
        if not fixed.startswith(sums.tobytes(), fmt.HEADER_FIXED_NBYTES):
            raise CorruptBlockError(f"{path}: inner chunk checksum mismatch")


class SyscallFloor:
    """The system calls alone, per block, one thread, on paths shaped like the store's.

    Two questions the other floors cannot answer on their own: how much of the store's time
    per small block is the *shape of its paths* (format v1 names a block
    ``<namespace>/g<group>/c/0/0/0/0/<hi>/<lo>``, a dozen components each open walks, against
    the raw floor's ``<root>/<hi>/<lo>``), and how much is the *protocol's system calls* with
    no code around them (no header built, no checksum: zero bytes in their place).

    ``path_of`` gives the store's absolute path of a block and ``store_root`` the store's root;
    this floor re-roots those paths under ``root`` (creating their directories once, untimed):

    * raw: open ``O_CREAT|O_TRUNC``, ``pwrite``, close; open, ``preadv``, close;
    * protocol: ``lstat``, then kvstore's own compound operations
      (:meth:`~kvstore.io.fileio.FileIO.write_new`: open ``O_EXCL``, one vectored write of a
      header-sized page, the data and the index; ``sync_and_rename``: ``renameat2`` without
      replacing; close), and ``read_regular`` (open, ``fstat``, one ``preadv``, close). On
      :class:`~kvstore.io.native_fileio.NativeFileIO` each is one native call, so the Python
      left is one loop step per block.
    """

    def __init__(
        self,
        root: Path,
        store_root: Path,
        path_of: Callable[[bytes], str],
        layout: ShardLayout,
    ) -> None:
        if not layout.dense:
            raise ValueError("syscall floor: expected a dense layout (chunks back to back)")
        self.root = root
        self.layout = layout
        self._store_root = str(store_root)
        self._path_of = path_of
        self._fio = NativeFileIO()
        self._header = memoryview(bytearray(layout.header_nbytes))
        self._index = memoryview(layout.index_bytes)
        self._counter = itertools.count()

    def _paths(self, work: Workload, kind: str) -> list[str]:
        """Each block's store path re-rooted under ``root/kind`` (directories made here)."""
        out = []
        for block_hash in work.hashes:
            store_path = self._path_of(block_hash)
            if not store_path.startswith(self._store_root + os.sep):
                raise ValueError(f"{store_path}: expected a path under {self._store_root}")
            path = f"{self.root}/{kind}{store_path[len(self._store_root) :]}"
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            out.append(path)
        return out

    def raw_write(self, work: Workload) -> tuple[float, list[str]]:
        """Seconds to write every block raw on store-shaped paths, and the paths."""
        paths = self._paths(work, f"raw{next(self._counter)}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _OPEN
        start = time.perf_counter()
        for i, path in enumerate(paths):
            fd = os.open(path, flags, 0o600)
            try:
                os.pwrite(fd, work.data(i).data, 0)
            finally:
                os.close(fd)
        return time.perf_counter() - start, paths

    def raw_read(self, paths: list[str], outs: list[np.ndarray]) -> float:
        start = time.perf_counter()
        for i, path in enumerate(paths):
            fd = os.open(path, os.O_RDONLY | _OPEN)
            try:
                os.preadv(fd, [outs[i % len(outs)].data], 0)
            finally:
                os.close(fd)
        return time.perf_counter() - start

    def protocol_write(self, work: Workload) -> tuple[float, list[str]]:
        """Seconds to publish every block with the protocol's calls alone, and the paths."""
        layout, fio = self.layout, self._fio
        paths = self._paths(work, f"protocol{next(self._counter)}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        header, index = self._header, self._index
        offset, end, size = layout.data_offset, layout.data_end, layout.file_nbytes
        start = time.perf_counter()
        for i, final in enumerate(paths):
            if stored(final):
                continue
            directory, _, name = final.rpartition("/")
            tmp = f"{directory}/.{name}.tmp-{i}"
            data = work.data(i).data
            fd = fio.write_new(tmp, flags, 0o600, [(0, header), (offset, data), (end, index)], size)
            try:
                fio.sync_and_rename(None, tmp, final)
            finally:
                fio.close(fd)
        return time.perf_counter() - start, paths

    def protocol_read(self, paths: list[str], outs: list[np.ndarray]) -> float:
        layout, fio, header = self.layout, self._fio, self._header
        offset, size = layout.data_offset, layout.file_nbytes
        flags = os.O_RDONLY
        start = time.perf_counter()
        for i, path in enumerate(paths):
            fio.read_regular(path, flags, [(0, header), (offset, outs[i % len(outs)].data)], size)
        return time.perf_counter() - start

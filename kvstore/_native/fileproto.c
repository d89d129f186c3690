/* kvstore._native._fileproto: the per-file protocol of one block file in one call, without the GIL.
 *
 * Each function does what kvstore/io/fileio.py's Python reference of the same name does with
 * FileIO's primitives (open, pwritev, preadv, fcntl, ftruncate, fstat, futimens, fdatasync,
 * renameat2), in the same order and with the same flags, so that a block costs one Python
 * call instead of a dozen. Every buffer is acquired (PyObject_GetBuffer) while the GIL is
 * held, the system calls run with the GIL released, and the buffers are released once the GIL
 * is back: no Python object is touched without it.
 *
 * The rules of kvstore/io/fileio.py hold here too: every open adds O_NOFOLLOW | O_NONBLOCK |
 * O_CLOEXEC (a link is never followed, a FIFO never blocks the open); a file is read only after
 * fstat says it is regular; a descriptor is closed on every error path (write_new returns its
 * descriptor only on success); a rename never replaces a name (RENAME_NOREPLACE). Errors come
 * out as the OSError os.* would raise (the file name on an open's or rename's error only, as
 * os.open and kvstore.io.rename do); EINTR is retried (regular files; the loops are short).
 * kvstore/io/fileproto.py binds the module and self-tests it; FileIO falls back to its Python
 * reference when it is missing.
 *
 * The module is compiled from several files, one job each (fileproto_internal.h lists them and
 * declares what they share): this one holds the small calls (first_unaligned, constants), the
 * method table and PyInit__fileproto.
 */

#include "fileproto_internal.h"

static PyObject *
fileproto_first_unaligned(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *segments_obj;
    Py_ssize_t alignment;
    if (!PyArg_ParseTuple(args, "On:first_unaligned", &segments_obj, &alignment)) {
        return NULL;
    }
    if (alignment <= 0) {
        PyErr_Format(PyExc_ValueError, "first_unaligned: expected an alignment > 0, got %zd",
                     alignment);
        return NULL;
    }
    Py_ssize_t n = 0;
    segment *segs = kv_fp_acquire_segments(segments_obj, 0, &n);
    if (segs == NULL) {
        return NULL;
    }
    Py_ssize_t index = n;
    int address_aligned = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        int address_ok = (uintptr_t)segs[i].view.buf % (uintptr_t)alignment == 0;
        /* An empty buffer's address is moot (is_aligned in kvstore/io/buffers.py). */
        if (segs[i].view.len % alignment != 0 || (segs[i].view.len > 0 && !address_ok)) {
            index = i;
            address_aligned = address_ok;
            break;
        }
    }
    kv_fp_release_segments(segs, n);
    return Py_BuildValue("(nO)", index, address_aligned ? Py_True : Py_False);
}

static PyObject *
fileproto_constants(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(args))
{
    return Py_BuildValue("{s:i,s:i,s:i,s:i,s:i}", "O_DIRECT", (int)O_DIRECT, "O_NOFOLLOW",
                         (int)O_NOFOLLOW, "O_NONBLOCK", (int)O_NONBLOCK, "O_CLOEXEC",
                         (int)O_CLOEXEC, "IOV_MAX", (int)IOV_MAX);
}

static PyMethodDef fileproto_methods[] = {
    {"write_new", kv_fp_write_new, METH_VARARGS,
     "write_new(path, flags, mode, segments, buffered_from, file_nbytes) -> fd: open `path` "
     "(flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, mode), write the (offset, buffer) segments "
     "in order, one pwritev per file-contiguous run (O_DIRECT cleared with one F_SETFL before "
     "segment `buffered_from`), ftruncate to file_nbytes when the data ends elsewhere. The "
     "descriptor is returned open; on an error it is closed and OSError raised."},
    {"read_regular", kv_fp_read_regular, METH_VARARGS,
     "read_regular(path, flags, segments, expected_size, allow_trailer, touch_if_older_than_ns) "
     "-> (st_mode, st_size, st_dev, st_ino, st_mtime_ns, short): open `path` (flags | "
     "O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC), fstat, and only for a regular file of the expected "
     "size fill the writable (offset, buffer) segments with preadv; `short` is None or "
     "(offset, expected, got) of a run that came back short. The file is closed before the "
     "call returns; OSError for a failed system call."},
    {"write_new_hashed", kv_fp_write_new_hashed, METH_VARARGS,
     "write_new_hashed(path, flags, mode, segments, buffered_from, file_nbytes, first, last, "
     "chunk_nbytes, group_nbytes, sums, xxh3) -> fd: write_new, with segments [first, last) "
     "(whole chunks of chunk_nbytes) written first, group by group (file-contiguous runs of at "
     "most group_nbytes), each group's chunks hashed with the capsule `xxh3` "
     "(kvstore._native._xxh3batch.function()) into the next values of the writable uint64 buffer "
     "`sums` just before its pwritev; then the other segments in order. With O_DIRECT the "
     "hashed segments must come before buffered_from."},
    {"read_regular_hashed", kv_fp_read_regular_hashed, METH_VARARGS,
     "read_regular_hashed(path, flags, segments, expected_size, touch_if_older_than_ns, first, "
     "last, chunk_nbytes, group_nbytes, sums, xxh3) -> read_regular's outcome: read_regular "
     "(no trailer), with segments [first, last) read group by group, each group's chunks "
     "hashed into the next values of `sums` right after its preadv (values past a short read "
     "are not written)."},
    {"sync_and_rename", kv_fp_sync_and_rename, METH_VARARGS,
     "sync_and_rename(fd, src, dst) -> bool: fdatasync(fd) when fd >= 0, then "
     "renameat2(src, dst, RENAME_NOREPLACE). False when the file system lacks renameat2 (the "
     "file is synced; the caller renames another way); OSError (FileExistsError when dst "
     "exists) otherwise."},
    {"publish_pieces", kv_fp_publish_pieces, METH_VARARGS,
     "publish_pieces(blocks, flags, mode, file_nbytes, piece_nbytes, starts, slot_of, "
     "chunk_nbytes, slots_offset, index, index_offset, alignment, xxh3) -> [outcome]: for each "
     "(tmp, final, header, span) of `blocks`, in order and without the GIL: lstat(final) (a "
     "regular file: 0, nothing written); the span's chunks of chunk_nbytes hashed front to "
     "back with the capsule `xxh3` into the header's uint64 slots at slots_offset (chunk s "
     "into slot slot_of[s]); open(tmp, flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, mode) "
     "(O_DIRECT kept only when the header and every piece are aligned); one pwritev of the "
     "header and the pieces (span + starts[k], piece_nbytes each, back to back after the "
     "header), the index buffered at index_offset, ftruncate to file_nbytes; close; "
     "renameat2(tmp, final, RENAME_NOREPLACE). Outcome 1: published; 0: the name was taken "
     "(by the probe or the rename); -errno: that step failed and tmp was removed."},
    {"read_pieces", kv_fp_read_pieces, METH_VARARGS,
     "read_pieces(blocks, flags, file_nbytes, header_nbytes, piece_nbytes, starts, slot_of, "
     "chunk_nbytes, slots_offset, touch_if_older_than_ns, xxh3) -> [outcome]: for each (path, "
     "header, span) of `blocks`, in order and without the GIL: open(path, flags | O_NOFOLLOW | "
     "O_NONBLOCK | O_CLOEXEC), fstat, and for a regular file of file_nbytes bytes one preadv "
     "of the header and the pieces (span + starts[k], piece_nbytes each, back to back after "
     "the header), touch (futimens) when its mtime is older than touch_if_older_than_ns, "
     "close; then the span's chunks hashed with the capsule `xxh3` and compared with the "
     "header's uint64 slots at slots_offset (chunk s with slot slot_of[s]). Outcome 1: read "
     "and every chunk matches; -errno of the step that failed, -EBADMSG for a file that is "
     "not regular, has the wrong size, reads short or differs from its checksums."},
    {"exists_many", kv_fp_exists_many, METH_VARARGS,
     "exists_many(paths) -> [code]: lstat of each path without the GIL: 1 a regular file, 0 "
     "no such name (ENOENT), -1 anything else (another kind of entry, or an error: the caller "
     "asks again one by one for the words)."},
    {"list_dir_step", kv_fp_list_dir_step, METH_VARARGS,
     "list_dir_step(fd, nbytes, beat) -> (entries, failure) | None: one getdents64 of at most "
     "`nbytes` bytes (4096..16 MiB) from the directory descriptor `fd` (its position "
     "advances), then fstatat(fd, name, AT_SYMLINK_NOFOLLOW) of each entry but . and .., "
     "without the GIL. `entries`: [(name, (st_mode, st_ino, st_dev, st_nlink, st_size, "
     "st_blocks, st_mtime_ns, st_ctime_ns))] in the directory's order, names decoded as "
     "os.fsdecode does; an entry gone before its fstatat (ENOENT) is left out. `failure`: "
     "None, or (errno, name) of an fstatat that failed otherwise (the step ends there; the "
     "caller raises). None at the end of the directory; OSError when getdents64 fails. "
     "`beat`: None, or a writable buffer of at least 8 bytes, 8-byte aligned, where "
     "CLOCK_MONOTONIC seconds are stored as a double after the getdents64 and each fstatat "
     "(kvstore/io/stall.py beat_slot)."},
    {"read_files", kv_fp_read_files, METH_VARARGS,
     "read_files(paths, file_nbytes, rows, beat) -> [outcome]: for each path, in order and "
     "without the GIL: open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC), fstat, and "
     "for a regular file of exactly file_nbytes bytes pread it whole into rows[i * "
     "file_nbytes:(i + 1) * file_nbytes] of the writable buffer `rows`; close; a beat as "
     "list_dir_step's. No mtime is touched. Outcome 1: read whole; -errno of the step that "
     "failed; -EBADMSG for a file that is not regular, has another size or reads short (its "
     "row then holds what was read)."},
    {"check_rows", kv_fp_check_rows, METH_VARARGS,
     "check_rows(rows, count, row_nbytes, equal, zero, ranges, key, hash_hi, hash_lo, slots, "
     "crc_offset, xxh3) -> bytes: for each of the `count` rows of `row_nbytes` bytes at the "
     "start of the buffer `rows`, without the GIL, 1 when every rule holds, else 0: each "
     "(offset, bytes) of `equal` (the row's bytes there are those), each (offset, length) of "
     "`zero` (all zero there), each (offset, low, high) of `ranges` (low <= the byte <= high), "
     "`key` (hi_offset, lo_offset, lo_shift): the byte at hi_offset is hash_hi[i] and the "
     "big-endian uint64 at lo_offset shifted right by lo_shift (1..63) is hash_lo[i]; `slots` "
     "(slots_offset, chunks, first, stride, chunk_nbytes): each little-endian uint64 slot c is "
     "non-zero and the capsule `xxh3` of the chunk_nbytes at first + c * stride; the "
     "little-endian uint32 at crc_offset is the crc32c of the bytes before it. Every rule "
     "must lie within a row; ValueError, TypeError or OverflowError otherwise."},
    {"first_unaligned", fileproto_first_unaligned, METH_VARARGS,
     "first_unaligned(segments, alignment) -> (index, address_aligned): the index of the first "
     "(offset, buffer) segment whose memory's address or length is not a multiple of "
     "`alignment` (len(segments) when none), and whether that one's address is."},
    {"constants", fileproto_constants, METH_NOARGS,
     "constants() -> dict: the flag values this module was compiled with (self-test)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fileproto_module = {
    PyModuleDef_HEAD_INIT,
    "kvstore._native._fileproto",
    "The per-file protocol of one block file in one call without the GIL (see "
    "kvstore/io/fileproto.py).",
    -1,
    fileproto_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__fileproto(void)
{
    return PyModule_Create(&fileproto_module);
}

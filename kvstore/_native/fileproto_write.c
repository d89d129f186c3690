/* kvstore._native._fileproto: writing a new file (write_new, write_new_hashed: open, write,
 * truncate; the descriptor returned open) and finishing it (sync_and_rename: fdatasync, then
 * renameat2 without replacing). */

#include "fileproto_internal.h"

/* The body of write_new and write_new_hashed, after their arguments are parsed and
 * checked: open, write (the hashed segments first, group by group, when ``h`` is not NULL,
 * then the others in order), truncate. Returns the open descriptor, or NULL with OSError set
 * (the descriptor closed). Releases the segments and ``path``. */
static PyObject *
new_file(PyObject *name, PyObject *path, int flags, int mode, segment *segs, Py_ssize_t n,
         Py_ssize_t buffered_from, Py_ssize_t file_nbytes, const hashing *h)
{
    const char *cpath = PyBytes_AS_STRING(path);
    int fd = -1;
    int err = 0;
    int open_failed = 0;
    Py_BEGIN_ALLOW_THREADS
    do {
        fd = open(cpath, flags | OPEN_FLAGS, (mode_t)mode);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) {
        err = errno;
        open_failed = 1;
    }
    Py_ssize_t end = 0;
    if (err == 0 && h != NULL) {
        Py_ssize_t unused_at, unused_want, unused_got;
        err = kv_fp_hashed_transfer(fd, segs, h, 1, &end, &unused_at, &unused_want, &unused_got);
        if (err == 0) {
            err = kv_fp_write_plain(fd, flags, segs, 0, h->first, buffered_from, &end);
        }
        if (err == 0) {
            err = kv_fp_write_plain(fd, flags, segs, h->last, n, buffered_from, &end);
        }
    }
    else if (err == 0) {
        err = kv_fp_write_plain(fd, flags, segs, 0, n, buffered_from, &end);
    }
    if (err == 0 && end != file_nbytes) { /* a new file ends where its last byte went */
        int rc;
        do {
            rc = ftruncate(fd, (off_t)file_nbytes);
        } while (rc < 0 && errno == EINTR);
        if (rc < 0) {
            err = errno;
        }
    }
    if (err != 0 && fd >= 0) {
        close(fd);
        fd = -1;
    }
    Py_END_ALLOW_THREADS
    kv_fp_release_segments(segs, n);
    if (err != 0) {
        kv_fp_raise_errno(err, open_failed ? name : NULL);
        Py_DECREF(path);
        return NULL;
    }
    Py_DECREF(path);
    return PyLong_FromLong(fd);
}

/* The segments of a new file, acquired (see kv_fp_acquire_segments), after the checks write_new and
 * write_new_hashed share: a file mode, 0 <= buffered_from <= the segment count, file_nbytes >=
 * 0; NULL with an exception (nothing held) otherwise. */
static segment *
new_file_segments(PyObject *segments_obj, int mode, Py_ssize_t buffered_from,
                  Py_ssize_t file_nbytes, Py_ssize_t *n)
{
    if (kv_fp_check_mode("write_new", mode) < 0) {
        return NULL;
    }
    segment *segs = kv_fp_acquire_segments(segments_obj, 0, n);
    if (segs == NULL) {
        return NULL;
    }
    if (buffered_from < 0 || buffered_from > *n || file_nbytes < 0) {
        PyErr_Format(PyExc_ValueError,
                     "write_new: expected 0 <= buffered_from <= %zd segments and "
                     "file_nbytes >= 0, got %zd and %zd",
                     *n, buffered_from, file_nbytes);
        kv_fp_release_segments(segs, *n);
        return NULL;
    }
    return segs;
}

PyObject *
kv_fp_write_new(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *name;
    PyObject *path;
    int flags;
    int mode;
    PyObject *segments_obj;
    Py_ssize_t buffered_from;
    Py_ssize_t file_nbytes;
    if (!PyArg_ParseTuple(args, "OiiOnn:write_new", &name, &flags, &mode, &segments_obj,
                          &buffered_from, &file_nbytes)
        || !PyUnicode_FSConverter(name, &path)) {
        return NULL;
    }
    Py_ssize_t n = 0;
    segment *segs = new_file_segments(segments_obj, mode, buffered_from, file_nbytes, &n);
    if (segs == NULL) {
        Py_DECREF(path);
        return NULL;
    }
    return new_file(name, path, flags, mode, segs, n, buffered_from, file_nbytes, NULL);
}

PyObject *
kv_fp_write_new_hashed(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *name;
    PyObject *path;
    int flags;
    int mode;
    PyObject *segments_obj;
    Py_ssize_t buffered_from;
    Py_ssize_t file_nbytes;
    Py_ssize_t first, last, chunk_nbytes, group_nbytes;
    PyObject *sums_obj;
    PyObject *capsule;
    if (!PyArg_ParseTuple(args, "OiiOnnnnnnOO:write_new_hashed", &name, &flags, &mode,
                          &segments_obj, &buffered_from, &file_nbytes, &first, &last,
                          &chunk_nbytes, &group_nbytes, &sums_obj, &capsule)
        || !PyUnicode_FSConverter(name, &path)) {
        return NULL;
    }
    Py_ssize_t n = 0;
    segment *segs = new_file_segments(segments_obj, mode, buffered_from, file_nbytes, &n);
    if (segs == NULL) {
        Py_DECREF(path);
        return NULL;
    }
    hashing h;
    Py_buffer sums_view;
    if (kv_fp_parse_hashing(&h, capsule, first, last, chunk_nbytes, group_nbytes, sums_obj,
                            &sums_view, segs, n)
        < 0) {
        kv_fp_release_segments(segs, n);
        Py_DECREF(path);
        return NULL;
    }
    if ((flags & O_DIRECT) && last > buffered_from && last > first) {
        /* They are written first: O_DIRECT, once cleared, is not set again. */
        PyErr_Format(PyExc_ValueError,
                     "write_new_hashed: expected the hashed segments [%zd, %zd) before "
                     "buffered_from (%zd) with O_DIRECT",
                     first, last, buffered_from);
        PyBuffer_Release(&sums_view);
        kv_fp_release_segments(segs, n);
        Py_DECREF(path);
        return NULL;
    }
    PyObject *fd = new_file(name, path, flags, mode, segs, n, buffered_from, file_nbytes, &h);
    PyBuffer_Release(&sums_view);
    return fd;
}

/* renameat2's "this file system (or kernel) lacks the operation" (kvstore/io/rename.py). */
static int
rename_unsupported(int err)
{
    return err == EINVAL || err == ENOSYS || err == EOPNOTSUPP || err == ENOTSUP;
}

PyObject *
kv_fp_sync_and_rename(PyObject *Py_UNUSED(module), PyObject *args)
{
    int fd;
    PyObject *src_name;
    PyObject *dst_name;
    PyObject *src = NULL;
    PyObject *dst = NULL;
    if (!PyArg_ParseTuple(args, "iOO:sync_and_rename", &fd, &src_name, &dst_name)
        || !PyUnicode_FSConverter(src_name, &src)) {
        return NULL;
    }
    if (!PyUnicode_FSConverter(dst_name, &dst)) {
        Py_DECREF(src);
        return NULL;
    }
    if (fd < -1) {
        PyErr_Format(PyExc_ValueError,
                     "sync_and_rename: expected a descriptor >= 0, or -1 for no sync, got %d", fd);
        Py_DECREF(src);
        Py_DECREF(dst);
        return NULL;
    }
    int sync_err = 0, rename_err = 0;
    const char *csrc = PyBytes_AS_STRING(src);
    const char *cdst = PyBytes_AS_STRING(dst);
    Py_BEGIN_ALLOW_THREADS
    if (fd >= 0) {
        int rc;
        do {
            rc = fdatasync(fd);
        } while (rc < 0 && errno == EINTR);
        if (rc < 0) {
            sync_err = errno;
        }
    }
    if (sync_err == 0 && kv_fp_renameat2_noreplace(csrc, cdst) < 0) {
        rename_err = errno;
    }
    Py_END_ALLOW_THREADS
    Py_DECREF(src);
    Py_DECREF(dst);
    if (sync_err != 0) {
        return kv_fp_raise_errno(sync_err, NULL);
    }
    if (rename_err == 0) {
        Py_RETURN_TRUE;
    }
    if (rename_unsupported(rename_err)) {
        Py_RETURN_FALSE; /* the file is synced; the caller renames another way */
    }
    /* Both names, as kvstore.io.rename raises them (FileExistsError.filename2 is the name
     * the publisher compares with). */
    errno = rename_err;
    return PyErr_SetFromErrnoWithFilenameObjects(PyExc_OSError, src_name, dst_name);
}

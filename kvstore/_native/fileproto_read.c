/* kvstore._native._fileproto: reading a regular file (read_regular, read_regular_hashed: open,
 * fstat, read only a regular file of the expected size, touch) and probing names (exists_many:
 * lstat, a link or any other kind of entry never taken for a file). */

#include "fileproto_internal.h"

/* The body of read_regular and read_regular_hashed after parsing: open, fstat, and for a
 * regular file of the expected size fill the segments (the hashed ones, when ``h`` is not
 * NULL, group by group with their checksums), touch; the outcome tuple, or NULL with OSError
 * set. Releases the segments and ``path``. */
static PyObject *
regular_file(PyObject *name, PyObject *path, int flags, segment *segs, Py_ssize_t n,
             Py_ssize_t expected_size, int allow_trailer, long long touch_if_older_than_ns,
             const hashing *h)
{
    const char *cpath = PyBytes_AS_STRING(path);
    struct stat st;
    memset(&st, 0, sizeof st);
    int err = 0;
    int open_failed = 0;
    Py_ssize_t short_at = -1, short_want = 0, short_got = 0;
    Py_BEGIN_ALLOW_THREADS
    int fd;
    do {
        fd = open(cpath, flags | OPEN_FLAGS, 0600); /* a caller's O_CREAT: FileIO.open's mode */
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) {
        err = errno;
        open_failed = 1;
    }
    else if (fstat(fd, &st) < 0) {
        err = errno;
    }
    /* Not regular, or the wrong size: returned with nothing read, the caller raises. */
    else if (S_ISREG(st.st_mode)
             && (st.st_size == expected_size || (allow_trailer && st.st_size > expected_size))) {
        /* The plain segments in order, the hashed ones (if any) in their place. */
        Py_ssize_t hashed_first = h != NULL ? h->first : n;
        Py_ssize_t hashed_last = h != NULL ? h->last : n;
        for (Py_ssize_t i = 0; i < n;) {
            if (i == hashed_first && hashed_first < hashed_last) {
                Py_ssize_t unused_end = 0;
                err = kv_fp_hashed_transfer(fd, segs, h, 0, &unused_end, &short_at,
                                            &short_want, &short_got);
                if (err != 0 || short_at >= 0) {
                    break;
                }
                i = hashed_last;
                continue;
            }
            Py_ssize_t stop = kv_fp_run_end(segs, i, i < hashed_first ? hashed_first : n);
            Py_ssize_t want = 0;
            for (Py_ssize_t j = i; j < stop; j++) {
                want += segs[j].view.len;
            }
            Py_ssize_t got = kv_fp_transfer_run(fd, segs, i, stop, 0);
            if (got < 0) {
                err = errno;
                break;
            }
            if (got != want) {
                short_at = segs[i].offset;
                short_want = want;
                short_got = got;
                break;
            }
            i = stop;
        }
        if (err == 0 && short_at < 0) {
            long long mtime_ns = (long long)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
            if (mtime_ns < touch_if_older_than_ns) {
                /* A read-only mount or a foreign owner: last-use tracking is best effort. */
                (void)futimens(fd, NULL);
            }
        }
    }
    if (fd >= 0) {
        close(fd);
    }
    Py_END_ALLOW_THREADS
    kv_fp_release_segments(segs, n);
    if (err != 0) {
        kv_fp_raise_errno(err, open_failed ? name : NULL);
        Py_DECREF(path);
        return NULL;
    }
    Py_DECREF(path);
    long long mtime_ns = (long long)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
    if (short_at < 0) {
        return Py_BuildValue("(IL KK L O)", (unsigned int)st.st_mode, (long long)st.st_size,
                             (unsigned long long)st.st_dev, (unsigned long long)st.st_ino,
                             mtime_ns, Py_None);
    }
    return Py_BuildValue("(IL KK L (nnn))", (unsigned int)st.st_mode, (long long)st.st_size,
                         (unsigned long long)st.st_dev, (unsigned long long)st.st_ino, mtime_ns,
                         short_at, short_want, short_got);
}

/* A read's expected file size: >= 0; -1 with ValueError otherwise. */
static int
check_expected_size(Py_ssize_t expected_size)
{
    if (expected_size < 0) {
        PyErr_Format(PyExc_ValueError,
                     "read_regular: expected a file size >= 0, got %zd", expected_size);
        return -1;
    }
    return 0;
}

PyObject *
kv_fp_read_regular(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *name;
    PyObject *path;
    int flags;
    PyObject *segments_obj;
    Py_ssize_t expected_size;
    int allow_trailer;
    long long touch_if_older_than_ns;
    if (!PyArg_ParseTuple(args, "OiOnpL:read_regular", &name, &flags, &segments_obj,
                          &expected_size, &allow_trailer, &touch_if_older_than_ns)
        || !PyUnicode_FSConverter(name, &path)) {
        return NULL;
    }
    if (check_expected_size(expected_size) < 0) {
        Py_DECREF(path);
        return NULL;
    }
    Py_ssize_t n = 0;
    segment *segs = kv_fp_acquire_segments(segments_obj, 1, &n);
    if (segs == NULL) {
        Py_DECREF(path);
        return NULL;
    }
    return regular_file(name, path, flags, segs, n, expected_size, allow_trailer,
                        touch_if_older_than_ns, NULL);
}

PyObject *
kv_fp_read_regular_hashed(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *name;
    PyObject *path;
    int flags;
    PyObject *segments_obj;
    Py_ssize_t expected_size;
    long long touch_if_older_than_ns;
    Py_ssize_t first, last, chunk_nbytes, group_nbytes;
    PyObject *sums_obj;
    PyObject *capsule;
    if (!PyArg_ParseTuple(args, "OiOnLnnnnOO:read_regular_hashed", &name, &flags,
                          &segments_obj, &expected_size, &touch_if_older_than_ns, &first,
                          &last, &chunk_nbytes, &group_nbytes, &sums_obj, &capsule)
        || !PyUnicode_FSConverter(name, &path)) {
        return NULL;
    }
    if (check_expected_size(expected_size) < 0) {
        Py_DECREF(path);
        return NULL;
    }
    Py_ssize_t n = 0;
    segment *segs = kv_fp_acquire_segments(segments_obj, 1, &n);
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
    PyObject *outcome = regular_file(name, path, flags, segs, n, expected_size, 0,
                                     touch_if_older_than_ns, &h);
    PyBuffer_Release(&sums_view);
    return outcome;
}

/* -- exists_many: existence probes of a batch of names ------------------------------------ */

PyObject *
kv_fp_exists_many(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *paths_obj;
    if (!PyArg_ParseTuple(args, "O:exists_many", &paths_obj)) {
        return NULL;
    }
    /* A snapshot: an item's __fspath__ may change the caller's list, never this tuple. */
    PyObject *seq = PySequence_Tuple(paths_obj);
    if (seq == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Format(PyExc_TypeError, "exists_many: expected a sequence of paths, got %.200s",
                         Py_TYPE(paths_obj)->tp_name);
        }
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    PyObject **encoded = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(PyObject *));
    int *codes = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(int));
    PyObject *result = NULL;
    Py_ssize_t got = 0;
    if (encoded == NULL || codes == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++) {
        if (!PyUnicode_FSConverter(PyTuple_GET_ITEM(seq, got), &encoded[got])) {
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        struct stat st;
        if (lstat(PyBytes_AS_STRING(encoded[i]), &st) == 0) {
            codes[i] = S_ISREG(st.st_mode) ? 1 : -1;
        }
        else {
            codes[i] = errno == ENOENT ? 0 : -1;
        }
    }
    Py_END_ALLOW_THREADS
    result = kv_fp_code_list(codes, n);
done:
    for (Py_ssize_t i = 0; encoded != NULL && i < got; i++) {
        Py_DECREF(encoded[i]);
    }
    PyMem_Free(encoded);
    PyMem_Free(codes);
    Py_DECREF(seq);
    return result;
}

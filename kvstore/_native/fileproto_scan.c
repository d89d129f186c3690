/* kvstore._native._fileproto: what the offline tools' walks need, many entries per GIL release:
 * list_dir_step (the next entries of a directory, each with its lstat) and read_files (whole
 * small files, each into its row of one buffer). A store of tiny blocks has millions of
 * entries; one system call's worth of Python and GIL hand-over per entry would be most of
 * `kvstore verify`'s time, so these take the Python cost once per batch.
 *
 * Their references (kvstore/io/dirlist.py, kvstore/io/file_batch.py) do the same system calls
 * one by one with the GIL: os.scandir + os.stat(follow_symlinks=False), os.open + fstat +
 * preadv. */

#include "fileproto_internal.h"

#include <dirent.h>
#include <stddef.h>
#include <time.h>

/* list_dir_step's buffer: at least one whole entry of any name (a 255-byte name is a 280-byte
 * record), at most what a caller could want in one step. */
#define DIR_STEP_MIN 4096
#define DIR_STEP_MAX (16 << 20)
/* The smallest record taken: its fields (19 bytes), a 1-byte name and its NUL (the kernel pads
 * records to 8: 24). Bounds the number of entries one buffer can hold, so none is dropped. */
#define DIRENT_MIN_RECLEN (offsetof(struct dirent64, d_name) + 2)

typedef struct {
    const char *name; /* inside the getdents buffer */
    struct stat st;
} listed_entry;

/* The caller's beat slot (kvstore/io/stall.py beat_slot): None, or a writable buffer of at least
 * 8 bytes at an 8-byte-aligned address, where the call stores CLOCK_MONOTONIC seconds (a native
 * double, time.monotonic()'s clock) after each entry or file: a slow mount's tool watchdog then
 * hears every answer, as it does from the Python reference's stall.beat(). *slot is NULL for
 * None. 0, or -1 with TypeError (not a writable contiguous buffer) or ValueError (too short,
 * misaligned) naming ``call``. */
static int
acquire_beat(const char *call, PyObject *obj, Py_buffer *view, double **slot)
{
    *slot = NULL;
    if (obj == Py_None) {
        return 0;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "%s: expected the beat slot as None or a writable contiguous buffer, got "
                     "%.200s",
                     call, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (view->len < (Py_ssize_t)sizeof(double) || (uintptr_t)view->buf % sizeof(double) != 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s: expected a beat slot of at least 8 bytes at an 8-byte-aligned address, "
                     "got %zd bytes at an address %s",
                     call, view->len,
                     (uintptr_t)view->buf % sizeof(double) != 0 ? "not aligned" : "aligned");
        PyBuffer_Release(view);
        return -1;
    }
    *slot = (double *)view->buf;
    return 0;
}

/* A beat (no GIL needed: one aligned store of a double, read by the watchdog thread). */
static void
beat_now(double *slot)
{
    struct timespec now;
    if (slot != NULL && clock_gettime(CLOCK_MONOTONIC, &now) == 0) {
        *(volatile double *)slot = (double)now.tv_sec + (double)now.tv_nsec / 1e9;
    }
}

/* sec * 10**9 + nsec as a Python int, exact for any time (as os.stat's st_*_ns). */
static PyObject *
ns_value(long long sec, long nsec)
{
    long long ns;
    if (!__builtin_mul_overflow(sec, 1000000000LL, &ns) && !__builtin_add_overflow(ns, nsec, &ns)) {
        return PyLong_FromLongLong(ns);
    }
    /* Beyond year 2262 (or before 1677): only a hostile tree's files. */
    PyObject *s = PyLong_FromLongLong(sec);
    PyObject *billion = PyLong_FromLongLong(1000000000LL);
    PyObject *n = PyLong_FromLong(nsec);
    PyObject *scaled = s != NULL && billion != NULL ? PyNumber_Multiply(s, billion) : NULL;
    PyObject *out = scaled != NULL && n != NULL ? PyNumber_Add(scaled, n) : NULL;
    Py_XDECREF(s);
    Py_XDECREF(billion);
    Py_XDECREF(n);
    Py_XDECREF(scaled);
    return out;
}

/* (name, (st_mode, st_ino, st_dev, st_nlink, st_size, st_blocks, st_mtime_ns, st_ctime_ns)) */
static PyObject *
entry_tuple(const listed_entry *e)
{
    PyObject *name = PyUnicode_DecodeFSDefault(e->name);
    PyObject *mtime = ns_value((long long)e->st.st_mtim.tv_sec, e->st.st_mtim.tv_nsec);
    PyObject *ctime = ns_value((long long)e->st.st_ctim.tv_sec, e->st.st_ctim.tv_nsec);
    PyObject *out = NULL;
    if (name != NULL && mtime != NULL && ctime != NULL) {
        out = Py_BuildValue("(N(IKKKLLNN))", name, (unsigned int)e->st.st_mode,
                            (unsigned long long)e->st.st_ino, (unsigned long long)e->st.st_dev,
                            (unsigned long long)e->st.st_nlink, (long long)e->st.st_size,
                            (long long)e->st.st_blocks, mtime, ctime);
        return out; /* N: the tuple holds the three (Py_BuildValue releases them on failure) */
    }
    Py_XDECREF(name);
    Py_XDECREF(mtime);
    Py_XDECREF(ctime);
    return NULL;
}

PyObject *
kv_fp_list_dir_step(PyObject *Py_UNUSED(module), PyObject *args)
{
    int fd;
    Py_ssize_t nbytes;
    PyObject *beat_obj;
    if (!PyArg_ParseTuple(args, "inO:list_dir_step", &fd, &nbytes, &beat_obj)) {
        return NULL;
    }
    if (fd < 0) {
        PyErr_Format(PyExc_ValueError, "list_dir_step: expected a descriptor >= 0, got %d", fd);
        return NULL;
    }
    if (nbytes < DIR_STEP_MIN || nbytes > DIR_STEP_MAX) {
        PyErr_Format(PyExc_ValueError,
                     "list_dir_step: expected a buffer of %d..%d bytes, got %zd", DIR_STEP_MIN,
                     DIR_STEP_MAX, nbytes);
        return NULL;
    }
    Py_buffer beat_view;
    double *beat;
    if (acquire_beat("list_dir_step", beat_obj, &beat_view, &beat) < 0) {
        return NULL;
    }
    Py_ssize_t capacity = nbytes / (Py_ssize_t)DIRENT_MIN_RECLEN + 1;
    char *buf = PyMem_RawMalloc((size_t)nbytes);
    listed_entry *entries = PyMem_RawMalloc((size_t)capacity * sizeof(listed_entry));
    if (buf == NULL || entries == NULL) {
        PyMem_RawFree(buf);
        PyMem_RawFree(entries);
        if (beat != NULL) {
            PyBuffer_Release(&beat_view);
        }
        return PyErr_NoMemory();
    }
    Py_ssize_t n = 0;
    int list_err = 0, stat_err = 0;
    const char *failed_name = NULL;
    long got;
    Py_BEGIN_ALLOW_THREADS
    do {
        got = syscall(SYS_getdents64, fd, buf, (size_t)nbytes);
    } while (got < 0 && errno == EINTR);
    if (got < 0) {
        list_err = errno;
    }
    else {
        beat_now(beat);
    }
    const size_t name_at = offsetof(struct dirent64, d_name);
    const size_t reclen_at = offsetof(struct dirent64, d_reclen);
    for (long pos = 0; got > 0 && pos < got && n < capacity;) {
        unsigned short reclen;
        /* A record cut short, overrunning the buffer or without its NUL: the kernel never
         * returns one; were it to, the listing fails (EIO) rather than lose entries quietly. */
        if ((size_t)(got - pos) < DIRENT_MIN_RECLEN) {
            list_err = EIO;
            break;
        }
        memcpy(&reclen, buf + pos + reclen_at, sizeof reclen);
        if (reclen < DIRENT_MIN_RECLEN || reclen > got - pos) {
            list_err = EIO;
            break;
        }
        const char *name = buf + pos + name_at;
        if (memchr(name, '\0', reclen - name_at) == NULL) {
            list_err = EIO;
            break;
        }
        pos += reclen;
        if (strcmp(name, ".") == 0 || strcmp(name, "..") == 0) {
            continue;
        }
        int rc;
        do {
            rc = fstatat(fd, name, &entries[n].st, AT_SYMLINK_NOFOLLOW);
        } while (rc < 0 && errno == EINTR);
        beat_now(beat);
        if (rc < 0) {
            if (errno == ENOENT) {
                continue; /* removed since it was listed: left out, as the reference does */
            }
            stat_err = errno;
            failed_name = name;
            break;
        }
        entries[n++].name = name;
    }
    Py_END_ALLOW_THREADS
    PyObject *result = NULL;
    PyObject *listed = NULL;
    if (list_err != 0) {
        errno = list_err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    if (got == 0) {
        /* The end. A step whose entries all vanished is ([], None), not this. */
        Py_INCREF(Py_None);
        result = Py_None;
        goto done;
    }
    listed = PyList_New(n);
    if (listed == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = entry_tuple(&entries[i]);
        if (item == NULL) {
            goto done;
        }
        PyList_SET_ITEM(listed, i, item);
    }
    if (failed_name == NULL) {
        result = Py_BuildValue("(OO)", listed, Py_None);
    }
    else {
        PyObject *name = PyUnicode_DecodeFSDefault(failed_name);
        if (name != NULL) {
            result = Py_BuildValue("(O(iN))", listed, stat_err, name);
        }
    }
done:
    Py_XDECREF(listed);
    PyMem_RawFree(buf);
    PyMem_RawFree(entries);
    if (beat != NULL) {
        PyBuffer_Release(&beat_view);
    }
    return result;
}

/* -- read_files: whole small files into the rows of one buffer ----------------------------- */

/* One file of read_files, without the GIL: 1, or -errno of the failed step, -EBADMSG for a
 * file that is not regular, is not file_nbytes long or reads short. */
static int
read_one_file(const char *path, char *row, Py_ssize_t file_nbytes)
{
    int fd;
    do {
        fd = open(path, O_RDONLY | OPEN_FLAGS);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) {
        return -errno;
    }
    int code = 1;
    struct stat st;
    if (fstat(fd, &st) < 0) {
        code = -errno;
    }
    else if (!S_ISREG(st.st_mode) || st.st_size != file_nbytes) {
        code = -EBADMSG;
    }
    else {
        Py_ssize_t done = 0;
        while (done < file_nbytes) {
            ssize_t got = pread(fd, row + done, (size_t)(file_nbytes - done), (off_t)done);
            if (got < 0 && errno == EINTR) {
                continue;
            }
            if (got < 0) {
                code = -errno;
                break;
            }
            if (got == 0) {
                code = -EBADMSG; /* shorter than its fstat said: it shrank meanwhile */
                break;
            }
            done += got;
        }
    }
    close(fd);
    return code;
}

PyObject *
kv_fp_read_files(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *paths_obj;
    Py_ssize_t file_nbytes;
    PyObject *rows_obj;
    PyObject *beat_obj;
    if (!PyArg_ParseTuple(args, "OnOO:read_files", &paths_obj, &file_nbytes, &rows_obj,
                          &beat_obj)) {
        return NULL;
    }
    if (file_nbytes <= 0) {
        PyErr_Format(PyExc_ValueError, "read_files: expected a file size > 0, got %zd",
                     file_nbytes);
        return NULL;
    }
    PyObject *seq;
    Py_ssize_t n = 0;
    PyObject **encoded = kv_fp_sequence_slots(
        paths_obj, "read_files: expected a sequence of paths", sizeof(PyObject *), &seq, &n);
    if (encoded == NULL) {
        return NULL;
    }
    int *codes = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(int));
    PyObject *result = NULL;
    Py_ssize_t got = 0;
    Py_buffer rows;
    int have_rows = 0;
    Py_buffer beat_view;
    double *beat = NULL;
    if (codes == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++) {
        if (!PyUnicode_FSConverter(PyTuple_GET_ITEM(seq, got), &encoded[got])) {
            goto done;
        }
    }
    if (PyObject_GetBuffer(rows_obj, &rows, PyBUF_WRITABLE) < 0) {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyErr_Format(PyExc_TypeError,
                     "read_files: expected the rows as a writable contiguous buffer, got %.200s "
                     "(%S)",
                     Py_TYPE(rows_obj)->tp_name, value != NULL ? value : Py_None);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        goto done;
    }
    have_rows = 1;
    Py_ssize_t need;
    if (__builtin_mul_overflow(n, file_nbytes, &need)) {
        PyErr_Format(PyExc_OverflowError,
                     "read_files: expected %zd files of %zd bytes to fit below 2**63 bytes", n,
                     file_nbytes);
        goto done;
    }
    if (rows.len < need) {
        PyErr_Format(PyExc_ValueError,
                     "read_files: expected rows of at least %zd bytes (%zd files of %zd), got %zd",
                     need, n, file_nbytes, rows.len);
        goto done;
    }
    if (acquire_beat("read_files", beat_obj, &beat_view, &beat) < 0) {
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        codes[i] = read_one_file(PyBytes_AS_STRING(encoded[i]), (char *)rows.buf + i * file_nbytes,
                                 file_nbytes);
        beat_now(beat);
    }
    Py_END_ALLOW_THREADS
    result = kv_fp_code_list(codes, n);
done:
    if (beat != NULL) {
        PyBuffer_Release(&beat_view);
    }
    if (have_rows) {
        PyBuffer_Release(&rows);
    }
    for (Py_ssize_t i = 0; i < got; i++) {
        Py_DECREF(encoded[i]);
    }
    PyMem_Free(encoded);
    PyMem_Free(codes);
    Py_DECREF(seq);
    return result;
}

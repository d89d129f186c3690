/* kvstore._native._fileproto: the system-call loops every call shares, run without the GIL:
 * pwritev/preadv of file-contiguous runs in IOV_MAX batches (resuming after short transfers),
 * a new file's plain writes (O_DIRECT cleared before buffered_from), renameat2 with
 * RENAME_NOREPLACE, and the OSError of a failed call (raised once the GIL is back). */

#include "fileproto_internal.h"

/* pwritev (``write``) or preadv of segments [first, last), which are file-contiguous from
 * segs[first].offset, in IOV_MAX batches, resuming after short transfers. Returns the bytes
 * moved (a read stops short at end of file), -1 with errno set, or NO_PROGRESS for a write
 * that moved nothing. No GIL needed. */
Py_ssize_t
kv_fp_transfer_run(int fd, segment *segs, Py_ssize_t first, Py_ssize_t last, int write)
{
    struct iovec small[8];
    Py_ssize_t most = last - first < IOV_MAX ? last - first : IOV_MAX;
    struct iovec *iov = small;
    if (most > 8) {
        iov = malloc((size_t)most * sizeof(struct iovec)); /* no GIL: the C allocator */
        if (iov == NULL) {
            errno = ENOMEM;
            return -1;
        }
    }
    Py_ssize_t total = 0;
    Py_ssize_t index = first; /* the first segment not fully moved */
    Py_ssize_t consumed = 0;  /* bytes of segs[index] already moved */
    off_t position = (off_t)segs[first].offset;
    while (index < last) {
        int n = 0;
        Py_ssize_t want = 0;
        for (Py_ssize_t i = index; i < last && n < most; i++, n++) {
            Py_ssize_t skip = i == index ? consumed : 0;
            iov[n].iov_base = (char *)segs[i].view.buf + skip;
            iov[n].iov_len = (size_t)(segs[i].view.len - skip);
            want += segs[i].view.len - skip;
        }
        if (want == 0) { /* only empty segments left */
            break;
        }
        ssize_t done;
        do {
            done = write ? pwritev(fd, iov, n, position) : preadv(fd, iov, n, position);
        } while (done < 0 && errno == EINTR);
        if (done <= 0) {
            if (done < 0) {
                total = -1; /* errno set by the call */
            }
            else if (write) {
                total = NO_PROGRESS;
            }
            break;
        }
        total += done;
        position += done;
        while (done > 0 && index < last) {
            Py_ssize_t left = segs[index].view.len - consumed;
            if (done >= left) {
                done -= left;
                index++;
                consumed = 0;
            }
            else {
                consumed += done;
                done = 0;
            }
        }
        while (index < last && segs[index].view.len == 0) {
            index++;
        }
    }
    if (iov != small) {
        int saved = errno;
        free(iov);
        errno = saved;
    }
    return total;
}

/* The end of the file-contiguous run of segments starting at ``first`` (exclusive), at most
 * ``limit``. */
Py_ssize_t
kv_fp_run_end(segment *segs, Py_ssize_t first, Py_ssize_t limit)
{
    Py_ssize_t i = first + 1;
    Py_ssize_t end = segs[first].offset + segs[first].view.len;
    while (i < limit && segs[i].offset == end) {
        end += segs[i].view.len;
        i++;
    }
    return i;
}

/* Write segments [lo, hi) with one pwritev per file-contiguous run (runs end at
 * buffered_from; O_DIRECT cleared with one F_SETFL before segment buffered_from when the
 * flags hold it). Returns 0 or the error (NO_PROGRESS included); *end: the furthest byte
 * written. No GIL needed. */
int
kv_fp_write_plain(int fd, int flags, segment *segs, Py_ssize_t lo, Py_ssize_t hi,
                  Py_ssize_t buffered_from, Py_ssize_t *end)
{
    for (Py_ssize_t i = lo; i < hi;) {
        if (i == buffered_from && (flags & O_DIRECT)) {
            /* The flags the file was opened with, less O_DIRECT: F_SETFL changes only the
             * status flags, so no F_GETFL is needed (FileIO.clear_direct). */
            if (fcntl(fd, F_SETFL, (flags | OPEN_FLAGS) & ~O_DIRECT) < 0) {
                return errno;
            }
        }
        Py_ssize_t limit = i < buffered_from && buffered_from < hi ? buffered_from : hi;
        Py_ssize_t stop = kv_fp_run_end(segs, i, limit);
        Py_ssize_t done = kv_fp_transfer_run(fd, segs, i, stop, 1);
        if (done < 0) {
            return done == NO_PROGRESS ? NO_PROGRESS : errno;
        }
        if (segs[i].offset + done > *end) {
            *end = segs[i].offset + done;
        }
        i = stop;
    }
    return 0;
}

/* Raise the OSError os.* raises for ``err`` (file name ``path`` when not NULL). */
PyObject *
kv_fp_raise_errno(int err, PyObject *path)
{
    errno = err;
    if (err == NO_PROGRESS) {
        PyObject *exc = PyObject_CallFunction(PyExc_OSError, "is", ENOSPC,
                                              "pwritev made no progress");
        if (exc != NULL) {
            PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
            Py_DECREF(exc);
        }
        return NULL;
    }
    if (path != NULL) {
        return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
    }
    return PyErr_SetFromErrno(PyExc_OSError);
}

int
kv_fp_renameat2_noreplace(const char *src, const char *dst)
{
#ifdef SYS_renameat2
    return (int)syscall(SYS_renameat2, AT_FDCWD, src, AT_FDCWD, dst, RENAME_NOREPLACE_FLAG);
#else
    errno = ENOSYS;
    return -1;
#endif
}

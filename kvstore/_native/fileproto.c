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
 */
#define PY_SSIZE_T_CLEAN
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <Python.h>

#include "native_common.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef O_DIRECT
#define O_DIRECT 0
#endif
#ifndef IOV_MAX
#define IOV_MAX 1024
#endif
#define OPEN_FLAGS (O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK)
#define RENAME_NOREPLACE_FLAG 1u /* linux/fs.h RENAME_NOREPLACE */
#define NO_PROGRESS (-2)         /* a write loop's "pwritev made no progress" */

/* One file segment: where it goes in the file and the memory it is written from or read
 * into. */
typedef struct {
    Py_ssize_t offset;
    Py_buffer view;
} segment;

static void
release_segments(segment *segs, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        PyBuffer_Release(&segs[i].view);
    }
    PyMem_Free(segs);
}

/* ``obj`` snapshotted as a new tuple (*seq, a new reference; *n items) and a zeroed array of
 * one ``item_size`` slot per item (at least one), for the caller to fill and PyMem_Free. The
 * tuple holds every item for the call: a list the caller mutates meanwhile (from an item's
 * __fspath__ or __index__) changes nothing here. NULL with TypeError (``what``) or
 * MemoryError, and nothing held, otherwise. */
static void *
sequence_slots(PyObject *obj, const char *what, size_t item_size, PyObject **seq,
               Py_ssize_t *n)
{
    *seq = PySequence_Tuple(obj);
    if (*seq == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Format(PyExc_TypeError, "%s, got %.200s", what, Py_TYPE(obj)->tp_name);
        }
        return NULL;
    }
    *n = PyTuple_GET_SIZE(*seq);
    void *slots = PyMem_Calloc(*n > 0 ? (size_t)*n : 1, item_size);
    if (slots == NULL) {
        Py_CLEAR(*seq);
        PyErr_NoMemory();
    }
    return slots;
}

/* ``obj`` (any integer: int, numpy integers, anything with __index__) as a Py_ssize_t in
 * *out; 0, or -1 with TypeError or OverflowError naming ``what`` (item ``i``). */
static int
index_arg(PyObject *obj, Py_ssize_t *out, const char *what, Py_ssize_t i)
{
    PyObject *number = PyNumber_Index(obj);
    if (number == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Format(PyExc_TypeError,
                         "file protocol: expected segment %zd's %s as an integer, got %.200s", i,
                         what, Py_TYPE(obj)->tp_name);
        }
        return -1;
    }
    *out = PyLong_AsSsize_t(number);
    if (*out == -1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Format(PyExc_OverflowError,
                         "file protocol: expected segment %zd's %s below 2**63, got %S", i,
                         what, number);
        }
        Py_DECREF(number);
        return -1;
    }
    Py_DECREF(number);
    return 0;
}

/* Acquire ``obj``, a sequence of (offset, buffer) pairs in file order, as segments (writable
 * buffers when ``writable``). NULL with an exception set on bad input; *count is set. */
static segment *
acquire_segments(PyObject *obj, int writable, Py_ssize_t *count)
{
    PyObject *seq;
    Py_ssize_t n;
    segment *segs = sequence_slots(obj,
                                   "file protocol: expected segments as a sequence of "
                                   "(offset, buffer) pairs",
                                   sizeof(segment), &seq, &n);
    if (segs == NULL) {
        return NULL;
    }
    Py_ssize_t got = 0;
    for (; got < n; got++) {
        PyObject *item = PyTuple_GET_ITEM(seq, got);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_Format(PyExc_TypeError,
                         "file protocol: expected segment %zd as an (offset, buffer) pair, "
                         "got %.200s",
                         got, Py_TYPE(item)->tp_name);
            goto fail;
        }
        Py_ssize_t offset;
        if (index_arg(PyTuple_GET_ITEM(item, 0), &offset, "offset", got) < 0) {
            goto fail;
        }
        if (offset < 0) {
            PyErr_Format(PyExc_ValueError,
                         "file protocol: expected segment %zd at an offset >= 0, got %zd", got,
                         offset);
            goto fail;
        }
        int flags = writable ? PyBUF_WRITABLE : PyBUF_SIMPLE;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(item, 1), &segs[got].view, flags) < 0) {
            PyObject *type, *value, *traceback;
            PyErr_Fetch(&type, &value, &traceback);
            PyErr_Format(PyExc_TypeError,
                         "file protocol: expected segment %zd's memory as a %s buffer, "
                         "got %.200s (%S)",
                         got, writable ? "writable contiguous" : "contiguous",
                         Py_TYPE(PyTuple_GET_ITEM(item, 1))->tp_name,
                         value != NULL ? value : Py_None);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(traceback);
            goto fail;
        }
        segs[got].offset = offset;
        Py_ssize_t end;
        if (__builtin_add_overflow(offset, segs[got].view.len, &end)) {
            PyErr_Format(PyExc_OverflowError,
                         "file protocol: expected segment %zd to end below 2**63, got %zd "
                         "bytes at %zd",
                         got, segs[got].view.len, offset);
            got++; /* its buffer is held: released below */
            goto fail;
        }
    }
    Py_DECREF(seq);
    *count = n;
    return segs;
fail:
    Py_DECREF(seq);
    release_segments(segs, got);
    return NULL;
}

/* Whether the memory [a, a + a_len) and [b, b + b_len) share a byte. */
static int
overlaps(const void *a, Py_ssize_t a_len, const void *b, Py_ssize_t b_len)
{
    uintptr_t a0 = (uintptr_t)a, b0 = (uintptr_t)b;
    return a_len > 0 && b_len > 0 && a0 < b0 + (uintptr_t)b_len && b0 < a0 + (uintptr_t)a_len;
}

/* A file mode of open(2): 0..07777; -1 with ValueError naming ``call`` otherwise. */
static int
check_mode(const char *call, int mode)
{
    if (mode < 0 || mode > 07777) {
        PyErr_Format(PyExc_ValueError, "%s: expected a file mode 0..0o7777, got %d", call, mode);
        return -1;
    }
    return 0;
}

/* pwritev (``write``) or preadv of segments [first, last), which are file-contiguous from
 * segs[first].offset, in IOV_MAX batches, resuming after short transfers. Returns the bytes
 * moved (a read stops short at end of file), -1 with errno set, or NO_PROGRESS for a write
 * that moved nothing. No GIL needed. */
static Py_ssize_t
transfer_run(int fd, segment *segs, Py_ssize_t first, Py_ssize_t last, int write)
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
static Py_ssize_t
run_end(segment *segs, Py_ssize_t first, Py_ssize_t limit)
{
    Py_ssize_t i = first + 1;
    Py_ssize_t end = segs[first].offset + segs[first].view.len;
    while (i < limit && segs[i].offset == end) {
        end += segs[i].view.len;
        i++;
    }
    return i;
}

/* -- checksums computed as the bytes pass (write_new_hashed, read_regular_hashed) ---------- */

/* XXH64_hash_t XXH3_64bits(const void *input, size_t length), handed over by
 * kvstore._native._xxh3batch.function() as a capsule: the one binding of python-xxhash's function. */
/* Most parts (pieces of segments) in one group: kvstore/io/fileio.py's hash_groups keeps the
 * same bound, so both cut a run into the same groups (the same short-read words). */
#define GROUP_PARTS 64

typedef struct {
    xxh3_64_fn fn;
    Py_ssize_t first, last;   /* the hashed segments [first, last), each whole chunks */
    Py_ssize_t chunk_nbytes;  /* > 0 */
    Py_ssize_t group_nbytes;  /* whole chunks, at least one */
    uint64_t *sums;           /* one native uint64 per chunk of those segments, in order */
} hashing;


/* Fill *h from the arguments (the capsule, the range, the geometry and `sums`, acquired into
 * *sums_view, which the caller releases); -1 with ValueError/TypeError on bad input. */
static int
parse_hashing(hashing *h, PyObject *capsule, Py_ssize_t first, Py_ssize_t last,
              Py_ssize_t chunk_nbytes, Py_ssize_t group_nbytes, PyObject *sums_obj,
              Py_buffer *sums_view, segment *segs, Py_ssize_t n)
{
    void *address = PyCapsule_GetPointer(capsule, XXH3_CAPSULE_NAME);
    if (address == NULL) {
        return -1; /* TypeError/ValueError naming the capsule, set by the call */
    }
    memcpy(&h->fn, &address, sizeof h->fn);
    if (first < 0 || first > last || last > n) {
        PyErr_Format(PyExc_ValueError,
                     "file protocol: expected hashed segments 0 <= first <= last <= %zd, got "
                     "[%zd, %zd)",
                     n, first, last);
        return -1;
    }
    if (chunk_nbytes <= 0 || group_nbytes <= 0) {
        PyErr_Format(PyExc_ValueError,
                     "file protocol: expected chunk_nbytes > 0 and group_nbytes > 0, got %zd and "
                     "%zd",
                     chunk_nbytes, group_nbytes);
        return -1;
    }
    Py_ssize_t chunks = 0;
    for (Py_ssize_t i = first; i < last; i++) {
        if (segs[i].view.len % chunk_nbytes != 0) {
            PyErr_Format(PyExc_ValueError,
                         "file protocol: expected hashed segment %zd to hold whole chunks of %zd "
                         "bytes, got %zd bytes",
                         i, chunk_nbytes, segs[i].view.len);
            return -1;
        }
        chunks += segs[i].view.len / chunk_nbytes;
    }
    if (PyObject_GetBuffer(sums_obj, sums_view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS)
        < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "file protocol: expected sums as a writable C-contiguous uint64 buffer, "
                     "got %.200s",
                     Py_TYPE(sums_obj)->tp_name);
        return -1;
    }
    if (!is_uint64_format(sums_view->format, sums_view->itemsize)
        || sums_view->len / 8 < chunks || (uintptr_t)sums_view->buf % 8 != 0) {
        PyErr_Format(PyExc_ValueError,
                     "file protocol: expected sums of at least %zd native uint64 values "
                     "aligned to 8 bytes, got format '%s', %zd bytes at address %% 8 = %d",
                     chunks, sums_view->format ? sums_view->format : "B", sums_view->len,
                     (int)((uintptr_t)sums_view->buf % 8));
        PyBuffer_Release(sums_view);
        return -1;
    }
    /* The sums are written while the hashed memory is still being hashed (or read): apart,
     * or the values would depend on the order of the two. */
    for (Py_ssize_t i = first; i < last; i++) {
        if (overlaps(sums_view->buf, sums_view->len, segs[i].view.buf, segs[i].view.len)) {
            PyErr_Format(PyExc_ValueError,
                         "file protocol: expected sums apart from the hashed memory, got an "
                         "overlap with segment %zd",
                         i);
            PyBuffer_Release(sums_view);
            return -1;
        }
    }
    h->first = first;
    h->last = last;
    h->chunk_nbytes = chunk_nbytes;
    /* Whole chunks, at least one: a chunk larger than the group is a group of its own. */
    h->group_nbytes = group_nbytes < chunk_nbytes ? chunk_nbytes
                                                  : group_nbytes - group_nbytes % chunk_nbytes;
    h->sums = (uint64_t *)sums_view->buf;
    return 0;
}

/* The chunks of parts[0, count), in order, hashed into *sums (advanced past them). */
static void
hash_parts(const hashing *h, const segment *parts, int count, uint64_t **sums)
{
    for (int p = 0; p < count; p++) {
        const char *at = (const char *)parts[p].view.buf;
        Py_ssize_t chunks = parts[p].view.len / h->chunk_nbytes;
        for (Py_ssize_t c = 0; c < chunks; c++) {
            (*sums)[c] = h->fn(at + c * h->chunk_nbytes, (size_t)h->chunk_nbytes);
        }
        *sums += chunks;
    }
}

/* Write (``write``) or read the hashed segments group by group: a group is a file-contiguous
 * run of whole chunks of at most group_nbytes (at most GROUP_PARTS pieces of segments), moved
 * by one transfer_run and hashed just before its write or just after its read, while it is in
 * the CPU cache. Returns 0, or an errno value (NO_PROGRESS: a write that moved nothing); a
 * read that comes back short sets *short_at/want/got and stops. *end: the furthest byte
 * moved. No GIL needed. */
static int
hashed_transfer(int fd, segment *segs, const hashing *h, int write, Py_ssize_t *end,
                Py_ssize_t *short_at, Py_ssize_t *short_want, Py_ssize_t *short_got)
{
    segment parts[GROUP_PARTS];
    uint64_t *sums = h->sums;
    Py_ssize_t i = h->first;
    Py_ssize_t consumed = 0; /* bytes of segs[i] already in a group */
    while (i < h->last) {
        if (segs[i].view.len == consumed) {
            i++;
            consumed = 0;
            continue;
        }
        int count = 0;
        Py_ssize_t start = segs[i].offset + consumed;
        Py_ssize_t want = 0;
        while (i < h->last && count < GROUP_PARTS) {
            Py_ssize_t left = segs[i].view.len - consumed;
            if (left == 0) { /* this segment is done; the next one continues the group? */
                if (i + 1 < h->last && segs[i + 1].offset == start + want) {
                    i++;
                    consumed = 0;
                    continue;
                }
                break;
            }
            Py_ssize_t room = h->group_nbytes - want;
            Py_ssize_t take = left < room ? left : room;
            if (take == 0) {
                break;
            }
            parts[count].offset = segs[i].offset + consumed;
            parts[count].view = segs[i].view; /* a copy of the struct: never released */
            parts[count].view.buf = (char *)segs[i].view.buf + consumed;
            parts[count].view.len = take;
            count++;
            consumed += take;
            want += take;
        }
        if (write) {
            hash_parts(h, parts, count, &sums);
        }
        Py_ssize_t done = transfer_run(fd, parts, 0, count, write);
        if (done < 0) {
            return done == NO_PROGRESS ? NO_PROGRESS : errno;
        }
        if (start + done > *end) {
            *end = start + done;
        }
        if (!write) {
            if (done != want) {
                *short_at = start;
                *short_want = want;
                *short_got = done;
                return 0;
            }
            hash_parts(h, parts, count, &sums);
        }
    }
    return 0;
}

/* Raise the OSError os.* raises for ``err`` (file name ``path`` when not NULL). */
static PyObject *
raise_errno(int err, PyObject *path)
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

/* Write segments [lo, hi) with one pwritev per file-contiguous run (runs end at
 * buffered_from; O_DIRECT cleared with one F_SETFL before segment buffered_from when the
 * flags hold it). Returns 0 or the error (NO_PROGRESS included); *end: the furthest byte
 * written. No GIL needed. */
static int
write_plain(int fd, int flags, segment *segs, Py_ssize_t lo, Py_ssize_t hi,
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
        Py_ssize_t stop = run_end(segs, i, limit);
        Py_ssize_t done = transfer_run(fd, segs, i, stop, 1);
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
        err = hashed_transfer(fd, segs, h, 1, &end, &unused_at, &unused_want, &unused_got);
        if (err == 0) {
            err = write_plain(fd, flags, segs, 0, h->first, buffered_from, &end);
        }
        if (err == 0) {
            err = write_plain(fd, flags, segs, h->last, n, buffered_from, &end);
        }
    }
    else if (err == 0) {
        err = write_plain(fd, flags, segs, 0, n, buffered_from, &end);
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
    release_segments(segs, n);
    if (err != 0) {
        raise_errno(err, open_failed ? name : NULL);
        Py_DECREF(path);
        return NULL;
    }
    Py_DECREF(path);
    return PyLong_FromLong(fd);
}

/* The segments of a new file, acquired (see acquire_segments), after the checks write_new and
 * write_new_hashed share: a file mode, 0 <= buffered_from <= the segment count, file_nbytes >=
 * 0; NULL with an exception (nothing held) otherwise. */
static segment *
new_file_segments(PyObject *segments_obj, int mode, Py_ssize_t buffered_from,
                  Py_ssize_t file_nbytes, Py_ssize_t *n)
{
    if (check_mode("write_new", mode) < 0) {
        return NULL;
    }
    segment *segs = acquire_segments(segments_obj, 0, n);
    if (segs == NULL) {
        return NULL;
    }
    if (buffered_from < 0 || buffered_from > *n || file_nbytes < 0) {
        PyErr_Format(PyExc_ValueError,
                     "write_new: expected 0 <= buffered_from <= %zd segments and "
                     "file_nbytes >= 0, got %zd and %zd",
                     *n, buffered_from, file_nbytes);
        release_segments(segs, *n);
        return NULL;
    }
    return segs;
}

static PyObject *
fileproto_write_new(PyObject *Py_UNUSED(module), PyObject *args)
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

static PyObject *
fileproto_write_new_hashed(PyObject *Py_UNUSED(module), PyObject *args)
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
    if (parse_hashing(&h, capsule, first, last, chunk_nbytes, group_nbytes, sums_obj,
                      &sums_view, segs, n)
        < 0) {
        release_segments(segs, n);
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
        release_segments(segs, n);
        Py_DECREF(path);
        return NULL;
    }
    PyObject *fd = new_file(name, path, flags, mode, segs, n, buffered_from, file_nbytes, &h);
    PyBuffer_Release(&sums_view);
    return fd;
}

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
                err = hashed_transfer(fd, segs, h, 0, &unused_end, &short_at, &short_want,
                                      &short_got);
                if (err != 0 || short_at >= 0) {
                    break;
                }
                i = hashed_last;
                continue;
            }
            Py_ssize_t stop = run_end(segs, i, i < hashed_first ? hashed_first : n);
            Py_ssize_t want = 0;
            for (Py_ssize_t j = i; j < stop; j++) {
                want += segs[j].view.len;
            }
            Py_ssize_t got = transfer_run(fd, segs, i, stop, 0);
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
    release_segments(segs, n);
    if (err != 0) {
        raise_errno(err, open_failed ? name : NULL);
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

static PyObject *
fileproto_read_regular(PyObject *Py_UNUSED(module), PyObject *args)
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
    segment *segs = acquire_segments(segments_obj, 1, &n);
    if (segs == NULL) {
        Py_DECREF(path);
        return NULL;
    }
    return regular_file(name, path, flags, segs, n, expected_size, allow_trailer,
                        touch_if_older_than_ns, NULL);
}

static PyObject *
fileproto_read_regular_hashed(PyObject *Py_UNUSED(module), PyObject *args)
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
    segment *segs = acquire_segments(segments_obj, 1, &n);
    if (segs == NULL) {
        Py_DECREF(path);
        return NULL;
    }
    hashing h;
    Py_buffer sums_view;
    if (parse_hashing(&h, capsule, first, last, chunk_nbytes, group_nbytes, sums_obj,
                      &sums_view, segs, n)
        < 0) {
        release_segments(segs, n);
        Py_DECREF(path);
        return NULL;
    }
    PyObject *outcome = regular_file(name, path, flags, segs, n, expected_size, 0,
                                     touch_if_older_than_ns, &h);
    PyBuffer_Release(&sums_view);
    return outcome;
}

static int
renameat2_noreplace(const char *src, const char *dst)
{
#ifdef SYS_renameat2
    return (int)syscall(SYS_renameat2, AT_FDCWD, src, AT_FDCWD, dst, RENAME_NOREPLACE_FLAG);
#else
    errno = ENOSYS;
    return -1;
#endif
}

/* renameat2's "this file system (or kernel) lacks the operation" (kvstore/io/rename.py). */
static int
rename_unsupported(int err)
{
    return err == EINVAL || err == ENOSYS || err == EOPNOTSUPP || err == ENOTSUP;
}

static PyObject *
fileproto_sync_and_rename(PyObject *Py_UNUSED(module), PyObject *args)
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
    if (sync_err == 0 && renameat2_noreplace(csrc, cdst) < 0) {
        rename_err = errno;
    }
    Py_END_ALLOW_THREADS
    Py_DECREF(src);
    Py_DECREF(dst);
    if (sync_err != 0) {
        return raise_errno(sync_err, NULL);
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

/* -- publish_pieces: whole blocks given as pieces, written and named in one call --------- */

#define PUBLISHED 1     /* publish_pieces: the block's file was written and named */
#define ALREADY_THERE 0 /* publish_pieces: a regular file had the name (nothing written) */

/* One block of a publish_pieces batch: its temporary and final names, its header (fixed part
 * packed, checksum slots filled here) and the memory its pieces lie in. */
typedef struct {
    PyObject *tmp; /* bytes (PyUnicode_FSConverter) */
    PyObject *final;
    Py_buffer header;
    Py_buffer span;
    int outcome;
} piece_block;

/* The geometry every block of a batch shares (checked once, with the GIL). */
typedef struct {
    int flags, mode;
    Py_ssize_t file_nbytes, piece_nbytes, npieces, chunk_nbytes, nchunks, slots_offset;
    Py_ssize_t index_offset, alignment;
    Py_ssize_t header_nbytes, span_nbytes; /* every block's header and span: checked sizes */
    const int64_t *starts;  /* piece k starts at span + starts[k] */
    const int64_t *slot_of; /* the span's chunk s is the block's chunk slot_of[s] */
    Py_buffer index;
    xxh3_64_fn fn;
} piece_plan;

static void
release_piece_blocks(piece_block *blocks, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_XDECREF(blocks[i].tmp);
        Py_XDECREF(blocks[i].final);
        if (blocks[i].header.obj != NULL) {
            PyBuffer_Release(&blocks[i].header);
        }
        if (blocks[i].span.obj != NULL) {
            PyBuffer_Release(&blocks[i].span);
        }
    }
    PyMem_Free(blocks);
}

/* Whether every byte a block's O_DIRECT write sends from memory, or its O_DIRECT read
 * fills, is aligned: the header and every piece, in address and length (so are their file
 * offsets; a write's index goes buffered after them, a read leaves the index unread). */
static int
piece_block_aligned(const piece_plan *p, const piece_block *b)
{
    uintptr_t a = (uintptr_t)p->alignment;
    if ((uintptr_t)b->header.buf % a != 0 || (uintptr_t)b->header.len % a != 0
        || (uintptr_t)p->piece_nbytes % a != 0) {
        return 0;
    }
    for (Py_ssize_t k = 0; k < p->npieces; k++) {
        if ((uintptr_t)((const char *)b->span.buf + p->starts[k]) % a != 0) {
            return 0;
        }
    }
    return 1;
}

/* One block: existence probe, checksums into the header's slots, the temporary file written
 * (header, pieces, index) and closed, then named without replacing. Returns PUBLISHED,
 * ALREADY_THERE, or -errno of the step that failed, the temporary file removed (the caller
 * takes the block through its reference path, which reports the failure in its own words).
 * ``segs``: room for npieces + 2 segments. No GIL needed. */
static int
publish_piece_block(const piece_plan *p, piece_block *b, segment *segs)
{
    const char *tmp = PyBytes_AS_STRING(b->tmp);
    const char *final = PyBytes_AS_STRING(b->final);
    struct stat st;
    if (lstat(final, &st) == 0) {
        /* A regular file is the block (names are content hashes); anything else is for the
         * reference path to report (FileIO.exists raises EntryKindError). */
        return S_ISREG(st.st_mode) ? ALREADY_THERE : -EEXIST;
    }
    if (errno != ENOENT) {
        return -errno;
    }
    const char *span = (const char *)b->span.buf;
    char *slots = (char *)b->header.buf + p->slots_offset;
    for (Py_ssize_t s = 0; s < p->nchunks; s++) { /* front to back: the prefetcher follows */
        uint64_t sum = p->fn(span + s * p->chunk_nbytes, (size_t)p->chunk_nbytes);
        memcpy(slots + 8 * p->slot_of[s], &sum, 8);
    }
    int direct = (p->flags & O_DIRECT) && piece_block_aligned(p, b);
    int flags = direct ? p->flags : p->flags & ~O_DIRECT;
    Py_ssize_t n = 0;
    segs[n].offset = 0;
    segs[n].view.buf = b->header.buf;
    segs[n].view.len = b->header.len;
    n++;
    for (Py_ssize_t k = 0; k < p->npieces; k++, n++) {
        segs[n].offset = b->header.len + k * p->piece_nbytes;
        segs[n].view.buf = (char *)span + p->starts[k];
        segs[n].view.len = p->piece_nbytes;
    }
    segs[n].offset = p->index_offset;
    segs[n].view.buf = p->index.buf;
    segs[n].view.len = p->index.len;
    n++;
    int fd;
    do {
        fd = open(tmp, flags | OPEN_FLAGS, (mode_t)p->mode);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) {
        return -errno; /* nothing created (O_EXCL) */
    }
    Py_ssize_t end = 0;
    int err = write_plain(fd, flags, segs, 0, n, direct ? n - 1 : n, &end);
    if (err == NO_PROGRESS) {
        err = ENOSPC;
    }
    if (err == 0 && end != p->file_nbytes) {
        int rc;
        do {
            rc = ftruncate(fd, (off_t)p->file_nbytes);
        } while (rc < 0 && errno == EINTR);
        if (rc < 0) {
            err = errno;
        }
    }
    if (close(fd) < 0 && err == 0 && errno != EINTR) {
        err = errno;
    }
    if (err == 0) {
        if (renameat2_noreplace(tmp, final) == 0) {
            return PUBLISHED;
        }
        err = errno;
    }
    (void)unlink(tmp);
    /* The rename found the block there: another writer published it since the probe. */
    return err == EEXIST ? ALREADY_THERE : -err;
}

/* ``obj`` as native int64 values aligned to 8 bytes (``count`` of them; any number when
 * count < 0), acquired into *view; -1 with TypeError/ValueError naming ``what``. */
static int
int64_buffer(const char *call, PyObject *obj, Py_buffer *view, const char *what,
             Py_ssize_t count)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "%s: expected %s as a C-contiguous int64 buffer, got %.200s", call, what,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    const char *f = view->format != NULL ? view->format : "B";
    if (f[0] == '@' || f[0] == '=' || f[0] == '<') {
        f++;
    }
    if (view->itemsize != 8 || !(strcmp(f, "q") == 0 || strcmp(f, "l") == 0)
        || (count >= 0 && view->len / 8 != count) || (uintptr_t)view->buf % 8 != 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s: expected %s as %s%zd int64 values aligned to 8 bytes, got format "
                     "'%s', %zd bytes at address %% 8 = %d",
                     call, what, count < 0 ? "any number of (here " : "", count < 0 ? view->len / 8 : count,
                     view->format ? view->format : "B", view->len,
                     (int)((uintptr_t)view->buf % 8));
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The checks of the piece counts and sizes (GIL held): whole chunks, a span that fits in a
 * Py_ssize_t; p->span_nbytes and p->nchunks set. -1 with ValueError/OverflowError. */
static int
check_piece_sizes(const char *call, piece_plan *p)
{
    if (p->piece_nbytes <= 0 || p->chunk_nbytes <= 0 || p->piece_nbytes % p->chunk_nbytes != 0
        || p->alignment <= 0 || p->npieces <= 0 || p->npieces > IOV_MAX - 2) {
        PyErr_Format(PyExc_ValueError,
                     "%s: expected 1..%d pieces of whole chunks and an alignment > 0, got %zd "
                     "pieces of %zd bytes, chunks of %zd, alignment %zd",
                     call, IOV_MAX - 2, p->npieces, p->piece_nbytes, p->chunk_nbytes,
                     p->alignment);
        return -1;
    }
    if (__builtin_mul_overflow(p->npieces, p->piece_nbytes, &p->span_nbytes)) {
        PyErr_Format(PyExc_OverflowError,
                     "%s: expected a span below 2**63 bytes, got %zd pieces of %zd bytes", call,
                     p->npieces, p->piece_nbytes);
        return -1;
    }
    p->nchunks = p->span_nbytes / p->chunk_nbytes;
    return 0;
}

/* The checks of where the pieces lie (GIL held): they tile the span exactly (every start a
 * multiple of piece_nbytes, each place once), and slot_of is the chunk order that follows
 * from them (the span's chunk s, in the piece starting at its piece-sized place, is the
 * block's chunk of that piece and position). -1 with ValueError otherwise: a piece outside
 * the span would write or read memory that is not the block's, overlapping pieces or another
 * order would store checksums that are not the chunks'. */
static int
check_piece_places(const char *call, const piece_plan *p)
{
    /* piece_at[j]: the piece that starts at j * piece_nbytes (-1: none yet) */
    Py_ssize_t *piece_at = PyMem_Malloc((size_t)p->npieces * sizeof(Py_ssize_t));
    if (piece_at == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t j = 0; j < p->npieces; j++) {
        piece_at[j] = -1;
    }
    for (Py_ssize_t k = 0; k < p->npieces; k++) {
        int64_t start = p->starts[k];
        if (start < 0 || start % p->piece_nbytes != 0 || start / p->piece_nbytes >= p->npieces
            || piece_at[start / p->piece_nbytes] >= 0) {
            PyErr_Format(PyExc_ValueError,
                         "%s: expected the starts to tile the %zd-byte span with pieces of %zd "
                         "bytes (each a multiple of it, once), got %lld for piece %zd",
                         call, p->span_nbytes, p->piece_nbytes, (long long)start, k);
            PyMem_Free(piece_at);
            return -1;
        }
        piece_at[start / p->piece_nbytes] = k;
    }
    Py_ssize_t per_piece = p->piece_nbytes / p->chunk_nbytes;
    for (Py_ssize_t s = 0; s < p->nchunks; s++) {
        int64_t slot = (int64_t)(piece_at[s / per_piece] * per_piece + s % per_piece);
        if (p->slot_of[s] != slot) {
            PyErr_Format(PyExc_ValueError,
                         "%s: expected slot_of[%zd] = %lld (the chunk order the starts give), "
                         "got %lld",
                         call, s, (long long)slot, (long long)p->slot_of[s]);
            PyMem_Free(piece_at);
            return -1;
        }
    }
    PyMem_Free(piece_at);
    return 0;
}

/* The checks of the header (GIL held): file_nbytes >= 0, a header of header_nbytes >= 0
 * holding every checksum slot, header and span inside the file. -1 with ValueError or
 * OverflowError otherwise. */
static int
check_piece_header(const char *call, const piece_plan *p)
{
    Py_ssize_t slots_end, data_end;
    if (p->file_nbytes < 0 || p->slots_offset < 0 || p->header_nbytes < 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s: expected file_nbytes, slots_offset and the header's size >= 0, got "
                     "%zd, %zd and %zd",
                     call, p->file_nbytes, p->slots_offset, p->header_nbytes);
        return -1;
    }
    if (__builtin_mul_overflow(p->nchunks, (Py_ssize_t)8, &slots_end)
        || __builtin_add_overflow(slots_end, p->slots_offset, &slots_end)
        || __builtin_add_overflow(p->header_nbytes, p->span_nbytes, &data_end)) {
        PyErr_Format(PyExc_OverflowError,
                     "%s: expected the slots (%zd at %zd) and the %zd-byte header and span to "
                     "end below 2**63",
                     call, p->nchunks, p->slots_offset, p->header_nbytes);
        return -1;
    }
    if (slots_end > p->header_nbytes || data_end > p->file_nbytes) {
        PyErr_Format(PyExc_ValueError,
                     "%s: expected %zd checksum slots at %zd inside the %zd-byte header, and "
                     "header and %zd-byte span inside the %zd-byte file",
                     call, p->nchunks, p->slots_offset, p->header_nbytes, p->span_nbytes,
                     p->file_nbytes);
        return -1;
    }
    return 0;
}

/* Acquire the (tmp, final, header, span) items (reads: (path, header, span)) from a snapshot of
 * ``items_obj`` and check each against the plan; NULL with an exception (nothing held)
 * otherwise. */
static piece_block *
acquire_piece_blocks(PyObject *items_obj, const piece_plan *p, int reading, Py_ssize_t *count)
{
    const char *call = reading ? "read_pieces" : "publish_pieces";
    const char *shape = reading ? "(path, header, span)" : "(tmp, final, header, span)";
    Py_ssize_t size = reading ? 3 : 4;
    PyObject *seq;
    Py_ssize_t n;
    piece_block *blocks = sequence_slots(
        items_obj, "file protocol: expected the blocks as a sequence of tuples",
        sizeof(piece_block), &seq, &n);
    if (blocks == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(seq, i);
        piece_block *b = &blocks[i];
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != size) {
            PyErr_Format(PyExc_TypeError, "%s: expected block %zd as a %s tuple, got %.200s",
                         call, i, shape, Py_TYPE(item)->tp_name);
            goto fail;
        }
        /* reads: the file's path in ``final`` (tmp unused) */
        if ((!reading && !PyUnicode_FSConverter(PyTuple_GET_ITEM(item, 0), &b->tmp))
            || !PyUnicode_FSConverter(PyTuple_GET_ITEM(item, size - 3), &b->final)) {
            goto fail;
        }
        PyObject *header = PyTuple_GET_ITEM(item, size - 2);
        PyObject *span = PyTuple_GET_ITEM(item, size - 1);
        if (PyObject_GetBuffer(header, &b->header, PyBUF_WRITABLE) < 0) {
            b->header.obj = NULL;
            PyErr_Format(PyExc_TypeError,
                         "%s: expected block %zd's header as a writable contiguous buffer, got "
                         "%.200s",
                         call, i, Py_TYPE(header)->tp_name);
            goto fail;
        }
        if (PyObject_GetBuffer(span, &b->span, reading ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
            b->span.obj = NULL;
            PyErr_Format(PyExc_TypeError,
                         "%s: expected block %zd's span as a %scontiguous buffer, got %.200s",
                         call, i, reading ? "writable " : "", Py_TYPE(span)->tp_name);
            goto fail;
        }
        if (b->header.len != p->header_nbytes || b->span.len != p->span_nbytes) {
            PyErr_Format(PyExc_ValueError,
                         "%s: block %zd: expected a header of %zd bytes and a span of %zd "
                         "bytes, got %zd and %zd",
                         call, i, p->header_nbytes, p->span_nbytes, b->header.len, b->span.len);
            goto fail;
        }
        /* A publish fills the header's slots while it hashes the span: apart, or the sums
         * would depend on the order of the two (a read would fill one with the other). */
        if (overlaps(b->header.buf, b->header.len, b->span.buf, b->span.len)) {
            PyErr_Format(PyExc_ValueError,
                         "%s: block %zd: expected its header and span in separate memory, got "
                         "an overlap",
                         call, i);
            goto fail;
        }
    }
    Py_DECREF(seq);
    *count = n;
    return blocks;
fail:
    Py_DECREF(seq);
    release_piece_blocks(blocks, n);
    return NULL;
}

/* -- read_pieces: whole blocks read into pieces and verified, in one call ------------------ */

#define VERIFIED 1 /* read_pieces: read whole, every chunk matches its slot */

/* One block: open, fstat (a regular file of file_nbytes bytes), one preadv of the header and
 * every piece where it lies, touch, close, then each chunk's xxh3 against its slot. Returns
 * VERIFIED or -errno: EBADMSG for a file that is not regular, of the wrong size, short, or
 * whose checksums differ (the caller reads it again through its reference path, which
 * reports and quarantines it in its own words). No GIL needed. */
static int
read_piece_block(const piece_plan *p, piece_block *b, segment *segs, long long touch_ns)
{
    const char *path = PyBytes_AS_STRING(b->final);
    char *span = (char *)b->span.buf;
    Py_ssize_t n = 0;
    segs[n].offset = 0;
    segs[n].view.buf = b->header.buf;
    segs[n].view.len = b->header.len;
    n++;
    for (Py_ssize_t k = 0; k < p->npieces; k++, n++) {
        segs[n].offset = b->header.len + k * p->piece_nbytes;
        segs[n].view.buf = span + p->starts[k];
        segs[n].view.len = p->piece_nbytes;
    }
    /* O_DIRECT (the store's direct_reads) only where every byte read lands aligned */
    int flags = (p->flags & O_DIRECT) && piece_block_aligned(p, b) ? p->flags
                                                                    : p->flags & ~O_DIRECT;
    int fd;
    do {
        fd = open(path, flags | OPEN_FLAGS, 0600); /* as read_regular */
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) {
        return -errno;
    }
    struct stat st;
    int err = 0;
    if (fstat(fd, &st) < 0) {
        err = errno;
    }
    else if (!S_ISREG(st.st_mode) || st.st_size != p->file_nbytes) {
        err = EBADMSG;
    }
    else {
        Py_ssize_t got = transfer_run(fd, segs, 0, n, 0);
        if (got < 0) {
            err = errno;
        }
        else if (got != p->index_offset) { /* header and pieces end where the index starts */
            err = EBADMSG;
        }
        else {
            long long mtime_ns = (long long)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
            if (mtime_ns < touch_ns) {
                (void)futimens(fd, NULL); /* best effort, as read_regular */
            }
        }
    }
    close(fd);
    if (err != 0) {
        return -err;
    }
    const char *slots = (const char *)b->header.buf + p->slots_offset;
    for (Py_ssize_t s = 0; s < p->nchunks; s++) {
        uint64_t sum = p->fn(span + s * p->chunk_nbytes, (size_t)p->chunk_nbytes);
        uint64_t slot;
        memcpy(&slot, slots + 8 * p->slot_of[s], 8);
        if (sum != slot) {
            return -EBADMSG;
        }
    }
    return VERIFIED;
}

/* The geometry arguments both batch calls share, checked (GIL held): the capsule, starts and
 * slot_of acquired into *starts_view and *slot_view (the caller releases both on success;
 * nothing is held on failure), p's counts set, the pieces' places checked; -1 with an
 * exception. */
static int
parse_piece_geometry(const char *call, piece_plan *p, PyObject *starts_obj, PyObject *slot_obj,
                     PyObject *capsule, Py_buffer *starts_view, Py_buffer *slot_view)
{
    void *address = PyCapsule_GetPointer(capsule, XXH3_CAPSULE_NAME);
    if (address == NULL) {
        return -1;
    }
    memcpy(&p->fn, &address, sizeof p->fn);
    if (int64_buffer(call, starts_obj, starts_view, "starts", -1) < 0) {
        return -1;
    }
    p->npieces = starts_view->len / 8;
    p->starts = (const int64_t *)starts_view->buf;
    if (check_piece_sizes(call, p) < 0) {
        PyBuffer_Release(starts_view);
        return -1;
    }
    if (int64_buffer(call, slot_obj, slot_view, "slot_of", p->nchunks) < 0) {
        PyBuffer_Release(starts_view);
        return -1;
    }
    p->slot_of = (const int64_t *)slot_view->buf;
    if (check_piece_places(call, p) < 0) {
        PyBuffer_Release(slot_view);
        PyBuffer_Release(starts_view);
        return -1;
    }
    return 0;
}

/* Acquire the blocks of a batch, run publish_piece_block (``reading`` 0) or read_piece_block
 * on each with the GIL released, and return their outcomes as a list (NULL with an
 * exception; nothing held either way). */
static PyObject *
run_piece_batch(const piece_plan *p, PyObject *items_obj, int reading, long long touch_ns)
{
    Py_ssize_t n = 0;
    piece_block *blocks = acquire_piece_blocks(items_obj, p, reading, &n);
    if (blocks == NULL) {
        return NULL;
    }
    segment *segs = PyMem_Calloc((size_t)p->npieces + 2, sizeof(segment));
    if (segs == NULL) {
        release_piece_blocks(blocks, n);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        blocks[i].outcome = reading ? read_piece_block(p, &blocks[i], segs, touch_ns)
                                    : publish_piece_block(p, &blocks[i], segs);
    }
    Py_END_ALLOW_THREADS
    PyObject *result = PyList_New(n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        PyObject *value = PyLong_FromLong(blocks[i].outcome);
        if (value == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, value);
    }
    PyMem_Free(segs);
    release_piece_blocks(blocks, n);
    return result;
}

static PyObject *
fileproto_publish_pieces(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *items_obj, *starts_obj, *slot_obj, *index_obj, *capsule;
    piece_plan p;
    memset(&p, 0, sizeof p);
    if (!PyArg_ParseTuple(args, "OiinnOOnnOnnO:publish_pieces", &items_obj, &p.flags, &p.mode,
                          &p.file_nbytes, &p.piece_nbytes, &starts_obj, &slot_obj,
                          &p.chunk_nbytes, &p.slots_offset, &index_obj, &p.index_offset,
                          &p.alignment, &capsule)
        || check_mode("publish_pieces", p.mode) < 0) {
        return NULL;
    }
    Py_buffer starts_view, slot_view;
    if (parse_piece_geometry("publish_pieces", &p, starts_obj, slot_obj, capsule, &starts_view,
                             &slot_view)
        < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    if (PyObject_GetBuffer(index_obj, &p.index, PyBUF_SIMPLE) < 0) {
        PyErr_Format(PyExc_TypeError,
                     "publish_pieces: expected the index as a contiguous buffer, got %.200s",
                     Py_TYPE(index_obj)->tp_name);
        goto done;
    }
    Py_ssize_t index_end;
    if (p.index_offset < 0) {
        PyErr_Format(PyExc_ValueError,
                     "publish_pieces: expected the index at an offset >= 0, got %zd",
                     p.index_offset);
    }
    else if (__builtin_add_overflow(p.index_offset, p.index.len, &index_end)) {
        PyErr_Format(PyExc_OverflowError,
                     "publish_pieces: expected the %zd-byte index at %zd to end below 2**63",
                     p.index.len, p.index_offset);
    }
    else if (index_end > p.file_nbytes || p.index_offset < p.span_nbytes) {
        PyErr_Format(PyExc_ValueError,
                     "publish_pieces: expected the %zd-byte index at %zd inside the %zd-byte "
                     "file, after the %zd-byte span",
                     p.index.len, p.index_offset, p.file_nbytes, p.span_nbytes);
    }
    else {
        /* The pieces end where the index starts: the header is what comes before them. */
        p.header_nbytes = p.index_offset - p.span_nbytes;
        if (check_piece_header("publish_pieces", &p) == 0) {
            result = run_piece_batch(&p, items_obj, 0, 0);
        }
    }
    PyBuffer_Release(&p.index);
done:
    PyBuffer_Release(&slot_view);
    PyBuffer_Release(&starts_view);
    return result;
}

static PyObject *
fileproto_read_pieces(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *items_obj, *starts_obj, *slot_obj, *capsule;
    long long touch_ns;
    piece_plan p;
    memset(&p, 0, sizeof p);
    if (!PyArg_ParseTuple(args, "OinnnOOnnLnO:read_pieces", &items_obj, &p.flags,
                          &p.file_nbytes, &p.header_nbytes, &p.piece_nbytes, &starts_obj,
                          &slot_obj, &p.chunk_nbytes, &p.slots_offset, &touch_ns, &p.alignment,
                          &capsule)) {
        return NULL;
    }
    Py_buffer starts_view, slot_view;
    if (parse_piece_geometry("read_pieces", &p, starts_obj, slot_obj, capsule, &starts_view,
                             &slot_view)
        < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    if (check_piece_header("read_pieces", &p) == 0) {
        p.index_offset = p.header_nbytes + p.span_nbytes; /* where the pieces end */
        result = run_piece_batch(&p, items_obj, 1, touch_ns);
    }
    PyBuffer_Release(&slot_view);
    PyBuffer_Release(&starts_view);
    return result;
}

/* -- exists_many: existence probes of a batch of names ------------------------------------ */

static PyObject *
fileproto_exists_many(PyObject *Py_UNUSED(module), PyObject *args)
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
    result = PyList_New(n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        PyObject *value = PyLong_FromLong(codes[i]);
        if (value == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, value);
    }
done:
    for (Py_ssize_t i = 0; encoded != NULL && i < got; i++) {
        Py_DECREF(encoded[i]);
    }
    PyMem_Free(encoded);
    PyMem_Free(codes);
    Py_DECREF(seq);
    return result;
}

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
    segment *segs = acquire_segments(segments_obj, 0, &n);
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
    release_segments(segs, n);
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
    {"write_new", fileproto_write_new, METH_VARARGS,
     "write_new(path, flags, mode, segments, buffered_from, file_nbytes) -> fd: open `path` "
     "(flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, mode), write the (offset, buffer) segments "
     "in order, one pwritev per file-contiguous run (O_DIRECT cleared with one F_SETFL before "
     "segment `buffered_from`), ftruncate to file_nbytes when the data ends elsewhere. The "
     "descriptor is returned open; on an error it is closed and OSError raised."},
    {"read_regular", fileproto_read_regular, METH_VARARGS,
     "read_regular(path, flags, segments, expected_size, allow_trailer, touch_if_older_than_ns) "
     "-> (st_mode, st_size, st_dev, st_ino, st_mtime_ns, short): open `path` (flags | "
     "O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC), fstat, and only for a regular file of the expected "
     "size fill the writable (offset, buffer) segments with preadv; `short` is None or "
     "(offset, expected, got) of a run that came back short. The file is closed before the "
     "call returns; OSError for a failed system call."},
    {"write_new_hashed", fileproto_write_new_hashed, METH_VARARGS,
     "write_new_hashed(path, flags, mode, segments, buffered_from, file_nbytes, first, last, "
     "chunk_nbytes, group_nbytes, sums, xxh3) -> fd: write_new, with segments [first, last) "
     "(whole chunks of chunk_nbytes) written first, group by group (file-contiguous runs of at "
     "most group_nbytes), each group's chunks hashed with the capsule `xxh3` "
     "(kvstore._native._xxh3batch.function()) into the next values of the writable uint64 buffer "
     "`sums` just before its pwritev; then the other segments in order. With O_DIRECT the "
     "hashed segments must come before buffered_from."},
    {"read_regular_hashed", fileproto_read_regular_hashed, METH_VARARGS,
     "read_regular_hashed(path, flags, segments, expected_size, touch_if_older_than_ns, first, "
     "last, chunk_nbytes, group_nbytes, sums, xxh3) -> read_regular's outcome: read_regular "
     "(no trailer), with segments [first, last) read group by group, each group's chunks "
     "hashed into the next values of `sums` right after its preadv (values past a short read "
     "are not written)."},
    {"sync_and_rename", fileproto_sync_and_rename, METH_VARARGS,
     "sync_and_rename(fd, src, dst) -> bool: fdatasync(fd) when fd >= 0, then "
     "renameat2(src, dst, RENAME_NOREPLACE). False when the file system lacks renameat2 (the "
     "file is synced; the caller renames another way); OSError (FileExistsError when dst "
     "exists) otherwise."},
    {"publish_pieces", fileproto_publish_pieces, METH_VARARGS,
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
    {"read_pieces", fileproto_read_pieces, METH_VARARGS,
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
    {"exists_many", fileproto_exists_many, METH_VARARGS,
     "exists_many(paths) -> [code]: lstat of each path without the GIL: 1 a regular file, 0 "
     "no such name (ENOENT), -1 anything else (another kind of entry, or an error: the caller "
     "asks again one by one for the words)."},
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

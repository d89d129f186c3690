/* kvstore._fileproto: the per-file protocol of one block file in one call, without the GIL.
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

/* Acquire ``obj``, a sequence of (offset, buffer) pairs in file order, as segments (writable
 * buffers when ``writable``). NULL with an exception set on bad input; *count is set. */
static segment *
acquire_segments(PyObject *obj, int writable, Py_ssize_t *count)
{
    PyObject *seq = PySequence_Fast(obj, "file protocol: expected segments as a sequence of "
                                         "(offset, buffer) pairs");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    segment *segs = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(segment));
    if (segs == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    Py_ssize_t got = 0;
    for (; got < n; got++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, got);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_Format(PyExc_TypeError,
                         "file protocol: expected segment %zd as an (offset, buffer) pair, "
                         "got %.200s",
                         got, Py_TYPE(item)->tp_name);
            goto fail;
        }
        Py_ssize_t offset = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 0));
        if (offset == -1 && PyErr_Occurred()) {
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
    }
    Py_DECREF(seq);
    *count = n;
    return segs;
fail:
    Py_DECREF(seq);
    release_segments(segs, got);
    return NULL;
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
 * kvstore._xxh3batch.function() as a capsule: the one binding of python-xxhash's function. */
typedef uint64_t (*xxh3_64_fn)(const void *input, size_t length);
#define XXH3_CAPSULE_NAME "kvstore._xxh3batch.XXH3_64bits"
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

/* A native-endian uint64 element format of the buffer protocol (struct module codes), as
 * kvstore/_xxh3batch.c accepts for its `out`. */
static int
is_uint64_format(const char *format, Py_ssize_t itemsize)
{
    if (itemsize != 8 || format == NULL) {
        return 0;
    }
    if (format[0] == '@' || format[0] == '=') {
        format++;
    }
#if PY_LITTLE_ENDIAN
    else if (format[0] == '<') {
        format++;
    }
#else
    else if (format[0] == '>' || format[0] == '!') {
        format++;
    }
#endif
    return (strcmp(format, "Q") == 0 || (sizeof(unsigned long) == 8 && strcmp(format, "L") == 0));
}

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
        || sums_view->len / 8 < chunks) {
        PyErr_Format(PyExc_ValueError,
                     "file protocol: expected sums of at least %zd native uint64 values, got "
                     "format '%s', %zd bytes",
                     chunks, sums_view->format ? sums_view->format : "B", sums_view->len);
        PyBuffer_Release(sums_view);
        return -1;
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
 * write_new_hashed share: 0 <= buffered_from <= the segment count, file_nbytes >= 0; NULL with
 * ValueError (nothing held) otherwise. */
static segment *
new_file_segments(PyObject *segments_obj, Py_ssize_t buffered_from, Py_ssize_t file_nbytes,
                  Py_ssize_t *n)
{
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
    segment *segs = new_file_segments(segments_obj, buffered_from, file_nbytes, &n);
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
    segment *segs = new_file_segments(segments_obj, buffered_from, file_nbytes, &n);
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
        fd = open(cpath, flags | OPEN_FLAGS);
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
     "(kvstore._xxh3batch.function()) into the next values of the writable uint64 buffer "
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
    "kvstore._fileproto",
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

/* kvstore._native._fileproto: checksums computed as the bytes pass (write_new_hashed,
 * read_regular_hashed): the hashing arguments checked, and the hashed segments moved group by
 * group, each group hashed just before its write or just after its read. */

#include "fileproto_internal.h"

/* Most parts (pieces of segments) in one group: kvstore/io/hashed_groups.py's hashed_groups
 * keeps the same bound, so both cut a run into the same groups (the same short-read words). */
#define GROUP_PARTS 64

/* Fill *h from the arguments (the capsule, the range, the geometry and `sums`, acquired into
 * *sums_view, which the caller releases); -1 with ValueError/TypeError on bad input. */
int
kv_fp_parse_hashing(hashing *h, PyObject *capsule, Py_ssize_t first, Py_ssize_t last,
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
        if (kv_fp_overlaps(sums_view->buf, sums_view->len, segs[i].view.buf, segs[i].view.len)) {
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
 * by one kv_fp_transfer_run and hashed just before its write or just after its read, while it is in
 * the CPU cache. Returns 0, or an errno value (NO_PROGRESS: a write that moved nothing); a
 * read that comes back short sets *short_at/want/got and stops. *end: the furthest byte
 * moved. No GIL needed. */
int
kv_fp_hashed_transfer(int fd, segment *segs, const hashing *h, int write, Py_ssize_t *end,
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
        Py_ssize_t done = kv_fp_transfer_run(fd, parts, 0, count, write);
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

/* kvstore._native._fileproto: piece batches, whole blocks given as pieces of a span, without
 * the GIL: publish_pieces (probe, hash into the header's slots, write, name without
 * replacing) and read_pieces (open, fstat, read, touch, verify every chunk), block by block.
 * Their arguments are checked in fileproto_piece_args.c. */

#include "fileproto_internal.h"

/* -- publish_pieces: whole blocks given as pieces, written and named in one call --------- */

#define PUBLISHED 1     /* publish_pieces: the block's file was written and named */
#define ALREADY_THERE 0 /* publish_pieces: a regular file had the name (nothing written) */

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
    int err = kv_fp_write_plain(fd, flags, segs, 0, n, direct ? n - 1 : n, &end);
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
        if (kv_fp_renameat2_noreplace(tmp, final) == 0) {
            return PUBLISHED;
        }
        err = errno;
    }
    (void)unlink(tmp);
    /* The rename found the block there: another writer published it since the probe. */
    return err == EEXIST ? ALREADY_THERE : -err;
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
        Py_ssize_t got = kv_fp_transfer_run(fd, segs, 0, n, 0);
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

/* Acquire the blocks of a batch, run publish_piece_block (``reading`` 0) or read_piece_block
 * on each with the GIL released, and return their outcomes as a list (NULL with an
 * exception; nothing held either way). */
static PyObject *
run_piece_batch(const piece_plan *p, PyObject *items_obj, int reading, long long touch_ns)
{
    Py_ssize_t n = 0;
    piece_block *blocks = kv_fp_acquire_piece_blocks(items_obj, p, reading, &n);
    if (blocks == NULL) {
        return NULL;
    }
    segment *segs = PyMem_Calloc((size_t)p->npieces + 2, sizeof(segment));
    if (segs == NULL) {
        kv_fp_release_piece_blocks(blocks, n);
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
    kv_fp_release_piece_blocks(blocks, n);
    return result;
}

PyObject *
kv_fp_publish_pieces(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *items_obj, *starts_obj, *slot_obj, *index_obj, *capsule;
    piece_plan p;
    memset(&p, 0, sizeof p);
    if (!PyArg_ParseTuple(args, "OiinnOOnnOnnO:publish_pieces", &items_obj, &p.flags, &p.mode,
                          &p.file_nbytes, &p.piece_nbytes, &starts_obj, &slot_obj,
                          &p.chunk_nbytes, &p.slots_offset, &index_obj, &p.index_offset,
                          &p.alignment, &capsule)
        || kv_fp_check_mode("publish_pieces", p.mode) < 0) {
        return NULL;
    }
    Py_buffer starts_view, slot_view;
    if (kv_fp_parse_piece_geometry("publish_pieces", &p, starts_obj, slot_obj, capsule,
                                   &starts_view, &slot_view)
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
        if (kv_fp_check_piece_header("publish_pieces", &p) == 0) {
            result = run_piece_batch(&p, items_obj, 0, 0);
        }
    }
    PyBuffer_Release(&p.index);
done:
    PyBuffer_Release(&slot_view);
    PyBuffer_Release(&starts_view);
    return result;
}

PyObject *
kv_fp_read_pieces(PyObject *Py_UNUSED(module), PyObject *args)
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
    if (kv_fp_parse_piece_geometry("read_pieces", &p, starts_obj, slot_obj, capsule,
                                   &starts_view, &slot_view)
        < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    if (kv_fp_check_piece_header("read_pieces", &p) == 0) {
        p.index_offset = p.header_nbytes + p.span_nbytes; /* where the pieces end */
        result = run_piece_batch(&p, items_obj, 1, touch_ns);
    }
    PyBuffer_Release(&slot_view);
    PyBuffer_Release(&starts_view);
    return result;
}
